"""Length buckets (data/streams/buckets.py): only documents of min..max tokens, judged after
tokenization, counted when dropped; exact restore, the fingerprint, converted corpora, show_step.

    pytest tests/test_data_buckets.py -q -m "not slow"     (~1 min on 2 shared cores)
    pytest tests/test_data_buckets.py -q                   (+ a bucketed mixture through train.py and
                                                            show_step: ~2 min more)

Every kept document's length is counted again here with the tokenizer itself, from its text.
"""
import gzip
import json
import os
from pathlib import Path

import numpy as np
import pytest

import data
from data.pipeline import consumed_figures, state_counters
from data.streams.buckets import NoDocumentInBucketError
from data.streams.mixture import SOURCE_ID_SHIFT
from tests.data_helpers import (
    REPO,
    TOKENIZER,
    assert_batches_equal,
    cfg,
    close,
    convert,
    decode_doc_id,
    jround,
    take,
    write_corpus,
)

SAMPLE = sorted(str(p) for p in Path(REPO, "data", "sample").glob("000[0-6]/en_head.json.gz"))


def n_tokens(texts):
    """Tokenizer tokens of each text (no EOS/BOS), the bucket's measure."""
    from data.tokenizer import load_tokenizer
    tok = load_tokenizer(TOKENIZER)
    return [len(e.ids) for e in tok.encode_batch(list(texts), add_special_tokens=False)]


def seen_docs(batches, n_files, source=None):
    """{(file, line 0-based)} of every document in the batches (of one mixture source)."""
    out = set()
    for b in batches:
        did = np.asarray(b["doc_ids"])
        for d in np.unique(did[did >= 0]).tolist():
            if source is not None:
                if d >> SOURCE_ID_SHIFT != source:
                    continue
                d &= (1 << SOURCE_ID_SHIFT) - 1
            _, f, line = decode_doc_id(d, n_files)
            out.add((f, line))
    return out


def sample_texts():
    return {(f, i): json.loads(line)["raw_content"]
            for f, path in enumerate(SAMPLE) for i, line in enumerate(gzip.open(path, "rt"))}


# ---------------------------------------------------------------- the filter
def test_kept_documents_are_in_the_bucket_and_every_one_of_them_is_kept(tmp_path):
    texts = write_corpus(tmp_path, n_files=4, docs_per_file=16, max_words=120)
    files = sorted({p for p, _ in texts})
    lens = dict(zip(texts, n_tokens(texts.values()), strict=True))
    lo, hi = 60, 140
    inside = {(files.index(p), ln - 1) for (p, ln), n in lens.items() if lo <= n <= hi}
    assert 10 < len(inside) < len(texts) - 10       # the bucket keeps some and drops some
    c = cfg(tmp_path, min_doc_tokens=lo, max_doc_tokens=hi)
    it = data.make_host_iterator(c, 0, 1, debug=True)
    base = jround(it.get_state())
    batches = take(it, 60)                            # > 2 epochs of the kept documents
    seen = seen_docs(batches, len(files))
    assert seen == inside                             # none outside, none of the inside missing
    figures = consumed_figures(it.get_state(), base)
    assert figures["out_of_bucket_documents"] >= len(texts) - len(inside)   # at least one epoch's
    close(it)
    # Without a bucket the same files give the other documents too and count none out of it.
    it = data.make_host_iterator(cfg(tmp_path), 0, 1, debug=True)
    assert seen_docs(take(it, 60), len(files)) - inside
    assert state_counters(it.get_state())["oob"] == 0
    close(it)


@pytest.mark.slow
def test_a_document_in_pieces_is_judged_by_its_whole_length(tmp_path):
    # File 0's line 2 is ~250 k characters: tokenized in 3 pieces of <= 100 k characters
    # (data/readers/sources.py PIECE_CHARS). A bound between a piece's tokens and the document's
    # keeps it (min) or drops it (max), as a whole.
    texts = write_corpus(tmp_path, n_files=1, docs_per_file=4, long_doc_chars=250_000)
    long_text = texts[(sorted(texts)[0][0], 2)]
    whole = n_tokens([long_text])[0]
    piece = max(n_tokens([long_text[i:i + 100_000] for i in range(0, len(long_text), 100_000)]))
    assert piece < whole // 2
    common = dict(seq_len=4096, global_batch_size=1, num_shards=1, shuffle_window=0)
    it = data.make_host_iterator(cfg(tmp_path, min_doc_tokens=piece + 1, **common), 0, 1, debug=True)
    batches = take(it, 3)
    assert seen_docs(batches, 1) == {(0, 1)}
    assert state_counters(it.get_state())["oob"] >= 1      # line 1, read in the same chunk
    close(it)
    it = data.make_host_iterator(cfg(tmp_path, max_doc_tokens=whole - 1, **common), 0, 1, debug=True)
    assert (0, 1) not in seen_docs(take(it, 3), 1)
    close(it)


def test_a_bucket_no_document_fits_stops_in_one_line(tmp_path):
    write_corpus(tmp_path, n_files=4, docs_per_file=4, max_words=40)
    it = data.make_host_iterator(cfg(tmp_path, min_doc_tokens=10_000), 0, 1)
    with pytest.raises(NoDocumentInBucketError) as e:
        next(it)
    assert "data.min_doc_tokens" in str(e.value) and "\n" not in str(e.value)
    close(it)


# ---------------------------------------------------------------- a bucketed mixture
def two_bucket_sources(extra=()):
    """The sample's training files as two sources, documents under 512 tokens and over 1024."""
    paths = [os.path.join(REPO, "data/sample/000[0-6]/en_head.json.gz")]
    return [{"name": "short", "paths": paths, "weight": 2, "max_tokens": 512},
            {"name": "long", "paths": paths, "weight": 1, "min_tokens": 1024}, *extra]


def mix(**kw):
    base = dict(paths=(), sources=two_bucket_sources(), seq_len=64, global_batch_size=8, num_shards=4,
                shuffle_window=4, num_workers=0)
    base.update(kw)
    return cfg(REPO, **base)


def test_a_mixture_of_buckets_keeps_each_sources_bucket_and_counts_per_source():
    texts = sample_texts()
    lens = dict(zip(texts, n_tokens(texts.values()), strict=True))
    it = data.make_host_iterator(mix(), 0, 1, debug=True)
    base = jround(it.get_state())
    batches = take(it, 24)
    short, long_ = seen_docs(batches, len(SAMPLE), 0), seen_docs(batches, len(SAMPLE), 1)
    assert short and long_
    assert all(lens[d] <= 512 for d in short) and all(lens[d] >= 1024 for d in long_)
    fig = consumed_figures(it.get_state(), base)
    assert fig["source/short/out_of_bucket_documents"] > 0 and fig["source/long/out_of_bucket_documents"] > 0
    assert fig["out_of_bucket_documents"] == (fig["source/short/out_of_bucket_documents"]
                                              + fig["source/long/out_of_bucket_documents"])
    close(it)


@pytest.mark.parametrize("workers", [0, pytest.param(1, marks=pytest.mark.slow)])   # 1: worker processes
def test_restore_of_a_bucketed_mixture_is_exact(workers):
    n = 14
    it = data.make_host_iterator(mix(num_workers=workers), 0, 1, debug=True)
    states, ref = [jround(it.get_state())], []
    for _ in range(n + 2):
        ref.append(next(it))
        states.append(jround(it.get_state()))
    close(it)
    for k in ((3, 11) if workers else (0, 5, 9, 13)):
        it = data.restore_host_iterator(mix(num_workers=workers), 0, 1, [states[k]], debug=True)
        for j, b in enumerate(take(it, 2)):
            assert_batches_equal(b, ref[k + j], f"restored at {k}, batch {k + j}")
        close(it)


def test_buckets_are_in_the_fingerprint_and_a_changed_bucket_is_refused_on_continue():
    from data.state import mixture_changes

    plain = data.fingerprint(cfg(REPO, paths=(SAMPLE[0],)))
    assert "min_doc_tokens" not in plain and "max_doc_tokens" not in plain   # unbucketed runs unchanged
    fp = data.fingerprint(cfg(REPO, paths=(SAMPLE[0],), min_doc_tokens=100))
    assert fp["min_doc_tokens"] == 100 and {k: v for k, v in fp.items() if k != "min_doc_tokens"} == plain
    m = data.fingerprint(mix())
    assert m["source.short.max_tokens"] == 512 and m["source.long.min_tokens"] == 1024
    assert "source.short.min_tokens" not in m
    wider = data.fingerprint(mix(sources=[{**two_bucket_sources()[0], "max_tokens": 600}, two_bucket_sources()[1]]))
    with pytest.raises(ValueError) as e:
        mixture_changes(m, wider)
    assert "data.source.short.max_tokens changed" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("kw,needle", [
    (dict(min_doc_tokens=-1), "data.min_doc_tokens=-1"),
    (dict(min_doc_tokens=10, max_doc_tokens=5), "data.min_doc_tokens=10 is above data.max_doc_tokens=5"),
    (dict(max_doc_tokens="8k"), "data.max_doc_tokens='8k'"),
    (dict(paths=(), sources=[{"name": "a", "paths": ["x"], "weight": 1, "min_tokens": 2.5}]),
     "data.sources[a].min_tokens=2.5"),
    (dict(paths=(), min_doc_tokens=8, sources=[{"name": "a", "paths": ["x"], "weight": 1}]),
     "give each source its own min_tokens"),
])
def test_bucket_mistakes_fail_in_one_line(kw, needle):
    with pytest.raises(ValueError) as e:
        cfg(REPO, **kw)
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


# ---------------------------------------------------------------- converted corpora
def test_a_converted_corpus_keeps_its_bucket_and_restores_exactly(tmp_path):
    out = tmp_path / "tok"
    assert convert(os.path.join(REPO, "data/sample/000[0-1]/en_head.json.gz"), out) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    texts = sample_texts()
    # record index -> its text's tokens: the converter keeps the input files' order and lines
    lens = n_tokens([texts[(f, i)] for f in range(2) for i in range(int(manifest["files"][f]["documents"]))])
    n_docs = len(lens)
    c = cfg(REPO, paths=(str(out),), seq_len=64, global_batch_size=8, num_shards=4, min_doc_tokens=700,
            max_doc_tokens=3000)
    it = data.make_host_iterator(c, 0, 1, debug=True)
    states, ref = [jround(it.get_state())], []
    for _ in range(12):
        ref.append(next(it))
        states.append(jround(it.get_state()))
    close(it)
    kept = {int(d) % n_docs for b in ref for d in np.unique(b["doc_ids"][b["doc_ids"] >= 0])}
    assert kept and all(700 <= lens[d] <= 3000 for d in kept)
    assert consumed_figures(states[-1], states[0])["out_of_bucket_documents"] > 0
    for k in (0, 7):
        it = data.restore_host_iterator(c, 0, 1, [states[k]], debug=True)
        for j, b in enumerate(take(it, 2)):
            assert_batches_equal(b, ref[k + j], f"restored at {k}")
        close(it)


# ---------------------------------------------------------------- through train.py and show_step
@pytest.mark.slow
def test_train_resumes_a_bucketed_mixture_exactly_and_show_step_lists_its_documents(tmp_path):
    import train as train_mod
    from tests.run_helpers import MICRO, ONE_SCHEDULE, make_cfg, read_jsonl, read_metrics, rows_by_step

    sources = ("data.sources=[{name:short,paths:['" + os.path.join(REPO, "data/sample/000[0-6]/en_head.json.gz")
               + "'],weight:2,max_tokens:512},{name:long,paths:['"
               + os.path.join(REPO, "data/sample/000[0-6]/en_head.json.gz") + "'],weight:1,min_tokens:1024}]")
    common = [*MICRO, *ONE_SCHEDULE, "data=sample_mix", sources, "data.seq_len=64", "data.num_workers=0",
              "train.log_every=1", "checkpoint.every=2", "train.eval_every=0",
              "logger.wandb.mode=disabled", "++train.debug_batches=true"]
    straight, cut = tmp_path / "straight", tmp_path / "cut"
    train_mod.train(make_cfg(straight, *common, "train.steps=4"))
    train_mod.train(make_cfg(cut, *common, "train.steps=2"))
    assert train_mod.train(make_cfg(cut, *common, "train.steps=4"))["start_step"] == 2
    hashes = {d: {r["step"]: r["batch_hash"] for r in read_jsonl(d / "debug_batches.p0.jsonl")}
              for d in (straight, cut)}
    assert [hashes[cut][s] for s in (3, 4)] == [hashes[straight][s] for s in (3, 4)]
    last = read_metrics(straight)[-1]
    assert last["data/source/long/out_of_bucket_documents"] > 0
    assert "data/out_of_bucket_documents" in last
    # show_step replays steps before and after the checkpoint: the very rows the run logged, and
    # each document it names is inside its source's bucket, counted from its text.
    import importlib.util
    import sys
    spec = importlib.util.spec_from_file_location("show_step", os.path.join(REPO, "scripts", "show_step.py"))
    show = importlib.util.module_from_spec(spec)
    sys.modules["show_step"] = show       # dataclasses look their module up while the file runs
    spec.loader.exec_module(show)
    texts = sample_texts()
    logged = rows_by_step(straight)
    for step in (1, 4):
        res = show.show_step(straight, step)
        assert [[r["shard"], r["first_doc_id"], r["last_doc_id"], r["hash"]] for r in res["rows"]] == logged[step]
        for r in res["rows"]:
            docs = [texts[SAMPLE.index(d["file"]), d["line"] - 1] for d in r["documents"]]
            ok = {"short": lambda n: n <= 512, "long": lambda n: n >= 1024}[r["source"]]
            assert docs and all(ok(n) for n in n_tokens(docs)), (step, r["source"])

"""A run's data continued at another row length and batch (data.shape_change=continue), at the data
level: saved states of P hosts at seq_len L1 (data/resume.py continue_at_length) restored into one
host at L2, its batch changed too.

    pytest -n0 tests/test_data_shape_change.py -q        (~1 min on 2 shared cores)

The proof is a count: every document of the first epoch is delivered exactly once, in tokens — the
tokens a document has in every row of both phases, summed, are its text's tokens plus EOS (in order
where there is no shuffle window), so a row lost or handed out twice at the switch, or a packer
carry-over dropped, fails. The same states restored without the mark fail the count (the control).
"""
import glob
import os
from collections import defaultdict

import numpy as np
import pytest

import data
from data.resume import SHAPE_HINT, continue_at_length, plan_resume
from data.streams.mixture import SOURCE_ID_SHIFT
from tests.data_helpers import (
    TOKENIZER,
    close,
    convert,
    decode_doc_id,
    expected_tokens,
    jround,
    mix_cfg,
    rows_of,
    take,
    write_corpus,
)
from tests.data_helpers import cfg as text_cfg


def first_phase(c1, hosts: int, n: int):
    """n batches on each of `hosts` hosts at c1 -> (their rows, every host's saved state)."""
    rows, states = [], []
    for h in range(hosts):
        it = data.make_host_iterator(c1, h, hosts, debug=True)
        rows += rows_of(take(it, n))
        states.append(jround(it.get_state()))
        close(it)
    return rows, states


def second_phase(c2, states, n: int, saved_seq_len: int | None):
    """n batches of one host at c2 from the saved states (marked when saved_seq_len is given)."""
    if saved_seq_len is not None:
        states = jround(continue_at_length(states, saved_seq_len))
    it = data.make_host_iterator(c2, 0, 1, shard_states=data.merge_host_states(states), debug=True)
    batches = take(it, n)
    state = jround(it.get_state())
    close(it)
    return batches, state


def tokens_by_doc(rows, key) -> dict:
    """{key(doc id): its tokens in delivery order} over rows [(shard, doc ids, tokens)]."""
    out = defaultdict(list)
    for _, did, tok in rows:
        for d, t in zip(did.tolist(), tok.tolist(), strict=True):
            if d >= 0:
                out[key(d)].append(t)
    return out


def assert_every_document_once(got: dict, want: dict, ordered: bool) -> int:
    """got/want: {document: tokens}; first-epoch documents only (keys of want). -> documents checked."""
    missing = [k for k in want if k not in got]
    assert not missing, f"{len(missing)} of {len(want)} documents never delivered: {missing[:5]}"
    for k, w in want.items():
        g = got[k]
        assert len(g) == len(w), f"document {k}: {len(g)} tokens delivered, it has {len(w)}"
        if ordered:
            assert g == w, f"document {k}: tokens out of order"
        else:
            assert sorted(g) == sorted(w), f"document {k}: other tokens"
    return len(want)


def text_docs(root, texts) -> tuple[dict, callable]:
    """The first epoch's documents {(file, line): tokens} and the key of a doc id."""
    files = sorted(glob.glob(os.path.join(str(root), "*", "en_head.*")))
    want = {(files.index(path), line - 1): expected_tokens(text) for (path, line), text in texts.items()}

    return want, first_epoch_key(len(files))


def first_epoch_key(n_files: int):
    """A doc id -> (file, line) in the first epoch, ("later", id) after."""
    def key(d):
        epoch, f, line = decode_doc_id(d, n_files)
        return (f, line) if epoch == 0 else ("later", d)
    return key


@pytest.mark.parametrize("packing,window,L1,L2,n1,n2,workers", [
    ("concat", 8, 32, 128, 5, 40, 0),        # longer rows, 2 hosts -> 1, batch 8 -> 4
    ("concat", 8, 128, 32, 3, 120, 0),       # shorter rows: the old window's rest is many new rows
    ("first_fit", 0, 32, 128, 5, 40, 0),     # no shuffle: each document's tokens in order
    pytest.param("first_fit", 8, 32, 128, 5, 40, 2, marks=pytest.mark.slow),   # re-packed in 2 input worker processes
])
def test_every_document_once_across_a_switch(tmp_path, packing, window, L1, L2, n1, n2, workers):
    texts = write_corpus(tmp_path, n_files=8, docs_per_file=6, max_words=80)
    c1 = text_cfg(tmp_path, seq_len=L1, global_batch_size=8, shuffle_window=window, packing=packing)
    c2 = text_cfg(tmp_path, seq_len=L2, global_batch_size=4, shuffle_window=window, packing=packing,
                  num_workers=workers, shape_change="continue")
    rows, states = first_phase(c1, 2, n1)
    batches, _ = second_phase(c2, states, n2, L1)
    assert batches[0]["inputs"].shape == (4, L2)
    want, key = text_docs(tmp_path, texts)
    got = tokens_by_doc(rows + rows_of(batches), key)
    assert assert_every_document_once(got, want, ordered=window == 0) == 48
    # the control: the states restored at L2 without the mark lose the window's rest (or do not
    # restore: the rows emitted exceed the window rebuilt at L2)
    with pytest.raises((AssertionError, ValueError)):
        batches, _ = second_phase(c2, states, n2, None)
        assert_every_document_once(tokens_by_doc(rows + rows_of(batches), key), want, ordered=False)


def test_1024_to_4096(tmp_path):
    """The context extension's lengths: long documents, rows of 1025 then 4097 tokens."""
    texts = write_corpus(tmp_path, n_files=8, docs_per_file=10, min_words=200, max_words=900)
    c1 = text_cfg(tmp_path, seq_len=1024, global_batch_size=8, shuffle_window=4)
    c2 = text_cfg(tmp_path, seq_len=4096, global_batch_size=4, shuffle_window=4, shape_change="continue")
    rows, states = first_phase(c1, 2, 3)
    batches, _ = second_phase(c2, states, 16, 1024)
    want, key = text_docs(tmp_path, texts)
    assert assert_every_document_once(tokens_by_doc(rows + rows_of(batches), key), want, ordered=False) == 80


def test_the_switched_stream_restores_exactly(tmp_path):
    """The re-packed stream is a function of the saved states (two restores give the same batches),
    and its own states restore as any: a resume after the switch sees the very next batches."""
    write_corpus(tmp_path, n_files=8, docs_per_file=6, max_words=80)
    c1 = text_cfg(tmp_path, seq_len=32, global_batch_size=8, shuffle_window=8)
    c2 = text_cfg(tmp_path, seq_len=128, global_batch_size=4, shuffle_window=8, shape_change="continue")
    _, states = first_phase(c1, 2, 5)
    straight, _ = second_phase(c2, states, 12, 32)
    first, mid = second_phase(c2, states, 5, 32)
    it = data.make_host_iterator(c2, 0, 1, shard_states=data.merge_host_states([mid]), debug=True)
    rest = take(it, 7)
    close(it)
    for a, b in zip(straight, first + rest, strict=True):
        for k in a:
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_converted_records(tmp_path):
    """A converted corpus (data/streams/records.py) continues the same way."""
    texts = write_corpus(tmp_path / "src", n_files=4, docs_per_file=12, max_words=80)
    assert convert(os.path.join(str(tmp_path / "src"), "*", "en_head.json.gz"), tmp_path / "tok") == 0
    c1 = text_cfg(tmp_path, paths=(str(tmp_path / "tok"),), seq_len=32, global_batch_size=8)
    c2 = text_cfg(tmp_path, paths=(str(tmp_path / "tok"),), seq_len=128, global_batch_size=4,
                  shape_change="continue")
    rows, states = first_phase(c1, 2, 5)
    batches, _ = second_phase(c2, states, 40, 32)
    docs = [expected_tokens(texts[k]) for k in sorted(texts)]     # the manifest's order: files, then lines
    want = dict(enumerate(docs))
    got = tokens_by_doc(rows + rows_of(batches), lambda d: d if d < len(docs) else ("later", d))
    assert assert_every_document_once(got, want, ordered=False) == 48


def test_mixture_every_source_continues(tmp_path):
    """A mixture's shard holds a stream per source: each one is re-packed (parked ones when listed)."""
    sources = [("web", 2.0, 4, 10, "raw_content"), ("books", 1.0, 4, 6, "raw_content")]
    texts = {name: write_corpus(tmp_path / name, n_files=n, docs_per_file=d, seed=i, max_words=60, text_key=k)
             for i, (name, _, n, d, k) in enumerate(sources)}
    c1 = mix_cfg(tmp_path, sources=sources, seq_len=16, global_batch_size=8)
    c2 = mix_cfg(tmp_path, sources=sources, seq_len=64, global_batch_size=4, shape_change="continue")
    rows, states = first_phase(c1, 2, 6)
    batches, _ = second_phase(c2, states, 60, 16)
    mask = (1 << SOURCE_ID_SHIFT) - 1
    for i, (name, *_) in enumerate(sources):
        files = sorted(glob.glob(os.path.join(str(tmp_path / name), "*", "*")))
        want = {(files.index(p), line - 1): expected_tokens(t) for (p, line), t in texts[name].items()}
        mine = [(s, np.where((did >= 0) & (did >> SOURCE_ID_SHIFT == i), did & mask, -1), tok)
                for s, did, tok in rows + rows_of(batches)]
        key = first_epoch_key(len(files))
        assert assert_every_document_once(tokens_by_doc(mine, key), want, ordered=False) == len(want)


def test_plan_refuses_in_one_line():
    saved = {"seq_len": 256, "num_shards": 4, "tokenizer": "t", "packing": "concat"}
    plan = plan_resume(saved, {**saved, "seq_len": 1024}, mixture_change="refuse", allow_data_change=False)
    assert plan.hint == SHAPE_HINT and plan.saved_seq_len is None and "data.seq_len" not in plan.accepted
    plan = plan_resume(saved, {**saved, "seq_len": 1024}, mixture_change="refuse", allow_data_change=False,
                       shape_change="continue")
    assert plan.accepted == {"data.seq_len"} and plan.saved_seq_len == 256
    with pytest.raises(ValueError, match=r"^data.shape_change=continue: data.num_shards changed \(4 -> 8\)") as e:
        plan_resume(saved, {**saved, "seq_len": 1024, "num_shards": 8}, mixture_change="refuse",
                    allow_data_change=False, shape_change="continue")
    assert "\n" not in str(e.value)
    # nothing else is accepted: another packing is still a difference the caller refuses
    plan = plan_resume(saved, {**saved, "packing": "first_fit"}, mixture_change="refuse", allow_data_change=False,
                       shape_change="continue")
    assert plan.accepted == set() and plan.saved_seq_len is None


def test_torch_batches_load_a_state_of_another_length(tmp_path):
    """data.torch.Batches: the states of 2 ranks at seq_len 32 load into one rank at 128 with the
    flag (every first-epoch document's tokens counted once), and are refused without it."""
    pytest.importorskip("torch")
    from data.torch import Batches

    texts = write_corpus(tmp_path, n_files=8, docs_per_file=6, max_words=80)

    def ov(**kw):
        base = {"data.paths": os.path.join(str(tmp_path), "*", "en_head.json.gz"), "tokenizer.path": TOKENIZER,
                "data.seq_len": 32, "data.global_batch_size": 8, "data.num_shards": 4, "data.num_workers": 0,
                "data.shuffle_window": 8, "data.eval.holdout_files": 0, "seed": 0, **kw}
        return [f"{k}={v}" for k, v in base.items()]

    want, key = text_docs(tmp_path, texts)
    counts = defaultdict(int)

    def count(batch):
        for row in batch["doc_ids"].numpy():
            for d in row[row >= 0].tolist():
                counts[key(d)] += 1

    ranks = [Batches(ov(), rank=r, world=2, debug=True) for r in range(2)]
    for b in ranks:
        for _ in range(5):
            count(next(b))
    saved = [b.state_dict() for b in ranks]
    for b in ranks:
        b.close()
    with pytest.raises(ValueError, match=r"data.seq_len=32, this config has 128 \(set data.shape_change=continue"):
        Batches(ov(**{"data.seq_len": 128})).load_state_dict(saved)
    with pytest.raises(ValueError, match="data.global_batch_size=8, this config has 4 .set data.shape_change"):
        Batches(ov(**{"data.global_batch_size": 4})).load_state_dict(saved)
    one = Batches(ov(**{"data.seq_len": 128, "data.global_batch_size": 4, "data.shape_change": "continue"}),
                  debug=True)
    one.load_state_dict(saved)
    for _ in range(40):
        batch = next(one)
        assert batch["input_ids"].shape == (4, 128)
        count(batch)
    one.close()
    assert {k: counts[k] for k in want} == {k: len(w) for k, w in want.items()}

"""Converted (pre-tokenized ArrayRecord) sources: scripts/prepare_data.py and data/streams/records.py.

    pytest tests/test_data_records.py -q

Real conversions (ArrayRecord files on disk, the converter killed with SIGKILL in a subprocess),
real Grain pipelines with worker processes, states through a JSON round trip.
"""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import data
from data.streams import records
from data.streams.permutation import FeistelPermutation
from tests import forked
from tests.data_helpers import (
    REPO,
    SCRIPT,
    TOKENIZER,
    assert_batches_equal,
    convert,
    jround,
    take,
    wide_tokenizer,
    wide_words,
    write_corpus,
    write_lines,
)
from tests.run_helpers import main_in_process


def rcfg(out, **kw):
    base = dict(paths=(str(out),), tokenizer=TOKENIZER, seq_len=16, global_batch_size=8,
                num_workers=0, num_shards=4, seed=0)
    base.update(kw)
    return data.DataConfig(**base)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """6 text files of 9-11 documents, converted: (text root, converted dir, texts)."""
    root = tmp_path_factory.mktemp("text")
    texts = write_corpus(root, n_files=6, docs_per_file=10, max_words=60)
    out = tmp_path_factory.mktemp("conv") / "tok"
    assert convert(os.path.join(str(root), "*", "en_head.json.gz"), out) == 0
    return root, out, texts


def expected_docs(out, texts):
    """The converted corpus' documents in index order: the text path's tokens of each."""
    import tokenizers
    tok = tokenizers.Tokenizer.from_file(TOKENIZER)
    m = records.load_manifest(str(out))
    root = os.path.dirname(next(iter(texts))[0])
    root = os.path.dirname(root)
    docs = []
    for p in m["files"]:
        src = os.path.join(root, p["source"])
        lines = sorted(ln for (path, ln) in texts if path == src)
        assert len(lines) == p["documents"]
        docs += [tok.encode(texts[(src, ln)], add_special_tokens=False).ids for ln in lines]
    return docs


def shard_rows(batches):
    """{shard: [(doc_ids row, tokens row), ...]} in stream order."""
    out = {}
    for b in batches:
        tok = np.concatenate([b["inputs"], b["targets"][:, -1:]], axis=1)
        for r in range(tok.shape[0]):
            out.setdefault(int(b["row_shard"][r]), []).append((b["doc_ids"][r], tok[r]))
    return out


# ---------------------------------------------------------------- the permutation
def test_feistel_is_a_permutation_drawn_per_seed():
    for n in (1, 2, 3, 7, 64, 1000, 4097):
        p = FeistelPermutation(n, [0, 0])
        assert sorted(p(np.arange(n)).tolist()) == list(range(n)), n
    a, b = FeistelPermutation(1000, [0, 0]), FeistelPermutation(1000, [0, 1])
    assert a(np.arange(1000)).tolist() != b(np.arange(1000)).tolist()
    assert a(np.arange(1000)).tolist() == FeistelPermutation(1000, [0, 0])(np.arange(1000)).tolist()


# ---------------------------------------------------------------- every document once per epoch
@pytest.mark.parametrize("hosts", [1, 2, 4])
def test_every_document_once_per_epoch(corpus, hosts):
    _, out, texts = corpus
    docs = expected_docs(out, texts)
    N = len(docs)
    eos = 2   # data/sample/tokenizer.json's </s>
    import tokenizers
    assert tokenizers.Tokenizer.from_file(TOKENIZER).token_to_id("</s>") == eos
    c = rcfg(out)
    # enough batches for every shard to pass into epoch 2
    total = sum(len(d) + 1 for d in docs)
    n_batches = 3 * total // (c.global_batch_size * (c.seq_len + 1)) + 20
    per_host = [take(data.make_host_iterator(c, h, hosts, debug=True), n_batches)
                for h in range(hosts)]
    # the fixed batch layout: the hosts' batches side by side are the 1-host batches
    one = take(data.make_host_iterator(c, 0, 1, debug=True), n_batches)
    for step in range(n_batches):
        for key in one[step]:
            np.testing.assert_array_equal(
                np.concatenate([per_host[h][step][key] for h in range(hosts)]), one[step][key],
                err_msg=f"step {step} {key}")
    rows = {}
    for h in range(hosts):
        rows.update(shard_rows(per_host[h]))
    assert sorted(rows) == list(range(c.num_shards))
    orders = {0: [], 1: []}
    for epoch in (0, 1):
        got = {}
        for shard, rs in rows.items():
            seq = []
            for did, tok in rs:
                for d, t in zip(did.tolist(), tok.tolist(), strict=True):
                    if d >= 0 and d // N == epoch:
                        got.setdefault(d % N, []).append(t)
                        if not seq or seq[-1] != d % N:
                            seq.append(d % N)
            # positions shard, shard + V, ... of the epoch's permutation
            assert seq == FeistelPermutation(N, [c.seed, epoch])(
                np.arange(shard, N, c.num_shards)).tolist(), (shard, epoch)
            orders[epoch] += seq
        assert sorted(got) == list(range(N)), f"epoch {epoch}: documents lost"
        for i, d in enumerate(docs):
            assert got[i] == d + [eos], f"epoch {epoch}, document {i}: tokens differ"
    assert orders[0] != orders[1], "the next epoch must draw a new order"


# ---------------------------------------------------------------- restore
@pytest.mark.slow
@pytest.mark.parametrize("workers,packing", [(0, "concat"), (0, "first_fit"), (2, "concat")])
def test_exact_restore_sweep(corpus, workers, packing):
    _, out, _ = corpus
    c = rcfg(out, num_workers=workers, packing=packing)
    ref_it = data.make_host_iterator(rcfg(out, packing=packing), 0, 1, debug=True)
    ref, states = [], [jround(ref_it.get_state())]
    n = 160   # crosses window and epoch boundaries (an epoch is ~70 batches)
    for _ in range(n):
        ref.append(next(ref_it))
        states.append(jround(ref_it.get_state()))
    assert any(st["start"]["epoch"] > 0 for st in states[-1]["shards"].values())
    if workers == 0:
        it = data.make_host_iterator(c, 0, 1, debug=True)
        next(it)
        for k in range(0, n - 2):
            it.set_state(states[k])
            for j in range(k, k + 2):
                assert_batches_equal(next(it), ref[j], f"restore at {k}, batch {j}")
        it.close()
    else:
        # workers start from the per-shard states (what restore_host_iterator does)
        for k in (1, 75, n - 3):
            it = data.restore_host_iterator(c, 0, 1, [states[k]], debug=True)
            for j in range(k, k + 3):
                assert_batches_equal(next(it), ref[j], f"restore at {k}, batch {j}")
            it.close()
    assert len(json.dumps(states[-1])) < 8000, "the state must stay small"


@pytest.mark.slow
@pytest.mark.parametrize("P1,N1,P2,N2,k1", [(2, 0, 1, 0, 40), (1, 2, 2, 0, 9), (2, 1, 4, 0, 77)])
def test_elastic_restore(corpus, P1, N1, P2, N2, k1):
    _, out, _ = corpus
    base = rcfg(out)
    host_states, before = [], []
    for h in range(P1):
        it = data.make_host_iterator(rcfg(out, num_workers=N1), h, P1, debug=True)
        before.append(take(it, k1))
        host_states.append(jround(it.get_state()))
        it.close()
    k2 = 20
    after = []
    for h in range(P2):
        it = data.restore_host_iterator(rcfg(out, num_workers=N2), h, P2, host_states, debug=True)
        after.append(take(it, k2))
        it.close()
    straight = take(data.make_host_iterator(base, 0, 1, debug=True), k1 + k2)
    for step in range(k1 + k2):
        hosts = ([before[h][step] for h in range(P1)] if step < k1
                 else [after[h][step - k1] for h in range(P2)])
        for key in straight[step]:
            np.testing.assert_array_equal(np.concatenate([b[key] for b in hosts]),
                                          straight[step][key], err_msg=f"step {step} {key}")


# ---------------------------------------------------------------- the converter
@pytest.mark.slow
def test_converter_resumes_after_sigkill_byte_identical(tmp_path):
    write_corpus(tmp_path / "text", n_files=10, docs_per_file=150, min_words=200, max_words=500)
    src = os.path.join(str(tmp_path / "text"), "*", "en_head.json.gz")
    args = [sys.executable, SCRIPT, "--paths", src, "--tokenizer", TOKENIZER, "--no-progress"]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    subprocess.run(args + ["--out", str(straight)], check=True, capture_output=True)
    proc = subprocess.Popen(args + ["--out", str(killed)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if (killed / "done").is_dir() and len(os.listdir(killed / "done")) >= 2:
            break
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (killed / records.MANIFEST).exists(), "the conversion must be killed mid-run"
    res = subprocess.run(args + ["--out", str(killed)], check=True, capture_output=True, text=True)
    assert "were already done" in res.stdout

    def tree(d):
        return {os.path.relpath(os.path.join(r, f), d): open(os.path.join(r, f), "rb").read()
                for r, _, fs in os.walk(d) for f in fs}
    a, b = tree(straight), tree(killed)
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name] == b[name], f"{name} differs after a kill and a restart"


@pytest.mark.slow
def test_converter_bad_records_lenient_and_strict(tmp_path):
    write_corpus(tmp_path / "text", n_files=2, docs_per_file=4, ext=".jsonl")
    bad = tmp_path / "text" / "0001" / "en_head.jsonl"
    lines = bad.read_bytes().splitlines()
    lines[1] = b'{"raw_content": "cut'                    # line 2: malformed JSON
    lines.insert(3, b'{"other": "no text"}')              # line 4: missing key
    write_lines(str(bad), lines)
    src = os.path.join(str(tmp_path / "text"), "*", "en_head.jsonl")
    assert convert(src, tmp_path / "lenient") == 0
    m = records.load_manifest(str(tmp_path / "lenient"))
    assert m["bad_records"] == {"malformed_json": 1, "missing_key": 1}
    assert m["documents"] == 7
    assert m["bad_examples"][0] == f"{bad}:2: malformed_json"
    with pytest.raises(SystemExit, match=f"{bad}:2: malformed_json"):
        convert(src, tmp_path / "strict", "--strict")
    assert not (tmp_path / "strict" / records.MANIFEST).exists()


@pytest.mark.slow
def test_converter_reads_jsonl_zst_and_text_key(tmp_path):
    texts = write_corpus(tmp_path / "text", n_files=2, docs_per_file=3, ext=".jsonl.zst",
                         text_key="text")
    out = tmp_path / "out"
    assert convert(os.path.join(str(tmp_path / "text"), "*", "en_head.jsonl.zst"), out,
                   "--text-key", "text") == 0
    assert records.load_manifest(str(out))["documents"] == len(texts) == 6


# ---------------------------------------------------------------- ids above 65,535 (Llama 3, Qwen)
@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """A 70,022-id byte-level BPE tokenizer (Qwen2-style), a corpus whose words encode to ids of
    65,536 and above, converted: (tokenizer path, converted dir, texts)."""
    base = tmp_path_factory.mktemp("wide")
    tok = wide_tokenizer(base / "tokenizer.json")
    texts = write_corpus(base / "text", n_files=3, docs_per_file=8, max_words=40, words=wide_words())
    assert convert(os.path.join(str(base / "text"), "*", "en_head.json.gz"), base / "tok", tokenizer=tok) == 0
    return tok, base / "tok", texts


def test_converter_stores_wide_ids_as_uint32_and_reads_them_back(wide, corpus):
    import tokenizers
    from array_record.python.array_record_module import ArrayRecordReader
    tok_path, out, texts = wide
    assert records.load_manifest(str(corpus[1]))["dtype"] == "uint16"    # 4,096 ids: two bytes
    m = records.load_manifest(str(out))
    assert m["dtype"] == "uint32"
    assert json.loads((out / "job.json").read_text())["dtype"] == "uint32"
    tok = tokenizers.Tokenizer.from_file(tok_path)
    root = out.parent / "text"
    stored = []
    for p in m["files"]:
        src = os.path.join(str(root), p["source"])
        want = [tok.encode(texts[(src, ln)], add_special_tokens=False).ids
                for ln in sorted(ln for (path, ln) in texts if path == src)]
        reader = ArrayRecordReader(str(out / p["file"]))
        got = [np.frombuffer(r, np.uint32).tolist() for r in reader.read(list(range(p["documents"])))]
        reader.close()
        assert got == want, p["file"]
        stored += want
    flat = np.concatenate([np.asarray(d) for d in stored])
    assert (flat >= 1 << 16).mean() > 0.15          # the corpus exercises the wide ids
    # through the training source: every epoch-0 document in the batches is its ids + EOS (int32)
    eos = tok.token_to_id("<|endoftext|>")
    assert eos == 70_000
    c = rcfg(out, tokenizer=tok_path, num_shards=2)
    data.validate(c, 1, 1)
    batches = take(data.make_host_iterator(c, 0, 1, debug=True), 12)
    assert batches[0]["inputs"].dtype == np.int32
    seen = {}
    for rows in shard_rows(batches).values():
        for did, toks in rows:
            for d, t in zip(did.tolist(), toks.tolist(), strict=True):
                if 0 <= d < len(stored):
                    seen.setdefault(d, []).append(t)
    assert len(seen) == len(stored)
    # the one document a row boundary cuts is counted in both rows (inputs + targets' last)
    whole = [d for d, t in seen.items() if t == stored[d] + [eos]]
    assert len(whole) >= len(stored) - 2, (len(whole), len(stored))


def test_manifest_dtype_that_cannot_hold_the_tokenizer_is_refused(wide, tmp_path):
    import shutil
    tok_path, out, _ = wide
    for dtype, needle in [("uint16", "stores token ids as uint16 (ids below 65,536) but tokenizer.path="),
                          ("int8", "dtype 'int8' is not one of uint16, uint32")]:
        bad = tmp_path / dtype
        shutil.copytree(out, bad)
        m = json.loads((bad / records.MANIFEST).read_text())
        m["dtype"] = dtype
        (bad / records.MANIFEST).write_text(json.dumps(m))
        with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")) as e:
            data.validate(rcfg(bad, tokenizer=tok_path, num_shards=2), 1, 1)
        assert "\n" not in str(e.value)
        assert dtype != "uint16" or "70,022 ids" in str(e.value)


# ---------------------------------------------------------------- mismatches fail in one line
def run_cli(tmp_path, *overrides):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return forked.run([sys.executable, os.path.join(REPO, "train.py"),
                           f"hydra.run.dir={tmp_path}/run", "logger.wandb.mode=disabled",
                           *overrides], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=300)


def _fails_before_compile(tmp_path, result, needle):
    assert result.returncode != 0
    err = result.stderr.strip().splitlines()
    assert err and needle in err[-1], result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    _nothing_started(tmp_path)


def _nothing_started(tmp_path):
    assert not (tmp_path / "run" / "checkpoints").exists()
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def _fails_in_process(capsys, tmp_path, needle, *overrides):
    """The same check, through train.main in this process (tests/run_helpers.py main_in_process)."""
    code, lines = main_in_process(capsys, tmp_path / "run", *overrides)
    assert code != 0 and len(lines) == 1 and needle in lines[0], lines
    _nothing_started(tmp_path)


@pytest.mark.slow
def test_manifest_mismatch_fails_in_one_line(corpus, tmp_path, capsys):
    import shutil
    _, out, _ = corpus
    bad = tmp_path / "tok"
    shutil.copytree(out, bad)
    part = bad / "part-000002.array_record"
    part.write_bytes(part.read_bytes()[:-10])
    res = run_cli(tmp_path, f"data.paths=[{bad}]")    # one case on the real command line
    _fails_before_compile(tmp_path, res, "part-000002.array_record has")
    part.unlink()
    _fails_in_process(capsys, tmp_path, "part-000002.array_record is listed in",
                      f"data.paths=[{bad}]", "data.eval.holdout_files=0")


@pytest.mark.slow
def test_tokenizer_mismatch_fails_in_one_line(corpus, tmp_path, capsys):
    import tokenizers
    _, out, _ = corpus
    tok = tokenizers.Tokenizer.from_file(TOKENIZER)
    tok.add_special_tokens(["<extra>"])
    other = tmp_path / "other_tokenizer.json"
    tok.save(str(other))
    # a model large enough for either tokenizer: only the conversion's tokenizer is wrong
    _fails_in_process(capsys, tmp_path, "converted with another tokenizer",
                      f"data.paths=[{out}]", f"tokenizer.path={other}", "model.vocab_size=4224")


# ---------------------------------------------------------------- a converted source in a mixture
@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 1])
def test_converted_directory_mixes_with_text_and_resumes_exactly(corpus, tmp_path, workers):
    from data.streams.mixture import source_of_doc_id
    root, out, _ = corpus
    mix = data.DataConfig(paths=(), tokenizer=TOKENIZER, seq_len=16, global_batch_size=8,
                          num_workers=workers, num_shards=4, seed=0, shuffle_window=4,
                          sources=[{"name": "web", "weight": 1.0,
                                    "paths": [os.path.join(str(root), "*", "en_head.json.gz")]},
                                   {"name": "conv", "weight": 3.0, "paths": [str(out)]}])
    files = data.list_files(mix)
    assert files["conv"] == sorted(records.part_files(str(out)))   # listed from the manifest
    fp = data.fingerprint(mix, files=files)
    assert fp["source.conv.manifest"] == records.manifest_hash(records.load_manifest(str(out)))
    it = data.make_host_iterator(mix, 0, 1, debug=True)
    first = take(it, 12)
    state = jround(it.get_state())
    rest = take(it, 12)
    if hasattr(it, "close"):
        it.close()
    rows = np.concatenate([source_of_doc_id(b["doc_ids"][:, 0]) for b in first + rest])
    assert set(rows.tolist()) == {0, 1}
    assert abs((rows == 1).mean() - 0.75) < 0.05          # conv's weight is 3 of 4
    again = data.restore_host_iterator(mix, 0, 1, [state], debug=True)
    for i, (a, b) in enumerate(zip(rest, take(again, 12), strict=True)):
        assert_batches_equal(a, b, f"batch {i} after restore")
    if hasattr(again, "close"):
        again.close()

"""Bad data: each kind skipped, counted and named (lenient) or raised with file:line (strict);
a lenient run survives bad files anywhere, bad held-out files included; errors in input workers
reach the user as one line.

    pytest tests/test_data_bad.py -q
"""
import gzip
import json
import os
import random
import shutil

import numpy as np
import pytest

import data
from data.pipeline import state_counters
from tests.data_helpers import cfg, take, write_corpus, write_lines

GOOD = [json.dumps({"raw_content": f"good document number {i} " + "text " * 200}).encode()
        for i in range(12)]

CASES = {
    "malformed_json": b'{"raw_content": "oops',
    "missing_key": json.dumps({"text": "no raw_content here"}).encode(),
    "non_string_text": json.dumps({"raw_content": 42}).encode(),
    "empty_text": json.dumps({"raw_content": "   "}).encode(),
    "invalid_utf8": b'{"raw_content": "bad \xff\xfe bytes"}',
}


def _corpus(root, kind):
    """Two files; the bad thing is in file b (line 3 for record kinds)."""
    os.makedirs(root / "d", exist_ok=True)
    a = str(root / "d" / "a.json.gz")
    b = str(root / "d" / "b.json.gz")
    write_lines(a, GOOD[:6] * 4)
    if kind in CASES:
        write_lines(b, GOOD[6:8] + [CASES[kind]] + GOOD[8:12])
        return b, 3
    if kind == "truncated_file":
        raw = gzip.compress(b"".join(g + b"\n" for g in GOOD[6:12] * 2))
        with open(b, "wb") as f:
            f.write(raw[: len(raw) // 2])
        return b, None
    if kind == "empty_file":
        with gzip.open(b, "wb"):
            pass
        return b, 0
    if kind == "corrupt_file":   # not gzip at all
        with open(b, "wb") as f:
            f.write(random.Random(0).randbytes(4000))
        return b, 1
    raise AssertionError(kind)


KINDS = list(CASES) + ["truncated_file", "empty_file", "corrupt_file"]


@pytest.mark.parametrize("kind", KINDS)
def test_bad_lenient(tmp_path, kind):
    path, line = _corpus(tmp_path, kind)
    c = cfg(tmp_path, paths=(str(tmp_path / "d" / "*.json.gz"),), num_shards=1,
            files_per_stream=2)
    it = data.make_host_iterator(c, 0, 1)
    take(it, 10)  # stays inside epoch 0 of each shard
    cnt = state_counters(it.get_state())
    assert cnt["bad"] == {kind: 1}
    assert len(cnt["badex"]) == 1
    ex = cnt["badex"][0]
    assert ex.startswith(path + ":") and f": {kind}" in ex
    if line is not None:
        assert ex.startswith(f"{path}:{line}: ")


@pytest.mark.parametrize("kind", KINDS)
def test_bad_strict(tmp_path, kind):
    path, line = _corpus(tmp_path, kind)
    c = cfg(tmp_path, paths=(str(tmp_path / "d" / "*.json.gz"),), num_shards=1, strict=True,
            files_per_stream=2)
    it = data.make_host_iterator(c, 0, 1)
    with pytest.raises(data.BadDataError) as e:
        take(it, 20)
    msg = str(e.value)
    assert path in msg and kind in msg
    if line is not None:
        assert f"{path}:{line}: {kind}" in msg


@pytest.mark.slow
def test_bad_strict_through_worker(tmp_path):
    path, line = _corpus(tmp_path, "malformed_json")
    c = cfg(tmp_path, paths=(str(tmp_path / "d" / "*.json.gz"),), num_shards=1, strict=True,
            num_workers=1)
    it = data.make_host_iterator(c, 0, 1)
    with pytest.raises(Exception, match=f"b.json.gz:{line}: malformed_json"):
        take(it, 20)
    it.close()


def test_bad_counts_survive_restore_and_stats(tmp_path):
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P
    _corpus(tmp_path, "missing_key")
    c = cfg(tmp_path, paths=(str(tmp_path / "d" / "*.json.gz"),), num_shards=2)
    sh = NamedSharding(Mesh(np.array(jax.devices()[:4]), ("data",)), P("data"))
    pf = data.DevicePrefetcher(data.make_host_iterator(c, 0, 1), sh)
    for _ in range(10):
        next(pf)
    s = pf.stats()
    assert s["bad_records"] == {"missing_key": 1} and len(s["bad_examples"]) == 1
    st = json.loads(json.dumps(pf.consumed_state()))
    pf.close()
    it = data.make_host_iterator(c, 0, 1)
    it.set_state(st)
    next(it)
    assert state_counters(it.get_state())["bad"] == {"missing_key": 1}


def test_huge_document_is_pieced(tmp_path):
    """A multi-megabyte document is tokenized in bounded pieces and fully emitted."""
    from data.readers.sources import PIECE_CHARS
    os.makedirs(tmp_path / "d")
    big = "lorem ipsum dolor sit amet " * (3_000_000 // 27)
    write_lines(str(tmp_path / "d" / "a.jsonl"), [json.dumps({"raw_content": big}).encode()])
    c = cfg(tmp_path, paths=(str(tmp_path / "d" / "*.jsonl"),), num_shards=1, seq_len=256,
            global_batch_size=8)
    it = data.make_host_iterator(c, 0, 1, debug=True)
    ntok = 0
    for _ in range(40):
        b = next(it)
        ntok += int((b["doc_ids"] >= 0).sum())
        assert len(set(b["doc_ids"].ravel().tolist())) == 1   # all rows: the one document
    cnt = state_counters(it.get_state())
    assert cnt["rows"] == 320 and cnt["tokens"] == ntok
    # the stream's reader is inside the document (pieces), not past it
    from data.host import find_shard_states
    rd = find_shard_states(it.get_state())["0"]["start"]["reader"]
    assert rd["slots"] and rd["slots"][0][2] > 0 and len(big) > 10 * PIECE_CHARS


def test_restore_inside_a_huge_document(tmp_path):
    os.makedirs(tmp_path / "d")
    big = "lorem ipsum dolor sit amet " * (400_000 // 27)
    small = [json.dumps({"raw_content": f"small doc {i} " + "x y " * 30}) for i in range(5)]
    write_lines(str(tmp_path / "d" / "a.jsonl"),
                [s.encode() for s in small[:2]] + [json.dumps({"raw_content": big}).encode()]
                + [s.encode() for s in small[2:]])
    c = cfg(tmp_path, paths=(str(tmp_path / "d" / "*.jsonl"),), num_shards=1, seq_len=64,
            global_batch_size=4, shuffle_window=4)
    it = data.make_host_iterator(c, 0, 1)
    states, ref = [], []
    for _ in range(400):
        states.append(json.loads(json.dumps(it.get_state())))
        ref.append(next(it))
    from data.host import find_shard_states
    inside = [k for k, s in enumerate(states)
              if any(sl[2] > 0 for sl in find_shard_states(s)["0"]["start"]["reader"]["slots"])]
    assert len(inside) > 50
    for k in inside[::40] + [inside[-1]]:
        it2 = data.make_host_iterator(c, 0, 1)
        it2.set_state(states[k])
        for j in range(k, min(k + 3, 400)):
            b = next(it2)
            for key in b:
                np.testing.assert_array_equal(b[key], ref[j][key])


def test_corrupt_zstd_file_is_skipped(tmp_path):
    # zstandard raises its own ZstdError (not an OSError) on a corrupt frame.
    os.makedirs(tmp_path / "d")
    write_lines(str(tmp_path / "d" / "a.jsonl.zst"), GOOD[:6] * 4)
    bad = str(tmp_path / "d" / "b.jsonl.zst")
    with open(bad, "wb") as f:
        f.write(random.Random(0).randbytes(4000))
    c = cfg(tmp_path, paths=(str(tmp_path / "d" / "*.jsonl.zst"),), num_shards=1)
    it = data.make_host_iterator(c, 0, 1)
    take(it, 10)
    cnt = state_counters(it.get_state())
    assert cnt["bad"] == {"corrupt_file": 1} and cnt["badex"][0].startswith(bad + ":1: corrupt_file")


# ---------------------------------------------------------------- a shard without any valid document
def _dead_shard_corpus(root):
    """8 files, 4 virtual shards: shard v owns files v and v + 4; both of shard 1's are bad."""
    write_corpus(root, n_files=8, docs_per_file=12)
    dead = [os.path.join(str(root), "0001", "en_head.json.gz"),
            os.path.join(str(root), "0005", "en_head.json.gz")]
    with gzip.open(dead[0], "wb"):
        pass
    with open(dead[1], "wb") as f:
        f.write(random.Random(1).randbytes(3000))
    return dead


@pytest.mark.parametrize("workers", [0, 1])
def test_shard_without_valid_document_is_named_at_the_first_batch(tmp_path, workers):
    """Found when the shard's first window is read, i.e. before the first batch, with the shard and
    its files' faults in one line; through a real input worker it arrives as the same error."""
    dead = _dead_shard_corpus(tmp_path)
    it = data.make_host_iterator(cfg(tmp_path, num_workers=workers), 0, 1)
    with pytest.raises(data.NoValidDocumentError) as e:
        next(it)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("virtual shard 1: none of its 2 file(s)")
    assert f"{dead[0]}:0: empty_file" in msg and f"{dead[1]}:1: corrupt_file" in msg
    if hasattr(it, "close"):
        it.close()


def test_held_out_files_without_a_valid_document_are_left_out(tmp_path, capsys):
    write_corpus(tmp_path, n_files=8)
    empty = os.path.join(str(tmp_path), "0007", "en_head.json.gz")
    with gzip.open(empty, "wb"):
        pass
    base = cfg(tmp_path, global_batch_size=4)
    listing = {"train": data.list_files(base), "eval": []}
    _, eval_cfg, _, eval_files = data.split_eval(base, listing, 2)
    assert eval_cfg.num_shards == 2
    kept, kept_files = data.valid_eval_files(eval_cfg, eval_files, announce=True)
    assert kept_files == [os.path.join(str(tmp_path), "0006", "en_head.json.gz")]
    assert kept.num_shards == 1
    [line] = capsys.readouterr().out.splitlines()
    assert line.startswith("data.eval: 1 of 2 held-out file(s)") and f"{empty}:0: empty_file" in line
    assert line.endswith("evaluating on the other 1")
    next(data.make_host_iterator(kept, 0, 1, files=kept_files))    # the kept held-out data reads
    _, eval_cfg, _, eval_files = data.split_eval(base, listing, 1)
    assert data.valid_eval_files(eval_cfg, eval_files, announce=False) == (None, [])


# ---------------------------------------------------------------- train.py, as a user runs it
CLI = ["train.steps=2", "train.log_every=2", "checkpoint.every=0", "optimizer.warmup_steps=1",
       "model.max_seq_len=64", "data.seq_len=32", "data.global_batch_size=8"]


def _user_corpus(tmp_path):
    """The bundled sample as a new user's corpus: shard 0002 truncated, and an empty 0008 that
    sorts last, so it becomes the held-out file."""
    from tests.data_helpers import REPO
    root = tmp_path / "corpus"
    shutil.copytree(os.path.join(REPO, "data", "sample"), root, ignore=shutil.ignore_patterns("*.json"))
    raw = (root / "0002" / "en_head.json.gz").read_bytes()
    (root / "0002" / "en_head.json.gz").write_bytes(raw[: len(raw) // 3])
    os.makedirs(root / "0008")
    with gzip.open(root / "0008" / "en_head.json.gz", "wb"):
        pass
    return root


@pytest.mark.slow
def test_cli_lenient_run_survives_bad_training_and_held_out_files(tmp_path):
    from run_helpers import read_metrics, run_cli
    root = _user_corpus(tmp_path)
    for name in ("0001", "0003"):      # bad records near the head of two files (after a first good line)
        path = root / name / "en_head.json.gz"
        first, rest = gzip.decompress(path.read_bytes()).split(b"\n", 1)
        path.write_bytes(gzip.compress(b"\n".join([first, CASES["malformed_json"], CASES["missing_key"], rest])))
    r = run_cli(tmp_path, *CLI, f"data.paths=[{root}/*/en_head.json.gz]", "train.eval_every=2",
                "data.num_workers=1")
    assert r.returncode == 0, r.stderr[-3000:]
    notice = [ln for ln in r.stdout.splitlines() if ln.startswith("data.eval:")]
    assert notice == [f"data.eval: 1 of 1 held-out file(s) hold no valid document "
                      f"({root}/0008/en_head.json.gz:0: empty_file): training without evaluation"]
    rows = read_metrics(tmp_path / "run")
    assert [row["step"] for row in rows] == [2] and "eval_loss" not in rows[0]
    # The console's end says what metrics.jsonl counted: how many, of which kinds, the first file:lines.
    counted = {k.removeprefix("data/bad_"): v for k, v in rows[-1].items()
               if k.startswith("data/bad_") and k != "data/bad_examples"}
    assert counted.get("malformed_json", 0) >= 1 and counted.get("missing_key", 0) >= 1, counted
    [line] = [ln for ln in r.stdout.splitlines() if ln.startswith("Skipped ")]
    by_kind = ", ".join(f"{k} {n}" for k, n in sorted(counted.items(), key=lambda kv: (-kv[1], kv[0])))
    assert line.startswith(f"Skipped {sum(counted.values())} bad record(s) in this start ({by_kind}; "), line
    assert rows[-1]["data/bad_examples"].split("; ")[0] in line and f"{root}/000" in line, line
    lines = r.stdout.splitlines()
    assert lines.index(line) == len(lines) - 2 and lines[-1].startswith("Done:")      # after the goodput lines


@pytest.mark.slow
def test_cli_worker_data_errors_are_one_line(tmp_path):
    """Strict mode and a lenient run with a dead virtual shard: the error is raised inside the input
    worker process and reaches the user as one line naming the file, before the first step."""
    from run_helpers import run_cli
    root = _user_corpus(tmp_path)
    strict = run_cli(tmp_path, *CLI, f"data.paths=[{root}/*/en_head.json.gz]", "train.eval_every=0",
                     "data.eval.holdout_files=0", "data.strict=true", "data.num_workers=1")
    lenient_dir = tmp_path / "dead"
    os.makedirs(lenient_dir)
    dead = _dead_shard_corpus(lenient_dir / "corpus")
    lenient = run_cli(lenient_dir, *CLI, f"data.paths=[{lenient_dir}/corpus/*/en_head.json.gz]",
                      "data.eval.holdout_files=0", "data.num_workers=1")
    for r, needle in ((strict, f"bad record at {root}/0008/en_head.json.gz:0: empty_file"),
                      (lenient, "virtual shard 1: none of its 2 file(s) holds a valid document (")):
        assert r.returncode == 1, r.stderr[-3000:]
        assert "Traceback" not in r.stderr, r.stderr[-3000:]
        [line] = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert line.startswith("data error: ") and needle in line, line
        assert "step " not in r.stdout
    assert f"{dead[0]}:0: empty_file" in lenient.stderr and f"{dead[1]}:1: corrupt_file" in lenient.stderr

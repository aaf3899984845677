"""Bad data: each kind skipped, counted and named (lenient) or raised with file:line (strict)."""
import gzip
import json
import os

import numpy as np
import pytest

import data
from data.pipeline import state_counters
from tests.data_helpers import cfg, take, write_lines

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
    raise AssertionError(kind)


KINDS = list(CASES) + ["truncated_file", "empty_file"]


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
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
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
    from data.sources import PIECE_CHARS
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

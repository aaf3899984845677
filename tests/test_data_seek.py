"""Restore cost independent of the position in a file (.gz seek points, byte offsets) and files
split across virtual shards.

  python -m pytest -q tests/test_data_seek.py
"""
import gzip
import json
import os
import random
import zlib

import numpy as np
import pytest

import data
from data.readers import gzpoints, gzseek
from tests.data_helpers import assert_batches_equal, cfg, decode_doc_id, jround, rows_of, take, write_corpus

SMALL_SPACING = 64 << 10
MAX_BLOCK = 256 << 10   # text in one deflate block, generously


@pytest.fixture
def small_spacing(monkeypatch):
    """Seek points every 64 KB of text, so that small files hold many of them (in-process
    only: spawned workers see the module's own spacing)."""
    monkeypatch.setattr(gzseek, "SPACING", SMALL_SPACING)
    monkeypatch.setattr(gzseek, "FREE_REREAD", SMALL_SPACING)


def _words(rng, n):
    # random letters: text that compresses ~2x like real text, not ~10x like a tiny vocabulary
    return " ".join("".join(rng.choice("etaoinshrdlucmfwypvbgkqjxz") for _ in range(rng.randint(2, 9)))
                    for _ in range(n))


def _jsonl(rng, n_docs, tag, min_words=20, max_words=400):
    return b"".join(
        json.dumps({"raw_content": f"doc {tag}-{i}: " + _words(rng, rng.randint(min_words, max_words))}).encode()
        + b"\n"
                    for i in range(n_docs))


@pytest.fixture(params=["zlib-ng", "zlib"])
def inflate_lib(request, monkeypatch):
    """The stream's reader (gzpoints) inflating with each library it can use: zlib-ng's calls
    from the `zlib-ng` package (a dependency: found, or this fails), the system's zlib where that
    package is missing."""
    lib = gzpoints._load_zlib_ng() if request.param == "zlib-ng" else gzpoints._load_zlib()
    assert lib is not None and lib.name == request.param
    monkeypatch.setattr(gzpoints, "ZLIB", lib)
    return lib


def test_the_installed_reader_inflates_with_zlib_ng():
    assert gzpoints.ZLIB.name == "zlib-ng", "the zlib-ng package's zng_ calls were not found"


@pytest.mark.parametrize("way", ["second pass", "own points"])
def test_gz_seek_points_resume_exactly(tmp_path, small_spacing, way, inflate_lib):
    """From the newest point before any offset, the text read equals the file's text: across
    block boundaries at every bit position, a sync flush (a byte-aligned stored block) and a
    second gzip member. Points found both ways: by indexed_gzip's second pass over the file
    (PointFinder) and by the stream's reader itself as it reads (data/readers/gzpoints.py,
    which hands out the whole text, both members, as it goes), with each library it inflates with."""
    rng = random.Random(0)
    part1, part2 = _jsonl(rng, 500, "a"), _jsonl(rng, 200, "b")
    path = str(tmp_path / "x.json.gz")
    with open(path, "wb") as f:
        z = zlib.compressobj(6, zlib.DEFLATED, 31)
        half = len(part1) // 2
        f.write(z.compress(part1[:half]) + z.flush(zlib.Z_SYNC_FLUSH))
        f.write(z.compress(part1[half:]) + z.flush())
        f.write(gzip.compress(part2))
    text = part1 + part2
    if way == "second pass":
        finder = gzseek.PointFinder(path)
        point_before = finder.point_before
    else:
        finder = gzseek.open_gz_at(path, None, 0, seek_points=True)
        assert gzseek.own_points(finder) is finder
        at = [0]

        def point_before(off):   # the reader at `off`, its text the file's so far
            assert finder.read(off - at[0]) == text[at[0]:off]
            at[0] = off
            return finder.point_before(off)
    seen_bits, points = set(), {}
    for off in range(0, len(text), 9_973):
        pt = point_before(off)
        if off < gzseek.FREE_REREAD:
            assert pt is None
        # a restore re-reads from the point (or the start): bounded wherever off is (points
        # sit on deflate block boundaries at least a spacing apart)
        assert off - (pt[3] if pt else 0) <= 2 * SMALL_SPACING + MAX_BLOCK, f"re-read at {off}"
        if pt is None:
            continue
        assert pt[3] <= off
        assert len(json.dumps(pt)) < 60_000     # one compressed 32 KB window, no more
        seen_bits.add(pt[2])
        points[pt[3]] = pt
    if way == "own points":
        assert finder.read() == text[at[0]:], "the reader's text to the end, both members"
    finder.close()
    assert {b % 2 for b in seen_bits if b} == {0, 1}, f"bit offsets seen: {seen_bits}"
    # the reader keeps points in the first member only (RPv2's files have one)
    assert len(points) >= (8 if way == "second pass" else 6)
    own = way == "own points"     # restored by the reader that finds its points, or zlib's module
    for uncmp, pt in sorted(points.items()):
        for off in (uncmp, uncmp + 5_000):
            fh = gzseek.open_gz_at(path, jround(pt), off, seek_points=own)
            assert fh.read(20_000) == text[off:off + 20_000], f"point at {uncmp}, offset {off}"
            fh.close()
    last = max(points)
    fh = gzseek.open_gz_at(path, points[last], last, seek_points=own)
    assert fh.read() == text[last:], "to the end, through the second member"
    fh.close()
    # restored at the first point, the same later points are found
    first = min(points)
    if own:
        seeded = gzseek.open_gz_at(path, jround(points[first]), first, seek_points=True)
        assert gzseek.own_points(seeded) is seeded
        assert seeded.read(last - first) == text[first:last]
    else:
        seeded = gzseek.PointFinder(path, jround(points[first]))
    assert seeded.point_before(last) == points[last]
    seeded.close()


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar")).split()[1])


def _restore_read_bytes(c, state):
    """Bytes this process reads from restore to the first batch (tokenizer file included)."""
    before = _rchar()
    it = data.make_host_iterator(c, 0, 1)
    it.set_state(jround(state))
    batch = next(it)
    return _rchar() - before, batch


def test_the_streams_reader_finds_its_own_points_and_reads_damaged_files_as_gzip_does(
        tmp_path, small_spacing, monkeypatch, inflate_lib):
    """A .gz file the stream reads (ShardReader) is inflated once: its slots' seek points come
    from the reader itself, never from a second pass (PointFinder refuses to be made here), and a
    restore from them is exact and reads on finding its own points. Damaged and odd files read
    as gzip's reader reads them: an empty file and an empty member are no text, a cut file an
    EOFError, random bytes an error."""
    from data.readers.sources import BadRecords, ShardReader

    def refuse(*a, **k):
        raise AssertionError("a second pass over a file the reader inflates itself")
    monkeypatch.setattr(gzseek, "PointFinder", refuse)
    rng = random.Random(3)
    text = _jsonl(rng, 600, "c")
    path = str(tmp_path / "x.json.gz")
    with open(path, "wb") as f:
        f.write(gzip.compress(text, 6))
    docs = [json.loads(line)["raw_content"] for line in text.splitlines()]
    r = ShardReader([path], [0], 1, 0, 0, 1, "raw_content", BadRecords(True))
    got, states = [], []
    for _ in range(450):
        got.append(r.next_piece()[0])
        states.append(jround(r.get_state()))
    r.close()
    assert got == docs[:450]
    deep = states[-1]["slots"][0]
    assert deep[3] > 4 * SMALL_SPACING and deep[4] is not None and deep[4][3] <= deep[3]
    again = ShardReader([path], [0], 1, 0, 0, 1, "raw_content", BadRecords(True))
    again.set_state(states[-1])
    assert [again.next_piece()[0] for _ in range(100)] == docs[450:550]
    later = again.get_state()["slots"][0]     # the restored reader's own points, further on
    assert later[4][3] > deep[4][3] and later[4][3] <= later[3]
    again.close()
    # odd and damaged files, read from the start as the stream reads them
    full = gzip.compress(text, 6)
    for name, raw, want in (("empty", b"", b""), ("empty member", gzip.compress(b""), b""),
                            ("cut", full[:len(full) // 2], EOFError), ("not gzip", rng.randbytes(4000), OSError),
                            ("two members", gzip.compress(b"a\n") + gzip.compress(b"b\n"), b"a\nb\n")):
        p = str(tmp_path / f"{name}.json.gz")
        with open(p, "wb") as f:
            f.write(raw)
        fh = gzseek.open_gz_at(p, None, 0, seek_points=True)
        if isinstance(want, bytes):
            assert fh.read() == want, name
        else:
            with pytest.raises(want):
                fh.read()
        fh.close()


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs Linux /proc/self/io")
def test_restore_deep_in_gz_is_exact_and_reads_a_bounded_amount(tmp_path, small_spacing):
    rng = random.Random(1)
    vocab = [_words(rng, 1) for _ in range(5000)]
    lines = [json.dumps({"raw_content": f"doc {i}: " + " ".join(rng.choices(vocab, k=300))})
             for i in range(4000)]
    (tmp_path / "0000").mkdir()
    with gzip.open(tmp_path / "0000" / "en_head.json.gz", "wb", compresslevel=6) as fh:
        fh.write("\n".join(lines).encode() + b"\n")
    size = os.path.getsize(tmp_path / "0000" / "en_head.json.gz")
    c = cfg(tmp_path, num_shards=1, files_per_stream=1, seq_len=512, global_batch_size=16,
            shuffle_window=4)
    it = data.make_host_iterator(c, 0, 1)
    states, batches = [], []
    for _ in range(420):
        states.append(jround(it.get_state()))
        batches.append(next(it))
    slot = states[-1]["shards"]["0"]["start"]["reader"]["slots"][0]
    assert slot[3] > 4_500_000 and slot[4] is not None, "the run must go deep into the file"
    # exact at many restore points, shallow to deep
    for k in list(range(0, 420, 47)) + [419]:
        r = data.make_host_iterator(c, 0, 1)
        r.set_state(states[k])
        for j in range(k, min(k + 2, 420)):
            assert_batches_equal(next(r), batches[j], f"restore at {k}, batch {j}")
    # bytes read on restore do not grow with the position: deep ~ shallow (isal reads 512 KB
    # at a time, the restored reader 256 KB; chunks are read ahead for the first window)
    shallow, b0 = _restore_read_bytes(c, states[1])
    deep, b1 = _restore_read_bytes(c, states[419])
    assert_batches_equal(b0, batches[1])
    assert_batches_equal(b1, batches[419])
    assert deep - shallow < 1_000_000, \
        f"deep restore read {deep} bytes, shallow {shallow} (file {size}): re-read unbounded"


@pytest.mark.parametrize("ext", [".jsonl", ".jsonl.zst", ".json.gz"])
def test_restore_sweep_every_format(tmp_path, ext):
    write_corpus(tmp_path, n_files=2, docs_per_file=40, max_words=60, ext=ext)
    c = cfg(tmp_path, num_shards=2, files_per_stream=2, shuffle_window=3, seq_len=16,
            global_batch_size=4)
    it = data.make_host_iterator(c, 0, 1)
    states, batches = [], []
    for _ in range(60):
        states.append(jround(it.get_state()))
        batches.append(next(it))
    offs = [s[3] for st in states for sh in st["shards"].values()
            for s in sh["start"]["reader"]["slots"]]
    assert max(offs) > 0
    r = data.make_host_iterator(c, 0, 1)
    next(r)
    for k in range(0, 60, 3):
        r.set_state(states[k])
        for j in range(k, min(k + 2, 60)):
            assert_batches_equal(next(r), batches[j], f"{ext}: restore at {k}, batch {j}")


def test_old_state_version_fails_in_one_line(tmp_path):
    write_corpus(tmp_path, n_files=2, docs_per_file=4)
    c = cfg(tmp_path, num_shards=2, global_batch_size=2)
    it = data.make_host_iterator(c, 0, 1)
    next(it)
    st = jround(it.get_state())
    st["__vshards__"] = 2
    with pytest.raises(ValueError, match="state has version 2.*start the data from scratch"):
        data.restore_host_iterator(c, 0, 1, [st])


# ---- one file split across virtual shards ----

def _split_cfg(tmp_path, **kw):
    base = dict(num_shards=8, global_batch_size=8, shuffle_window=4, seq_len=16,
                files_per_stream=1)
    base.update(kw)
    return cfg(tmp_path, **base)


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_one_file_feeds_8_shards_on_2_hosts_exactly_once(tmp_path, workers):
    write_corpus(tmp_path, n_files=1, docs_per_file=64, max_words=40)
    c = _split_cfg(tmp_path, num_workers=workers)
    rows = []
    for h in range(2):
        it = data.make_host_iterator(c, h, 2, debug=True)
        rows += rows_of(take(it, 100))
        if hasattr(it, "close"):
            it.close()
    by_epoch = {}
    for shard, did, _ in rows:
        for d in set(did[did >= 0].tolist()):
            e, f, line = decode_doc_id(d, 1)
            assert f == 0 and line % 8 == shard, "a shard read another shard's line"
            by_epoch.setdefault(e, set()).add(line)
    assert by_epoch[0] == set(range(64)), "epoch 0: every line exactly once"
    assert by_epoch[1] == set(range(64))
    # exactly once: a document's tokens are in one shard only, and no line appears twice
    shards_of = {}
    for shard, did, _ in rows:
        for d in set(did[did >= 0].tolist()):
            shards_of.setdefault(d, set()).add(shard)
    assert all(len(s) == 1 for s in shards_of.values())
    assert data.fingerprint(c)["file_split"] == 8
    assert data.fingerprint(_split_cfg(tmp_path, num_shards=4, global_batch_size=4))[
        "file_split"] == 4


@pytest.mark.slow
@pytest.mark.parametrize("P1,N1,P2,N2", [(2, 0, 1, 0), (2, 2, 1, 1), (1, 0, 2, 0)])
def test_split_file_resume_exact_and_on_other_host_count(tmp_path, P1, N1, P2, N2):
    import dataclasses
    write_corpus(tmp_path, n_files=1, docs_per_file=48, max_words=60)
    base = _split_cfg(tmp_path)
    k1, k2 = 9, 14
    straight = take(data.make_host_iterator(base, 0, 1, debug=True), k1 + k2)
    saved, before = [], []
    for h in range(P1):
        it = data.make_host_iterator(dataclasses.replace(base, num_workers=N1), h, P1,
                                     debug=True)
        before.append(take(it, k1))
        saved.append(jround(it.get_state()))
        if hasattr(it, "close"):
            it.close()
    # same topology: exact continuation
    if N1 == 0:
        for h in range(P1):
            it = data.restore_host_iterator(base, h, P1, saved, debug=True)
            after = take(it, 3)
            ref = data.make_host_iterator(base, h, P1, debug=True)
            ref_b = take(ref, k1 + 3)[k1:]
            for a, b in zip(after, ref_b, strict=True):
                assert_batches_equal(a, b)
    c2 = dataclasses.replace(base, num_workers=N2)
    after = []
    for h in range(P2):
        it = data.restore_host_iterator(c2, h, P2, saved, debug=True)
        after.append(take(it, k2))
        if hasattr(it, "close"):
            it.close()
    for step in range(k1 + k2):
        hosts = ([before[h][step] for h in range(P1)] if step < k1
                 else [after[h][step - k1] for h in range(P2)])
        for key in ("inputs", "targets", "doc_ids", "row_shard"):
            np.testing.assert_array_equal(np.concatenate([b[key] for b in hosts]),
                                          straight[step][key], err_msg=f"step {step} {key}")


def test_mixture_sources_with_fewer_files_than_shards_are_split(tmp_path):
    from data.streams.mixture import SOURCE_ID_SHIFT, source_of_doc_id
    for i, name in enumerate(("a", "b")):
        write_corpus(tmp_path / name, n_files=1, docs_per_file=24, seed=i, max_words=30)
    sources = [{"name": n, "weight": 1.0, "paths": [str(tmp_path / n / "*" / "*")]}
               for n in ("a", "b")]
    c = cfg(tmp_path, paths=(), sources=sources, num_shards=4, global_batch_size=8, seq_len=16,
            shuffle_window=4, files_per_stream=1)
    data.validate(c, 1, 1)
    fp = data.fingerprint(c)
    assert fp["source.a.file_split"] == fp["source.b.file_split"] == 4
    lines = {0: {}, 1: {}}
    for shard, did, _ in rows_of(take(data.make_host_iterator(c, 0, 1, debug=True), 80)):
        for d in set(did[did >= 0].tolist()):
            e, f, line = decode_doc_id(d & ((1 << SOURCE_ID_SHIFT) - 1), 1)
            assert line % 4 == shard, "a shard read another shard's line of a source"
            lines[int(source_of_doc_id(d))].setdefault(e, set()).add(line)
    for src in (0, 1):
        assert lines[src][0] == set(range(24)), f"source {src}: epoch 0 not every line once"

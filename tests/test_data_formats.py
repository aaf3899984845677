"""Input formats other than JSON lines (data/readers/formats.py): JSON arrays (.json, .json.gz), Parquet,
Arrow (Hugging Face save_to_disk), the .jsonl.zstd / .json.zst endings; each read exactly once per
epoch on 1 and 2 hosts, restored exactly, converted like the same documents as .json.gz, its bad
input named (lenient and strict), and a file of no format read here refused in one line.
Fixtures are written by pyarrow (and `datasets` where installed), not by hand-made bytes.

    pytest tests/test_data_formats.py -q
"""
import dataclasses
import gzip
import json
import os
import random

import numpy as np
import pytest

import data
from data.pipeline import state_counters
from data.readers import formats
from tests.data_helpers import (
    FORMATS,
    assert_batches_equal,
    cfg,
    convert,
    doc_text,
    doc_tokens,
    expected_tokens,
    fcfg,
    jround,
    rows_of,
    take,
    write_corpus,
    write_docs,
    write_records,
    write_save_to_disk,
)

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

# ---------------------------------------------------------------- exactly once per epoch
@pytest.mark.parametrize("kind", list(FORMATS))
@pytest.mark.parametrize("P", [1, 2])
def test_exactly_once_per_epoch(tmp_path, kind, P):
    # 3 files over 4 shards: files are split across shards as well
    texts = write_docs(tmp_path, kind, n_files=3)
    files = sorted({p for p, _ in texts})
    c = fcfg(tmp_path, num_shards=4, global_batch_size=4, shuffle_window=4)
    data.check_files(c, P, data.list_files(c))
    # every batch takes one row (33 tokens) of each shard; the biggest shard (two of the six parts)
    # must pass two epochs
    n_batches = int(2.6 * sum(len(expected_tokens(t)) for t in texts.values()) / 3 / 33) + 24
    rows = []
    for h in range(P):
        it = data.make_host_iterator(c, h, P, debug=True)
        rows += rows_of(take(it, n_batches))   # one host batch per global batch
    epochs = {}
    for (e, f, rec), toks in doc_tokens(rows, len(files)).items():
        epochs.setdefault(e, {})[(files[f], rec + 1)] = toks
    assert max(epochs) >= 2
    for e in (0, 1):
        assert set(epochs[e]) == set(texts), f"{kind} epoch {e}: documents missing or extra"
        for key, toks in epochs[e].items():
            assert sorted(toks) == sorted(expected_tokens(texts[key])), f"{kind} {key}"
    state = state_counters(it.get_state())
    assert not state["bad"], state["badex"]


@pytest.mark.parametrize("kind", ["parquet", "arrow"])
def test_a_file_split_among_shards_by_row_group_decodes_only_its_groups(tmp_path, kind, monkeypatch):
    """One file of 8 row groups over 4 shards: each shard decodes its own 2 groups and never
    another's, every document comes once per epoch, and a restore mid-way goes on exactly."""
    recs = [{"story": f"doc {i}: " + " ".join(["word"] * (5 + i % 7))} for i in range(64)]
    (tmp_path / "0000").mkdir()
    write_records(str(tmp_path / "0000" / ("part" + FORMATS[kind])), kind, recs, row_group=8)
    cls = {"parquet": formats.ParquetRecords, "arrow": formats.ArrowRecords}[kind]
    loads = []
    real_load = cls._load

    def counting(self, g):
        loads.append((self.part[1], g))
        return real_load(self, g)

    monkeypatch.setattr(cls, "_load", counting)
    c = fcfg(tmp_path, num_shards=4, global_batch_size=4, shuffle_window=2, seq_len=16)
    it = data.make_host_iterator(c, 0, 1, debug=True)
    batches = take(it, 60)
    assert loads and all(g % 4 == part for part, g in loads), sorted(set(loads))
    assert {g for _, g in loads} == set(range(8))
    seen = {}
    for (e, _, rec), toks in doc_tokens(rows_of(batches), 1).items():
        seen.setdefault(e, {})[rec] = toks
    assert sorted(seen[0]) == list(range(64)), "epoch 0: each row group's documents once"
    for rec, toks in seen[0].items():
        assert sorted(toks) == sorted(expected_tokens(recs[rec]["story"])), rec
    states = [jround(it.get_state())]
    more = take(it, 6)
    r = data.make_host_iterator(c, 0, 1, debug=True)
    r.set_state(states[0])
    for j, b in enumerate(more):
        assert_batches_equal(next(r), b, f"{kind}: batch {j} after a restore at 60")
    # the split is named in the fingerprint: a run saved under the row split does not resume as if
    fp = data.fingerprint(c, files=data.list_files(c))
    assert fp["file_split"] == 4 and fp["file_split_by"] == "row_group"


def test_formats_are_told_by_content(tmp_path):
    write_docs(tmp_path / "a", "array.json", n_files=1)
    write_docs(tmp_path / "l", "lines.json", n_files=1)
    write_docs(tmp_path / "p", "parquet", n_files=1)
    found = {formats.sniff(os.path.join(str(tmp_path), k, "0000", "part" + ext)): k
             for k, ext in (("a", ".json"), ("l", ".json"), ("p", ".parquet"))}
    assert found == {"array": "a", "lines": "l", "parquet": "p"}
    # names that say nothing: Parquet by its magic bytes, gzip'd JSON lines by content
    os.rename(tmp_path / "p" / "0000" / "part.parquet", tmp_path / "p" / "0000" / "shard-0")
    assert formats.sniff(str(tmp_path / "p" / "0000" / "shard-0")) == "parquet"
    with gzip.open(tmp_path / "noext", "wb") as f:
        f.write(b'{"story": "x"}\n')
    assert formats.sniff(str(tmp_path / "noext")) == "lines"


# ---------------------------------------------------------------- restore
@pytest.mark.parametrize("kind", ["array.json", "array.json.gz", "parquet", "arrow"])
def test_restore_sweep(tmp_path, kind):
    write_docs(tmp_path, kind, n_files=2, docs_per_file=30)
    c = fcfg(tmp_path, num_shards=2, files_per_stream=2, shuffle_window=3, seq_len=16,
             global_batch_size=4)
    it = data.make_host_iterator(c, 0, 1)
    states, batches = [], []
    for _ in range(50):
        states.append(jround(it.get_state()))
        batches.append(next(it))
    slots = [s for st in states for sh in st["shards"].values() for s in sh["start"]["reader"]["slots"]]
    assert max(s[3] for s in slots) > 0 and {s[5] for s in slots} == {kind.split(".")[0]}
    r = data.make_host_iterator(c, 0, 1)
    next(r)
    for k in range(0, 50, 3):
        r.set_state(states[k])
        for j in range(k, min(k + 2, 50)):
            assert_batches_equal(next(r), batches[j], f"{kind}: restore at {k}, batch {j}")


@pytest.mark.parametrize("kind", ["array.json", "parquet"])
def test_elastic_restore_2_hosts_to_1(tmp_path, kind):
    from data.state import merge_host_states
    write_docs(tmp_path, kind, n_files=4, docs_per_file=12)
    c = fcfg(tmp_path, num_shards=4, shuffle_window=4, seq_len=16, global_batch_size=4)
    ref = [b for b in take(data.make_host_iterator(c, 0, 1, debug=True), 14)]
    states = []
    for h in range(2):
        it = data.make_host_iterator(c, h, 2, debug=True)
        take(it, 5)
        states.append(jround(it.get_state()))
    it1 = data.make_host_iterator(c, 0, 1, shard_states=merge_host_states(states), debug=True)
    for j in range(5, 14):
        assert_batches_equal(next(it1), ref[j], f"{kind}: batch {j} after 2 hosts -> 1")


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar")).split()[1])


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs Linux /proc/self/io")
@pytest.mark.parametrize("kind", ["array.json", "parquet"])
def test_restore_deep_in_a_big_file_reads_a_bounded_amount(tmp_path, kind):
    """A restore near the end of a big file reads about what one near its start reads: a seek
    (JSON array) or one row group (Parquet), never the file up to the position."""
    rng = random.Random(3)
    recs = [{"story": f"doc {i}: " + " ".join(rng.choice("abcdefghij") * rng.randint(2, 9)
                                              for _ in range(100))} for i in range(1000)]
    (tmp_path / "0000").mkdir()
    path = str(tmp_path / "0000" / ("part" + FORMATS[kind]))
    write_records(path, kind, recs, row_group=100)
    size = os.path.getsize(path)
    c = fcfg(tmp_path, num_shards=1, files_per_stream=1, seq_len=512, global_batch_size=8,
             shuffle_window=2)
    it = data.make_host_iterator(c, 0, 1)
    states = [jround(it.get_state())]
    batches = []
    for _ in range(400):
        batches.append(next(it))
        states.append(jround(it.get_state()))
    deep_slot = states[-2]["shards"]["0"]["start"]["reader"]["slots"][0]
    assert deep_slot[1] > 600, "the run must go deep into the file"

    def restore_bytes(k):
        before = _rchar()
        r = data.make_host_iterator(c, 0, 1)
        r.set_state(states[k])
        b = next(r)
        return _rchar() - before, b

    shallow, b0 = restore_bytes(1)
    deep, b1 = restore_bytes(399)
    assert_batches_equal(b0, batches[1])
    assert_batches_equal(b1, batches[399])
    assert deep - shallow < size // 4, f"deep restore read {deep} bytes, shallow {shallow} (file {size})"


# ---------------------------------------------------------------- bad input
def _bad_corpus(root, case):
    """A good file and a bad one (`case`); -> (bad path, where it is named, kind)."""
    os.makedirs(root / "d", exist_ok=True)
    good = [{"story": f"good document {i} " + "text " * 150} for i in range(8)]
    fmt = {"parquet": "parquet", "arrow": "arrow", "zstd": "lines.jsonl.zstd"}.get(case.split("_")[0], "array.json")
    ext = FORMATS[fmt]
    write_records(str(root / "d" / ("a" + ext)), fmt, good)
    bad = str(root / "d" / ("b" + ext))
    if case == "array_cut_mid_object":
        raw = json.dumps(good[:4]).encode()
        with open(bad, "wb") as f:
            f.write(raw[: raw.index(b'"story"', 300) + 12])
        return bad, f"{bad}:2: truncated_file", "truncated_file"
    if case == "array_malformed_element":
        with open(bad, "wb") as f:
            f.write(b'[{"story": "fine one"}, {"story": "bad" "json"}, {"story": "fine two"}]')
        return bad, f"{bad}:2: malformed_json", "malformed_json"
    if case == "array_wrong_key":     # the TinyStories mistake: text_key names no key of theirs
        write_records(bad, "array.json", [{"text": "x", "summary": "y"}] * 3)
        return bad, f"{bad}:1: missing_key (no 'story'; its keys: text, summary", "missing_key"
    if case == "parquet_truncated":
        write_records(bad, "parquet", good)
        raw = open(bad, "rb").read()
        with open(bad, "wb") as f:
            f.write(raw[: len(raw) // 2])
        return bad, f"{bad}:0: corrupt_file (not a readable Parquet file", "corrupt_file"
    if case == "parquet_missing_column":
        pq.write_table(pa.table({"content": ["x", "y"]}), bad)
        return bad, f"{bad}:0: missing_key (no column 'story'; its columns: content", "missing_key"
    if case == "parquet_null":
        pq.write_table(pa.table({"story": ["fine", None, "also fine"]}), bad)
        return bad, f"{bad}:2: null_text", "null_text"
    if case == "parquet_not_text":
        pq.write_table(pa.table({"story": [1, 2]}), bad)
        return bad, f"{bad}:0: non_string_text (column 'story' holds int64", "non_string_text"
    if case in ("arrow_truncated", "zstd_truncated"):   # a download cut short: half the file
        write_records(bad, fmt, good)
        raw = open(bad, "rb").read()
        with open(bad, "wb") as f:
            f.write(raw[: len(raw) // 2])
        if fmt == "arrow":
            return bad, f"{bad}:0: corrupt_file (not a readable Arrow file", "corrupt_file"
        return bad, f"{bad}:1: truncated_file (the zstd file ends inside a frame)", "truncated_file"
    if case == "arrow_missing_column":
        write_records(bad, "arrow", [{"content": "x"}, {"content": "y"}])
        return bad, f"{bad}:0: missing_key (no column 'story'; its columns: content", "missing_key"
    if case == "arrow_null":
        write_records(bad, "arrow", [{"story": "fine"}, {"story": None}, {"story": "also fine"}])
        return bad, f"{bad}:2: null_text", "null_text"
    if case == "zstd_corrupt":      # DCLM's .jsonl.zstd ending, not zstd at all
        with open(bad, "wb") as f:
            f.write(random.Random(0).randbytes(4000))
        return bad, f"{bad}:1: corrupt_file (ZstdError", "corrupt_file"
    raise AssertionError(case)


BAD_CASES = ["array_cut_mid_object", "array_malformed_element", "array_wrong_key", "parquet_truncated",
             "parquet_missing_column", "parquet_null", "parquet_not_text", "arrow_truncated",
             "arrow_missing_column", "arrow_null", "zstd_corrupt", "zstd_truncated"]


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_input_lenient(tmp_path, case):
    bad, where, kind = _bad_corpus(tmp_path, case)
    c = fcfg(tmp_path, paths=(str(tmp_path / "d" / "*"),), num_shards=1)
    it = data.make_host_iterator(c, 0, 1)
    take(it, 10)
    cnt = state_counters(it.get_state())
    assert set(cnt["bad"]) == {kind}, cnt
    assert cnt["badex"][0].startswith(where), cnt["badex"]


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_input_strict(tmp_path, case):
    bad, where, kind = _bad_corpus(tmp_path, case)
    c = fcfg(tmp_path, paths=(str(tmp_path / "d" / "*"),), num_shards=1, strict=True)
    it = data.make_host_iterator(c, 0, 1)
    with pytest.raises(data.BadDataError) as e:
        take(it, 20)
    msg = str(e.value)
    assert "\n" not in msg and where in msg, msg


def test_tinystories_with_the_wrong_text_key_names_the_keys(tmp_path):
    """The issue's TinyStories run: arrays of objects with the text under `story`, read with the
    default text_key. The one line names the keys the records do have."""
    write_docs(tmp_path, "array.json", n_files=1)
    c = fcfg(tmp_path, text_key="raw_content", num_shards=1)
    with pytest.raises(data.NoValidDocumentError, match=r"missing_key \(no 'raw_content'; its keys: story, "
                                                        r"instruction, n \(set data.text_key\)\)"):
        next(data.make_host_iterator(c, 0, 1))


# ---------------------------------------------------------------- files of no format read here
@pytest.mark.parametrize("name,content,looks", [
    ("notes.json", json.dumps({"data": [{"story": "x"}]}, indent=2).encode(),
     "one JSON document spread over several lines"),
    ("table.csv", b"id,story,source\n1,once upon a time,gpt\n", "CSV text (first line 'id,story,source')"),
    # mtime=0: the same bytes whenever it is collected (test workers must collect the same tests)
    ("x.json.gz", gzip.compress(b"just some words\n", mtime=0), "plain text (first line 'just some words')"),
    ("blob.bin", bytes(range(256)) * 4, "binary data (first bytes 00 01 02"),
], ids=["json-document", "csv", "gzip-text", "binary"])
def test_unreadable_file_fails_in_one_line_before_anything_starts(tmp_path, name, content, looks):
    write_docs(tmp_path, "parquet", n_files=2)
    bad = tmp_path / "0001" / name
    bad.write_bytes(content)
    c = cfg(tmp_path, paths=(os.path.join(str(tmp_path), "*", "*"),), text_key="story")
    with pytest.raises(ValueError) as e:
        data.validate(c, 1, 1)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"data.paths: {bad} is not read: ")
    assert looks in msg and "Parquet (.parquet)" in msg and "JSON arrays of objects" in msg, msg


def test_a_later_unreadable_file_is_a_bad_record(tmp_path):
    """Validation reads the start of one file per file-name ending (not every file of a bucket): a
    later file of an ending already seen that holds no JSON records is named when it is read."""
    write_docs(tmp_path, "array.json", n_files=2)
    bad = tmp_path / "0001" / "zz.json"
    bad.write_bytes(json.dumps({"data": [{"story": "x"}]}, indent=2).encode())
    c = cfg(tmp_path, paths=(os.path.join(str(tmp_path), "*", "*"),), text_key="story", num_shards=1)
    data.validate(c, 1, 1)
    it = data.make_host_iterator(c, 0, 1)
    take(it, 10)
    cnt = state_counters(it.get_state())
    assert cnt["bad"] == {"unrecognized_file": 1}
    assert cnt["badex"][0].startswith(f"{bad}:0: unrecognized_file (not JSON lines nor a JSON array")
    with pytest.raises(data.BadDataError, match=f"{bad}:0: unrecognized_file"):
        take(data.make_host_iterator(dataclasses.replace(c, strict=True), 0, 1), 10)


# ---------------------------------------------------------------- Hugging Face save_to_disk
def test_hf_save_to_disk_directory(tmp_path):
    rng = random.Random(5)
    per_file = [[doc_text(rng, f"{f}-{i}", 30) for i in range(10)] for f in range(3)]
    write_save_to_disk(tmp_path / "ds", per_file)
    c = cfg(tmp_path, paths=(str(tmp_path / "ds"),), text_key="story", num_shards=2,
            global_batch_size=2, shuffle_window=0)
    files = data.list_files(c)
    assert len(files) == 3 and all(f.endswith(".arrow") for f in files)
    data.validate(c, 1, 1)
    rows = rows_of(take(data.make_host_iterator(c, 0, 1, debug=True), 60))
    got = {(f, rec) for (e, f, rec) in doc_tokens(rows, 3) if e == 0}
    assert got == {(f, i) for f in range(3) for i in range(10)}
    (tmp_path / "plain").mkdir()
    with pytest.raises(ValueError, match="neither written by scripts/prepare_data.py"):
        data.list_files(cfg(tmp_path, paths=(str(tmp_path / "plain"),)))


def _epoch0_texts(c, n_files, batches=80):
    """{(file index, record)} read in epoch 0."""
    rows = rows_of(take(data.make_host_iterator(c, 0, 1, debug=True), batches))
    return {(f, rec) for (e, f, rec) in doc_tokens(rows, n_files) if e == 0}


def test_hf_dataset_folder_reads_its_train_files_as_the_hub_does(tmp_path):
    """A Hugging Face dataset folder (a hub snapshot or clone) given as a path: its train split,
    by the card's `configs:` when it has them, else by the hub's default layout; the same files
    `datasets.load_dataset(folder, split="train")` reads, where `datasets` is installed."""
    rng = random.Random(7)
    hub = tmp_path / "hub"
    (hub / "data").mkdir(parents=True)
    train = {f"data/train-{i:05d}-of-00002.parquet": [doc_text(rng, f"tr{i}-{j}", 20) for j in range(6)]
             for i in range(2)}
    test = {"data/test-00000-of-00001.parquet": [doc_text(rng, f"te-{j}", 20) for j in range(4)]}
    for rel, texts in {**train, **test}.items():
        write_records(str(hub / rel), "parquet", [{"text": t} for t in texts])
    (hub / ".gitattributes").write_text("*.parquet filter=lfs\n")
    (hub / "README.md").write_text("---\nlicense: cc-by-4.0\nlanguage: [en]\n---\n# A dataset\n")
    c = cfg(tmp_path, paths=(str(hub),), text_key="text", num_shards=2, global_batch_size=2, shuffle_window=0)
    files = data.list_files(c)
    assert [os.path.relpath(f, hub) for f in files] == sorted(train)
    data.validate(c, 1, 1)
    assert _epoch0_texts(c, 2) == {(f, j) for f in range(2) for j in range(6)}
    try:
        import datasets
    except ImportError:
        datasets = None
    if datasets is not None:
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
        ref = datasets.load_dataset(str(hub), split="train", cache_dir=str(tmp_path / "hf_cache"))
        assert sorted(ref["text"]) == sorted(t for ts in train.values() for t in ts)

    # The card's configs: the default config's train split (globs relative to the folder).
    (hub / "stories").mkdir()
    for i in range(2):
        write_records(str(hub / "stories" / f"part{i}.jsonl"), "lines",
                      [{"text": doc_text(rng, f"st{i}-{j}", 20)} for j in range(5)])
    (hub / "README.md").write_text(
        "---\nconfigs:\n- config_name: tiny\n  data_files: data/test-*.parquet\n"
        "- config_name: stories\n  default: true\n  data_files:\n  - split: train\n    path: stories/*.jsonl\n"
        "  - split: validation\n    path: data/test-*.parquet\n---\n")
    assert [os.path.relpath(f, hub) for f in data.list_files(c)] == ["stories/part0.jsonl", "stories/part1.jsonl"]
    # No train split among several: named in one line, with the splits.
    (hub / "README.md").write_text("---\nconfigs:\n- config_name: default\n  data_files:\n"
                                   "  - split: a\n    path: data/*.parquet\n  - split: b\n    path: stories/*\n---\n")
    with pytest.raises(ValueError, match=r"config 'default' has no train split \(a, b\)"):
        data.list_files(c)
    # A folder with no file of a format read here is still refused, naming what it accepts.
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    (tmp_path / "empty" / "sub" / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match="nor a Hugging Face dataset folder"):
        data.list_files(cfg(tmp_path, paths=(str(tmp_path / "empty"),)))


def test_hf_dataset_folder_at_a_url_selects_what_the_local_folder_does(tmp_path, monkeypatch):
    """hf://datasets/ORG/NAME[@REV] (or any URL naming a folder) stands for the same train files
    as the same folder on disk, chosen from one listing plus one read of its README.md; fsspec's
    in-memory file system stands in for the hub (unreachable in tests). A glob still lists
    every object it matches."""
    import fsspec
    from fsspec.implementations.memory import MemoryFileSystem

    from data.listing import list_paths
    rng = random.Random(11)
    hub = tmp_path / "hub"
    (hub / "data").mkdir(parents=True)
    names = [f"data/train-{i:05d}-of-00002.parquet" for i in range(2)] + ["data/test-00000-of-00001.parquet"]
    for rel in names:
        write_records(str(hub / rel), "parquet", [{"text": doc_text(rng, rel, 20)} for _ in range(6)])
    (hub / ".gitattributes").write_text("*.parquet filter=lfs diff=lfs merge=lfs -text\n")
    (hub / "README.md").write_text(
        "---\nlicense: cc-by-4.0\nconfigs:\n- config_name: default\n  data_files:\n"
        "  - split: train\n    path: data/train-*\n  - split: test\n    path: data/test-*\n---\n# A dataset\n")
    fs = fsspec.filesystem("memory")
    base = f"memory://hub_{os.getpid()}"
    fs.put(str(hub), base, recursive=True)

    def rel(f):
        return f.split(f"hub_{os.getpid()}/", 1)[1]

    # requests, counted at the file system: a listing (find, or an ls outside it), a metadata
    # request (info), an object read (cat_file: a ranged read; _open: a file)
    calls = {"list": 0, "info": 0, "read": []}
    inside = [False]

    def counted(name, kind):
        orig = getattr(MemoryFileSystem, name)

        def wrapper(self, path, *a, **kw):
            if kind == "read":
                calls["read"].append(rel(str(path)))
            elif kind == "find":     # glob calls find, find calls ls: the outermost call counts
                calls["list"] += not inside[0]
                was, inside[0] = inside[0], True
                try:
                    return orig(self, path, *a, **kw)
                finally:
                    inside[0] = was
            elif kind == "list" and not inside[0] or kind == "info" and not inside[0]:
                calls[kind] += 1
            return orig(self, path, *a, **kw)
        monkeypatch.setattr(MemoryFileSystem, name, wrapper)

    for name, kind in (("find", "find"), ("glob", "find"), ("ls", "list"), ("info", "info"),
                       ("cat_file", "read"), ("_open", "read")):
        counted(name, kind)
    try:
        local = list_paths(str(hub)).files
        assert [os.path.relpath(f, hub) for f in local] == names[:2]
        for url in (base, base + "/"):
            calls.update(list=0, info=0, read=[])
            listing = list_paths(url)
            assert [rel(f) for f in listing.files] == names[:2], listing.files
            assert calls == {"list": 1, "info": 0, "read": ["README.md"]}, calls
            assert sorted(listing.sizes) == listing.files and listing.dirs_read == 1
        # the same batches as the local folder, read through the URL
        kw = dict(text_key="text", num_shards=2, global_batch_size=2, shuffle_window=0)
        local_c, remote_c = cfg(tmp_path, paths=(str(hub),), **kw), cfg(tmp_path, paths=(base,), **kw)
        files = data.list_files(remote_c)
        a = take(data.make_host_iterator(local_c, 0, 1), 8)
        b = take(data.make_host_iterator(remote_c, 0, 1, files=files), 8)
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_batches_equal(x, y, f"batch {i} of the folder at a URL")
        # a glob keeps listing what it matches, the card unread
        calls.update(list=0, info=0, read=[])
        assert [rel(f) for f in list_paths(f"{base}/data/*.parquet").files] == sorted(names)
        assert calls == {"list": 1, "info": 0, "read": []}, calls
        # without a card: the hub's default layout (the files naming the train split), as locally
        fs.rm(f"{base}/README.md")
        (hub / "README.md").unlink()
        assert [rel(f) for f in list_paths(base).files] == names[:2] == \
            [os.path.relpath(f, hub) for f in list_paths(str(hub)).files]
    finally:
        monkeypatch.undo()
        fs.rm(base, recursive=True)


# ---------------------------------------------------------------- the converter
def _converted_records(src_glob, out, text_key):
    from array_record.python.array_record_module import ArrayRecordReader

    from data.streams import records
    assert convert(src_glob, out, "--text-key", text_key) == 0
    docs = []
    for part in records.part_files(str(out)):
        r = ArrayRecordReader(part, "readahead_buffer_size:0")
        docs += r.read(list(range(r.num_records())))
        r.close()
    return docs


@pytest.mark.parametrize("kind", ["array.json", "array.json.gz", "parquet"])
def test_converter_output_equals_the_json_gz_output(tmp_path, kind):
    texts = write_docs(tmp_path / "in", kind, n_files=2, docs_per_file=7)
    ref_texts = write_corpus(tmp_path / "ref", n_files=2, docs_per_file=7, text_key="story")
    # the same documents as .json.gz lines, file by file and in order
    by_file = {}
    for (path, _), t in sorted(texts.items()):
        by_file.setdefault(os.path.basename(os.path.dirname(path)), []).append(t)
    for path, _ in ref_texts:
        d = os.path.basename(os.path.dirname(path))
        with gzip.open(path, "wb") as f:
            f.write(b"".join(json.dumps({"story": t}).encode() + b"\n" for t in by_file[d]))
    got = _converted_records(os.path.join(str(tmp_path / "in"), "*", "part*"), tmp_path / "out", "story")
    ref = _converted_records(os.path.join(str(tmp_path / "ref"), "*", "*.json.gz"), tmp_path / "outref", "story")
    assert len(got) == len(texts) and got == ref
    assert np.frombuffer(got[0], np.uint16).size > 3


# ---------------------------------------------------------------- the run, through train.py
CLI = ["train.steps=2", "train.log_every=2", "checkpoint.every=0", "optimizer.warmup_steps=1",
       "model.max_seq_len=64", "data.seq_len=32", "data.global_batch_size=8", "data.eval.holdout_files=0",
       "train.eval_every=0"]


@pytest.mark.slow
def test_cli_tinystories_arrays_train_and_a_csv_stops_before_compile(tmp_path):
    """`train.py "data.paths='DIR/*.json'" data.text_key=story` on TinyStories-shaped files (JSON
    arrays of objects) trains; the same run over a directory holding a CSV stops in one line, before
    anything is compiled."""
    from run_helpers import read_metrics, run_cli
    write_docs(tmp_path / "ts", "array.json", n_files=4, docs_per_file=30)
    r = run_cli(tmp_path, *CLI, f"data.paths='{tmp_path}/ts/*/part.json'", "data.text_key=story",
                "data.num_workers=1")
    assert r.returncode == 0, r.stderr[-3000:]
    assert [row["step"] for row in read_metrics(tmp_path / "run")] == [2]
    (tmp_path / "ts" / "0001" / "stories.csv").write_text("id,story,source\n1,once upon a time,gpt\n")
    bad = run_cli(tmp_path / "ts", *CLI, f"data.paths='{tmp_path}/ts/*/*'", "data.text_key=story")
    assert bad.returncode != 0 and "Traceback" not in bad.stderr, bad.stderr[-3000:]
    [line] = [ln for ln in bad.stderr.splitlines() if ln.strip()]
    assert f"{tmp_path}/ts/0001/stories.csv is not read: " in line and "CSV text" in line, line
    assert not (tmp_path / "ts" / "run" / "metrics.jsonl").exists()

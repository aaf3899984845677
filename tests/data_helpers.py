"""Small corpora for the data tests: every document's text is unique."""
from __future__ import annotations

import gzip
import importlib.util
import json
import os
import random
from pathlib import Path

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER = os.path.join(REPO, "data", "sample", "tokenizer.json")

WORDS = ("alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega river stone "
         "cloud forest engine signal vector matrix garden window silver copper market "
         "harbor lantern pencil rocket").split()


def doc_text(rng: random.Random, tag: str, n_words: int, words=WORDS) -> str:
    return f"doc {tag}: " + " ".join(rng.choice(words) for _ in range(n_words)) + "."


def write_corpus(root, n_files=8, docs_per_file=12, seed=0, min_words=5, max_words=120,
                 long_doc_chars=0, ext=".json.gz", text_key="raw_content", words=WORDS):
    """Writes root/NNNN/en_head<ext>; returns {(path, line_1based): text}."""
    rng = random.Random(seed)
    texts = {}
    for f in range(n_files):
        d = os.path.join(str(root), f"{f:04d}")
        os.makedirs(d, exist_ok=True)
        path = os.path.join(d, "en_head" + ext)
        lines = []
        for i in range(docs_per_file):
            t = doc_text(rng, f"{f}-{i}", rng.randint(min_words, max_words), words)
            if long_doc_chars and f == 0 and i == 1:
                words, n = [], 0
                while n < long_doc_chars:
                    words.append(rng.choice(WORDS))
                    n += len(words[-1]) + 1
                t = f"doc {f}-{i} long: " + " ".join(words)
            lines.append(json.dumps({text_key: t, "doc_id": f"{f}-{i}"}))
            texts[(path, i + 1)] = t
        write_lines(path, [ln.encode() for ln in lines])
    return texts


def write_lines(path, lines: list[bytes]):
    data = b"".join(ln + b"\n" for ln in lines)
    if path.endswith(".gz"):
        with gzip.open(path, "wb") as f:
            f.write(data)
    elif path.endswith(".zst"):
        import zstandard
        with open(path, "wb") as f:
            f.write(zstandard.ZstdCompressor().compress(data))
    else:
        with open(path, "wb") as f:
            f.write(data)


def cfg(root, **kw):
    import data
    base = dict(paths=(os.path.join(str(root), "*", "en_head.*"),), tokenizer=TOKENIZER,
                seq_len=32, global_batch_size=4, num_workers=0, num_shards=4,
                shuffle_window=8, files_per_stream=2, seed=0)
    base.update(kw)
    return data.DataConfig(**base)


def take(it, n):
    return [next(it) for _ in range(n)]


def jround(x):
    return json.loads(json.dumps(x))


def assert_batches_equal(a, b, msg=""):
    assert a.keys() == b.keys(), msg
    for k in a:
        np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]), err_msg=f"{msg} {k}")


def decode_doc_id(did: int, n_files: int):
    """-> (epoch, file_index, line_0based)."""
    hi, line = did >> 24, did & 0xFFFFFF
    return hi // n_files, hi % n_files, line


def rows_of(batches):
    """Flatten debug batches into rows: list of (shard, doc_ids row, tokens row)."""
    out = []
    for b in batches:
        tok = np.concatenate([b["inputs"], b["targets"][:, -1:]], axis=1)
        for r in range(tok.shape[0]):
            out.append((int(b["row_shard"][r]), b["doc_ids"][r], tok[r]))
    return out


def expected_tokens(text):
    """A document's tokens as the stream packs them: its text's, then EOS."""
    from data.tokenizer import load_tokenizer
    tok = load_tokenizer(TOKENIZER)
    return tok.encode(text, add_special_tokens=False).ids + [tok.token_to_id("</s>")]


def doc_tokens(rows, n_files):
    """{(epoch, file, line): token list in stream order within rows}; rows must be in order
    per shard for the token order to be meaningful, counts are always exact."""
    docs = {}
    for _, did, tok in rows:
        for d, t in zip(did.tolist(), tok.tolist(), strict=False):
            if d < 0:
                continue
            docs.setdefault(decode_doc_id(d, n_files), []).append(t)
    return docs


# ---------------------------------------------------------------- converted corpora (scripts/prepare_data.py)
SCRIPT = os.path.join(REPO, "scripts", "prepare_data.py")


def _converter():
    spec = importlib.util.spec_from_file_location("prepare_data", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def convert(src_glob, out, *extra, tokenizer=TOKENIZER):
    return _converter().main(["--paths", src_glob, "--tokenizer", tokenizer, "--out", str(out),
                              "--no-progress", *extra])


# ---------------------------------------------------------------- other formats (test_data_formats.py)
# ext -> how write_docs stores a file's records
FORMATS = {
    "array.json": ".json", "array.json.gz": ".json.gz", "lines.json": ".json",
    "lines.jsonl.zstd": ".jsonl.zstd", "lines.json.zst": ".json.zst",
    "parquet": ".parquet", "arrow": ".arrow",
}


def write_records(path: str, kind: str, recs: list[dict], row_group: int = 4) -> None:
    """recs (dicts) into one file of `kind` (a FORMATS key)."""
    # every caller skips without pyarrow, as when this lived in test_data_formats.py (a module skip)
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    if kind.startswith("array"):
        raw = json.dumps(recs, indent=1).encode()   # pretty-printed, as dataset dumps often are
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "wb") as f:
            f.write(raw)
    elif kind.startswith("lines"):
        raw = b"".join(json.dumps(r).encode() + b"\n" for r in recs)
        if ".zst" in path:
            import zstandard
            raw = zstandard.ZstdCompressor().compress(raw)
        with open(path, "wb") as f:
            f.write(raw)
    elif kind == "parquet":
        pq.write_table(pa.Table.from_pylist(recs), path, row_group_size=row_group)
    elif kind == "arrow":
        table = pa.Table.from_pylist(recs)
        with pa.OSFile(path, "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
            for batch in table.to_batches(max_chunksize=row_group):
                w.write_batch(batch)
    else:
        raise AssertionError(kind)


def write_docs(root, kind, n_files=4, docs_per_file=9, seed=0, text_key="story", max_words=60):
    """TinyStories-like records (text under `story`, with a nested object beside it) in n_files
    files root/NNNN/part<ext>; returns {(path, record_1based): text}."""
    rng = random.Random(seed)
    texts = {}
    for f in range(n_files):
        d = os.path.join(str(root), f"{f:04d}")
        os.makedirs(d, exist_ok=True)
        path = os.path.join(d, "part" + FORMATS[kind])
        recs = []
        for i in range(docs_per_file):
            t = doc_text(rng, f"{f}-{i}", rng.randint(3, max_words))
            if i % 3 == 1:   # characters the array scanner must not take for structure
                t += ' "quoted ] } {", a \\ backslash\nand a new line'
            if i % 3 == 2:   # more `},` in a string than the scanner's fast path tries: the exact scan
                t += " {a}, {b}], {c}, {d}, {e}, {f}, end"
            recs.append({text_key: t, "instruction": {"prompt": "p", "words": ["a", "b"]}, "n": i})
            texts[(path, i + 1)] = t
        write_records(path, kind, recs)
    return texts


def write_save_to_disk(root, texts_per_file, text_key="story"):
    """A `datasets` save_to_disk directory: with `datasets` installed, written by it; otherwise
    the same layout written by pyarrow (Arrow IPC stream files + state.json + dataset_info.json)."""
    flat = [t for ts in texts_per_file for t in ts]
    try:
        import datasets
    except ImportError:
        datasets = None
    if datasets is not None:
        datasets.Dataset.from_dict({text_key: flat}).save_to_disk(
            str(root), num_shards=len(texts_per_file))
        return
    os.makedirs(root)
    root = Path(root)
    names = []
    for i, ts in enumerate(texts_per_file):
        names.append(f"data-{i:05d}-of-{len(texts_per_file):05d}.arrow")
        write_records(str(root / names[-1]), "arrow", [{text_key: t} for t in ts])
    (root / "state.json").write_text(json.dumps({"_data_files": [{"filename": n} for n in names]}))
    (root / "dataset_info.json").write_text("{}")


def fcfg(root, **kw):
    kw.setdefault("text_key", "story")
    kw.setdefault("paths", (os.path.join(str(root), "*", "part*"),))
    return cfg(root, **kw)


# ---------------------------------------------------------------- mixtures (test_data_mixture*.py)
# name, weight, files, documents per file, text key
SOURCES = [("web", 5.0, 8, 30, "raw_content"), ("books", 3.0, 4, 20, "raw_content"),
           ("tiny", 2.0, 4, 3, "text")]


def mix_cfg(root, sources=SOURCES, **kw):
    base = dict(paths=(), num_shards=4, global_batch_size=8, seq_len=16, shuffle_window=4,
                sources=[{"name": name, "weight": w, "paths": [os.path.join(str(root), name, "*", "*")],
                          "text_key": key} for name, w, _, _, key in sources])
    base.update(kw)
    return cfg(root, **base)


def write_sources(root, sources=SOURCES):
    for i, (name, _, n_files, docs, key) in enumerate(sources):
        write_corpus(os.path.join(str(root), name), n_files=n_files, docs_per_file=docs, seed=i,
                     max_words=60, text_key=key)


def close(it):
    if hasattr(it, "close"):
        it.close()


# ---------------------------------------------------------------- vocabularies past 65,536 ids
def make_tokenizers_module():
    """scripts/bench/make_tokenizers.py: Llama-3- and Qwen2-style byte-level BPE built locally."""
    spec = importlib.util.spec_from_file_location(
        "make_tokenizers", os.path.join(REPO, "scripts", "bench", "make_tokenizers.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


WIDE_PIECES = 70_000


def wide_tokenizer(path, family="qwen2", pieces=WIDE_PIECES) -> str:
    """Saves at `path` a byte-level BPE tokenizer of `family` with `pieces` BPE pieces (its special
    tokens after them), built without training (make_tokenizers.constructed); returns the path."""
    make_tokenizers_module().constructed(family, pieces).save(str(path))
    return str(path)


def wide_words(pieces=WIDE_PIECES) -> list[str]:
    """WORDS and synthetic words that a wide_tokenizer encodes to single ids of 65,536 and above."""
    mt = make_tokenizers_module()
    first = 256 + 26 * 26          # make_tokenizers.constructed: the k-th word's id is first + k
    return list(WORDS) + [mt.synthetic_word(k) for k in range((1 << 16) - first, pieces - first, 97)]

"""Small corpora for the data tests: every document's text is unique."""
from __future__ import annotations

import gzip
import json
import os
import random

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER = os.path.join(REPO, "data", "sample", "tokenizer.json")

WORDS = ("alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega river stone "
         "cloud forest engine signal vector matrix garden window silver copper market "
         "harbor lantern pencil rocket").split()


def doc_text(rng: random.Random, tag: str, n_words: int) -> str:
    return f"doc {tag}: " + " ".join(rng.choice(WORDS) for _ in range(n_words)) + "."


def write_corpus(root, n_files=8, docs_per_file=12, seed=0, min_words=5, max_words=120,
                 long_doc_chars=0, ext=".json.gz", text_key="raw_content"):
    """Writes root/NNNN/en_head<ext>; returns {(path, line_1based): text}."""
    rng = random.Random(seed)
    texts = {}
    for f in range(n_files):
        d = os.path.join(str(root), f"{f:04d}")
        os.makedirs(d, exist_ok=True)
        path = os.path.join(d, "en_head" + ext)
        lines = []
        for i in range(docs_per_file):
            t = doc_text(rng, f"{f}-{i}", rng.randint(min_words, max_words))
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

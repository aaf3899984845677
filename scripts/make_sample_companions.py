#!/usr/bin/env python3
"""Write RedPajama-v2's companion files for the bundled sample (or any documents in its layout):
quality signals, a duplicates file and minhash bands, beside the documents as RPv2 lays them out.

    python scripts/make_sample_companions.py --docs 'data/sample/*/en_head.json.gz'

For each documents file D (root and relative name as data/readers/companions.py finds them):
  quality_signals/<rel>.signals.json.gz   a JSON line per document: {id, id_int, metadata,
                                          quality_signals}, each signal [[start, end, score]]
  duplicates/<rel>.duplicates.parquet     `doc_id` of every exact copy but the first seen
                                          (text normalized as CCNet does: lower case, digits
                                          and punctuation dropped, spaces collapsed)
  minhash/<rel>.minhash.parquet           id, id_int, signature_sim{0.7,0.8,0.9,1.0}: band
                                          hashes of 128 minhashes over word 13-grams

The signals are our own short implementations of the document-level signals the presets of
data/readers/quality.py read (and rps_lines_start_with_bulletpoint per line), after RPv2's
definitions; two are stand-ins, named so in docs/data.md: rps_doc_ldnoobw_words counts the
words of --badwords (none by default: 0), and rps_doc_ml_wikiref_score is the share of the
document's lines that end like a sentence (RPv2's is a fastText classifier we do not ship).
Deterministic: the same documents give the same bytes.
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import hashlib
import io
import json
import os
import re
import sys
import zlib

import numpy as np

from data.readers.companions import companion_path, split_path

# (bands, rows) per similarity threshold over 128 minhashes, as RPv2 chose them
BANDS = {"0.7": (14, 9), "0.8": (9, 13), "0.9": (5, 25), "1.0": (1, 128)}
NUM_PERM = 128
NGRAM = 13
_PRIME = 4294967311   # > 2**32: (a * h + b) % p with h < 2**32 stays inside uint64
_BULLETS = ("\u2022", "\u25cf", "\u25cb", "\u25aa", "\u25ab", "*", "-", "\u2013", "\u2014", "\u00b7")
_SENT_END = re.compile(r"[.!?]+(?=\s|$)")
_WORD = re.compile(r"\S+")


def _norm_words(text: str) -> list[str]:
    return re.sub(r"[^\w\s]|\d|_", " ", text.lower()).split()


def _round(x: float) -> float:
    return round(float(x), 4)


def _top_ngram_frac(words: list[str], n: int, total_chars: int) -> float:
    if len(words) < n or not total_chars:
        return 0.0
    grams = collections.Counter(tuple(words[i:i + n]) for i in range(len(words) - n + 1))
    gram, count = grams.most_common(1)[0]
    return sum(map(len, gram)) * count / total_chars


def _dupe_ngram_frac(words: list[str], n: int, total_chars: int) -> float:
    if len(words) < n or not total_chars:
        return 0.0
    grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
    counts = collections.Counter(grams)
    covered = np.zeros(len(words), bool)
    for i, g in enumerate(grams):
        if counts[g] > 1:
            covered[i:i + n] = True
    return sum(len(w) for w, c in zip(words, covered, strict=True) if c) / total_chars


def signals(text: str, badwords: frozenset = frozenset()) -> dict:
    """The quality signals of one document, RPv2's span form: [[0, len, score]] or per line."""
    n = len(text)
    lines = text.split("\n")
    words = _WORD.findall(text)
    nw = len(words)
    norm = _norm_words(text)
    chars = sum(map(len, norm))
    doc = {
        "ccnet_nlines": len(lines),
        "rps_doc_word_count": len(norm),
        "rps_doc_mean_word_length": chars / len(norm) if norm else None,
        "rps_doc_symbol_to_word_ratio": ((text.count("#") + text.count("...") + text.count("\u2026"))
                                         / nw if nw else None),
        "rps_doc_frac_lines_end_with_ellipsis": (sum(ln.rstrip().endswith(("...", "\u2026")) for ln in lines)
                                                 / len(lines)),
        "rps_doc_frac_no_alph_words": (sum(not any(c.isalpha() for c in w) for w in words) / nw
                                       if nw else None),
        "rps_doc_num_sentences": len(_SENT_END.findall(text)),
        "rps_doc_ldnoobw_words": sum(w in badwords for w in norm),
        "rps_doc_lorem_ipsum": text.lower().count("lorem ipsum") / n if n else 0.0,
        "rps_doc_curly_bracket": (text.count("{") + text.count("}")) / n if n else 0.0,
        "rps_doc_ml_wikiref_score": (sum(bool(_SENT_END.search(ln.rstrip()[-1:] or "x")) for ln in lines
                                         if ln.strip()) / max(1, sum(bool(ln.strip()) for ln in lines))),
    }
    for k in (2, 3, 4):
        doc[f"rps_doc_frac_chars_top_{k}gram"] = _top_ngram_frac(norm, k, chars)
    for k in range(5, 11):
        doc[f"rps_doc_frac_chars_dupe_{k}grams"] = _dupe_ngram_frac(norm, k, chars)
    out = {k: [[0, n, None if v is None else _round(v)]] for k, v in doc.items()}
    spans, start = [], 0
    for ln in lines:
        end = start + len(ln)
        spans.append([start, end, float(ln.lstrip().startswith(_BULLETS))])
        start = end + 1
    out["rps_lines_start_with_bulletpoint"] = spans
    return out


def digest(text: str) -> str:
    """The exact-duplicate key: the text normalized as CCNet does, hashed."""
    return hashlib.sha1(" ".join(_norm_words(text)).encode()).hexdigest()


def _perms() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0x5EED)
    return (rng.integers(1, _PRIME, NUM_PERM, dtype=np.uint64),
            rng.integers(0, _PRIME, NUM_PERM, dtype=np.uint64))


def minhash_bands(text: str, perms) -> dict[str, list[bytes]]:
    """signature_sim<t>: one 8-byte hash per band of the document's 128 minhashes."""
    words = _norm_words(text)
    grams = {" ".join(words[i:i + NGRAM]) for i in range(max(1, len(words) - NGRAM + 1))}
    h = np.array([zlib.crc32(g.encode()) for g in grams], np.uint64)
    a, b = perms
    mins = ((h[:, None] * a[None, :] + b[None, :]) % np.uint64(_PRIME)).min(0).astype("<u4")
    out = {}
    for t, (bands, rows) in BANDS.items():
        out[f"signature_sim{t}"] = [hashlib.blake2b(mins[i * rows:(i + 1) * rows].tobytes(),
                                                    digest_size=8).digest() for i in range(bands)]
    return out


def _id(rel: str, row: int) -> str:
    return f"{rel}.json.gz/{row}"


def _write_parquet(path: str, table) -> None:
    import pyarrow.parquet as pq
    os.makedirs(os.path.dirname(path), exist_ok=True)
    pq.write_table(table, path, compression="zstd")


def write_companions(doc_files: list[str], badwords: frozenset = frozenset(), root: str | None = None) -> dict:
    """Writes every documents file's companions; -> {"documents", "duplicates"} counts."""
    import pyarrow as pa
    perms = _perms()
    seen: set[str] = set()
    n_docs = n_dups = 0
    for fi, path in enumerate(sorted(doc_files)):
        rel = split_path(path)[1]
        sig_lines, dups, mh = [], [], collections.defaultdict(list)
        with gzip.open(path, "rb") as f:
            for row, raw in enumerate(f):
                text = json.loads(raw)["raw_content"]
                doc_id, id_int = _id(rel, row), (fi << 24) | row
                sig_lines.append(json.dumps({"id": doc_id, "id_int": id_int,
                                             "metadata": {"nlines": text.count("\n") + 1},
                                             "quality_signals": signals(text, badwords)},
                                            separators=(",", ":")))
                d = digest(text)
                if d in seen:
                    dups.append(doc_id)
                seen.add(d)
                mh["id"].append(doc_id)
                mh["id_int"].append(id_int)
                for k, v in minhash_bands(text, perms).items():
                    mh[k].append(v)
                n_docs += 1
        n_dups += len(dups)
        sp = companion_path(path, "signals", root)
        os.makedirs(os.path.dirname(sp), exist_ok=True)
        buf = io.BytesIO()
        with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0) as g:   # mtime 0: the same bytes each run
            g.write(("\n".join(sig_lines) + "\n").encode())
        with open(sp, "wb") as out:
            out.write(buf.getvalue())
        _write_parquet(companion_path(path, "duplicates", root),
                       pa.table({"doc_id": pa.array(dups, pa.string())}))
        cols = {"id": pa.array(mh["id"], pa.string()), "id_int": pa.array(mh["id_int"], pa.int64())}
        cols.update({k: pa.array(v, pa.list_(pa.binary())) for k, v in mh.items()
                     if k.startswith("signature")})
        _write_parquet(companion_path(path, "minhash", root), pa.table(cols))
    return {"documents": n_docs, "duplicates": n_dups}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", default="data/sample/*/en_head.json.gz",
                    help="glob of RPv2-layout documents files (.json.gz, `raw_content`)")
    ap.add_argument("--root", default=None,
                    help="where quality_signals/, duplicates/, minhash/ go (default: the documents' root)")
    ap.add_argument("--badwords", default=None,
                    help="a file of words (one a line) rps_doc_ldnoobw_words counts (default: none)")
    args = ap.parse_args()
    files = sorted(glob.glob(args.docs))
    if not files:
        sys.exit(f"--docs {args.docs!r} matches no file")
    bad = frozenset()
    if args.badwords:
        with open(args.badwords, encoding="utf-8") as f:
            bad = frozenset(w.strip().lower() for w in f if w.strip())
    got = write_companions(files, bad, args.root)
    print(f"{got['documents']} documents in {len(files)} files: signals, {got['duplicates']} exact "
          "duplicate(s), minhash bands written")


if __name__ == "__main__":
    main()

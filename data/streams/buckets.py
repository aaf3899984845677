"""Length buckets: a source keeps only the documents of at least / at most N tokens.

`data.min_doc_tokens` / `data.max_doc_tokens` (data.paths), `min_tokens` / `max_tokens` per source
of `data.sources`, `data.eval.min_doc_tokens` (the held-out set). A document's length is its
tokenizer tokens (EOS and BOS not counted; a document over data/readers/sources.py PIECE_CHARS
characters is tokenized in pieces and its length is the sum of theirs), so the filter runs after
tokenization: documents outside the bucket are dropped from the packer's input and counted
("oob" among the shard counters: data/out_of_bucket_documents, per source
data/source/NAME/out_of_bucket_documents), never bad records.

Exact resume holds because the filter is a pure function of a chunk's tokens: a text stream with
a bucket reads its chunks as whole documents (a chunk runs on past its character budget to its
last document's last piece, data/streams/shard.py _read_chunk), so a document's pieces are
tokenized and judged together and a chunk still depends only on the reader position it starts
at. The bounds are in the data fingerprint (data/state.py): another bucket is other data.
"""
from __future__ import annotations

import numpy as np


class NoDocumentInBucketError(ValueError):
    """A virtual shard that read its files twice over without a document inside its bucket."""


def check_bounds(lo, hi, where_lo: str, where_hi: str) -> tuple[int, int]:
    """(min, max) as ints, 0 = no bound; one-line ValueError naming the key for a mistake."""
    out = []
    for v, where in ((lo, where_lo), (hi, where_hi)):
        if v is None:
            v = 0
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{where}={v!r}: must be an integer >= 0 (0 or null: no bound)")
        out.append(v)
    if out[1] and out[0] > out[1]:
        raise ValueError(f"{where_lo}={out[0]} is above {where_hi}={out[1]}: the bucket keeps no document")
    return out[0], out[1]


def describe(lo: int, hi: int) -> str:
    """'>= 8192 tokens', '<= 512 tokens', '256..1024 tokens'."""
    if lo and hi:
        return f"{lo}..{hi} tokens"
    return f">= {lo} tokens" if lo else f"<= {hi} tokens"


def keep_documents(flat: np.ndarray, lens, dids: list, firsts: list, lasts: list, lo: int, hi: int):
    """A chunk's tokenized pieces (whole documents: its first piece starts a document, its last
    ends one) without the documents outside [lo, hi] -> (flat, lens, dids, firsts, lasts, dropped
    documents). Lengths count the document's text tokens, summed over its pieces."""
    lens = np.asarray(lens, np.int64)
    first = np.asarray(firsts, bool)
    if not len(lens):
        return flat, lens, dids, firsts, lasts, 0
    doc = np.cumsum(first) - int(first[0])             # the document of each piece
    doc_len = np.bincount(doc, weights=lens)
    ok = doc_len >= lo
    if hi:
        ok &= doc_len <= hi
    dropped = int((~ok).sum())
    if not dropped:
        return flat, lens, dids, firsts, lasts, 0
    keep = ok[doc]
    flat = flat[np.repeat(keep, lens)]
    idx = np.flatnonzero(keep).tolist()
    return (flat, lens[keep], [dids[i] for i in idx], [firsts[i] for i in idx],
            [lasts[i] for i in idx], dropped)


def keep_records(flat: np.ndarray, lens: np.ndarray, dids: np.ndarray, lo: int, hi: int):
    """A block of converted documents (one piece each) without those outside [lo, hi] ->
    (flat, lens, dids, dropped)."""
    ok = lens >= lo
    if hi:
        ok &= lens <= hi
    dropped = int((~ok).sum())
    if not dropped:
        return flat, lens, dids, 0
    return flat[np.repeat(ok, lens)], lens[ok], dids[ok], dropped


def stuck(shard: int, n_files: int, lo: int, hi: int, where: str) -> NoDocumentInBucketError:
    return NoDocumentInBucketError(
        f"virtual shard {shard}: none of the documents of its {n_files} file(s) has {describe(lo, hi)} "
        f"(read twice over): widen {where} or give that source more files")

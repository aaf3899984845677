"""Packing token streams into rows of R = seq_len + 1 tokens.

Streams are three parallel arrays: tokens (int32), doc ids (int64, a global document
identity, -1 = padding) and `first` (bool, the token is its document's first token).
Segment ids and positions are derived from doc ids per row: a new segment starts at column 0
and wherever the doc id changes; positions restart at 0 at each segment start.

Both packers keep at most one row's worth of carry-over tokens between windows (first_fit
flushes its open bins at the end of every window), so their state is small JSON.
"""
from __future__ import annotations

import base64

import numpy as np

PAD_ID = 0


def assemble(flat: np.ndarray, lens: np.ndarray, dids, firsts, lasts, eos: int,
             bos: int | None):
    """Token pieces -> (tokens, doc_ids, first) with BOS (if bos is not None) before the
    first piece of a document and EOS after the last piece. `flat` may be any integer dtype
    (a converted corpus stores uint16). Vectorized per block: the pieces' tokens land on
    every slot that is not a BOS or EOS slot, in one masked assignment (index arithmetic per
    token cost ~10x more on a converted corpus, where this is most of the read path)."""
    firsts = np.asarray(firsts, bool)
    lasts = np.asarray(lasts, bool)
    pre = firsts if bos is not None else np.zeros(len(lens), bool)
    new_lens = lens + pre + lasts
    ends = np.cumsum(new_lens)
    total = int(ends[-1]) if len(ends) else 0
    starts = ends - new_lens
    tok = np.empty(total, np.int32)
    bos_at, eos_at = starts[pre], ends[lasts] - 1
    body = np.ones(total, bool)
    body[bos_at] = False
    body[eos_at] = False
    tok[body] = flat
    if bos is not None:
        tok[bos_at] = bos
    tok[eos_at] = eos
    did = np.repeat(np.asarray(dids, np.int64), new_lens)
    first = np.zeros(total, bool)
    first[starts[firsts & (new_lens > 0)]] = True
    return tok, did, first


def segments_positions(did: np.ndarray):
    """did [n, R] -> (segment_ids, positions) int32, 0 where did < 0 (padding).

    Per segment, not per token: a segment starts at each row's column 0 and wherever the doc
    id changes; its id in the row and its start are spread over its tokens with one
    np.repeat each (a cumsum of the bool start mask into int32 costs ~20x a repeat)."""
    n, r = did.shape
    flat = did.reshape(-1)
    start = np.empty(n * r, bool)
    if n * r:
        start[0] = True
        np.not_equal(flat[1:], flat[:-1], out=start[1:])
        start.reshape(n, r)[:, 0] = True
    at = np.flatnonzero(start)                   # flat index of every segment start
    length = np.diff(at, append=n * r)
    number = np.arange(len(at))
    row_first = np.maximum.accumulate(np.where(at % r == 0, number, 0))
    seg = np.repeat((number - row_first + 1).astype(np.int32), length).reshape(n, r)
    pos = np.arange(n * r, dtype=np.int32)
    pos -= np.repeat(at.astype(np.int32), length)
    pos = pos.reshape(n, r)
    if flat.size and flat.min() < 0:
        pad = did < 0
        seg[pad] = 0
        pos[pad] = 0
    return seg, pos


def _empty():
    return np.zeros(0, np.int32), np.zeros(0, np.int64), np.zeros(0, bool)


def carry_to_state(tok, did, first) -> dict:
    runs = []
    if len(tok):
        cut = np.flatnonzero(np.diff(did)) + 1
        b = np.concatenate([[0], cut, [len(did)]])
        for s, e in zip(b[:-1], b[1:], strict=False):
            runs.append([int(did[s]), int(e - s), int(first[s])])
    # tokens as base64 little-endian int32: one short string pickles and serializes fast
    return {"tokens": base64.b64encode(tok.astype("<i4").tobytes()).decode("ascii"),
            "runs": runs}


def carry_from_state(st: dict | None):
    if not st or not st.get("tokens"):
        return _empty()
    tok = np.frombuffer(base64.b64decode(st["tokens"]), "<i4").astype(np.int32)
    did = np.concatenate([np.full(c, d, np.int64) for d, c, _ in st["runs"]])
    first = np.zeros(len(tok), bool)
    off = 0
    for _, c, f in st["runs"]:
        first[off] = bool(f)
        off += c
    return tok, did, first


def remainder(tok, did, first, open_doc: int | None = None):
    """Tokens of packed rows not handed out, plus a packer's carry-over, as one carry for a
    packer of another row length (data.shape_change=continue): padding dropped, each document's
    pieces put together in the order they were packed (first_fit hands out a long document's
    full rows and the bin holding its end apart), documents in the order they first appear,
    `open_doc` (the document the next read continues: the carry-over's) last. -> (tok, did, first)."""
    keep = did >= 0
    tok, did, first = tok[keep], did[keep], first[keep]
    if not len(did):
        return _empty()
    docs, at = np.unique(did, return_index=True)
    rank = np.empty(len(docs), np.int64)
    rank[np.argsort(at, kind="stable")] = np.arange(len(docs))
    if open_doc is not None and open_doc in docs:
        rank[np.searchsorted(docs, open_doc)] = len(docs)
    order = np.argsort(rank[np.searchsorted(docs, did)], kind="stable")
    return tok[order], did[order], first[order]


class ConcatPacker:
    """Concatenate documents and cut rows of exactly R tokens; no padding."""

    def __init__(self, row_len: int):
        self.R = row_len
        self.carry = _empty()

    def set_carry(self, st):
        self.carry = carry_from_state(st)

    def carry_state(self) -> dict:
        return carry_to_state(*self.carry)

    def add(self, tok, did, first):
        ct, cd, cf = self.carry
        tok = np.concatenate([ct, tok])
        did = np.concatenate([cd, did])
        first = np.concatenate([cf, first])
        n = len(tok) // self.R
        k = n * self.R
        self.carry = (tok[k:].copy(), did[k:].copy(), first[k:].copy())
        return (tok[:k].reshape(n, self.R), did[:k].reshape(n, self.R),
                first[:k].reshape(n, self.R))

    def flush(self):
        return None


class FirstFitPacker:
    """First-fit bin packing of whole documents into at most `max_bins` open rows, padded.

    A document longer than a row fills whole rows first; its remainder is placed like a
    short document. When no open bin fits and all bins are open, the fullest bin is emitted.
    """

    def __init__(self, row_len: int, max_bins: int = 8):
        self.R = row_len
        self.max_bins = max_bins
        self.carry = _empty()   # the unfinished document (pieces so far), < R tokens
        self.bins: list[list] = []   # [used, [(tok, did, first), ...]]

    def set_carry(self, st):
        self.carry = carry_from_state(st)
        self.bins = []

    def carry_state(self) -> dict:
        return carry_to_state(*self.carry)

    def _row(self, parts):
        tok = np.full(self.R, PAD_ID, np.int32)
        did = np.full(self.R, -1, np.int64)
        first = np.zeros(self.R, bool)
        off = 0
        for t, d, f in parts:
            n = len(t)
            tok[off:off + n] = t
            did[off:off + n] = d
            first[off:off + n] = f
            off += n
        return tok, did, first

    def add(self, tok, did, first, lasts_end=None):
        """tok/did/first as from `assemble`. lasts_end: whether the block's last piece ends
        its document (else that document's tokens so far are carried to the next block)."""
        out = []
        ct, cd, cf = self.carry
        tok = np.concatenate([ct, tok])
        did = np.concatenate([cd, did])
        first = np.concatenate([cf, first])
        if len(tok) == 0:
            return self._stack(out)
        cut = np.flatnonzero(np.diff(did)) + 1
        b = np.concatenate([[0], cut, [len(did)]]).tolist()
        last_complete = bool(lasts_end)
        for j, (s, e) in enumerate(zip(b[:-1], b[1:], strict=False)):
            is_last_run = j == len(b) - 2
            while e - s >= self.R:
                out.append((tok[s:s + self.R], did[s:s + self.R], first[s:s + self.R]))
                s += self.R
            if is_last_run and not last_complete:
                self.carry = (tok[s:e].copy(), did[s:e].copy(), first[s:e].copy())
                break
            if e > s:
                self._place((tok[s:e], did[s:e], first[s:e]), out)
        else:
            self.carry = _empty()
        return self._stack(out)

    def _place(self, seg, out):
        n = len(seg[0])
        for bn in self.bins:
            if bn[0] + n <= self.R:
                bn[0] += n
                bn[1].append(seg)
                return
        if len(self.bins) >= self.max_bins:
            k = max(range(len(self.bins)), key=lambda i: self.bins[i][0])
            out.append(self._row(self.bins.pop(k)[1]))
        self.bins.append([n, [seg]])

    def flush(self):
        out = [self._row(bn[1]) for bn in self.bins]
        self.bins = []
        return self._stack(out)

    def _stack(self, rows):
        if not rows:
            return (np.zeros((0, self.R), np.int32), np.zeros((0, self.R), np.int64),
                    np.zeros((0, self.R), bool))
        return (np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows]),
                np.stack([r[2] for r in rows]))

"""The per-virtual-shard row stream and the per-host Grain IterDataset built on it.

A virtual shard's stream is deterministic and independent of hosts and workers:
files in a seeded per-epoch order -> documents -> batched tokenization -> packer -> windows
of >= W rows, each permuted with a seed from (seed, shard, window index).
Its state: the reader + packer carry + counters at the start of the current window, and how
many rows of the window were emitted. Restoring regenerates that one window and skips.

Layout of a host batch (R = seq_len + 1 tokens per packed row, non-overlapping):
inputs = row[:-1], targets = row[1:]; segment_ids count documents inside the row from 1
(0 = padding); positions restart at 0 at each document start AND at the start of a row (a
document continued from the previous row starts again at 0); loss_mask = 1 where target t
belongs to the same document as input t. EOS ends every document (BOS optional).

The global batch has a fixed layout: virtual shard v fills rows [v*k, (v+1)*k) of every global
batch, k = global_batch_size / V. Host h of P owns the contiguous shards [h*V/P, (h+1)*V/P), so
its local batch is exactly its slice of the global batch, and the global batch is the same for
any host count and any worker count: a run resumed on another topology sees the very batches an
uninterrupted run would have seen. An iterator (a host's, or one Grain worker's slice of it)
emits a slab: k rows of each of its shards in shard order, packed as one [rows, 3, R] array,
plus "row_shard"; the host merges its workers' slabs back into shard order
(WorkerMergeIterDataset) and derives the batch arrays (slab_to_batch).

Host state (JSON): {"__vshards__": 1, "num_shards": V,
"topology": [process_index, process_count, num_workers], "shards": {"v": shard state}}.
Shard state: {"start": {"reader", "carry", "win", "c"}, "emitted": k, "c": counters}; the
counters (rows, docs, tokens, pad, segs, bad records) cover the rows emitted so far, so a
consumed state gives exact consumed statistics. Bad records are counted when read (the
window is read ahead of consumption).
"""
from __future__ import annotations

import dataclasses

import grain
import numpy as np

from data import packing
from data.sources import BadRecords, ShardReader
from data.tokenizer import BatchEncoder, available_cores, set_thread_env

STATE_VERSION = 1
_MARK = "__vshards__"
COUNTER_KEYS = ("rows", "docs", "tokens", "pad", "segs", "trunc", "drop")
MAX_BLOCK_CHARS = 1 << 21
CHARS_PER_TOKEN_GUESS = 3


@dataclasses.dataclass(frozen=True)
class StreamSpec:
    """Everything a worker needs, picklable and small (no tokenizer object)."""
    files: tuple[str, ...]          # the global sorted file list
    num_shards: int
    tokenizer_json: str
    seq_len: int
    text_key: str
    strict: bool
    packing: str
    shuffle_window: int
    files_per_stream: int
    add_bos: bool
    seed: int
    rows_per_shard: int             # k: rows each virtual shard adds to every global batch
    num_workers: int
    debug: bool = False
    process_index: int = 0
    process_count: int = 1


def zero_counters() -> dict:
    c = {k: 0 for k in COUNTER_KEYS}
    c["bad"] = {}
    c["badex"] = []
    return c


def initial_shard_state() -> dict:
    return {"start": {"reader": ShardReader.initial_state(), "carry": None, "win": 0,
                      "c": zero_counters()},
            "emitted": 0, "c": zero_counters()}


def shard_files(spec_files, num_shards: int, shard: int):
    ids = list(range(shard, len(spec_files), num_shards))
    return [spec_files[i] for i in ids], ids


class ShardStream:
    def __init__(self, spec: StreamSpec, shard: int, encoder: BatchEncoder, state: dict):
        self.spec = spec
        self.shard = shard
        self.enc = encoder
        files, ids = shard_files(spec.files, spec.num_shards, shard)
        self.bad = BadRecords(spec.strict)
        self.reader = ShardReader(files, ids, len(spec.files), shard, spec.seed,
                                  spec.files_per_stream, spec.text_key, self.bad)
        R = spec.seq_len + 1
        if spec.packing == "concat":
            self.packer = packing.ConcatPacker(R)
        else:
            self.packer = packing.FirstFitPacker(R)
        self.W = max(int(spec.shuffle_window), 1)
        self._restore(state)

    # ---- state ----
    def get_state(self) -> dict:
        c = self.c
        return {"start": self._start, "emitted": self.emitted,
                "c": {**c, "bad": dict(self.bad.counts), "badex": list(self.bad.examples)}}

    def _restore(self, st: dict) -> None:
        s = st["start"]
        self.reader.set_state(s["reader"])
        self.packer.set_carry(s["carry"])
        self.win = int(s["win"])
        c = s["c"]
        self.c = {k: int(c[k]) for k in COUNTER_KEYS}
        self.bad.counts = {k: int(v) for k, v in c["bad"].items()}
        self.bad.examples = list(c["badex"])
        self._start = s
        self._build_window()
        k = int(st["emitted"])
        if k > len(self.perm):
            raise ValueError(f"virtual shard {self.shard}: state has {k} rows emitted from a "
                             f"window of {len(self.perm)}: data or settings changed")
        for _ in range(k):
            self._take()

    def _snapshot(self) -> dict:
        return {"reader": self.reader.get_state(), "carry": self.packer.carry_state(),
                "win": self.win, "c": {**self.c, "bad": dict(self.bad.counts),
                                       "badex": list(self.bad.examples)}}

    # ---- rows ----
    def _target_rows(self) -> int:
        """W rows, but a shard's first window is shorter by a shard-dependent fraction so
        that shards refill their windows at different times (smoother worker load, faster
        first batch). Depends only on (shard, window index): topology independent."""
        if self.win > 0:
            return self.W
        frac = 0.125 + 0.875 * ((self.shard * 0.6180339887498949) % 1.0)
        return max(1, int(self.W * frac))

    def _build_window(self) -> None:
        R = self.spec.seq_len + 1
        parts = []
        n = 0
        target = self._target_rows()
        while n < target:
            budget = min(MAX_BLOCK_CHARS, max(1024, (target - n) * R * CHARS_PER_TOKEN_GUESS))
            texts, dids, firsts, lasts = [], [], [], []
            chars = 0
            while chars < budget:
                text, did, first, last = self.reader.next_piece()
                texts.append(text)
                dids.append(did)
                firsts.append(first)
                lasts.append(last)
                chars += len(text)
            flat, lens = self.enc.encode(texts)
            tok, did, first = packing.assemble(
                flat, lens, dids, firsts, lasts, self.enc.eos,
                self.enc.bos if self.spec.add_bos else None)
            if isinstance(self.packer, packing.FirstFitPacker):
                rows = self.packer.add(tok, did, first, lasts_end=lasts[-1])
            else:
                rows = self.packer.add(tok, did, first)
            parts.append(rows)
            n += len(rows[0])
        fl = self.packer.flush()
        if fl is not None:
            parts.append(fl)
        tok = np.concatenate([p[0] for p in parts])
        did = np.concatenate([p[1] for p in parts])
        first = np.concatenate([p[2] for p in parts])
        seg, pos = packing.segments_positions(did)
        if self.W > 1:
            perm = np.random.default_rng([self.spec.seed, self.shard, self.win, 2]).permutation(
                len(tok))
        else:
            perm = np.arange(len(tok))
        self.tok, self.did, self.seg, self.pos = tok, did, seg, pos
        self.perm = perm.tolist()
        real = did >= 0
        self.m_tok = real.sum(1).tolist()
        self.m_docs = first.sum(1).tolist()
        self.m_segs = seg.max(1).tolist()
        self.emitted = 0
        self.win += 1

    def _take(self) -> int:
        i = self.perm[self.emitted]
        self.emitted += 1
        c = self.c
        c["rows"] += 1
        c["tokens"] += self.m_tok[i]
        c["pad"] += self.tok.shape[1] - self.m_tok[i]
        c["docs"] += self.m_docs[i]
        c["segs"] += self.m_segs[i]
        return i

    def next_row_into(self, b: int, out: dict) -> None:
        if self.emitted >= len(self.perm):
            self._start = self._snapshot()
            self._build_window()
        i = self._take()
        out["tok"][b] = self.tok[i]
        out["seg"][b] = self.seg[i]
        out["pos"][b] = self.pos[i]
        out["shard"][b] = self.shard
        if "did" in out:
            out["did"][b] = self.did[i]


def progress(shard_state: dict) -> int:
    return int(shard_state["c"]["rows"])


class HostIterDataset(grain.IterDataset):
    """k rows of each of this host's virtual shards per element, in shard order.

    `set_slice` (called by mp_prefetch in each worker) keeps a slice of the shards.
    """

    def __init__(self, spec: StreamSpec, shard_ids: list[int], shard_states: dict | None):
        super().__init__()
        self.spec = spec
        self.shard_ids = list(shard_ids)
        self.shard_states = shard_states or {}

    def set_slice(self, sl: slice, sequential_slice: bool = False) -> None:
        del sequential_slice
        self.shard_ids = self.shard_ids[sl]

    def __iter__(self):
        return HostIterator(self.spec, self.shard_ids, self.shard_states)

    def __str__(self) -> str:
        return f"HostIterDataset(shards={self.shard_ids})"


class HostIterator(grain.DatasetIterator):
    def __init__(self, spec: StreamSpec, shard_ids: list[int], shard_states: dict):
        super().__init__()
        if not shard_ids:
            raise ValueError("an input worker owns no virtual shard: raise data.num_shards or "
                             "lower data.num_workers")
        self.spec = spec
        self.shard_ids = sorted(shard_ids)
        self._states = {str(v): shard_states.get(str(v)) or initial_shard_state()
                        for v in shard_ids}
        self.streams = None   # built lazily: get_state in the main process must stay cheap

    def _init(self) -> None:
        n = max(self.spec.num_workers, 1)
        set_thread_env(available_cores() // n if self.spec.num_workers > 0
                       else available_cores())
        enc = BatchEncoder(self.spec.tokenizer_json)
        self.streams = [ShardStream(self.spec, v, enc, self._states[str(v)])
                        for v in self.shard_ids]
        self._states = None

    def __next__(self):
        """A slab: {"rows": int32 [B, 3, R] (tokens, segment ids, positions), "row_shard"}.

        Few, large arrays: each array of an element crosses from a Grain worker to the host
        process through its own shared-memory block, so the batch layout (inputs, targets,
        masks) is derived on the host side by `slab_to_batch`."""
        if self.streams is None:
            self._init()
        k, R = self.spec.rows_per_shard, self.spec.seq_len + 1
        B = k * len(self.streams)
        rows = np.empty((B, 3, R), np.int32)
        out = {"tok": rows[:, 0], "seg": rows[:, 1], "pos": rows[:, 2], "shard": np.empty((B,), np.int32)}
        if self.spec.debug:
            out["did"] = np.empty((B, R), np.int64)
        for j, stream in enumerate(self.streams):
            for b in range(j * k, (j + 1) * k):
                stream.next_row_into(b, out)
        slab = {"rows": rows, "row_shard": out["shard"]}
        if self.spec.debug:
            slab["doc_ids"] = out["did"]
        return slab

    def get_state(self) -> dict:
        if self.streams is None:
            shards = dict(self._states)
        else:
            shards = {str(s.shard): s.get_state() for s in self.streams}
        sp = self.spec
        return {_MARK: STATE_VERSION, "num_shards": sp.num_shards,
                "topology": [sp.process_index, sp.process_count, sp.num_workers],
                "shards": shards}

    def set_state(self, state: dict) -> None:
        if state.get(_MARK) != STATE_VERSION:
            raise ValueError("not an input-pipeline state of this version")
        if int(state["num_shards"]) != self.spec.num_shards:
            raise ValueError(f"saved state has {state['num_shards']} virtual shards, "
                             f"data.num_shards={self.spec.num_shards}")
        shards = state["shards"]
        missing = [v for v in self.shard_ids if str(v) not in shards]
        if missing:
            raise ValueError(f"saved input state lacks virtual shards {missing}: the host or "
                             "worker count changed; resume through merge_host_states")
        sts = {str(v): shards[str(v)] for v in self.shard_ids}
        if self.streams is None:
            self._states = sts
        else:
            for s in self.streams:
                s._restore(sts[str(s.shard)])

    def close(self) -> None:
        if self.streams:
            for s in self.streams:
                s.reader.close()


def find_shard_states(state, out: dict | None = None) -> dict:
    """Walks any (Grain-nested) state; returns {shard: most advanced shard state}."""
    if out is None:
        out = {}
    if isinstance(state, dict):
        if state.get(_MARK) is not None:
            for k, st in state["shards"].items():
                if k not in out or progress(st) > progress(out[k]):
                    out[k] = st
            return out
        for v in state.values():
            find_shard_states(v, out)
    elif isinstance(state, (list, tuple)):
        for v in state:
            find_shard_states(v, out)
    elif isinstance(state, (str, bytes)):
        s = state
        if isinstance(s, bytes):
            s = s.decode("utf-8", "replace")
        if _MARK in s:
            import json
            try:
                find_shard_states(json.loads(s), out)
            except ValueError:
                pass
    return out


class WorkerMergeIterDataset(grain.IterDataset):
    """After mp_prefetch: one host batch = one slab from each of the N workers (Grain reads its
    workers round-robin), rows put back in shard order. Always consumed N elements at a time,
    so the parent's state is at a group boundary whenever this iterator's state is taken."""

    def __init__(self, parent: grain.IterDataset, num_workers: int, keep_row_shard: bool):
        super().__init__(parent)
        self.num_workers = num_workers
        self.keep_row_shard = keep_row_shard

    def __iter__(self):
        return WorkerMergeIterator(self._parent.__iter__(), self.num_workers, self.keep_row_shard)

    def __str__(self) -> str:
        return f"WorkerMergeIterDataset(num_workers={self.num_workers})"


class WorkerMergeIterator(grain.DatasetIterator):
    def __init__(self, parent, num_workers: int, keep_row_shard: bool):
        super().__init__(parent)
        self.num_workers = num_workers
        self.keep_row_shard = keep_row_shard

    def __next__(self):
        slabs = [next(self._parent) for _ in range(self.num_workers)]
        row_shard = np.concatenate([s["row_shard"] for s in slabs])
        order = np.argsort(row_shard, kind="stable")
        merged = {key: np.concatenate([s[key] for s in slabs])[order] for key in slabs[0]}
        return slab_to_batch(merged, self.keep_row_shard)

    def get_state(self):
        return self._parent.get_state()

    def set_state(self, state):
        self._parent.set_state(state)

    def close(self) -> None:
        close = getattr(self._parent, "close", None)
        if close is not None:
            close()


def slab_to_batch(slab: dict, keep_debug: bool = False) -> dict:
    """Packed rows of R = seq_len + 1 tokens -> the model's batch (int32 [B, seq_len] each)."""
    tok, seg, pos = slab["rows"][:, 0], slab["rows"][:, 1], slab["rows"][:, 2]
    batch = {
        "inputs": np.ascontiguousarray(tok[:, :-1]), "targets": np.ascontiguousarray(tok[:, 1:]),
        "segment_ids": np.ascontiguousarray(seg[:, :-1]), "positions": np.ascontiguousarray(pos[:, :-1]),
        "loss_mask": ((seg[:, 1:] == seg[:, :-1]) & (seg[:, :-1] > 0)).astype(np.int32),
    }
    if keep_debug:
        batch["row_shard"] = slab["row_shard"]
        if "doc_ids" in slab:
            batch["doc_ids"] = slab["doc_ids"]
    return batch

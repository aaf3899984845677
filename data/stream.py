"""The per-virtual-shard row stream and the per-host Grain IterDataset built on it.

A virtual shard's stream is deterministic and independent of hosts and workers:
files in a seeded per-epoch order -> documents -> chunks of ~one window of text -> batched
tokenization -> packer -> windows of whole chunks (>= W rows), each permuted with a seed
from (seed, shard, window index).
Its state: the reader + packer carry + counters at the start of the current window, and how
many rows of the window were emitted. Restoring regenerates that one window and skips.

Where the cores go: a chunk is handed to the tokenizer's thread pool as soon as it is read
(BatchEncoder.submit; the tokenizer releases the GIL), and each shard keeps as many chunks
read ahead as the pool has threads, so the tokenizer runs on every core while this thread
reads and packs. The read-ahead never shows in the data: a chunk depends only on the reader
position it starts from, and the next window's start state is the first read-ahead chunk's.

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
emits a slab of G batches: k rows of each of its shards in shard order, packed as one
[G, rows, 3, R] array, plus "row_shard" (G = 1 in-process; a Grain worker sends ~256k tokens
per element after a ramp 1, 2, 4, ... that keeps the first batch early); the host merges its
workers' slabs back into shard order (WorkerMergeIterDataset) and derives the batch arrays
(slab_to_batch).

Host state (JSON): {"__vshards__": 2, "num_shards": V,
"topology": [process_index, process_count, num_workers], "shards": {"v": shard state}}, and
with workers "grain": {"state": [each worker pipeline's Grain state at the start of the current
group], "skip": n}.
Shard state: {"start": {"reader", "carry", "win", "c"}, "emitted": k, "c": counters}; the
counters (rows, docs, tokens, pad, segs, bad records) cover the rows emitted so far, so a
consumed state gives exact consumed statistics. Bad records are counted when read and
reported per window (the window is read ahead of consumption).
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses

import grain
import numpy as np

from data import packing
from data.sources import BadRecords, ShardReader
from data.tokenizer import BatchEncoder, available_cores, set_thread_env

STATE_VERSION = 2   # 2: windows are whole CHUNK_CHARS chunks
_MARK = "__vshards__"
COUNTER_KEYS = ("rows", "docs", "tokens", "pad", "segs", "trunc", "drop")
# Characters per tokenizer call: about one shuffle window of text, at most CHUNK_CHARS.
# Windows are whole chunks, so this is part of the data order: changing it changes the
# batches (and needs a new STATE_VERSION).
CHUNK_CHARS = 1 << 17
CHUNK_CHARS_PER_TOKEN = 4
MAX_ENCODE_THREADS = 4


class _Chunk:
    """Pieces handed to the encoder's thread pool, with the reader position and bad-record counts
    from just before they were read."""
    __slots__ = ("reader_state", "bad_counts", "bad_examples", "meta", "future")

    def __init__(self, reader_state, bad_counts, bad_examples):
        self.reader_state = reader_state
        self.bad_counts = bad_counts
        self.bad_examples = bad_examples
        self.meta = None
        self.future = None


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
    group: int = 1                  # host batches per element (per worker IPC message)


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
        self.chunk_chars = min(CHUNK_CHARS, max(256, self.W * R * CHUNK_CHARS_PER_TOKEN))
        self._ahead = collections.deque()   # chunks read ahead, being tokenized
        self._restore(state)

    # ---- state ----
    def get_state(self) -> dict:
        bad, badex = self._bad_now
        return {"start": self._start, "emitted": self.emitted,
                "c": {**self.c, "bad": dict(bad), "badex": list(badex)}}

    def _restore(self, st: dict) -> None:
        s = st["start"]
        self._ahead.clear()   # drop read-ahead chunks: reading restarts at s["reader"]
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
        """The next window's start: where its first (read-ahead) chunk began reading."""
        nxt = self._ahead[0]
        return {"reader": nxt.reader_state, "carry": self.packer.carry_state(),
                "win": self.win, "c": {**self.c, "bad": dict(nxt.bad_counts),
                                       "badex": list(nxt.bad_examples)}}

    # ---- rows ----
    def _target_rows(self) -> int:
        """W rows, but a shard's first window is shorter by a shard-dependent fraction so
        that shards refill their windows at different times (smoother worker load, faster
        first batch). Depends only on (shard, window index): topology independent."""
        if self.win > 0:
            return self.W
        frac = 0.125 + 0.875 * ((self.shard * 0.6180339887498949) % 1.0)
        return max(1, int(self.W * frac))

    def _read_chunk(self) -> "_Chunk":
        """Reads pieces up to chunk_chars and hands them to the encoder's pool at once, so the
        tokenizer (Rust, GIL released) runs while this thread reads the next chunk and packs
        the previous one. A chunk depends only on the reader position it starts at, which
        keeps windows (whole chunks) identical after a restore."""
        ch = _Chunk(self.reader.get_state(), dict(self.bad.counts), list(self.bad.examples))
        texts, dids, firsts, lasts = [], [], [], []
        chars = 0
        next_piece = self.reader.next_piece
        while chars < self.chunk_chars:
            text, did, first, last = next_piece()
            texts.append(text)
            dids.append(did)
            firsts.append(first)
            lasts.append(last)
            chars += len(text)
        ch.meta = (dids, firsts, lasts)
        ch.future = self.enc.submit(texts)
        return ch

    def _build_window(self) -> None:
        """Whole chunks until the window has its target rows. `enc.threads` chunks are kept
        read ahead, so that many tokenizer calls run while this thread packs; the next window
        starts at the first of them, and that chunk's recorded reader position and bad-record
        counts are the next window's start state."""
        depth = self.enc.threads
        while len(self._ahead) < depth:
            self._ahead.append(self._read_chunk())
        parts = []
        n = 0
        target = self._target_rows()
        while n < target:
            ch = self._ahead.popleft()
            self._ahead.append(self._read_chunk())
            flat, lens = ch.future.result()
            dids, firsts, lasts = ch.meta
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
        # bad records read for this window (the read-ahead chunks' are not yet reported)
        self._bad_now = (self._ahead[0].bad_counts, self._ahead[0].bad_examples)
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
        if "did" in out:
            out["did"][b] = self.did[i]


def progress(shard_state: dict) -> int:
    return int(shard_state["c"]["rows"])


class HostIterDataset(grain.IterDataset):
    """k rows of each of the given virtual shards per element, in shard order (a host's
    shards in-process, or one input worker's share of them)."""

    def __init__(self, spec: StreamSpec, shard_ids: list[int], shard_states: dict | None):
        super().__init__()
        self.spec = spec
        self.shard_ids = list(shard_ids)
        self.shard_states = shard_states or {}

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
        self._elements = 0    # elements emitted (sets the group size of the next one)

    def _init(self) -> None:
        # Each tokenizer call is serial; this process's share of the cores runs that many calls
        # at once (capped: one shard's read-ahead feeds the pool, and deeper read-ahead costs
        # memory on hosts with many shards; use more workers on large machines).
        set_thread_env(1)
        threads = min(MAX_ENCODE_THREADS,
                      max(1, available_cores() // max(self.spec.num_workers, 1)))
        self.enc = enc = BatchEncoder(self.spec.tokenizer_json, threads)
        self.streams = [ShardStream(self.spec, v, enc, self._states[str(v)])
                        for v in self.shard_ids]
        self._states = None

    def __next__(self):
        """A slab of G consecutive host batches (this iterator's rows of each):
        {"rows": int32 [G, B, 3, R] (tokens, segment ids, positions), "row_shard": [B]}, and
        in a Grain worker "states": the shard states after each of the G batches.

        Few, large messages: every element a worker sends costs a fixed amount of IPC work in
        both processes, so a worker sends up to `spec.group` batches at a time and the batch
        layout (inputs, targets, masks) is derived on the host side by `slab_to_batch`."""
        if self.streams is None:
            self._init()
        sp = self.spec
        # The first elements are small (1, 2, 4, ... batches up to G): a fresh or restored
        # worker sends its first batch as soon as its windows are built.
        G = min(sp.group, 1 << min(self._elements, 16))
        self._elements += 1
        k, R = sp.rows_per_shard, sp.seq_len + 1
        B = k * len(self.streams)
        rows = np.empty((G, B, 3, R), np.int32)
        dids = np.empty((G, B, R), np.int64) if sp.debug else None
        states = []
        for g in range(G):
            out = {"tok": rows[g, :, 0], "seg": rows[g, :, 1], "pos": rows[g, :, 2]}
            if dids is not None:
                out["did"] = dids[g]
            for j, stream in enumerate(self.streams):
                for b in range(j * k, (j + 1) * k):
                    stream.next_row_into(b, out)
            if sp.num_workers > 0:
                states.append({str(s.shard): s.get_state() for s in self.streams})
        slab = {"rows": rows, "row_shard": np.repeat(np.asarray(self.shard_ids, np.int32), k)}
        if dids is not None:
            slab["doc_ids"] = dids
        if states:
            slab["states"] = _Opaque(states)
        return slab

    def get_state(self) -> dict:
        if self.streams is None:
            shards = dict(self._states)
        else:
            shards = {str(s.shard): s.get_state() for s in self.streams}
        sp = self.spec
        return {_MARK: STATE_VERSION, "num_shards": sp.num_shards,
                "topology": [sp.process_index, sp.process_count, sp.num_workers],
                "shards": shards, "elements": self._elements}

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
        self._elements = int(state.get("elements", 0))
        if self.streams is None:
            self._states = sts
        else:
            for s in self.streams:
                s._restore(sts[str(s.shard)])

    def close(self) -> None:
        if self.streams:
            for s in self.streams:
                s.reader.close()
            self.enc.close()


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


class _Opaque:
    """A leaf for Grain's tree traversals (which would otherwise walk every key of the
    per-batch shard states); pickled as a whole with the element."""
    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __getstate__(self):
        return self.value

    def __setstate__(self, value):
        self.value = value


class WorkerMergeIterDataset(grain.IterDataset):
    """Over N single-worker mp_prefetch pipelines (worker i owns the host's shards i, i+N,
    ...): one element from each holds G host batches; their rows are put back in shard order
    and the G batches are handed out one by one.

    State: the per-shard states after the last batch handed out (exact, topology-independent:
    what `merge_host_states` and `restore_host_iterator` use), plus the workers' Grain states
    at the start of the current group and how many of its batches were handed out (for
    set_state on the same topology)."""

    def __init__(self, workers: list, spec: StreamSpec, keep_row_shard: bool):
        super().__init__(workers)
        self.spec = spec
        self.keep_row_shard = keep_row_shard

    def __iter__(self):
        return WorkerMergeIterator([w.__iter__() for w in self._parents], self.spec,
                                   self.keep_row_shard)

    def __str__(self) -> str:
        return f"WorkerMergeIterDataset(num_workers={self.spec.num_workers})"


class WorkerMergeIterator(grain.DatasetIterator):
    def __init__(self, workers: list, spec: StreamSpec, keep_row_shard: bool):
        super().__init__(workers)
        self.spec = spec
        self.workers = list(workers)
        self.keep_row_shard = keep_row_shard
        self._started = False        # a worker process starts at its pipeline's first next()
        self._group_start = None     # the workers' Grain states at the start of the group
        self._pos = 0                # batches of that group handed out
        self._group = None           # {"rows": [G, B, 3, R], "row_shard", "doc_ids"?}
        self._states = None          # per batch of the group: {shard: state}
        self._shards = None          # {shard: state} after the last batch handed out

    def _pull(self) -> None:
        self._group_start = self._worker_states()
        if self._started:
            els = [next(w) for w in self.workers]
        else:
            # All workers spawn and import at once (each takes ~1-2 s before its first row).
            with concurrent.futures.ThreadPoolExecutor(len(self.workers)) as pool:
                futs = [pool.submit(next, w) for w in self.workers]
                els = [f.result() for f in futs]
            self._started = True
        row_shard = np.concatenate([e["row_shard"] for e in els])
        order = np.argsort(row_shard, kind="stable")
        grp = {"rows": np.concatenate([e["rows"] for e in els], axis=1)[:, order],
               "row_shard": row_shard[order]}
        if "doc_ids" in els[0]:
            grp["doc_ids"] = np.concatenate([e["doc_ids"] for e in els], axis=1)[:, order]
        per_worker = [e["states"].value for e in els]
        self._states = [{v: st for sts in per_worker for v, st in sts[g].items()}
                        for g in range(grp["rows"].shape[0])]
        self._group = grp
        self._pos = 0

    def _worker_states(self) -> list:
        return [w.get_state() for w in self.workers]

    def __next__(self):
        if self._group is None:          # first batch, or after set_state: skip into the group
            skip = self._pos
            self._pull()
            self._pos = skip
        if self._pos >= len(self._states):
            self._pull()
        g = self._pos
        self._pos += 1
        self._shards = self._states[g]
        grp = self._group
        slab = {"rows": grp["rows"][g], "row_shard": grp["row_shard"]}
        if "doc_ids" in grp:
            slab["doc_ids"] = grp["doc_ids"][g]
        return slab_to_batch(slab, self.keep_row_shard)

    def get_state(self):
        sp = self.spec
        if self._group_start is None:
            self._group_start = self._worker_states()
        shards = self._shards
        if shards is None:               # nothing handed out: the workers' start states
            shards = find_shard_states(self._group_start)
        return {_MARK: STATE_VERSION, "num_shards": sp.num_shards,
                "topology": [sp.process_index, sp.process_count, sp.num_workers],
                "shards": dict(shards), "grain": {"state": self._group_start, "skip": self._pos}}

    def set_state(self, state):
        if state.get(_MARK) != STATE_VERSION or "grain" not in state:
            raise ValueError("not an input-pipeline state of this version with input workers "
                             "(resume through restore_host_iterator)")
        g = state["grain"]
        if len(g["state"]) != len(self.workers):
            raise ValueError(f"saved input state is from {len(g['state'])} input workers, "
                             f"data.num_workers={len(self.workers)}: resume through "
                             "restore_host_iterator")
        for w, st in zip(self.workers, g["state"]):
            w.set_state(st)
        self._group_start = list(g["state"])
        self._pos = int(g["skip"])
        self._group = self._states = None
        self._shards = dict(state["shards"])

    def close(self) -> None:
        for w in self.workers:
            w.close()


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

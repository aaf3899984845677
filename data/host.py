"""The per-host Grain IterDataset: k rows of each of the host's virtual shards per element.

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

Host state (JSON): {"__vshards__": STATE_VERSION (3), "num_shards": V,
"topology": [process_index, process_count, num_workers], "shards": {"v": shard state}}, and
with workers "grain": {"state": [each worker pipeline's Grain state at the start of the current
group], "skip": n}.
"""
from __future__ import annotations

import concurrent.futures
import gc
import json
import multiprocessing
import os
import signal
import time

import grain
import numpy as np

from data.streams.mixture import MixtureShardStream, initial_mixture_state, saved_sub_states
from data.streams.records import RecordShardStream, initial_record_state
from data.streams.shard import STATE_MARK, STATE_VERSION, ShardStream, StreamSpec, initial_shard_state, progress
from data.timing import zero_times
from data.tokenizer import BatchEncoder, available_cores, encode_threads, set_thread_env

_YIELDED = False


def yield_cores(nice: int) -> None:
    """An input worker process runs every thread `nice` lower in CPU priority than the trainer
    (its parent): once per process, threads it starts later inherit it. Measured on 2 cores with 2
    workers (bench_corpora's simulated loop at 80% of the rate): the loop's next() on a ready batch
    took 0.4-4.4 ms at the 99th percentile to maximum with the workers at the trainer's priority,
    0.15-0.4 ms with them 10 nicer: the loop's thread waited for a core, not for data. The workers
    still get every core the trainer leaves idle.

    The trainer already lowered the process at its birth (data/workers.py renice_new_workers), so
    its imports ran nicer too; this sets each thread to the trainer's priority + nice (never twice
    that), which also covers a worker the trainer missed."""
    global _YIELDED
    if _YIELDED or nice <= 0 or not hasattr(os, "setpriority"):
        return
    _YIELDED = True
    target = min(19, _trainer_priority() + nice)
    tids = os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ["0"]
    for tid in tids:   # Linux: a priority per thread; elsewhere "0" is the process
        try:
            if os.getpriority(os.PRIO_PROCESS, int(tid)) < target:
                os.setpriority(os.PRIO_PROCESS, int(tid), target)
        except OSError:   # the thread ended meanwhile
            pass


def _trainer_priority() -> int:
    """The trainer's (this worker's parent's) nice value; 0 when it is gone (the run is ending)."""
    try:
        return os.getpriority(os.PRIO_PROCESS, os.getppid())
    except OSError:
        return 0


def nicer_than_trainer() -> int:
    """How much lower this thread's CPU priority is than the trainer's."""
    if not hasattr(os, "getpriority"):
        return 0
    return os.getpriority(os.PRIO_PROCESS, 0) - _trainer_priority()


def make_encoder(spec: StreamSpec, times: dict | None = None, threads: int | None = None) -> BatchEncoder | None:
    """The tokenizer pool of one input process, as training builds it (scripts/show_step.py
    replays with the same): its share of the cores (data/tokenizer.py encode_threads). Converted
    records hold token ids already: no tokenizer to build (~0.2 s of a 32k-piece tokenizer.json
    parsed, on the way to the first batch).

    `threads` given: a pool of that size in a process that is not an input process (the
    trainer's head batch, data/workers.py head_slab), whose tokenizer variables are left as
    they are: its calls run serially or each on the tokenizer's Rayon pool, as that process has
    it set; the ids are the same. Setting them there would leak into the trainer's own later
    encode calls, and the worker processes are spawned meanwhile: a vfork'ed child exec'ing
    while another thread edits the environment can die before it reads its pipeline, and the
    spawning thread then blocks forever on the pipe (twice in a dozen runs on 2 cores while the
    head build put the variables back at its end; none since it leaves them alone)."""
    if spec.kind == "records":
        return None
    if threads is not None:
        return BatchEncoder(spec.tokenizer_json, threads, times)
    # Each tokenizer call is serial; this process's share of the cores runs that many calls
    # at once (capped: one shard's read-ahead feeds the pool, and deeper read-ahead costs
    # memory on hosts with many shards; use more workers on large machines).
    set_thread_env(1)
    return BatchEncoder(spec.tokenizer_json, encode_threads(available_cores(), spec.num_workers), times)


def make_shard_stream(spec: StreamSpec, shard: int, encoder: BatchEncoder | None,
                      state: dict | None, times: dict | None = None, head_rows: int = 0):
    """One virtual shard's row stream, of the kind the spec describes (state None: from the
    start; encoder None for "records", which needs no tokenizer). Every kind has
    next_row_into(b, out), get_state() (JSON, counters under "c"), _restore(state), close().
    `times`: the process's stage timers (data/timing.py), shared by its streams. head_rows: a
    text stream that will hand out only that many rows (ShardStream's; the others build whole). A mixture
    receives its sources' streams built here (data/streams/mixture.py imports nothing of this file)."""
    if spec.mixture:
        state = state or initial_stream_state(spec)
        initial = {name: initial_stream_state(sub) for name, _, sub in spec.mixture}
        saved = saved_sub_states(state)
        # A source without a saved sub-state starts from its beginning (a source added to a
        # mixture); a listed source that was parked continues where it stopped.
        subs = [make_shard_stream(sub, shard, encoder, saved.get(name) or initial[name], times)
                for name, _, sub in spec.mixture]
        return MixtureShardStream(spec, shard, subs, state, initial)
    if spec.kind == "records":
        return RecordShardStream(spec, shard, encoder, state)
    return ShardStream(spec, shard, encoder, state or initial_shard_state(), times, head_rows)


def build_streams(spec: StreamSpec, shard_ids: list[int], encoder: BatchEncoder | None,
                  states: dict, times: dict, head_rows: int = 0) -> list:
    """The process's shard streams, each built at its state (which builds its current window).

    Text streams are built side by side, one thread per shard: each reads its first window's
    chunks and waits on the tokenizer pool, so the pool gets every shard's first chunks at once
    instead of one shard's after another's (the reading of one overlaps the tokenizing of the
    others). The order of the list, and every stream's data, are those of a one-by-one build.
    (Their timers' sums may lose a few additions made at the same instant: statistics only.)"""
    def build(v):
        return make_shard_stream(spec, v, encoder, states[str(v)], times, head_rows)
    if spec.kind == "records" or len(shard_ids) < 2:   # no tokenizer to share
        return [build(v) for v in shard_ids]
    with concurrent.futures.ThreadPoolExecutor(len(shard_ids),
                                               thread_name_prefix="shard-build") as pool:
        futs = [pool.submit(build, v) for v in shard_ids]
    errors = [f.exception() for f in futs]
    if any(e is not None for e in errors):
        for f, e in zip(futs, errors, strict=True):   # close what was built; the first error
            if e is None:                             # in shard order propagates
                f.result().close()
        raise next(e for e in errors if e is not None)
    return [f.result() for f in futs]


def initial_stream_state(spec: StreamSpec) -> dict:
    """The state of a virtual shard that has emitted nothing yet, for the spec's kind."""
    if spec.mixture:
        return initial_mixture_state({name: initial_stream_state(sub) for name, _, sub in spec.mixture})
    return initial_record_state() if spec.kind == "records" else initial_shard_state()


def _leave_signals_to_the_trainer() -> None:
    """In an input worker process: ignore SIGTERM and SIGINT. A preempted VM signals every
    process, and Ctrl-C signals the whole foreground group; a worker that died of it mid-message
    left the trainer's own shutdown (Grain's close drains the worker's queue) hanging until a
    SIGKILL, with the checkpoint already saved but the exit never reached. The trainer decides:
    it saves, then stops its workers through Grain (an event, then SIGKILL), never by SIGTERM."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _freeze_what_is_there() -> None:
    """In an input worker process: the objects there now (its imports, ~156k of them with Grain's
    and JAX's modules) move out of the collector's reach. A worker makes short-lived containers
    only (parsed lines and signals, chunk lists), yet each full collection walked every imported
    object: ~100 ms of a core each (2-core machine), one every few seconds per worker, on the
    cores its tokenizer needs. Frozen, a full collection walks the few objects made since (0.2
    ms). Called before the first windows are built and again after them (what they imported).
    Reference counting still frees a frozen object (the first windows' lists when replaced); only
    a cycle among frozen objects would stay, and modules, their functions and classes are no
    garbage."""
    gc.freeze()


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
    def __init__(self, spec: StreamSpec, shard_ids: list[int], shard_states: dict,
                 tokenizer_threads: int | None = None, one_slab: bool = False):
        """tokenizer_threads: the tokenizer pool's size in a process that is not an input
        process (make_encoder); None, an input process's share of the cores. The rows never
        depend on it. one_slab: this iterator makes one batch and is closed (the trainer's
        head batch): a restored stream builds its window only as far as that batch's rows."""
        super().__init__()
        if not shard_ids:
            raise ValueError("an input worker owns no virtual shard: raise data.num_shards or "
                             "lower data.num_workers")
        self.spec = spec
        self.shard_ids = sorted(shard_ids)
        self._states = {str(v): shard_states.get(str(v)) or initial_stream_state(spec)
                        for v in shard_ids}
        self.streams = None   # built lazily: get_state in the main process must stay cheap
        self._fill_pending = False   # streams' read-ahead still to start (after a first slab)
        self._elements = 0    # elements emitted (sets the group size of the next one)
        self._tokenizer_threads = tokenizer_threads
        self._one_slab = one_slab
        # This process's stage timers (data/timing.py): statistics, never in the state.
        self.times = zero_times(reader_threads=1, in_host=spec.num_workers == 0)

    def _init(self) -> None:
        worker = multiprocessing.parent_process() is not None   # an input worker process
        if worker:
            _leave_signals_to_the_trainer()
            self.times["start_nice"] = nicer_than_trainer()
            yield_cores(self.spec.worker_nice)   # before its tokenizer threads start
            _freeze_what_is_there()
        self.enc = enc = make_encoder(self.spec, self.times, self._tokenizer_threads)
        self.times["tokenizer_threads"] = enc.threads if enc is not None else 0
        self.streams = build_streams(self.spec, self.shard_ids, enc, self._states, self.times,
                                     head_rows=self.spec.rows_per_shard if self._one_slab else 0)
        if worker:
            _freeze_what_is_there()
            self.times["gc_frozen"] = gc.get_freeze_count()
        self._states = None
        self._fill_pending = True

    def __next__(self):
        """A slab of G consecutive host batches (this iterator's rows of each):
        {"rows": int32 [G, B, 3, R] (tokens, segment ids, positions), "row_shard": [B]}, and
        in a Grain worker "states": the shard states after each of the G batches.

        Few, large messages: every element a worker sends costs a fixed amount of IPC work in
        both processes, so a worker sends up to `spec.group` batches at a time and the batch
        layout (inputs, targets, masks) is derived on the host side by `slab_to_batch`."""
        t0 = time.perf_counter()        # the start-up counts: its first windows wait on the tokenizer
        if self._one_slab and self._elements:
            raise RuntimeError("a one-slab HostIterator (the head batch's) was asked for a second slab")
        if self.streams is None:
            self._init()
        elif self._fill_pending:
            # the streams' first windows were built without read-ahead (ShardStream._build_window);
            # the first slab is out: start reading ahead, so the next windows are tokenized early
            self._fill_pending = False
            for stream in self.streams:
                fill = getattr(stream, "fill_ahead", None)
                if fill is not None:
                    fill()
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
        # Rows made and the seconds spent making them (untimed stages included: a converted
        # corpus times none), beside the timers: data/autoworkers.py rates a worker by them.
        self.times["rows_out"] = self.times.get("rows_out", 0) + G * B
        self.times["make_s"] = self.times.get("make_s", 0.0) + time.perf_counter() - t0
        slab = {"rows": rows, "row_shard": np.repeat(np.asarray(self.shard_ids, np.int32), k)}
        if dids is not None:
            slab["doc_ids"] = dids
        if states:
            slab["states"] = _Opaque(states)
            # this worker's timers so far travel with its slab (a few floats)
            slab["times"] = dict(self.times)
        return slab

    def stage_times(self) -> dict:
        """This process's cumulative stage seconds (data/timing.py)."""
        return dict(self.times)

    def get_state(self) -> dict:
        if self.streams is None:
            shards = dict(self._states)
        else:
            shards = {str(s.shard): s.get_state() for s in self.streams}
        sp = self.spec
        return {STATE_MARK: STATE_VERSION, "num_shards": sp.num_shards,
                "topology": [sp.process_index, sp.process_count, sp.num_workers],
                "shards": shards, "elements": self._elements}

    def set_state(self, state: dict) -> None:
        if state.get(STATE_MARK) != STATE_VERSION:
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
            self._fill_pending = True

    def close(self) -> None:
        for s in self.streams or ():
            s.close()
        if getattr(self, "enc", None) is not None:     # built even when a stream's build failed
            self.enc.close()
            self.enc = None


def find_shard_states(state, out: dict | None = None) -> dict:
    """Walks any (Grain-nested) state; returns {shard: most advanced shard state}."""
    if out is None:
        out = {}
    if isinstance(state, dict):
        if state.get(STATE_MARK) is not None:
            if state[STATE_MARK] != STATE_VERSION:
                raise ValueError(
                    f"saved input-pipeline state has version {state[STATE_MARK]}, this code reads "
                    f"version {STATE_VERSION} (byte offsets and seek points in files): it "
                    "cannot resume that data position exactly; start the data from scratch")
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
        if STATE_MARK in s:
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

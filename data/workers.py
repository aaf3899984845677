"""The host side of input workers: merging their slabs back into shard order, and
slab -> model batch."""
from __future__ import annotations

import concurrent.futures
import multiprocessing.queues
import os
import sys
import threading
import time

import grain
import numpy as np

from data.host import HostIterator, find_shard_states
from data.streams.shard import STATE_MARK, STATE_VERSION, StreamSpec
from data.timing import add_times, zero_times
from data.tokenizer import available_cores, serial_calls_unless_set


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


def head_slab(spec: StreamSpec, shards: dict) -> dict:
    """One host batch of the given shards ({shard: state}) made in this process, on all of its
    cores: the slab (HostIterator's, one batch) WorkerMergeIterator hands out while its workers
    start.

    A worker's tokenizer pool is its share of the cores (8 workers on 14 cores: 2 threads each),
    sized for the steady state, when every worker tokenizes. While the workers spawn and import
    the cores are mostly idle, and this batch tokenizes the first window of every host shard
    (56 shards x ~36 rows x 2049 tokens, ~4 M tokens): on one thread (~1 M tok/s) it lost to
    the workers' start every time. The shards' first windows are built side by side
    (data/host.py build_streams), so a pool of one thread per core has all their chunks to run.
    The rows depend only on the shard states, never on the pool's size. The trainer's tokenizer
    variables are left as they are (data/host.py make_encoder), but for TOKENIZERS_PARALLELISM,
    set to serial calls when unset before the workers first spawn (WorkerMergeIterator,
    data/tokenizer.py serial_calls_unless_set)."""
    it = HostIterator(spec, [int(v) for v in shards], shards, tokenizer_threads=available_cores(), one_slab=True)
    try:
        return next(it)
    finally:
        it.close()


class WorkerMergeIterator(grain.DatasetIterator):
    def __init__(self, workers: list, spec: StreamSpec, keep_row_shard: bool, head_start: bool = True):
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
        self._times = zero_times()   # this thread's stage timers: ipc, merge, worker_wait
        self._worker_times = [None] * len(self.workers)   # each worker's, from its last slab
        self._pending = None         # the workers' first elements, on their way (futures)
        self._head = None            # (rows, shard states after) of the batch made before the workers
        self._head_start = head_start
        serial_calls_unless_set()    # before this iterator's workers spawn: the head's calls serial

    def _start_workers(self) -> None:
        """Starts every worker process at once (each spawns and imports, ~1 s, before its first
        row); their first elements arrive as futures."""
        self._group_start = self._worker_states()
        if self.spec.worker_nice > 0:
            renice_new_workers(self.spec.worker_nice, len(self.workers))
        pool = concurrent.futures.ThreadPoolExecutor(len(self.workers), thread_name_prefix="worker-start")
        self._pending = [pool.submit(next, w) for w in self.workers]
        pool.shutdown(wait=False)
        self._started = True

    def _head_batch(self):
        """The next batch made in this process: the rows of every host shard from the same shard
        states (the rows depend on a shard's state only, not on which process makes them), so the
        first batch and the one after a restore do not wait for the worker processes' spawn and
        imports.

        data.head_batch "first" (workers not started yet): made alone. Measured on a 16-core
        host (8 workers, 56 shards of a 64-file corpus, seq 2048): the first batch in 1.02 s
        fresh and 1.48 s after a deep restore, against 1.77 / 2.36 s while the workers started
        beside it ("race") and 3.16 / 3.42 s from the workers ("off"): the head and the workers
        build the same windows, and side by side they slow each other down. (After a restore the
        head now packs each window only up to its rows: 1.04-1.09 s on a slower host of the
        kind.) The workers start after it, so the next batches come ~3 s later, while train.py
        compiles its step on the first batch. "race" (workers started): whichever comes first is used, the in-process
        batch or the workers' first group.

        None: the workers' first group came first, or the in-process build failed (the workers
        report the same data's errors themselves)."""
        if self._shards is not None:
            shards = self._shards
        else:
            shards = find_shard_states(self._group_start if self._started else self._worker_states())
        if not self._started:
            try:
                return head_slab(self.spec, shards)
            except Exception:  # noqa: BLE001 - the workers report the same data's errors themselves
                return None
        made = concurrent.futures.Future()

        def build():
            try:
                made.set_result(head_slab(self.spec, shards))
            except BaseException as e:  # noqa: BLE001 - reported through the future, never raised here
                made.set_exception(e)

        threading.Thread(target=build, name="input-head-start", daemon=True).start()
        while not made.done() and not all(f.done() for f in self._pending):
            concurrent.futures.wait([made, *[f for f in self._pending if not f.done()]],
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        if not made.done() or made.exception() is not None:
            return None
        return made.result()

    def _pull(self) -> None:
        t0, cpu0 = time.perf_counter(), time.thread_time()
        if not self._started:
            self._start_workers()
        if self._pending is not None:
            pending, self._pending = self._pending, None
            els = [f.result() for f in pending]
        else:
            self._group_start = self._worker_states()
            els = [next(w) for w in self.workers]
        # Inside next(): receiving (this thread's CPU) and waiting for the workers (the rest).
        t1, ipc = time.perf_counter(), time.thread_time() - cpu0
        self._times["ipc"] += ipc
        self._times["worker_wait"] += t1 - t0 - ipc
        self._worker_times = [e.get("times") for e in els]
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
        self._times["merge"] += time.perf_counter() - t1

    def _check_head(self, g: int) -> None:
        """The workers' rows at the head batch's place (g in their group) are the ones handed out,
        and their shard states after it the ones get_state gave meanwhile."""
        (rows, states), self._head = self._head, None
        if not np.array_equal(self._group["rows"][g], rows) or self._states[g] != states:
            raise RuntimeError("input workers made other rows than this process made from the same shard "
                               f"states (batch {g} of their first group): the data order is not a function "
                               "of the shard states; please report this with the data config")

    def _worker_states(self) -> list:
        return [w.get_state() for w in self.workers]

    def __next__(self):
        if self._group is None and not self._started and self._head_start and self.spec.head_batch != "off":
            if self.spec.head_batch == "first":
                slab = self._head_batch()
                self._start_workers()
            else:
                self._start_workers()
                slab = self._head_batch()
            if slab is not None:
                # Handed out now; the workers' first group holds the same rows at this position.
                self._head = (slab["rows"][0], slab["states"].value[0])
                self._pos += 1
                self._shards = slab["states"].value[0]
                one = {"rows": slab["rows"][0], "row_shard": slab["row_shard"]}
                if "doc_ids" in slab:
                    one["doc_ids"] = slab["doc_ids"][0]
                return slab_to_batch(one, self.keep_row_shard)
        if self._group is None:          # first batch, or after set_state: skip into the group
            skip = self._pos
            self._pull()
            while skip > len(self._states):   # past this group: a state saved just after a head batch
                skip -= len(self._states)     # that was the first of the next group
                self._pull()
            self._pos = skip
            if self._head is not None:
                self._check_head(skip - 1)
        if self._pos >= len(self._states):
            self._pull()
        g = self._pos
        self._pos += 1
        self._shards = self._states[g]
        grp = self._group
        t0 = time.perf_counter()
        slab = {"rows": grp["rows"][g], "row_shard": grp["row_shard"]}
        if "doc_ids" in grp:
            slab["doc_ids"] = grp["doc_ids"][g]
        batch = slab_to_batch(slab, self.keep_row_shard)
        self._times["merge"] += time.perf_counter() - t0
        return batch

    def stage_times(self) -> dict:
        """Cumulative stage seconds of this thread and of each worker up to its last slab."""
        total = dict(self._times)
        for t in self._worker_times:
            if t is not None:
                add_times(total, t)
        return total

    def worker_stage_times(self) -> list[dict]:
        """Each worker's own cumulative timers (and rows made), as of its last slab."""
        return [dict(t) for t in self._worker_times if t is not None]

    def get_state(self):
        sp = self.spec
        if self._group_start is None:
            self._group_start = self._worker_states()
        shards = self._shards
        if shards is None:               # nothing handed out: the workers' start states
            shards = find_shard_states(self._group_start)
        return {STATE_MARK: STATE_VERSION, "num_shards": sp.num_shards,
                "topology": [sp.process_index, sp.process_count, sp.num_workers],
                "shards": dict(shards), "grain": {"state": self._group_start, "skip": self._pos}}

    def set_state(self, state):
        if state.get(STATE_MARK) != STATE_VERSION or "grain" not in state:
            raise ValueError("not an input-pipeline state of this version with input workers "
                             "(resume through restore_host_iterator)")
        g = state["grain"]
        if len(g["state"]) != len(self.workers):
            raise ValueError(f"saved input state is from {len(g['state'])} input workers, "
                             f"data.num_workers={len(self.workers)}: resume through "
                             "restore_host_iterator")
        if self._pending is not None:      # first elements still on their way: they are of the old state
            concurrent.futures.wait(self._pending)
            self._pending = None
        self._head = None
        for w, st in zip(self.workers, g["state"], strict=True):
            w.set_state(st)
        self._group_start = list(g["state"])
        self._pos = int(g["skip"])
        self._group = self._states = None
        self._shards = dict(state["shards"])

    def close(self) -> None:
        if self._pending is not None:      # workers still starting: let them start, then stop them
            concurrent.futures.wait(self._pending)
            self._pending = None
        for w in self.workers:
            _close_draining(w)


def _child_pids() -> set[int]:
    """This process's child processes, from each of its threads' Linux /proc children list
    (no reaping, unlike multiprocessing.active_children, whose waitpid would race Grain's)."""
    out = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/children") as f:
                out.update(int(p) for p in f.read().split())
        except OSError:   # the thread ended meanwhile
            pass
    return out


def _is_spawned_worker(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"spawn_main" in f.read()   # multiprocessing's spawn, not its resource tracker
    except OSError:
        return False


def renice_new_workers(nice: int, count: int, timeout_s: float = 60.0, poll_s: float = 0.002) -> None:
    """Lowers the priority of the next `count` worker processes this process spawns to its own +
    `nice`, within milliseconds of their birth, from a thread that watches /proc.

    A worker lowered its own priority only once its pipeline started (yield_cores), after ~1 s of
    spawn and imports (Grain imports jax), all at the trainer's priority: 8 workers' imports took
    cores from the trainer's head batch, the first batch and the one after a restore. The spawning
    thread cannot be niced instead: the threads it starts in the trainer (Grain's prefetch thread,
    which receives every slab) would inherit it. Linux only (elsewhere yield_cores still lowers
    the workers once their pipeline starts)."""
    if nice <= 0 or count <= 0 or not os.path.isfile(f"/proc/self/task/{threading.get_native_id()}/children"):
        return
    before = _child_pids()
    target = min(19, os.getpriority(os.PRIO_PROCESS, 0) + nice)

    def watch():
        done = set()
        deadline = time.monotonic() + timeout_s
        while len(done) < count and time.monotonic() < deadline:
            for pid in _child_pids() - before - done:
                if not _is_spawned_worker(pid):
                    continue    # forked, not yet exec'd into python: seen again at the next poll
                done.add(pid)
                try:
                    os.setpriority(os.PRIO_PROCESS, pid, target)
                except OSError:   # gone already, or not ours to change: yield_cores covers it
                    pass
            time.sleep(poll_s)

    threading.Thread(target=watch, name="input-worker-nice", daemon=True).start()


def _close_draining(worker) -> None:
    """Closes one worker pipeline while emptying its process's queue. Grain's close drains the
    queue once, then joins the process; a worker that had more elements waiting in its queue's
    feeder thread (the pipe holds less than one slab) cannot exit until they are read, and Grain
    kills it only after 25 s: every switch of the worker count and every run end with workers
    waited that long (a run's "shutdown" badput)."""
    buffers = [it._buffer for it in worker_process_iterators(worker)
               if it._prefetch_process is not None and it._prefetch_process.is_alive()]
    # No thread can start while the interpreter finalizes (a close from __del__ at exit would
    # wait for it forever); Grain's own close still ends the process then, by its kill if need be.
    if not buffers or sys.is_finalizing():
        worker.close()
        return
    done = threading.Event()

    def drain(buffer):
        while not done.is_set():
            try:
                buffer.get(timeout=0.05)
            except Exception:  # noqa: BLE001 - queue.Empty, or closed under us: keep trying until done
                pass

    threads = [threading.Thread(target=drain, args=(b,), name="data-drain", daemon=True) for b in buffers]
    for t in threads:
        t.start()
    try:
        worker.close()
    finally:
        done.set()
        for t in threads:
            t.join()


def worker_process_iterators(it, depth: int = 8) -> list:
    """The iterators inside `it` that own a worker process and its multiprocessing queue
    (Grain's process prefetch: `_prefetch_process`, `_buffer`). mp_prefetch nests that one inside
    an interleave and a thread prefetch (Grain 0.2.18), so it is found by walking the tree rather
    than by one attribute path that the next Grain release may move."""
    found, seen, todo = [], set(), [(it, 0)]
    while todo:
        node, d = todo.pop()
        if id(node) in seen or d > depth:
            continue
        seen.add(id(node))
        if isinstance(node, (list, tuple)):
            todo.extend((x, d + 1) for x in node)
            continue
        if not isinstance(node, grain.DatasetIterator):
            continue
        if isinstance(getattr(node, "_buffer", None), multiprocessing.queues.Queue) and \
                hasattr(node, "_prefetch_process"):
            found.append(node)
            continue
        todo.extend((v, d + 1) for v in vars(node).values() if isinstance(v, (list, tuple, grain.DatasetIterator)))
    return found


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

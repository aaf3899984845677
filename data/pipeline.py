"""The per-host Grain pipeline and the device prefetcher."""
from __future__ import annotations

import collections
import dataclasses
import os
import threading
import time

import grain
from absl import flags

from data.config import DataConfig, check_bos, check_files, list_files
from data.host import HostIterDataset, find_shard_states
from data.readers.sources import DROPPED
from data.state import normalize_shard_states, sum_counters
from data.streams import records
from data.streams.mixture import mixture_spec, source_counters
from data.streams.shard import COUNTER_KEYS, StreamSpec, url_sizes
from data.timing import STAGES, WAITS, sub_times
from data.tokenizer import load_tokenizer, special_ids, tokenizer_json
from data.workers import WorkerMergeIterDataset, slab_to_batch

BATCH_KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")


def host_shards(num_shards: int, process_index: int, process_count: int) -> list[int]:
    """A contiguous block: the host's rows of the global batch are its shards' rows."""
    per_host = num_shards // process_count
    return list(range(process_index * per_host, (process_index + 1) * per_host))


def stream_spec(cfg: DataConfig, process_index: int, process_count: int, files, tok, *,
                debug: bool = False) -> StreamSpec:
    """The StreamSpec every virtual shard's stream is built from (files: list_files' result,
    already listed; tok: the loaded tokenizer). Also what scripts/show_step.py rebuilds a
    run's shards from, so a step can be replayed outside training."""
    eos, bos = special_ids(tok)   # raises when the tokenizer has no EOS
    check_bos(cfg, bos)
    tok_json = tokenizer_json(tok)   # remembered: this process's encoders (the head batch's) use `tok`
    spec = StreamSpec(
        files=() if cfg.sources else tuple(files), num_shards=cfg.num_shards, tokenizer_json=tok_json,
        seq_len=cfg.seq_len, text_key=cfg.text_key, strict=cfg.strict, packing=cfg.packing,
        shuffle_window=cfg.shuffle_window, files_per_stream=cfg.files_per_stream,
        add_bos=cfg.add_bos, seed=cfg.seed,
        rows_per_shard=cfg.global_batch_size // cfg.num_shards, num_workers=cfg.num_workers,
        debug=debug, process_index=process_index, process_count=process_count,
        group=worker_group(cfg, process_count), worker_nice=cfg.worker_nice, head_batch=cfg.head_batch,
        eos_id=eos, bos_id=-1 if bos is None else bos)
    if cfg.sources:
        return mixture_spec(spec, cfg, files)
    return dataclasses.replace(spec, sizes=url_sizes(files), **records.stream_fields(files), **cfg.bucket(),
                               **cfg.selection())


def make_host_dataset(cfg: DataConfig, process_index: int, process_count: int,
                      shard_states: dict | None = None, *, debug: bool = False,
                      files: list[str] | dict[str, list[str]] | None = None, tokenizer=None):
    if isinstance(cfg.num_workers, str):
        raise ValueError(f"data.num_workers={cfg.num_workers!r}: the pipeline takes a worker count; "
                         "train.py resolves auto (data/autoworkers.py)")
    files = list_files(cfg) if files is None else files
    if not cfg.sources:
        files = list(files)
    if cfg.global_batch_size % process_count:
        raise ValueError(f"data.global_batch_size={cfg.global_batch_size} is not divisible by "
                         f"the process count {process_count}")
    tok = tokenizer if tokenizer is not None else load_tokenizer(cfg.tokenizer)
    spec = stream_spec(cfg, process_index, process_count, files, tok, debug=debug)
    check_files(cfg, process_count, files, tokenizer=tok)
    states = normalize_shard_states(shard_states, cfg.num_shards)
    shards = host_shards(cfg.num_shards, process_index, process_count)
    if cfg.num_workers == 0:
        return _InProcessIterDataset(HostIterDataset(spec, shards, states), debug)
    if not flags.FLAGS.is_parsed():   # mp_prefetch outside absl.app.run (Hydra) needs this
        flags.FLAGS.mark_as_parsed()
    # One single-process mp_prefetch pipeline per worker (worker i owns shards i, i+N, ...)
    # rather than one mp_prefetch with N workers: Grain's interleave starts worker i+1 only
    # once worker i has sent its first element, so N workers took N x (spawn + imports) to
    # the first batch; WorkerMergeIterator starts separate pipelines all at once.
    workers = []
    for i in range(cfg.num_workers):
        w = HostIterDataset(spec, shards[i::cfg.num_workers], states)
        # Slabs travel pickled through the worker's pipe, not through shared memory: a
        # fresh shared-memory block per element (create, register with the resource
        # tracker, open, unlink) cost the host process ~1 ms per batch, more than copying
        # a few MB.
        w = grain.experimental.WithOptionsIterDataset(
            w, grain.experimental.DatasetOptions(min_shm_size=MIN_SHM_BYTES))
        workers.append(w.mp_prefetch(grain.multiprocessing.MultiprocessingOptions(
            num_workers=1, per_worker_buffer_size=worker_buffer_size(cfg, process_count))))
    return WorkerMergeIterDataset(workers, spec, keep_row_shard=debug)


MIN_SHM_BYTES = 64 << 20


class _InProcessIterDataset(grain.IterDataset):
    """No input workers: the host's slabs (one batch each) as batches, in this process. What
    `.map(slab_to_batch)` would be, plus the host iterator's stage timers (`stage_times`)."""

    def __init__(self, host: HostIterDataset, keep_debug: bool):
        super().__init__(host)
        self.keep_debug = keep_debug

    def __iter__(self):
        return _InProcessIterator(self._parent.__iter__(), self.keep_debug)

    def __str__(self) -> str:
        return "InProcessIterDataset"


class _InProcessIterator(grain.DatasetIterator):
    runs_in_process = True      # DevicePrefetcher reads ahead of it on a host thread of its own

    def __init__(self, host, keep_debug: bool):
        super().__init__(host)
        self.host = host
        self.keep_debug = keep_debug

    def __next__(self) -> dict:
        slab = next(self.host)
        one = {k: (v[0] if k in ("rows", "doc_ids") else v) for k, v in slab.items()}
        return slab_to_batch(one, self.keep_debug)

    def get_state(self) -> dict:
        return self.host.get_state()

    def set_state(self, state: dict) -> None:
        self.host.set_state(state)

    def stage_times(self) -> dict:
        return self.host.stage_times()

    def worker_stage_times(self) -> list[dict]:
        """The in-process reader counts as the one "worker" (data/autoworkers.py)."""
        return [self.host.stage_times()]

    def close(self) -> None:
        self.host.close()


# Tokens a worker sends per element. Each element costs a fixed amount of IPC work in the
# worker and the host process (pickling, the pipe, Grain's bookkeeping); on 2 cores with
# batches of 16 x 1024 that was ~10% of the throughput with 2 workers. ~3 MB per element.
WORKER_ELEMENT_TOKENS = 1 << 18
MAX_WORKER_GROUP = 32


def worker_group(cfg: DataConfig, process_count: int) -> int:
    """Host batches per worker element (1 without workers)."""
    if cfg.num_workers == 0:
        return 1
    rows = max(cfg.global_batch_size // process_count // cfg.num_workers, 1)
    g = -(-WORKER_ELEMENT_TOKENS // (rows * (cfg.seq_len + 1)))
    return int(min(MAX_WORKER_GROUP, max(1, g)))


def worker_buffer_size(cfg: DataConfig, process_count: int) -> int:
    """Elements each worker may run ahead: enough batches to absorb the burst of a window
    refill (each shard tokenizes a whole shuffle window at once), at least 2 elements."""
    shards_per_worker = -(-cfg.num_shards // (process_count * max(cfg.num_workers, 1)))
    rows = max(cfg.global_batch_size // process_count, 1)
    burst = -(-max(cfg.shuffle_window, 1) * shards_per_worker // rows)
    group = worker_group(cfg, process_count)
    return int(min(16, max(2, -(-(burst + 1) // group))))


def make_host_iterator(cfg: DataConfig, process_index: int, process_count: int,
                       shard_states: dict | None = None, *, debug: bool = False,
                       files: list[str] | dict[str, list[str]] | None = None, tokenizer=None):
    """A Grain DatasetIterator of host batches (dicts of int32 [B_host, seq_len]).

    shard_states: per-virtual-shard states from merge_host_states (elastic resume).
    debug=True adds "doc_ids" (int64 [B, seq_len + 1], global document ids, -1 = padding; a
    mixture's carry the source's index, data/streams/mixture.py) and "row_shard" (int32 [B]) for tests.
    files / tokenizer: already listed / loaded by the caller (a glob over thousands of shards
    on a mounted bucket is slow: list once per run); for data.sources, {source name: files}
    as list_files returns.
    """
    return iter(make_host_dataset(cfg, process_index, process_count, shard_states,
                                  debug=debug, files=files, tokenizer=tokenizer))


def restore_host_iterator(cfg: DataConfig, process_index: int, process_count: int,
                          host_states: list[dict] | None, *, debug: bool = False,
                          files: list[str] | None = None, tokenizer=None):
    """The host iterator positioned after the saved consumed states of ALL hosts (None or
    empty: from the start).

    The saved states of all hosts are merged into per-virtual-shard states and this host's
    iterator is built from its shards' states, whatever the topology was: its workers start
    where the shards stopped (Grain's own set_state would first let freshly started workers
    build their initial windows, then rebuild them: ~1-2 s more with 2 workers). The batches
    are those of an uninterrupted run, as the batch layout does not depend on the topology.
    """
    from data.state import merge_host_states
    kw = dict(debug=debug, files=files, tokenizer=tokenizer)
    if not host_states:
        return make_host_iterator(cfg, process_index, process_count, **kw)
    return make_host_iterator(cfg, process_index, process_count,
                              shard_states=merge_host_states(host_states), **kw)


def state_counters(state) -> dict:
    return sum_counters(find_shard_states(state))


def consumed_figures(state, base_state) -> dict:
    """What a host iterator delivered between two of its states (`base_state`: where counting
    starts): documents, tokens, rows, padding, truncated and dropped tokens, bad records by kind
    with the first examples, and a mixture's per-source figures. The training log's data figures
    (DevicePrefetcher.stats) and data/torch.py's Batches.stats."""
    c, base = state_counters(state), state_counters(base_state)
    d = {k: c[k] - base[k] for k in COUNTER_KEYS}
    counted = {k: v - base["bad"].get(k, 0) for k, v in c["bad"].items()}
    # documents data.quality / data.dedup did not hand out, by the rule that dropped them
    dropped = {k[len(DROPPED):]: v for k, v in counted.items() if k.startswith(DROPPED) and v}
    bad = {k: v for k, v in counted.items() if not k.startswith(DROPPED)}
    rows, tokens, pad = d["rows"], d["tokens"], d["pad"]
    return {
        "documents": d["docs"], "tokens": tokens, "rows": rows,
        "padding_tokens": pad,
        "padding_frac": pad / max(1, tokens + pad),
        "docs_per_row": d["segs"] / max(1, rows),
        "truncated_tokens": d["trunc"], "dropped_tokens": d["drop"],
        "out_of_bucket_documents": d["oob"],
        "dropped_documents": sum(dropped.values()),
        "dropped_by_rule": dropped,
        "bad_records": {k: v for k, v in bad.items() if v},
        "bad_examples": c["badex"][:10],
        **_source_figures(state, base_state),
    }


def _bad_total(counts: dict, dropped: bool = False) -> int:
    """Bad records (dropped=False) or documents the selection dropped, of a counter's "bad"."""
    return sum(v for k, v in counts.items() if k.startswith(DROPPED) == dropped)


def _source_figures(state, base_state) -> dict:
    """A mixture's per-source figures since this iterator started ("source/NAME/KEY"; the
    training log prefixes "data/"): rows, tokens, documents, padding, bad records, the epoch
    the source is reading, and its share of the tokens and of the rows."""
    now = source_counters(find_shard_states(state))
    if not now:
        return {}
    # parked=True: a source listed again on resume counts from its parked position
    base = source_counters(find_shard_states(base_state), parked=True)
    delta = {name: {key: c[key] - base.get(name, {}).get(key, 0) for key in COUNTER_KEYS}
             for name, c in now.items()}
    tokens = max(1, sum(d["tokens"] for d in delta.values()))
    rows = max(1, sum(d["rows"] for d in delta.values()))
    out = {}
    for name, d in delta.items():
        bad_now, bad_base = now[name]["bad"], base.get(name, {}).get("bad", {})
        out.update({
            f"source/{name}/tokens": d["tokens"], f"source/{name}/documents": d["docs"],
            f"source/{name}/rows": d["rows"], f"source/{name}/padding_tokens": d["pad"],
            f"source/{name}/epoch": now[name]["epoch"],
            f"source/{name}/bad_records": _bad_total(bad_now) - _bad_total(bad_base),
            f"source/{name}/dropped_documents": _bad_total(bad_now, True) - _bad_total(bad_base, True),
            f"source/{name}/out_of_bucket_documents": d["oob"],
            f"source/{name}/token_share": d["tokens"] / tokens,
            f"source/{name}/row_share": d["rows"] / rows,
        })
    return out


class _Stop:
    pass


class _Handoff:
    """A bounded buffer from one producer thread to one consumer whose get() of a ready item
    is one deque.popleft (atomic under the GIL): no lock, and no wake-up of the producer.

    Both matter on the training loop's path. A queue.Queue's get takes its mutex (which a
    switched-out producer may hold mid-put) and notifies the producer waiting for space; that
    wake-up alone cost the loop ~14 us a step on the 2-core VM (a futex wake of a thread on an
    idle core), 0.8% of a 1.7 ms step (scripts/bench/bench_records.py; 0.0008 without it). So a
    producer facing a full buffer polls instead, every quarter of the consumer's mean interval
    between gets (0.5 to 20 ms): it refills within a quarter step, and a slow step costs a few
    dozen wake-ups a second. A consumer facing an empty buffer is woken by the producer (that
    cost lands on the producer). Waits have timeouts: a lost wake-up costs a poll, never a hang."""

    _POLL_S = 0.05
    _MIN_POLL_S, _MAX_POLL_S = 0.0005, 0.02

    def __init__(self, maxsize: int):
        self._items: collections.deque = collections.deque()
        self._max = max(1, maxsize)
        self._added = threading.Event()
        self._space = threading.Event()
        self._consumer_waits = False
        self._last_get = None
        self._interval = self._MAX_POLL_S * 4     # mean seconds between gets

    def put(self, item, stop: threading.Event) -> bool:
        """Appends once there is room; False if `stop` is set first."""
        while len(self._items) >= self._max:
            if stop.is_set():
                return False
            self._space.wait(min(self._MAX_POLL_S, max(self._MIN_POLL_S, self._interval / 4)))
        self._items.append(item)
        if self._consumer_waits:
            self._added.set()
        return True

    def get(self):
        while True:
            try:
                item = self._items.popleft()
            except IndexError:
                self._added.clear()
                self._consumer_waits = True
                if not self._items:
                    self._added.wait(self._POLL_S)
                self._consumer_waits = False
                continue
            now = time.perf_counter()
            if self._last_get is not None:
                self._interval += 0.1 * (now - self._last_get - self._interval)
            self._last_get = now
            return item

    def drain(self) -> None:
        """Drops what is buffered and wakes a producer waiting for space (closing)."""
        self._items.clear()
        self._space.set()


# Tests plant a slow input stage on one host: "SECONDS" or "SECONDS@PROCESS" slows the h2d stage
# by SECONDS a batch (on that process only); "...+N" spares the first N batches of the
# prefetcher (a hang planted mid-run); with SLOW_ONCE_ENV=PATH set, only the first delay while
# PATH does not exist yet (it is then created: a restarted run goes on). Read once when a
# prefetcher starts; unset, nothing in the pipeline changes.
SLOW_STAGE_ENV = "JAXPT_TEST_SLOW_H2D"
SLOW_ONCE_ENV = "JAXPT_TEST_SLOW_ONCE"


def _planted_delay(to_global, spec: str):
    import jax

    spec, _, spared = spec.partition("+")
    seconds, _, process = spec.partition("@")
    if process and int(process) != jax.process_index():
        return to_global
    count = [0]
    once = os.environ.get(SLOW_ONCE_ENV)

    def slowed(batch):
        count[0] += 1
        if count[0] > int(spared or 0) and not (once and os.path.exists(once)):
            if once:
                open(once, "w").close()
            time.sleep(float(seconds))
        return to_global(batch)
    return slowed


class DevicePrefetcher:
    """Background thread: host batch -> global jax.Array, `prefetch` batches ahead."""

    # The prefetch thread does Python work (Grain's IPC, merging worker slabs, building global
    # arrays) while holding the GIL; at CPython's default 5 ms switch interval the training
    # loop's next() -- and its step dispatch -- can wait that long for the GIL although the
    # batch is ready. Measured with scripts/bench/bench_input.py on 2 cores: sim_wait_frac 0.009 at
    # 5 ms, 0.003 at 0.1-0.2 ms.
    GIL_SWITCH_INTERVAL_S = 0.0002
    # In-process input (no worker processes) has no buffer of its own: the reader, tokenizer and
    # packer run on the producer's side of the `prefetch` device batches, so a burst of work (a
    # window rebuilt, a long document) longer than those batches' steps reaches the loop. A host
    # thread reading ahead absorbs it: bench_corpora.py's simulated loop waited 0.017-0.032 of its
    # time with 2 batches of buffer, 0.003-0.008 with 16 (BENCHMARKS.md, #26). 16 still missed
    # about one round in six on the long-document corpus: traced, the tokenizer's cost per token
    # moves by ~25% over spans of seconds there (long documents, some in other scripts), which at
    # 80% load is a deficit of seconds, not of one window; 16 batches hold ~150 ms of it. So the
    # read-ahead is sized in bytes (host RAM only): HOST_PREFETCH_BYTES of host batches, at least
    # 16 and at most 64 of them (64 x ~0.2 MB at 16 x 1024; 40 x 1.6 MB for a v4 host's 64 x 2048).
    # Worker processes buffer on their own (several 256k-token slabs each).
    IN_PROCESS_HOST_PREFETCH = 64
    MIN_HOST_PREFETCH = 16
    HOST_PREFETCH_BYTES = 64 << 20

    def __init__(self, host_iterator, sharding, prefetch: int = 2, *,
                 follows: "DevicePrefetcher | None" = None, host_prefetch: int | None = None):
        """follows: a closed prefetcher whose consumed state `host_iterator` starts from (a
        switch of the worker count, data/autoworkers.py): stats() go on counting from its
        start, as if one pipeline had run throughout. host_prefetch: host batches read ahead on
        a thread of their own (None: IN_PROCESS_HOST_PREFETCH for an in-process iterator, else 0)."""
        import sys
        sys.setswitchinterval(min(sys.getswitchinterval(), self.GIL_SWITCH_INTERVAL_S))
        self._it = host_iterator
        self._sharding = sharding
        self._q = _Handoff(prefetch)
        self._stop = threading.Event()
        self._state = host_iterator.get_state()
        self._base_state = self._state if follows is None else follows._base_state
        self._stage_times = getattr(host_iterator, "stage_times", None)
        self._h2d = 0.0                      # seconds in _to_global (the "h2d" stage)
        if os.environ.get(SLOW_STAGE_ENV):
            self._to_global = _planted_delay(self._to_global, os.environ[SLOW_STAGE_ENV])
        self._times = self._base_times = self._times_now()
        # the stage seconds of the prefetchers this one follows (a new pipeline counts from 0)
        self._times_before = follows.stats()["stage_s"] if follows is not None else {}
        self._wait = follows._wait if follows is not None else 0.0
        self._batches = follows._batches if follows is not None else 0
        self._done = False
        self._closed = False
        self._closer = None                  # the thread of close(background=True)
        if host_prefetch is None:
            host_prefetch = self.IN_PROCESS_HOST_PREFETCH if getattr(host_iterator, "runs_in_process", False) else 0
        self._host_q = _Handoff(host_prefetch) if host_prefetch > 0 else None
        self._host_thread = None
        if self._host_q is not None:
            self._host_thread = threading.Thread(target=self._read_host, name="data-host", daemon=True)
            self._host_thread.start()
        self._thread = threading.Thread(target=self._run, name="data-prefetch", daemon=True)
        self._thread.start()

    def _to_global(self, batch: dict) -> dict:
        import jax
        out = {}
        for k, v in batch.items():
            if k in BATCH_KEYS:
                gshape = (v.shape[0] * jax.process_count(),) + v.shape[1:]
                out[k] = jax.make_array_from_process_local_data(self._sharding, v, gshape)
            else:
                out[k] = v
        return out

    def _times_now(self) -> dict | None:
        """The host iterator's cumulative stage seconds (data/timing.py) plus this thread's h2d."""
        if self._stage_times is None:
            return None
        t = self._stage_times()
        t["h2d"] = t.get("h2d", 0.0) + self._h2d
        return t

    def _put(self, item) -> bool:
        return self._q.put(item, self._stop)

    def _read_host(self) -> None:
        try:
            batch = next(self._it)
            # the first batch's bytes bound how many the read-ahead holds
            nbytes = sum(getattr(v, "nbytes", 0) for v in batch.values())
            fit = max(self.MIN_HOST_PREFETCH, self.HOST_PREFETCH_BYTES // max(1, nbytes))
            self._host_q._max = min(self._host_q._max, fit)
            while self._host_q.put((batch, self._it.get_state()), self._stop) and not self._stop.is_set():
                batch = next(self._it)
        except BaseException as e:  # noqa: BLE001 - handed on through the device thread
            self._host_q.put((_Stop(), e), self._stop)

    def _next_host(self):
        if self._host_q is None:
            batch = next(self._it)
            return batch, self._it.get_state()
        item = self._host_q.get()
        if isinstance(item[0], _Stop):
            raise item[1]
        return item

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                host_batch, state = self._next_host()
                t0 = time.perf_counter()
                batch = self._to_global(host_batch)
                self._h2d += time.perf_counter() - t0
                # the host arrays stay beside the global ones: a checkpoint may carry them (ready_next)
                if not self._put((batch, state, self._times_now(), host_batch)):
                    return
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            self._put((_Stop(), e))

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if self._done:
            raise StopIteration
        t0 = time.perf_counter()
        item = self._q.get()
        self._wait += time.perf_counter() - t0
        if isinstance(item[0], _Stop):
            self._done = True
            raise item[1]
        batch, self._state, self._times, _ = item
        self._batches += 1
        return batch

    def ready_next(self) -> tuple[dict, dict] | None:
        """(host arrays, host iterator state after it) of the batch the next __next__ returns, if
        it is made already; None otherwise (never waits: a save asks, data/carried.py)."""
        try:
            item = self._q._items[0]
        except IndexError:
            return None
        if isinstance(item[0], _Stop):
            return None
        return item[3], item[1]

    def consumed_state(self) -> dict:
        """Host iterator state right after the last batch returned by __next__."""
        return self._state

    def add_wait(self, seconds: float) -> None:
        """Counts the loop's wait on another prefetcher as this one's (data/feed.py Handover)."""
        self._wait += seconds

    def buffered(self) -> int:
        """Device batches ready for the loop now (benchmarks: a wait on a ready batch is not starvation)."""
        return len(self._q._items)

    def stats(self) -> dict:
        return {"batches": self._batches, **consumed_figures(self._state, self._base_state),
                "wait_s": self._wait,
                # seconds per input stage since this prefetcher started, as produced up to the last
                # batch returned (data/timing.py); {} when the iterator keeps no timers
                "stage_s": self._stage_seconds()}

    def _stage_seconds(self) -> dict:
        if not self._times:
            return dict(self._times_before)
        now = sub_times(self._times, self._base_times)
        for k in STAGES + WAITS:       # lanes stay those of the pipeline running now
            now[k] += self._times_before.get(k, 0.0)
        return now

    def host_iterator(self):
        return self._it

    def close(self, *, background: bool = False) -> None:
        """Stops the prefetch thread and the host iterator (its workers). background=True: the
        iterator's close runs on a thread (a later close() waits for it): a switch of the worker
        count lets the old workers exit (~0.3-0.7 s each on 2 cores) while the new ones start."""
        if self._closed:
            if self._closer is not None:
                self._closer.join()
            return
        self._closed = True
        self._stop.set()
        self._q.drain()
        if self._host_q is not None:
            self._host_q.drain()
            self._host_thread.join(timeout=10)
            # the device thread may wait on the host buffer: a stop item ends that wait
            self._host_q._items.append((_Stop(), StopIteration()))
            self._host_q._added.set()
        self._thread.join(timeout=10)
        close = getattr(self._it, "close", None)
        if close is None:
            return
        if background:
            self._closer = threading.Thread(target=close, name="data-close", daemon=True)
            self._closer.start()
        else:
            close()

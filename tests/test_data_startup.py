"""The way to the first batch (issue #26): first windows built without read-ahead, shards built
side by side, read-ahead started once the first batch is out. Counts, never timings."""
import os
import threading

import numpy as np
import pytest

import data
from data.config import list_files
from data.host import HostIterator
from data.pipeline import stream_spec
from data.timing import zero_times
from data.tokenizer import BatchEncoder, load_tokenizer, tokenizer_json
from tests.data_helpers import assert_batches_equal, cfg, jround, take, write_corpus


def _spec(c):
    return stream_spec(c, 0, 1, list_files(c), load_tokenizer(c.tokenizer))


class _CountingEncoder(BatchEncoder):
    """The real encoder, counting the tokenizer calls handed to its pool."""
    calls = 0

    def submit(self, texts):
        type(self).calls += 1
        return super().submit(texts)


def _chunk_sizes(tmp_path):
    # ~1 KB chunks (shuffle_window 8 x 33 tokens x 4 chars): every window is a few chunks
    write_corpus(tmp_path, n_files=4, docs_per_file=40, max_words=60)
    return cfg(tmp_path, num_shards=4, seq_len=32, global_batch_size=8, shuffle_window=8)


def test_first_batch_tokenizes_only_its_windows(tmp_path, monkeypatch):
    """Before the first slab, every tokenizer call is a chunk of some shard's first window (no
    read-ahead queued in front of the next shard's chunks); after it, each shard keeps the
    encoder's threads' worth of chunks read ahead, as in steady state."""
    import data.host as host
    c = _chunk_sizes(tmp_path)
    monkeypatch.setattr(host, "BatchEncoder", _CountingEncoder)
    monkeypatch.setattr(host, "encode_threads", lambda cores, workers: 2)
    _CountingEncoder.calls = 0
    it = HostIterator(_spec(c), [0, 1, 2, 3], {})
    next(it)
    assert all(len(s._ahead) == 0 for s in it.streams), "read ahead before the first slab"
    first = _CountingEncoder.calls
    # the chunks the first windows consumed: the reader positions their starts span
    assert first >= len(it.streams)
    next(it)
    assert all(len(s._ahead) == 2 for s in it.streams), [len(s._ahead) for s in it.streams]
    assert _CountingEncoder.calls == first + 2 * len(it.streams)
    # a restore of live streams (set_state) builds its windows without read-ahead again
    it.set_state(jround(it.get_state()))
    assert all(len(s._ahead) == 0 for s in it.streams)
    next(it)
    next(it)
    assert all(len(s._ahead) == 2 for s in it.streams)
    it.close()


@pytest.mark.parametrize("packing", ["concat", "first_fit"])
def test_read_ahead_timing_never_changes_the_batches(tmp_path, packing):
    """Streams reading ahead from their first window (the eager way) and the lazy first windows
    give the same batches, across many window refills and a restore from a state saved while a
    first window was being read without read-ahead."""
    c = _chunk_sizes(tmp_path)
    c = data.DataConfig(**{**c.__dict__, "packing": packing})
    spec = _spec(c)
    lazy = HostIterator(spec, [0, 1, 2, 3], {})
    eager = HostIterator(spec, [0, 1, 2, 3], {})
    eager._init()
    for s in eager.streams:
        s.fill_ahead()
    eager._fill_pending = False
    saved = None
    for i in range(60):
        a, b = next(lazy), next(eager)
        assert_batches_equal(a, b, f"batch {i}")
        if i == 0:
            saved = jround(lazy.get_state())
    restored = HostIterator(spec, [0, 1, 2, 3], saved["shards"])
    fresh = HostIterator(spec, [0, 1, 2, 3], {})
    take(fresh, 1)
    for i in range(40):
        assert_batches_equal(next(restored), next(fresh), f"after restore, batch {i}")
    for it in (lazy, eager, restored, fresh):
        it.close()


def test_shards_built_side_by_side_in_shard_order(tmp_path):
    """The streams come back in shard order, each at its own shard, built on separate threads;
    an error in one shard's build is raised (the first in shard order) and the others closed."""
    from data.host import build_streams, initial_stream_state
    c = _chunk_sizes(tmp_path)
    spec = _spec(c)
    enc = BatchEncoder(spec.tokenizer_json, 2)
    seen = set()
    import data.host as host
    real = host.make_shard_stream

    def recording(spec, v, encoder, state, times=None, head_rows=0):
        seen.add(threading.current_thread().name)
        return real(spec, v, encoder, state, times, head_rows)

    host.make_shard_stream = recording
    try:
        states = {str(v): initial_stream_state(spec) for v in range(4)}
        streams = build_streams(spec, [0, 1, 2, 3], enc, states, zero_times())
        assert [s.shard for s in streams] == [0, 1, 2, 3]
        assert all(name.startswith("shard-build") for name in seen) and len(seen) >= 2
        for s in streams:
            s.close()
        bad = dict(states)
        bad["2"] = {**initial_stream_state(spec), "emitted": 10**6}
        with pytest.raises(ValueError, match="virtual shard 2: state has 1000000 rows emitted"):
            build_streams(spec, [0, 1, 2, 3], enc, bad, zero_times())
    finally:
        host.make_shard_stream = real
        enc.close()


def _small_worker_cfg(tmp_path):
    write_corpus(tmp_path, n_files=4, docs_per_file=6, max_words=60, long_doc_chars=0)
    return cfg(tmp_path, num_shards=4, num_workers=2, shuffle_window=5, seq_len=16, global_batch_size=4)


def _run(c, n, host_states=None):
    it = data.restore_host_iterator(c, 0, 1, host_states, debug=True)
    states, batches = [jround(it.get_state())], []
    for _ in range(n):
        batches.append(next(it))
        states.append(jround(it.get_state()))
    it.close()
    return batches, states


@pytest.mark.slow
def test_head_batch_made_while_workers_start_is_theirs(tmp_path, monkeypatch):
    """With input workers, the first batch (fresh and after a restore) is made in this process
    while the workers spawn; it, the batches after it and the saved states equal those of the
    workers alone, and a restore from the state saved just after a head batch continues exactly."""
    from data.workers import WorkerMergeIterator
    c = _small_worker_cfg(tmp_path)
    real = WorkerMergeIterator._head_batch
    made = []

    def counting(self):
        slab = real(self)
        made.append(slab is not None)
        return slab

    monkeypatch.setattr(WorkerMergeIterator, "_head_batch", lambda self: None)
    ref, ref_states = _run(c, 24)
    monkeypatch.setattr(WorkerMergeIterator, "_head_batch", counting)
    got, states = _run(c, 24)
    assert made == [True], made           # the head batch is this process's, not the workers'
    for i, (a, b) in enumerate(zip(got, ref, strict=True)):
        assert_batches_equal(a, b, f"batch {i}")
    assert states == ref_states
    for k in (1, 2, 9):                   # just after a head batch, and inside / across groups
        made.clear()
        after, _ = _run(c, 4, [states[k]])
        assert made == [True], (k, made)
        for j, b in enumerate(after):
            assert_batches_equal(b, ref[k + j], f"restored at {k}, batch {k + j}")


@pytest.mark.slow
def test_workers_making_other_rows_than_the_head_batch_is_named(tmp_path, monkeypatch):
    """The workers' first group is checked against the head batch handed out before it: rows
    that differ (data order not a function of the shard states) stop with a clear error."""
    import data.workers as workers
    c = _small_worker_cfg(tmp_path)

    class Shifted(HostIterator):
        def __next__(self):
            slab = super().__next__()
            slab["rows"] = slab["rows"] + 1
            return slab

    monkeypatch.setattr(workers, "HostIterator", Shifted)
    it = data.make_host_iterator(c, 0, 1)
    next(it)
    with pytest.raises(RuntimeError, match="input workers made other rows"):
        take(it, 3)
    it.close()


class _GatedWorker(HostIterator):
    """A worker pipeline in this process (a HostIterator with the worker's share of the
    cores, as the worker process builds it) that makes its first slab only once released: the
    head batch is made while it "starts", whichever is faster on the machine at hand."""

    def __init__(self, spec, shard_ids, gate):
        super().__init__(spec, shard_ids, {})
        self.gate = gate

    def __next__(self):
        assert self.gate.wait(timeout=60)
        return super().__next__()


class _RecordingEncoder(BatchEncoder):
    """The real encoder, noting each one's pool size and whether its calls run serially."""
    made = []

    def __init__(self, tok_json, threads=1, times=None):
        super().__init__(tok_json, threads, times)
        type(self).made.append((self.threads, os.environ.get("TOKENIZERS_PARALLELISM")))


def test_head_batch_tokenizes_on_every_core_and_is_the_workers(tmp_path, monkeypatch):
    """Issue #38: the head batch (fresh, and the one after a restore) is tokenized on a pool of
    one thread per core, not on a worker's share (1 thread with 2 workers on 3 cores before the
    share was rounded up, which lost to the workers' start every time); the trainer's tokenizer
    variables are left as they are (data/host.py make_encoder); and its rows are those the workers make (checked by
    WorkerMergeIterator against their first group, and against batches made without it)."""
    import data.host as host
    import data.workers as workers
    from data.workers import WorkerMergeIterator
    c = _small_worker_cfg(tmp_path)
    spec = _spec(c)
    monkeypatch.setattr(host, "available_cores", lambda: 3)      # a worker's share: 3 / 2 -> 2 threads
    monkeypatch.setattr(workers, "available_cores", lambda: 3)
    monkeypatch.setattr(host, "BatchEncoder", _RecordingEncoder)
    env = ("RAYON_NUM_THREADS", "RAYON_RS_NUM_CPUS", "TOKENIZERS_PARALLELISM")

    def merged(head_start, state=None):
        gate = threading.Event()
        if not head_start:
            gate.set()
        ws = [_GatedWorker(spec, [0, 1, 2, 3][i::2], gate) for i in range(2)]
        it = WorkerMergeIterator(ws, spec, keep_row_shard=True, head_start=head_start)
        if state is not None:
            it.set_state(state)
        return it, gate

    ref, _ = merged(False)                # the workers alone
    want, states = [], [jround(ref.get_state())]
    for _ in range(12):
        want.append(next(ref))
        states.append(jround(ref.get_state()))
    ref.close()

    for at in (0, 1, 5):                  # fresh, just after the first batch, inside a group
        _RecordingEncoder.made = []
        trainer = dict(zip(env, ("7", "7", "off"), strict=True))   # the workers here set theirs in this process
        for k, v in trainer.items():
            monkeypatch.setenv(k, v)
        it, gate = merged(True, states[at] if at else None)
        first = next(it)                  # the workers wait at their gate: this is the head batch
        assert _RecordingEncoder.made == [(3, "off")], (at, _RecordingEncoder.made)
        assert {k: os.environ[k] for k in env} == trainer
        gate.set()
        got = [first] + take(it, 4)       # the workers' first group is checked against the head rows
        assert [t for t, _ in _RecordingEncoder.made[1:]] == [2, 2]
        it.close()
        for j, b in enumerate(got):
            assert_batches_equal(b, want[at + j], f"from {at}, batch {at + j}")


@pytest.mark.parametrize("preset", [None, "true"])
def test_head_batch_calls_the_tokenizer_serially_unless_told(tmp_path, monkeypatch, preset):
    """Unset, TOKENIZERS_PARALLELISM lets every encode_batch call fan out over the tokenizer's one
    Rayon pool, which the head batch's pool of one thread per core then funnels into (6.1 against
    10.5 M tok/s on 16 cores); a worker iterator sets it to serial calls before its workers spawn,
    and leaves a value the user set alone."""
    from data.workers import WorkerMergeIterator
    c = _small_worker_cfg(tmp_path)
    spec = _spec(c)
    if preset is None:
        monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    else:
        monkeypatch.setenv("TOKENIZERS_PARALLELISM", preset)
    seen = []
    real = BatchEncoder.encode

    def noting(self, texts):
        seen.append(os.environ.get("TOKENIZERS_PARALLELISM"))
        return real(self, texts)
    monkeypatch.setattr(BatchEncoder, "encode", noting)
    ws = [HostIterator(spec, [0, 1, 2, 3][i::2], {}) for i in range(2)]
    it = WorkerMergeIterator(ws, spec, keep_row_shard=True)
    next(it)          # the head batch, made in this process before the workers start
    it.close()
    for w in ws:
        w.close()
    # the head's calls (the first made; the in-process "workers" here set their own after it)
    assert seen and seen[0] == ("false" if preset is None else preset), seen


class _CountedWorker(HostIterator):
    """A worker pipeline in this process that notes when its first slab was asked for."""

    def __init__(self, spec, shard_ids, log):
        super().__init__(spec, shard_ids, {})
        self.log = log

    def __next__(self):
        self.log.append("worker")
        return super().__next__()


@pytest.mark.parametrize("mode", ["first", "race", "off"])
def test_head_batch_modes_make_the_same_batches(tmp_path, monkeypatch, mode):
    """data.head_batch: "first" makes the head batch before any worker is asked for a slab (on
    cores nothing else takes: the fastest first batch measured on the 16-core host), "race" while
    the workers start, "off" never; fresh and after a restore the batches are those the workers
    alone make."""
    import dataclasses

    import data.workers as workers
    from data.workers import WorkerMergeIterator
    c = _small_worker_cfg(tmp_path)
    spec = dataclasses.replace(_spec(c), head_batch=mode)
    log = []
    real = workers.head_slab

    def noting(spec_, shards):
        log.append("head")
        return real(spec_, shards)
    monkeypatch.setattr(workers, "head_slab", noting)

    def merged(state=None, head_start=True):
        ws = [_CountedWorker(spec, [0, 1, 2, 3][i::2], log) for i in range(2)]
        it = WorkerMergeIterator(ws, spec, keep_row_shard=True, head_start=head_start)
        if state is not None:
            it.set_state(state)
        return it

    ref = merged(head_start=False)
    want, states = [], [jround(ref.get_state())]
    for _ in range(8):
        want.append(next(ref))
        states.append(jround(ref.get_state()))
    ref.close()
    for at in (0, 3):
        log.clear()
        it = merged(states[at] if at else None)
        got = take(it, 4)
        it.close()
        for j, b in enumerate(got):
            assert_batches_equal(b, want[at + j], f"{mode} from {at}, batch {at + j}")
        if mode == "first":
            assert log[0] == "head" and log.count("head") == 1, log
        elif mode == "off":
            assert "head" not in log, log
        else:
            assert log.count("head") == 1, log


def _children_nice() -> dict[int, set[int]]:
    """{pid: {nice of each of its threads}} of this process's child processes but
    multiprocessing's resource tracker (Linux /proc)."""
    out = {}
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/status") as f:
                if next(line for line in f if line.startswith("PPid:")).split()[1] != str(os.getpid()):
                    continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"resource_tracker" in f.read():   # multiprocessing's helper, not a worker
                    continue
            # /proc/PID/task/TID/stat: field 19 is the thread's nice (after the parenthesized name)
            out[int(pid)] = {int(open(f"/proc/{pid}/task/{t}/stat").read().rsplit(")", 1)[1].split()[16])
                             for t in os.listdir(f"/proc/{pid}/task")}
        except (OSError, StopIteration):
            continue
    return out


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads thread priorities from Linux /proc")
@pytest.mark.parametrize("nice", [10, 0])
def test_input_workers_run_nicer_than_the_trainer(tmp_path, nice):
    """data.worker_nice: every thread of a worker process (its tokenizer threads included) runs
    that much nicer than the trainer, whose own threads keep their priority; and it did so from
    its birth: its spawn and imports (~1 s, Grain imports jax) ran nicer already, so they did not
    take cores from the trainer's head batch (the worker reports the difference it found when its
    pipeline started, before it lowered itself)."""
    write_corpus(tmp_path, n_files=4, docs_per_file=6)
    own = os.getpriority(os.PRIO_PROCESS, 0)
    before = set(_children_nice())
    it = data.make_host_iterator(cfg(tmp_path, num_workers=2, worker_nice=nice), 0, 1)
    take(it, 3)
    workers = {pid: n for pid, n in _children_nice().items() if pid not in before}
    at_start = [t["start_nice"] for t in it.worker_stage_times()]
    it.close()
    assert len(workers) >= 2, workers
    assert all(n == {min(19, own + nice)} for n in workers.values()), (own, workers)
    assert at_start == [min(19, own + nice) - own] * 2, at_start
    assert os.getpriority(os.PRIO_PROCESS, 0) == own


@pytest.mark.slow
def test_input_workers_freeze_their_imports_and_the_trainer_does_not(tmp_path):
    """An input worker moves what it imported (Grain's and JAX's modules, ~156k objects) out of
    the collector's reach before it streams (data/host.py _freeze_what_is_there): a full
    collection there then walks only what was made since, not ~100 ms of module objects on the
    tokenizer's cores. The trainer's own collector is left as it is: its head batch runs the same
    code in-process, and freezes nothing."""
    import gc
    before = gc.get_freeze_count()
    it = data.make_host_iterator(_small_worker_cfg(tmp_path), 0, 1)
    take(it, 3)
    frozen = [t.get("gc_frozen", 0) for t in it.worker_stage_times()]
    it.close()
    assert len(frozen) == 2 and min(frozen) > 20_000, frozen
    assert gc.get_freeze_count() == before


def test_head_batch_encodes_with_the_trainers_tokenizer(tmp_path):
    """The head batch's encoder uses the tokenizer the trainer loaded (stream_spec remembers it),
    instead of parsing StreamSpec.tokenizer_json again on the way to the first batch."""
    c = _small_worker_cfg(tmp_path)
    tok = load_tokenizer(c.tokenizer)
    spec = stream_spec(c, 0, 1, list_files(c), tok)
    it = HostIterator(spec, [0, 1, 2, 3], {}, tokenizer_threads=2, one_slab=True)
    next(it)
    assert it.enc.tok is tok
    assert tokenizer_json(tok) is spec.tokenizer_json     # serialized once, not per iterator
    with pytest.raises(RuntimeError, match="second slab"):
        next(it)
    it.close()


@pytest.mark.parametrize("packing", ["concat", "first_fit"])
def test_head_batch_after_a_restore_builds_windows_only_up_to_its_rows(tmp_path, monkeypatch, packing):
    """Restored deep in the shards, the head batch (one slab) rebuilds each window only up to
    the rows it hands out: the same rows and the same shard states after them as a whole
    window's restore, with fewer tokenizer calls; a state saved before windows kept their row
    count ("rows") rebuilds whole windows, and gives the same."""
    import dataclasses

    import data.host as host
    import data.streams.shard as shard
    c = dataclasses.replace(_chunk_sizes(tmp_path), packing=packing)
    spec = _spec(c)
    monkeypatch.setattr(host, "BatchEncoder", _CountingEncoder)
    # chunks of ~300 characters: a window spans several, as a 64-row window at seq 2048 spans
    # 4 of CHUNK_CHARS (here a window is about one chunk of the uncapped size)
    monkeypatch.setattr(shard, "CHUNK_CHARS", 300)
    shards = [0, 1, 2, 3]
    live = HostIterator(spec, shards, {})
    saved_calls = {"whole": 0, "head": 0}
    for step in range(12):
        next(live)
        state = jround(live.get_state())
        assert all(st["rows"] >= 1 for st in state["shards"].values())
        _CountingEncoder.calls = 0
        whole = HostIterator(spec, shards, state["shards"])
        want = next(whole)
        saved_calls["whole"] += _CountingEncoder.calls
        _CountingEncoder.calls = 0
        head = HostIterator(spec, shards, state["shards"], one_slab=True)
        got = next(head)
        saved_calls["head"] += _CountingEncoder.calls
        np.testing.assert_array_equal(got["rows"], want["rows"], err_msg=f"after batch {step}")
        assert jround(head.get_state()) == jround(whole.get_state()), f"after batch {step}"
        old = {v: {k: x for k, x in st.items() if k != "rows"} for v, st in state["shards"].items()}
        legacy = HostIterator(spec, shards, old, one_slab=True)
        np.testing.assert_array_equal(next(legacy)["rows"], want["rows"])
        for it in (whole, head, legacy):
            it.close()
    live.close()
    assert saved_calls["head"] < saved_calls["whole"], saved_calls

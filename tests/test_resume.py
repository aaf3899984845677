"""Exact resume with real processes: kills, preemption, partial saves, other process counts.

    pytest tests/test_resume.py -q        (~4 min on 2 cores)

Every run is `python train.py` in a subprocess with `train.debug_batches=true`, so each process
writes `debug_batches.p<i>.jsonl` (per step: a hash of its host batch; per row: virtual shard,
first/last document id, a hash of the row) and, with `train.log_every=1`, metrics.jsonl holds
every step's loss. "Identical" below means bit-identical: the same float in the JSON.

The reference is one straight run of N steps; the others are cut (SIGKILL right after a
checkpoint, SIGKILL during an asynchronous save, SIGTERM) and restarted with the same command.
A run that changes the process count is checked per virtual shard: the rows each shard
delivered, across the save and the restore, are exactly that shard's rows in the straight run:
no row (hence no document or token) lost or repeated.
"""
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

# Module fixtures train real runs: the whole file belongs to the slow tier.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
# The script under test; an override lets a patched copy run these tests.
TRAIN = Path(os.environ.get("JAXPT_TRAIN_SCRIPT", ROOT / "train.py"))

N = 10          # steps of every run
K = 5           # the checkpoint the kills and the process-count changes resume from
COMMON = ["logger.wandb.mode=disabled", "logger.progress_bar=false", "train.log_every=1",
          f"train.steps={N}", "data.seq_len=64", "data.global_batch_size=16", "data.num_shards=4", "train.eval_every=0",
          "optimizer.warmup_steps=2", "optimizer.decay_steps=50", "++train.debug_batches=true"]


# ---------------------------------------------------------------- helpers
def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def per_step(run_dir, process=0):
    """{step: (loss, batch_hash)}; a step run twice (before a kill and after the restart)
    keeps its last record, the one the finished run stands on."""
    losses = {r["step"]: r["loss"] for r in read_jsonl(Path(run_dir) / "metrics.jsonl")}
    if not (Path(run_dir) / f"debug_batches.p{process}.jsonl").exists():
        pytest.fail(f"{TRAIN} wrote no debug_batches.p{process}.jsonl: it lacks train.debug_batches")
    hashes = {r["step"]: r["batch_hash"] for r in read_jsonl(Path(run_dir) / f"debug_batches.p{process}.jsonl")}
    assert sorted(losses) == sorted(hashes) == list(range(1, N + 1)), (sorted(losses), sorted(hashes))
    return {s: (losses[s], hashes[s]) for s in losses}


def rows_by_step(run_dir):
    """{step: [row, ...]} over every process's debug file (last record of a step wins)."""
    out = defaultdict(list)
    for f in sorted(Path(run_dir).glob("debug_batches.p*.jsonl")):
        last = {r["step"]: r["rows"] for r in read_jsonl(f)}
        for s, rows in last.items():
            out[s].extend(rows)
    return out


def shard_streams(steps_rows, steps):
    """{virtual shard: [row hash, ...] in the order delivered} over `steps`."""
    out = defaultdict(list)
    for s in steps:
        for shard, _, _, h in steps_rows[s]:
            out[shard].append(h)
    return dict(out)


def env_for(processes):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    if processes:       # local_device_count sets the fake devices per process
        env.pop("XLA_FLAGS", None)
    return env


def free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def start(run_dir, *overrides, processes=0):
    """processes=0: one plain process (the suite's 8 fake devices); P>0: P processes joined by
    jax.distributed on localhost, 2 fake devices each."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    base = [sys.executable, str(TRAIN), f"hydra.run.dir={run_dir}", *COMMON, *overrides]
    if not processes:
        log = open(run_dir / f"log_{time.time_ns()}.txt", "w")
        return [subprocess.Popen(base, cwd=run_dir, env=env_for(0), stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)]
    port = free_port()
    procs = []
    for i in range(processes):
        log = open(run_dir / f"log_{time.time_ns()}_p{i}.txt", "w")
        procs.append(subprocess.Popen(
            base + [f"distributed.coordinator_address=localhost:{port}", f"distributed.num_processes={processes}",
                    f"distributed.process_id={i}", "distributed.local_device_count=2"],
            cwd=run_dir, env=env_for(processes), stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    return procs


def logs(run_dir):
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(Path(run_dir).glob("log_*.txt")))


def finish(procs, run_dir, timeout=240):
    rcs = []
    for p in procs:
        try:
            rcs.append(p.wait(timeout=timeout))
        except subprocess.TimeoutExpired:
            for q in procs:
                os.killpg(q.pid, signal.SIGKILL)
            pytest.fail(f"run timed out\n{logs(run_dir)}")
    assert rcs == [0] * len(procs), f"exit codes {rcs}\n{logs(run_dir)}"
    return rcs


def run(run_dir, *overrides, processes=0):
    finish(start(run_dir, *overrides, processes=processes), run_dir)


def run_until(run_dir, condition, sig, *overrides, group=True):
    """Starts a run and sends `sig` once condition() holds (polled every 5 ms): to the whole
    process group (the trainer and its data workers, like a crash) or to the trainer only."""
    (proc,) = start(run_dir, *overrides)
    while proc.poll() is None:
        if condition():
            (os.killpg if group else os.kill)(proc.pid if not group else os.getpgid(proc.pid), sig)
            break
        time.sleep(0.005)
    else:
        pytest.fail(f"the run ended before the condition held\n{logs(run_dir)}")
    try:
        return proc.wait(timeout=120)
    finally:
        if group:
            try:
                os.killpg(proc.pid, signal.SIGKILL)     # stragglers (data workers)
            except ProcessLookupError:
                pass


def complete_steps(ckpt_dir):
    return sorted(int(p.name) for p in Path(ckpt_dir).iterdir() if p.name.isdigit()) if Path(ckpt_dir).exists() else []


def resumed_at(run_dir):
    text = logs(run_dir)
    marks = [line for line in text.splitlines() if line.startswith("Resuming from")]
    assert marks, text
    return int(marks[-1].rsplit(" ", 1)[1])


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The reference: N steps straight, one process, in-process data (checkpoint every K)."""
    run_dir = tmp_path_factory.mktemp("straight")
    run(run_dir, "data.num_workers=0", f"checkpoint.every={K}")
    return run_dir


def assert_same_run(resumed_dir, straight_dir):
    a, b = per_step(resumed_dir), per_step(straight_dir)
    diff = [s for s in range(1, N + 1) if a[s] != b[s]]
    assert not diff, f"steps {diff} differ: resumed {[a[s] for s in diff]} straight {[b[s] for s in diff]}"


# ---------------------------------------------------------------- SIGKILL right after a checkpoint
@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_kill_after_checkpoint_resumes_bit_identically(workers, straight, tmp_path):
    ref = straight
    if workers:
        ref = tmp_path / "straight"
        run(ref, f"data.num_workers={workers}", "checkpoint.every=0")
    run_dir = tmp_path / "run"
    ckpt = run_dir / "checkpoints"
    run_until(run_dir, lambda: (ckpt / str(K)).is_dir(), signal.SIGKILL,
              f"data.num_workers={workers}", f"checkpoint.every={K}")
    assert complete_steps(ckpt)[-1] < N, "the kill came too late"
    run(run_dir, f"data.num_workers={workers}", f"checkpoint.every={K}")
    assert resumed_at(run_dir) == K
    assert_same_run(run_dir, ref)

    # The cut falls inside documents: some document has rows before and after step K.
    rows = rows_by_step(ref)
    before = {d for s in range(1, K + 1) for _, first, last, _ in rows[s] for d in (first, last)}
    after = {d for s in range(K + 1, N + 1) for _, first, last, _ in rows[s] for d in (first, last)}
    assert (before & after) - {-1}


# ---------------------------------------------------------------- SIGTERM: save, exit 0, resume
@pytest.mark.slow
def test_sigterm_saves_exits_zero_and_resumes(straight, tmp_path):
    run_dir = tmp_path / "run"
    metrics = run_dir / "metrics.jsonl"
    rc = run_until(run_dir, lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 3,
                   signal.SIGTERM, "data.num_workers=0", "checkpoint.every=0", group=False)
    assert rc == 0, logs(run_dir)
    saved = complete_steps(run_dir / "checkpoints")
    assert len(saved) == 1 and 3 <= saved[0] < N, (saved, logs(run_dir))
    assert f"Preempted: saved step {saved[0]}" in logs(run_dir)
    run(run_dir, "data.num_workers=0", "checkpoint.every=0")
    assert resumed_at(run_dir) == saved[0]
    assert_same_run(run_dir, straight)


@pytest.mark.slow
def test_sigterm_to_every_process_with_input_workers_saves_and_exits_zero(straight, tmp_path):
    """A preempted VM signals every process, the input workers too: the trainer still saves,
    stops its workers and exits 0 (a worker killed by the SIGTERM used to leave the trainer's
    shutdown hanging until a SIGKILL), and the next start resumes exactly."""
    run_dir = tmp_path / "run"
    metrics = run_dir / "metrics.jsonl"
    rc = run_until(run_dir, lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 3,
                   signal.SIGTERM, "data.num_workers=1", "checkpoint.every=0", group=True)
    assert rc == 0, logs(run_dir)
    saved = complete_steps(run_dir / "checkpoints")
    assert len(saved) == 1 and 3 <= saved[0] < N, (saved, logs(run_dir))
    run(run_dir, "data.num_workers=1", "checkpoint.every=0")
    assert resumed_at(run_dir) == saved[0]
    assert_same_run(run_dir, straight)


# ---------------------------------------------------------------- SIGKILL during an async save
@pytest.mark.slow
def test_kill_during_async_save_uses_last_complete_checkpoint(straight, tmp_path):
    run_dir = tmp_path / "run"
    ckpt = run_dir / "checkpoints"

    def saving_after_first():      # step 2 is complete and a later step is being written
        if not ckpt.exists():
            return False
        names = [p.name for p in ckpt.iterdir()]
        return "2" in names and any(".orbax-checkpoint-tmp" in n for n in names)

    run_until(run_dir, saving_after_first, signal.SIGKILL, "data.num_workers=0", "checkpoint.every=2")
    partial = [p.name for p in ckpt.iterdir() if ".orbax-checkpoint-tmp" in p.name]
    assert partial, f"no partial step left by the kill: {sorted(p.name for p in ckpt.iterdir())}"
    last_complete = complete_steps(ckpt)[-1]
    assert last_complete < N
    run(run_dir, "data.num_workers=0", "checkpoint.every=2")
    assert resumed_at(run_dir) == last_complete
    assert not [p for p in ckpt.iterdir() if ".orbax-checkpoint-tmp" in p.name]
    assert_same_run(run_dir, straight)


# ---------------------------------------------------------------- another process count
def assert_every_shard_continues_exactly(run_dirs_and_steps, straight_dir):
    """The rows each virtual shard delivered over the pieces of a run == its straight rows."""
    got = defaultdict(list)
    for run_dir, steps in run_dirs_and_steps:
        for shard, hashes in shard_streams(rows_by_step(run_dir), steps).items():
            got[shard].extend(hashes)
    want = shard_streams(rows_by_step(straight_dir), range(1, N + 1))
    assert sorted(got) == sorted(want) == list(range(4))
    for shard in want:
        assert len(set(got[shard])) == len(got[shard]), f"shard {shard}: a row repeated"
        assert got[shard] == want[shard], f"shard {shard}: rows lost, repeated or reordered"


@pytest.mark.slow
def test_two_processes_save_one_restores(straight, tmp_path):
    two, one = tmp_path / "two", tmp_path / "one"
    run(two, "data.num_workers=0", f"checkpoint.every={K}", f"train.steps={K}", processes=2)
    assert complete_steps(two / "checkpoints") == [K]
    data_files = sorted(p.name for p in (two / "checkpoints" / str(K) / "data").glob("process_*"))
    assert data_files == ["process_0-of-2.json", "process_1-of-2.json"]
    # One process, 2 devices, continues the two-process run.
    run(one, "data.num_workers=0", f"checkpoint.resume_from={two / 'checkpoints'}",
        "distributed.local_device_count=2")
    assert resumed_at(one) == K
    assert_every_shard_continues_exactly([(two, range(1, K + 1)), (one, range(K + 1, N + 1))], straight)
    # Same global batch, same rows per shard and step, other interleaving: the loss stays sane.
    losses = [r["loss"] for r in read_jsonl(one / "metrics.jsonl")]
    straight_losses = [r["loss"] for r in read_jsonl(straight / "metrics.jsonl")]
    assert abs(losses[-1] - straight_losses[-1]) < 0.5, (losses, straight_losses)


@pytest.mark.slow
def test_one_process_saves_two_restore(straight, tmp_path):
    two = tmp_path / "two"
    # The straight run's step-K checkpoint (1 process, 8 devices) continued by 2 x 2 devices.
    run(two, "data.num_workers=0", f"checkpoint.resume_from={straight / 'checkpoints' / str(K)}",
        "checkpoint.every=0", processes=2)
    assert resumed_at(two) == K
    assert_every_shard_continues_exactly([(straight, range(1, K + 1)), (two, range(K + 1, N + 1))], straight)


# ---------------------------------------------------------------- fingerprint
def make_cfg(run_dir, *overrides):
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose("train", overrides=[f"paths.run_dir={run_dir}", *COMMON, *overrides])


def load_train_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_under_test", TRAIN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_fingerprint_mismatch_stops_with_the_differences(straight, tmp_path):
    train_mod = load_train_module()

    src = f"checkpoint.resume_from={straight / 'checkpoints'}"
    with pytest.raises(train_mod.ConfigError) as e:
        train_mod.train(make_cfg(tmp_path / "a", src, "data.seq_len=128", "data.seed=7"))
    msg = str(e.value)
    assert "data.seq_len: checkpoint=64 now=128" in msg and "data.seed: checkpoint=0 now=7" in msg, msg
    assert "allow_data_change=true" in msg
    assert not (tmp_path / "a" / "checkpoints" / str(N)).exists()

    with pytest.raises(train_mod.ConfigError, match="model.n_layers: checkpoint=4 now=2"):
        train_mod.train(make_cfg(tmp_path / "b", src, "model.n_layers=2", "checkpoint.allow_data_change=true"))

    # On purpose: a new data layout continues the model (and reads the new data from its start).
    summary = train_mod.train(make_cfg(tmp_path / "c", src, "data.seq_len=128", "checkpoint.allow_data_change=true",
                                       f"train.steps={N + 1}", "checkpoint.every=0", "data.num_workers=0"))
    assert (summary["start_step"], summary["steps"]) == (N, N + 1)

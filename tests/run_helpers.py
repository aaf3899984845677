"""Helpers the tests of whole runs share: the composed config, a CLI run, the metrics it wrote,
and the exact-resume runs of test_resume.py (subprocesses with per-step batch hashes)."""
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

from tests import forked

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"

# The smallest Llama the whole-run journeys need (resume, hosts, slices, hangs, rollback): model=tiny
# at half its width and layers, ~3.5x less CPU a step; the journeys are about the run, not the network.
MICRO = ["model.d_model=64", "model.n_layers=2", "model.d_ff=128"]
# A learning-rate schedule that does not depend on train.steps. The schedule's numbers are constants
# of the compiled step, and decay_steps defaults to train.steps: runs of 4, 6 and 12 steps of the
# same model were three programs, each compiled (~3 CPU-s) once per session. With this, runs of
# any length on one shape and mesh share one (docs/development.md, "Where the suite's time goes").
ONE_SCHEDULE = ["optimizer.warmup_steps=2", "optimizer.decay_steps=50"]
# A short run that still logs, checkpoints and resumes.
TINY_FAST = [*MICRO, *ONE_SCHEDULE, "train.steps=12", "train.log_every=4", "checkpoint.every=6",
             "logger.wandb.mode=disabled", "data.num_workers=0"]


def make_cfg(run_dir, *overrides):
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose("train", overrides=[f"paths.run_dir={run_dir}", "logger.progress_bar=false", *overrides])


def read_metrics(run_dir):
    with open(Path(run_dir) / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def run_cli(tmp_path, *overrides):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return forked.run([sys.executable, str(ROOT / "train.py"), f"hydra.run.dir={tmp_path}/run",
                           "logger.wandb.mode=disabled", *overrides],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)


def main_in_process(capsys, run_dir, *overrides):
    """`python train.py OVERRIDES` for a mistake that stops before anything runs: train.main as
    Hydra calls it with the composed config, in this process (a whole train.py start-up costs
    ~7 s of CPU a case; each file keeps one mistake on the real command line).
    -> (exit code, the non-blank stderr lines)."""
    import train

    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        train.main(make_cfg(run_dir, "logger.wandb.mode=disabled", *overrides))
    return exit_.value.code, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


# ---------------------------------------------------------------- exact-resume runs (test_resume.py)
# Every run is `python train.py` in a subprocess with `train.debug_batches=true`; see test_resume.py.

# The script under test; an override lets a patched copy run these tests.
TRAIN = Path(os.environ.get("JAXPT_TRAIN_SCRIPT", ROOT / "train.py"))

N = 10          # steps of every run
K = 5           # the checkpoint the kills and the process-count changes resume from
COMMON = [*MICRO, "logger.wandb.mode=disabled", "logger.progress_bar=false", "train.log_every=1",
          f"train.steps={N}", "data.seq_len=64", "data.global_batch_size=16", "data.num_shards=4", "train.eval_every=0",
          *ONE_SCHEDULE, "++train.debug_batches=true"]


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


def without_device_count(env=None) -> dict:
    """The environment (default: this process's) as scripts/launch_local.py gives its processes:
    without the suite's 8 fake devices, for processes that get their own device count; the rest of
    XLA_FLAGS (tests/conftest.py's compile level) stays."""
    return load_script("launch_local").child_env(os.environ if env is None else env)


def env_for(processes):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    return without_device_count(env) if processes else env    # local_device_count sets them per process


def free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def start(run_dir, *overrides, processes=0, slices=1):
    """processes=0: one plain process (the suite's 8 fake devices); P>0: P processes joined by
    jax.distributed on localhost, 2 fake devices each; slices > 1: they form that many simulated
    slices of consecutive processes (scripts/launch_local.py --slices)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    base = [sys.executable, str(TRAIN), f"hydra.run.dir={run_dir}", *COMMON, *overrides]
    if not processes:
        log = open(run_dir / f"log_{time.time_ns()}.txt", "w")
        return [forked.Popen(base, cwd=run_dir, env=env_for(0), stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True)]
    port = free_port()
    procs = []
    for i in range(processes):
        log = open(run_dir / f"log_{time.time_ns()}_p{i}.txt", "w")
        procs.append(forked.Popen(
            base + [f"distributed.coordinator_address=localhost:{port}", f"distributed.num_processes={processes}",
                    f"distributed.process_id={i}", "distributed.local_device_count=2",
                    *([f"distributed.slice_index={i // (processes // slices)}"] if slices > 1 else [])],
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


def run(run_dir, *overrides, processes=0, slices=1):
    finish(start(run_dir, *overrides, processes=processes, slices=slices), run_dir)


def run_until(run_dir, condition, sig, *overrides, group=True, processes=0):
    """Starts a run and sends `sig` once condition() holds (polled every 5 ms): to the whole
    process group (the trainer and its data workers, like a crash) or to the trainer only; with
    processes=P, to each of the P trainers. Returns the exit code (P > 0: the list of them)."""
    procs = start(run_dir, *overrides, processes=processes)
    while all(p.poll() is None for p in procs):
        if condition():
            for p in procs:
                (os.killpg if group else os.kill)(os.getpgid(p.pid) if group else p.pid, sig)
            break
        time.sleep(0.005)
    else:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)        # the peers of a process that ended
            except ProcessLookupError:
                pass
        pytest.fail(f"the run ended before the condition held\n{logs(run_dir)}")
    try:
        rcs = [p.wait(timeout=120) for p in procs]
        return rcs if processes else rcs[0]
    finally:
        if group:
            for p in procs:
                try:
                    os.killpg(p.pid, signal.SIGKILL)     # stragglers (data workers)
                except ProcessLookupError:
                    pass


def complete_steps(ckpt_dir):
    return sorted(int(p.name) for p in Path(ckpt_dir).iterdir() if p.name.isdigit()) if Path(ckpt_dir).exists() else []


def resumed_at(run_dir):
    text = logs(run_dir)
    marks = [line for line in text.splitlines() if line.startswith("Resuming from")]
    assert marks, text
    return int(marks[-1].rsplit(" ", 1)[1])


def assert_same_run(resumed_dir, straight_dir):
    a, b = per_step(resumed_dir), per_step(straight_dir)
    diff = [s for s in range(1, N + 1) if a[s] != b[s]]
    assert not diff, f"steps {diff} differ: resumed {[a[s] for s in diff]} straight {[b[s] for s in diff]}"


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


def load_script(name: str):
    """scripts/<name>.py (or scripts/bench/<name>.py as "bench/<name>") as a module, to call its functions."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"scripts_{name.replace('/', '_')}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

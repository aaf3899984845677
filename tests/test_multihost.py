"""Several hosts: 2 local processes x 4 fake CPU devices (jax.distributed on localhost, started by
scripts/launch_local.py, the pod's code path) against 1 process x 8 devices.

    pytest tests/test_multihost.py -q

The global batch is the same whatever the host count (virtual shard v always fills the same
rows of it), so the losses must agree step for step; each host reads only its own shards; a
checkpoint written by both processes restores in both.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest
from run_helpers import MICRO, make_cfg, read_metrics, without_device_count

import train as train_mod

ROOT = Path(__file__).resolve().parents[1]
# decay_steps is fixed so that a run stopped at step 3 and continued to 6 follows the same schedule
# as a straight 6-step run.
COMMON = [*MICRO, "mesh=fsdp", "data.seq_len=64", "data.global_batch_size=16", "data.num_shards=4",
          "data.num_workers=1", "train.log_every=1", "train.eval_every=0", "checkpoint.every=3",
          "optimizer.warmup_steps=1", "optimizer.decay_steps=20", "logger.wandb.mode=disabled",
          "logger.progress_bar=false"]


def launch_two(run_dir, *overrides, env=None):
    env = {**without_device_count(), **(env or {})}
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "launch_local.py"), "--processes", "2", "--devices-per-process", "4",
         "--log-dir", str(run_dir / "logs"), "--", f"hydra.run.dir={run_dir}", *COMMON, *overrides],
        capture_output=True, text=True, env=env, timeout=600)
    logs = "\n".join(p.read_text() for p in sorted((run_dir / "logs").glob("*.log")))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:] + logs[-3000:]
    return result.stdout + logs


@pytest.mark.slow
def test_two_processes_equal_one_process_and_resume_in_both(tmp_path):
    single = tmp_path / "single"
    train_mod.train(make_cfg(single, *COMMON, "train.steps=6"))

    multi = tmp_path / "multi"
    launch_two(multi, "train.steps=3")
    out = launch_two(multi, "train.steps=6")
    assert "Resuming from latest checkpoint" in out
    # each host's next batch came with the checkpoint (data/carried.py); the losses below are exact
    assert "the checkpoint carried the next batch" in out

    losses_1 = {r["step"]: r["loss"] for r in read_metrics(single)}
    losses_2 = {r["step"]: r["loss"] for r in read_metrics(multi)}
    assert sorted(losses_2) == list(range(1, 7))
    for step in range(1, 7):
        assert abs(losses_2[step] - losses_1[step]) <= 1e-5 * abs(losses_1[step]), (step, losses_1, losses_2)

    # Each host read only its own virtual shards, and together exactly what the single host read.
    data_dir = multi / "checkpoints" / "6" / "data"
    states = [json.loads((data_dir / f"process_{i}-of-2.json").read_text()) for i in range(2)]
    from data.host import find_shard_states

    shards = [find_shard_states(s) for s in states]
    advanced = [{v for v, st in sh.items() if st["c"]["rows"] > 0} for sh in shards]
    assert advanced[0] and advanced[1] and not advanced[0] & advanced[1]
    single_state = json.loads(next((single / "checkpoints" / "6" / "data").glob("process_0-of-1.json")).read_text())
    single_shards = find_shard_states(single_state)
    assert advanced[0] | advanced[1] == set(single_shards)
    for v, st in single_shards.items():
        owner = shards[0] if v in advanced[0] else shards[1]
        assert owner[v]["c"] == st["c"], v      # same rows, documents, tokens per shard


@pytest.mark.slow
def test_a_host_that_compiles_late_starts_with_the_others(tmp_path):
    """One host reaches its first step 40 s after the other (a slow compile on a busy host). The
    first run of a step opens its collectives' communicators, a rendezvous that gives up after 30 s
    on CPU hosts (Gloo); compiled_together's barrier keeps the early host waiting there instead."""
    from tests.step_hooks import planted

    out = launch_two(tmp_path / "late", "train.steps=2", "checkpoint.every=0", env=planted(late_first_step="40@1"))
    assert "Gloo context initialization failed" not in out
    assert [r["step"] for r in read_metrics(tmp_path / "late") if "loss" in r] == [1, 2]

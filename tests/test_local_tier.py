"""The fast local checkpoint tier (model/local_tier.py, issue #22): a run killed after a local
save and before the next durable one resumes from the local step; when one host lost its local
tier, every host resumes from the durable step together; both exactly (the batches and losses
of an uninterrupted run).

    pytest tests/test_local_tier.py -q      (~2 min on 2 cores)
"""
import shutil
import signal

import pytest

from tests.test_resume import (
    K,
    N,
    assert_every_shard_continues_exactly,
    assert_same_run,
    complete_steps,
    finish,
    logs,
    read_jsonl,
    resumed_at,
    run,
    run_until,
    start,
)

LOCAL = ["checkpoint.local_every=2", "data.num_workers=0", f"checkpoint.every={K}"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The reference: test_resume's uninterrupted run (N steps, one process, in-process data)."""
    run_dir = tmp_path_factory.mktemp("straight")
    run(run_dir, "data.num_workers=0", f"checkpoint.every={K}")
    return run_dir


def tier(local, process=0):
    """The run's directory of `process` inside local_dir (named after the durable dir)."""
    runs = list(local.iterdir()) if local.is_dir() else []
    assert len(runs) <= 1, runs
    return runs[0] / f"p{process}" if runs else local / "none"


def local_steps(local, process=0):
    root = tier(local, process)
    return sorted(int(p.name) for p in root.iterdir() if p.name.isdigit()) if root.is_dir() else []


def test_settings_fail_in_one_line():
    from model.local_tier import LocalTier

    with pytest.raises(ValueError, match="checkpoint.local_every=0 must be positive"):
        LocalTier.check_settings({"local_dir": "/dev/shm/x", "local_every": 0})
    with pytest.raises(ValueError, match="not a URL"):
        LocalTier.check_settings({"local_dir": "gs://b/x", "local_every": 5})
    LocalTier.check_settings({"local_dir": None})


def assert_same_on_two_hosts(run_dir, straight):
    """Every virtual shard's rows in the order of the uninterrupted run, and its losses (two
    hosts add the same numbers in another order: float noise only)."""
    assert_every_shard_continues_exactly([(run_dir, range(1, N + 1))], straight)
    losses = {r["step"]: r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl")}
    want = {r["step"]: r["loss"] for r in read_jsonl(straight / "metrics.jsonl")}
    assert sorted(losses) == sorted(want)
    assert all(abs(losses[s] - want[s]) < 1e-4 for s in want), (losses, want)


@pytest.mark.slow
def test_killed_after_a_local_save_resumes_from_it_exactly(straight, tmp_path):
    run_dir, local = tmp_path / "run", tmp_path / "local"
    # Killed once local step 8 is complete: the newest durable step is K=5.
    run_until(run_dir, lambda: 8 in local_steps(local), signal.SIGKILL, f"checkpoint.local_dir={local}", *LOCAL)
    assert complete_steps(run_dir / "checkpoints")[-1] == K, "the kill came too late"
    assert local_steps(local)[-1] == 8
    run(run_dir, f"checkpoint.local_dir={local}", *LOCAL)
    assert resumed_at(run_dir) == 8
    assert f"Resuming from local checkpoint {tier(local)}/8" in logs(run_dir)
    assert tier(local).parent.name.startswith("run-")       # named after the durable checkpoint.dir
    assert_same_run(run_dir, straight)
    # Another run on the same local_dir never takes this run's steps.
    other = tmp_path / "other"
    run(other, f"checkpoint.local_dir={local}", *LOCAL, "train.steps=2")
    assert "Starting a new run" in logs(other) and "Resuming" not in logs(other)


@pytest.mark.slow
def test_a_host_without_its_local_tier_makes_every_host_take_the_durable_step(straight, tmp_path):
    run_dir, local = tmp_path / "run", tmp_path / "local"
    procs = start(run_dir, f"checkpoint.local_dir={local}", *LOCAL, "train.steps=8", processes=2)
    finish(procs, run_dir)
    # local_keep=2 of the local steps 2, 4, 6 (the last step, 8, is a durable save).
    assert local_steps(local, 0) == local_steps(local, 1) == [4, 6]
    # The durable step 8 and local step 6 exist: remove durable 8, so local 6 is newer than durable 5.
    shutil.rmtree(run_dir / "checkpoints" / "8")
    shutil.rmtree(tier(local, 1))                        # host 1's VM was recreated
    run(run_dir, f"checkpoint.local_dir={local}", *LOCAL, processes=2)
    assert resumed_at(run_dir) == K                      # the durable step, on both hosts
    # Both processes resumed alike, and the run is the uninterrupted one.
    p1 = [line for line in logs(run_dir).splitlines() if "Resuming from" in line]
    assert p1 and all("latest checkpoint" in line for line in p1), p1
    assert_same_on_two_hosts(run_dir, straight)
    # With every host's local tier there, they take it.
    run_2 = tmp_path / "run2"
    finish(start(run_2, f"checkpoint.local_dir={tmp_path / 'local2'}", *LOCAL, "train.steps=8", processes=2), run_2)
    shutil.rmtree(run_2 / "checkpoints" / "8")
    run(run_2, f"checkpoint.local_dir={tmp_path / 'local2'}", *LOCAL, processes=2)
    assert resumed_at(run_2) == 6
    assert "Resuming from local checkpoint" in logs(run_2)
    assert_same_on_two_hosts(run_2, straight)

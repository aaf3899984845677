"""The fast local checkpoint tier (model/runtime/local_tier.py, issue #22): a run killed after a local
save and before the next durable one resumes from the local step; when one host lost its local
tier, every host resumes from the durable step together; both exactly (the batches and losses
of an uninterrupted run); a damaged local step is moved aside and the previous one taken.

    pytest tests/test_local_tier.py -q      (~2 min on 2 cores)
"""
import re
import shutil
import signal

import pytest

from tests.run_helpers import (
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
# `straight`, the reference (N steps uninterrupted, one process, in-process data): conftest.py, per module.


def tier(local, process=0):
    """The run's directory of `process` inside local_dir (named after the durable dir)."""
    runs = list(local.iterdir()) if local.is_dir() else []
    assert len(runs) <= 1, runs
    return runs[0] / f"p{process}" if runs else local / "none"


def local_steps(local, process=0):
    root = tier(local, process)
    return sorted(int(p.name) for p in root.iterdir() if p.name.isdigit()) if root.is_dir() else []


def test_settings_fail_in_one_line():
    from model.runtime.local_tier import LocalTier

    with pytest.raises(ValueError, match="checkpoint.local_every=0 must be positive"):
        LocalTier.check_settings({"local_dir": "/dev/shm/x", "local_every": 0})
    with pytest.raises(ValueError, match="not a URL"):
        LocalTier.check_settings({"local_dir": "gs://b/x", "local_every": 5})
    LocalTier.check_settings({"local_dir": None})


# ---------------------------------------------------------------- damaged local steps (unit level)
def small_state():
    """A small real train state: a sharded and a replicated leaf on the suite's 8 devices, and
    its abstract twin (the current layout)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()), ("x",))
    sharded, replicated = NamedSharding(mesh, PartitionSpec("x")), NamedSharding(mesh, PartitionSpec())
    state = {"w": jax.device_put(jnp.arange(64 * 8, dtype=jnp.float32).reshape(64, 8), sharded),
             "b": jax.device_put(jnp.ones(16, jnp.bfloat16), replicated)}
    abstract = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state)
    return state, abstract


def saved_tier(root, steps=(2, 4), process_index=0):
    from model.runtime.local_tier import LocalTier

    state, abstract = small_state()
    t = LocalTier(str(root), every=2, keep=len(steps), process_index=process_index, run="r")
    for s in steps:
        t.save(s, state, {"position": s, "host": process_index}, {"step": s, "fingerprint": {}})
        t.wait()
    assert t.steps() == list(steps)
    return t, state, abstract


def counting_gather():
    calls = []

    def gather(x):
        calls.append(x)
        return [x]
    return gather, calls


def truncate_arrays(d):
    with open(d / "arrays.bin", "r+b") as f:
        f.truncate(1000)


def corrupt(name):
    def damage(d):
        (d / name).write_text((d / name).read_text()[:-3])      # a write cut short
    return damage


DAMAGES = {"arrays.bin": (truncate_arrays, r"arrays\.bin: 1000 bytes, the manifest needs \d+"),
           "arrays.bin missing": (lambda d: (d / "arrays.bin").unlink(), r"arrays\.bin: missing"),
           "manifest.json": (corrupt("manifest.json"), r"manifest\.json: JSONDecodeError"),
           "meta.json": (corrupt("meta.json"), r"meta\.json: JSONDecodeError"),
           "data.json": (corrupt("data.json"), r"data\.json: JSONDecodeError")}


def test_a_healthy_local_tier_picks_its_newest_step_and_restores_it(tmp_path, capsys):
    import numpy as np

    t, state, abstract = saved_tier(tmp_path)
    gather, calls = counting_gather()
    pick = t.pick(abstract, newer_than=None, gather=gather)
    assert (pick.step, pick.meta["step"], pick.data_states) == (4, 4, [{"position": 4, "host": 0}])
    assert pick.directory == str(t.root / "4") and len(calls) == 2
    got = t.restore(pick.step, abstract)
    assert all(np.array_equal(np.asarray(got[k]), np.asarray(state[k])) and got[k].sharding == state[k].sharding
               for k in state)
    assert t.pick(abstract, newer_than=3, gather=gather).step == 4
    assert t.pick(abstract, newer_than=4, gather=gather) is None          # the durable step is as new
    assert sorted(p.name for p in t.root.iterdir()) == ["2", "4"]          # nothing moved
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("damaged", list(DAMAGES))
def test_a_damaged_local_step_is_moved_aside_and_the_previous_one_picked(tmp_path, capsys, damaged):
    damage, reason = DAMAGES[damaged]
    t, state, abstract = saved_tier(tmp_path)
    damage(t.root / "4")
    pick = t.pick(abstract, newer_than=None, gather=counting_gather()[0])
    assert (pick.step, pick.meta["step"], pick.data_states) == (2, 2, [{"position": 2, "host": 0}])
    (line,) = capsys.readouterr().out.splitlines()
    assert re.fullmatch(rf"local checkpoint {re.escape(str(t.root))}/4 did not restore \({reason}.*\); "
                        rf"moved aside to {re.escape(str(t.root))}/4\.damaged-\d{{8}}T\d{{6}}Z", line), line
    assert t.steps() == [2] and len(list(t.root.glob("4.damaged-*"))) == 1     # never deleted
    t.restore(pick.step, abstract)
    # The last one damaged too: none left, the durable tier.
    damage(t.root / "2")
    assert t.pick(abstract, newer_than=None, gather=counting_gather()[0]) is None
    (line,) = capsys.readouterr().out.splitlines()
    assert f"local checkpoint {t.root}/2 did not restore" in line
    assert t.steps() == [] and len(list(t.root.glob("*.damaged-*"))) == 2


@pytest.mark.parametrize("damaged", ["arrays.bin", "meta.json"])
def test_a_step_damaged_on_one_host_makes_every_host_take_the_previous_one(tmp_path, capsys, damaged):
    """Two hosts (threads joined by an all-gather): host 1's step 4 is damaged; both pick step 2,
    with the same gathers, and host 0 keeps its healthy step 4."""
    import threading

    hosts = [saved_tier(tmp_path, process_index=i) for i in range(2)]
    DAMAGES[damaged][0](hosts[1][0].root / "4")
    slots, barrier, calls = [None, None], threading.Barrier(2, timeout=60), [0, 0]

    def gather_of(i):
        def gather(x):
            calls[i] += 1
            slots[i] = x
            barrier.wait()
            out = list(slots)
            barrier.wait()
            return out
        return gather

    picks = [None, None]

    def host(i):
        t, _, abstract = hosts[i]
        picks[i] = t.pick(abstract, newer_than=None, gather=gather_of(i))

    threads = [threading.Thread(target=host, args=(i,)) for i in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert [p.step for p in picks] == [2, 2] and calls[0] == calls[1]
    assert picks[0].data_states == picks[1].data_states == [{"position": 2, "host": 0}, {"position": 2, "host": 1}]
    assert hosts[0][0].steps() == [2, 4] and hosts[1][0].steps() == [2]
    (line,) = capsys.readouterr().out.splitlines()
    assert f"local checkpoint {hosts[1][0].root}/4 did not restore ({damaged}: " in line


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
    assert (tier(local) / "8" / "next_batch.npz").is_file()      # the host's next batch (data/carried.py)
    run(run_dir, f"checkpoint.local_dir={local}", *LOCAL)
    assert resumed_at(run_dir) == 8
    assert f"Resuming from local checkpoint {tier(local)}/8" in logs(run_dir)
    assert "the checkpoint carried the next batch" in logs(run_dir)
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
    # With every host's local tier there, they take it (and train steps 7 and 8 again).
    shutil.rmtree(run_dir / "checkpoints" / "8")
    run(run_dir, f"checkpoint.local_dir={local}", *LOCAL, processes=2)
    assert resumed_at(run_dir) == 6
    assert "Resuming from local checkpoint" in logs(run_dir)
    assert_same_on_two_hosts(run_dir, straight)
    # The run went on to N (durable N, local steps 6 and 8). Without durable N, every host's newest
    # local step is newer than the durable 5 again, but host 1's VM was recreated: its tier is gone.
    assert complete_steps(run_dir / "checkpoints") == [K, N]
    assert local_steps(local, 0) == local_steps(local, 1) == [6, 8]
    shutil.rmtree(run_dir / "checkpoints" / str(N))
    shutil.rmtree(tier(local, 1))
    run(run_dir, f"checkpoint.local_dir={local}", *LOCAL, processes=2)
    assert resumed_at(run_dir) == K                      # the durable step, on both hosts
    resumes = [line for line in logs(run_dir).splitlines() if line.startswith("Resuming from")]
    assert len(resumes) == 2 and "latest checkpoint" in resumes[-1], resumes
    # Both processes resumed alike, and the run is the uninterrupted one.
    assert_same_on_two_hosts(run_dir, straight)

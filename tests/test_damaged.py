"""Damaged checkpoints in whole runs: every kind of file a step holds, damaged one per step, on
1 process and on 2 jax.distributed processes.

    pytest tests/test_damaged.py -q        (~4 min on 2 cores; slow tier)

A run saves every 2 steps and keeps them all; then step 10's largest array chunk is truncated,
step 8's array manifest removed, step 6's data state (one process's JSON) and step 4's meta
overwritten with half a JSON. The same command again must name each of them in one line, move
it aside, and resume from step 2, with every later batch and loss bit-identical to the first
run's (train.debug_batches hashes). checkpoint.on_damaged=stop stops on the newest with one line.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from run_helpers import COMMON, TRAIN, env_for, finish, logs, read_jsonl, start

from tests import forked

N = 10
# What Orbax's leftover reads of a damaged step would print (model/runtime/checkpoint.py _SilenceDamagedReads).
LEFTOVER_REPORTS = ("Event loop is closed", "was never retrieved", "Exception ignored in")


def first_records(run_dir, process=0):
    """{step: (loss, batch hash)} as the first run recorded them (a step run again after the
    fallback appends a later record; the first one is the uninterrupted run's)."""
    out = {}
    for r in read_jsonl(Path(run_dir) / f"debug_batches.p{process}.jsonl"):
        out.setdefault(r["step"], [None, r["batch_hash"]])
    for r in read_jsonl(Path(run_dir) / "metrics.jsonl"):
        if out[r["step"]][0] is None:
            out[r["step"]][0] = r["loss"]
    return out


def last_records(run_dir, process=0):
    hashes = {r["step"]: r["batch_hash"] for r in read_jsonl(Path(run_dir) / f"debug_batches.p{process}.jsonl")}
    losses = {r["step"]: r["loss"] for r in read_jsonl(Path(run_dir) / "metrics.jsonl")}
    return {s: [losses[s], hashes[s]] for s in hashes}


def damage(ckpt, processes):
    """One kind of damage per step, newest first; returns {step: the item the line must name}."""
    last = processes - 1

    def largest(step):
        # the largest array chunk any process wrote (small replicated arrays are written whole by
        # the first replica, model/runtime/checkpoint.py MIN_REPLICA_SLICE_BYTES: the last process may write none)
        return max((ckpt / str(step) / "state").glob("ocdbt.process_*/d/*"), key=lambda p: p.stat().st_size)

    os.truncate(largest(10), 1000)                                    # a half-written array chunk
    (ckpt / "8" / "state" / "manifest.ocdbt").unlink()                # the arrays' manifest
    (ckpt / "6" / "data" / f"process_{last}-of-{processes}.json").write_text('{"shards": {"0')
    (ckpt / "4" / "meta" / "metadata").write_text("{not json")
    return {10: "state", 8: "state", 6: "data", 4: "meta"}


@pytest.mark.slow
@pytest.mark.parametrize("processes", [0, 2])
def test_each_damaged_step_is_moved_aside_and_the_run_resumes_exactly(processes, tmp_path):
    run_dir = tmp_path / "run"
    ckpt = run_dir / "checkpoints"
    args = ["data.num_workers=0", "checkpoint.every=2", "checkpoint.keep=0"]
    finish(start(run_dir, *args, processes=processes), run_dir)
    reference = {p: first_records(run_dir, p) for p in range(max(processes, 1))}
    assert sorted(reference[0]) == list(range(1, N + 1))
    named = damage(ckpt, max(processes, 1))

    if not processes:
        # checkpoint.on_damaged=stop: one line, exit 1, nothing moved.
        result = forked.run([sys.executable, str(TRAIN), f"hydra.run.dir={run_dir}", *COMMON, *args,
                                 "checkpoint.on_damaged=stop"], cwd=run_dir, env=env_for(0), capture_output=True,
                                text=True, timeout=300)
        assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
        errors = [line for line in result.stderr.splitlines() if line.startswith("checkpoint error:")]
        assert len(errors) == 1 and "/10 did not restore (state: " in errors[0], result.stderr[-2000:]
        assert "Traceback" not in result.stderr, result.stderr[-3000:]
        assert not [r for r in LEFTOVER_REPORTS if r in result.stdout + result.stderr], result.stderr[-3000:]
        assert not [p for p in ckpt.iterdir() if ".damaged-" in p.name]

    before = {p.name for p in run_dir.glob("log_*.txt")}
    finish(start(run_dir, *args, processes=processes), run_dir)
    moved = sorted(p.name.split(".")[0] for p in ckpt.iterdir() if ".damaged-" in p.name)
    assert sorted(map(int, moved)) == sorted(named), sorted(p.name for p in ckpt.iterdir())

    new_logs = [p for p in run_dir.glob("log_*.txt") if p.name not in before]
    main_log = next(p for p in new_logs if not processes or p.name.endswith("_p0.txt")).read_text()
    for step, item in named.items():
        lines = [line for line in main_log.splitlines() if f"checkpoints/{step} did not restore (" in line]
        assert len(lines) == 1, (step, lines, logs(run_dir))
        assert f"{item}: " in lines[0] or "on another host" in lines[0], lines[0]
        assert f"moved aside to {ckpt}/{step}.damaged-" in lines[0], lines[0]
    assert "Resuming from latest checkpoint" in main_log and main_log.rstrip().count("at step 2") >= 1, main_log
    # Nothing but the named lines: no error of ours, and on no host any of the reports a damaged
    # step's leftover reads would leave (model/runtime/checkpoint.py drops them before they are written).
    for p in new_logs:
        text = p.read_text()
        leaked = [r for r in LEFTOVER_REPORTS if r in text]
        assert not leaked, (p.name, leaked, text[-6000:])
    errors = [line for line in main_log.splitlines()
              if ("Error" in line or "Traceback" in line) and "did not restore" not in line]
    assert not errors, errors[:20]

    for p in range(max(processes, 1)):
        after = last_records(run_dir, p)
        diff = [s for s in range(3, N + 1) if after[s] != reference[p][s]]
        assert not diff, (p, {s: (reference[p][s], after[s]) for s in diff})
    # The new steps 4..10 are saved beside the moved ones.
    assert sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit()) == [2, 4, 6, 8, 10]
    json.loads((ckpt / "10" / "meta" / "metadata").read_text())


def test_a_damaged_steps_leftover_reads_are_not_reported_but_other_errors_are(tmp_path):
    """Orbax leaves a damaged step's sibling reads behind as suspended coroutines, unretrieved
    tasks and futures, and callbacks landing on a closed loop; collecting them prints tracebacks
    naming the step after our one line. Once a step is named damaged those reports are dropped;
    a report naming anything else still prints."""
    script = tmp_path / "leftovers.py"
    script.write_text(
        "import asyncio, gc, logging\n"
        "from model.runtime.checkpoint import silence_leftover_reads\n"
        "class Pending:\n"
        "    def __await__(self):\n"
        "        yield\n"
        "async def read(path):\n"
        "    try:\n"
        "        await Pending()\n"
        "    finally:\n"
        "        raise Exception(f\"Encountered error while reading array: 'path': '{path}/state/'\")\n"
        "silence_leftover_reads('/run/checkpoints/10')\n"
        "for path in ('/run/checkpoints/10', '/run/checkpoints/100'):\n"
        "    coroutine = read(path)\n"
        "    coroutine.send(None)       # suspended, as a sibling read is when the step fails\n"
        "    del coroutine\n"
        "    gc.collect()\n"
        "async def failing(path):\n"
        "    raise Exception(f\"'path': '{path}/state/'\")\n"
        "async def leave_tasks():\n"
        "    for path in ('/run/checkpoints/10', '/run/checkpoints/100'):\n"
        "        asyncio.get_running_loop().create_task(failing(path))\n"
        "    await asyncio.sleep(0)\n"
        "async def leave_futures():\n"
        "    for path in ('/run/checkpoints/10', '/run/checkpoints/100'):\n"
        "        asyncio.get_running_loop().create_future().set_exception(Exception(f\"'path': '{path}/state/'\"))\n"
        "    await asyncio.sleep(0)\n"
        "async def leave_gathers():   # a gather nobody awaited: _GatheringFuture\n"
        "    for path in ('/run/checkpoints/10', '/run/checkpoints/100'):\n"
        "        asyncio.gather(failing(path))\n"
        "    for _ in range(3):\n"
        "        await asyncio.sleep(0)\n"
        "logging.basicConfig()\n"
        "asyncio.run(leave_tasks())\n"
        "asyncio.run(leave_gathers())\n"
        "asyncio.run(leave_futures())\n"
        "gc.collect()\n"
        "closed = asyncio.new_event_loop()\n"
        "closed.close()\n"
        "class LateCallback:           # a read's callback landing after its loop closed\n"
        "    def __del__(self):\n"
        "        closed.call_soon_threadsafe(print)\n"
        "LateCallback()\n"
        "gc.collect()\n")
    result = subprocess.run([sys.executable, str(script)], cwd=Path(__file__).parents[1], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "/run/checkpoints/10/" not in result.stderr, result.stderr
    assert "/run/checkpoints/100/" in result.stderr, result.stderr
    assert result.stderr.count("Exception ignored in") == 1, result.stderr
    assert result.stderr.count("Task exception was never retrieved") == 1, result.stderr
    assert result.stderr.count("Future exception was never retrieved") == 2, result.stderr   # _Gathering too
    assert result.stderr.count("_GatheringFuture exception was never retrieved") == 1, result.stderr
    assert "Event loop is closed" not in result.stderr, result.stderr


def test_leftover_reports_are_dropped_from_the_start_of_a_guarded_read_and_only_there(tmp_path):
    """The reports land on several threads at once while the failure is still on its way up,
    before the step is named: they are dropped from the moment the guarded read starts, whole.
    A relative checkpoint directory is matched as it is spelt. Before any read, and for a step
    whose error is not damage (raised as it is), the reports pass."""
    script = tmp_path / "guarded.py"
    script.write_text(
        "import asyncio, gc, logging, sys, threading\n"
        "from model.runtime.checkpoint import DamagedCheckpoint, ResumePoint, guard_damage\n"
        "logging.basicConfig()\n"
        "closed = asyncio.new_event_loop()\n"
        "closed.close()\n"
        "class LateCallback:           # a read's callback landing after its loop closed\n"
        "    def __del__(self):\n"
        "        closed.call_soon_threadsafe(print)\n"
        "def late_callbacks(threads=4, each=25):\n"
        "    barrier = threading.Barrier(threads)\n"
        "    def run():\n"
        "        barrier.wait()\n"
        "        for _ in range(each):\n"
        "            LateCallback()\n"
        "    workers = [threading.Thread(target=run) for _ in range(threads)]\n"
        "    for w in workers:\n"
        "        w.start()\n"
        "    for w in workers:\n"
        "        w.join()\n"
        "LateCallback()                # nothing read yet: passes\n"
        "def damaged_read():\n"
        "    late_callbacks()          # before the failure is classified\n"
        "    raise Exception(\"Encountered error while reading array index: 'path': 'run/checkpoints/10/state/'\")\n"
        "try:\n"
        "    guard_damage(ResumePoint('run/checkpoints', 10, 'latest'), damaged_read, item='state',\n"
        "                 on_damaged='stop')\n"
        "except DamagedCheckpoint as e:\n"
        "    print('named:', e)\n"
        "late_callbacks()              # after: a slow read's callbacks\n"
        "async def leave_futures():\n"
        "    for path in ('run/checkpoints/10', 'run/checkpoints/100'):\n"
        "        asyncio.get_running_loop().create_future().set_exception(Exception(f'local file \"{path}/state/\"'))\n"
        "    await asyncio.sleep(0)\n"
        "asyncio.run(leave_futures())\n"
        "gc.collect()\n"
        "def unavailable():\n"
        "    raise Exception(\"UNAVAILABLE: 'path': '/other/checkpoints/4/state/'\")\n"
        "try:\n"
        "    guard_damage(ResumePoint('/other/checkpoints', 4, 'latest'), unavailable, item='state',\n"
        "                 on_damaged='stop')\n"
        "except DamagedCheckpoint:\n"
        "    sys.exit('UNAVAILABLE is not damage')\n"
        "except Exception as e:\n"
        "    print('raised:', e)\n"
        "class Leftover:\n"
        "    def __del__(self):\n"
        "        raise Exception(\"'path': '/other/checkpoints/4/state/'\")\n"
        "Leftover()\n"
        "gc.collect()\n")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    result = subprocess.run([sys.executable, str(script)], cwd=Path(__file__).parents[1], capture_output=True,
                            text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    assert "named: checkpoint run/checkpoints/10 did not restore (state: " in result.stdout, result.stdout
    assert "raised: UNAVAILABLE" in result.stdout, result.stdout
    assert result.stderr.count("RuntimeError: Event loop is closed") == 1, result.stderr      # the one before
    assert "run/checkpoints/10/" not in result.stderr, result.stderr
    assert result.stderr.count("Future exception was never retrieved") == 1, result.stderr
    assert "run/checkpoints/100/" in result.stderr, result.stderr
    assert result.stderr.count("Exception ignored in") == 2, result.stderr
    assert "'/other/checkpoints/4/state/'" in result.stderr, result.stderr

"""The hang watchdog (model/runtime/watchdog.py, issue #22): a process whose steps stop writes its threads'
stacks and a report, and exits with code 75; the launchers start the run again on that code; the
next start names the host that stopped first and resumes exactly."""
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from model.runtime import goodput
from model.runtime.watchdog import EXIT_HANG, MIN_TIMEOUT_S, announce_last_hang, hang_timeout, heartbeat_over
from tests.run_helpers import MICRO, ONE_SCHEDULE, ROOT, read_metrics, run_cli, without_device_count

# A watchdog in a process of its own (it ends the process it fires in).
SCRIPT = textwrap.dedent("""
    import subprocess, sys, time
    from pathlib import Path
    from model.runtime.watchdog import Watchdog

    out = Path(sys.argv[1])
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    (out / "child.pid").write_text(str(child.pid))
    w = Watchdog(1.0, run_dir=out / "run", reports_dir=out / "ckpt" / "hang_reports", process_index=3,
                 on_hang=lambda step: (out / "exit_event").write_text(str(step)))
    for step in range(1, 6):
        w.beat(step)
        time.sleep(0.05)
    with w.paused():                 # longer than the timeout: an evaluation, not a hang
        time.sleep(2.5)
    (out / "after_pause").write_text("ok")
    w.beat(6)

    def stuck_in_a_collective():
        time.sleep(60)

    stuck_in_a_collective()
    print("not reached")
""")


@pytest.mark.slow
def test_a_stuck_process_writes_stacks_and_a_report_then_exits_75(tmp_path):
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == EXIT_HANG, r.stderr[-2000:]
    assert time.monotonic() - t0 < 50                # well before the 60 s sleep ends
    assert (tmp_path / "after_pause").exists()       # the pause did not fire it
    assert "not reached" not in r.stdout
    assert "hang: no step completed" in r.stderr and "after step 6" in r.stderr
    stacks = (tmp_path / "run" / "hang_stacks_p3.txt").read_text()
    assert "stuck_in_a_collective" in stacks and "thread MainThread" in stacks and "hang-watchdog" in stacks
    report = json.loads((tmp_path / "ckpt" / "hang_reports" / "p3.json").read_text())
    assert report["process"] == 3 and report["last_step"] == 6 and report["timeout_s"] == 1.0
    assert (tmp_path / "exit_event").read_text() == "6"
    # The input workers' stand-in did not outlive it.
    pid = int((tmp_path / "child.pid").read_text())
    deadline = time.time() + 10
    while os.path.exists(f"/proc/{pid}") and "Z" not in _state(pid) and time.time() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{pid}") or "Z" in _state(pid)


def _state(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_the_automatic_timeout():
    assert hang_timeout(None, []) == MIN_TIMEOUT_S
    assert hang_timeout(None, [0.2] * 10) == MIN_TIMEOUT_S                # 20 x 0.2 s: the floor
    assert hang_timeout(None, [60.0, 50.0, 1000.0]) == 20 * 60.0          # the median, not the spike
    assert hang_timeout(5.0, [60.0]) == 5.0


def test_the_next_start_names_the_host_that_stopped_first(tmp_path):
    reports = tmp_path / "hang_reports"
    reports.mkdir()

    def write(p, step, t):
        (reports / f"p{p}.json").write_text(json.dumps({"process": p, "host": f"h{p}", "last_step": step,
                                                        "last_step_time": t}))
    write(0, 9, 1000.0)
    write(2, 9, 1001.0)
    line = announce_last_hang(reports, 3)
    assert "process 1 wrote no hang report" in line and "stopped first" in line
    assert not list(reports.glob("p*.json")) and len(list(reports.glob("seen-*/p*.json"))) == 2
    assert announce_last_hang(reports, 3) is None          # named once
    write(0, 9, 1000.0)
    write(1, 8, 990.0)
    line = announce_last_hang(reports, 2)
    assert "process 1 (h1) stopped first (the earliest last step)" in line
    # A report that fired long after it was due: that process was frozen itself.
    (reports / "p0.json").write_text(json.dumps({"process": 0, "host": "h0", "last_step": 9, "last_step_time": 1000.0,
                                                 "late_s": 40.0, "poll_s": 0.3}))
    write(1, 8, 990.0)
    line = announce_last_hang(reports, 2)
    assert "process 0 (h0) stopped first (it was frozen: its own watchdog ran 40 s late)" in line

    # A failure of its own (an error, not a hang) writes a `failed` report: before any watchdog
    # fired, it went first; after one fired, the hang did; beside a silent host, the silent one.
    def failed(p, at):
        (reports / f"p{p}.json").write_text(json.dumps({"process": p, "host": f"h{p}", "last_step": 9,
                                                        "fired_at": at, "failed": "ValueError: boom"}))

    def hung(p, at):
        (reports / f"p{p}.json").write_text(json.dumps({"process": p, "host": f"h{p}", "last_step": 9,
                                                        "last_step_time": 1000.0, "fired_at": at}))
    failed(0, 1005.0)
    hung(1, 1010.0)
    line = announce_last_hang(reports, 2)
    assert line.startswith("The last start ended in a failure: process 0 (h0) failed first, after step 9: "
                           "ValueError: boom;"), line
    failed(0, 1020.0)
    hung(1, 1010.0)
    assert "process 1 (h1) stopped first" in announce_last_hang(reports, 2)
    failed(0, 1005.0)
    failed(1, 1001.0)
    assert "process 1 (h1) failed first" in announce_last_hang(reports, 2)     # all failed: the first
    failed(0, 1005.0)
    line = announce_last_hang(reports, 2)
    assert "process 1 wrote no hang report" in line and "process 0 (h0) last completed step 9 at ? UTC " \
        "(failed: ValueError: boom)" in line, line


def test_the_next_start_names_the_slice_that_stopped_first(tmp_path, monkeypatch):
    """A 2 x 2 multislice job (processes 2 and 3 are slice 1): a whole slice that wrote no report is
    named as that slice; reports carry their slice. The layout is the running job's (one process
    here, so the job's layout is given)."""
    from model.runtime import watchdog

    monkeypatch.setattr(watchdog, "_slices_of_processes", lambda: {0: 0, 1: 0, 2: 1, 3: 1})
    reports = tmp_path / "hang_reports"
    reports.mkdir()
    for p in (0, 1):
        (reports / f"p{p}.json").write_text(json.dumps({"process": p, "slice": 0, "host": f"h{p}", "last_step": 9,
                                                        "last_step_time": 1000.0, "peer": True}))
    line = announce_last_hang(reports, 4)
    assert "slice 1 (process 2, 3) wrote no hang report" in line and "stopped first" in line, line
    assert "process 0 (h0, slice 0) last completed step 9" in line
    (reports / "p1.json").write_text(json.dumps({"process": 1, "slice": 0, "host": "h1", "last_step": 9}))
    line = announce_last_hang(reports, 4)      # process 0 crashed on the broken collectives, no report
    assert "slice 1 (process 2, 3) wrote no hang report" in line and "(process 0 of another slice wrote none" in line
    (reports / "p0.json").write_text(json.dumps({"process": 0, "slice": 0, "host": "h0", "last_step": 9}))
    (reports / "p2.json").write_text(json.dumps({"process": 2, "slice": 1, "host": "h2", "last_step": 9}))
    line = announce_last_hang(reports, 4)      # one host of each slice silent: named as processes
    assert "process 1, 3 wrote no hang report" in line, line


def _planted_hang_env(spec):
    from data.pipeline import SLOW_STAGE_ENV

    return {SLOW_STAGE_ENV: spec}


# The smallest Llama and the suite's one schedule (run_helpers): the hang and the restart are about
# the run, not the network, and the run's step is one the suite has compiled already.
HANG_RUN = [*MICRO, *ONE_SCHEDULE, "data.seq_len=64", "train.steps=12", "train.log_every=1", "checkpoint.every=3",
            "train.eval_every=0", "data.num_workers=0", "data.prefetch=1", "logger.progress_bar=false",
            # 8 s: well under the planted 600 s hang, and over what a loaded 2-core machine takes for
            # a step and the run's first (async) save, which fired a 3 s watchdog beside other tests.
            "train.hang_timeout_s=8"]


@pytest.mark.slow
def test_a_hung_run_exits_75_and_the_next_start_resumes_exactly(tmp_path, monkeypatch):
    """One process whose input stops after 8 batches: the watchdog ends it with code 75, stacks
    (the stuck input thread in them) and a report; the next start names it, resumes from the
    newest checkpoint and trains the steps after it to the same losses."""
    for k, v in _planted_hang_env("600+8").items():
        monkeypatch.setenv(k, v)
    t0 = time.monotonic()
    first = run_cli(tmp_path, *HANG_RUN)
    assert first.returncode == EXIT_HANG, first.stdout[-2000:] + first.stderr[-3000:]
    assert time.monotonic() - t0 < 200
    run_dir = tmp_path / "run"
    assert "hang: no step completed" in first.stderr
    stacks = (run_dir / "hang_stacks_p0.txt").read_text()
    assert "slowed" in stacks and "MainThread" in stacks     # the planted sleep, and the loop waiting on it
    events = goodput.read_events(run_dir / goodput.EVENTS_FILE)
    assert events[-1]["event"] == "exit" and events[-1]["reason"] == "hang"
    hung_at = events[-1]["step"]
    assert 6 <= hung_at <= 9, hung_at

    monkeypatch.delenv(next(iter(_planted_hang_env(""))))
    second = run_cli(tmp_path, *HANG_RUN)
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-3000:]
    assert "The last start ended in a hang: process 0" in second.stdout
    assert "Resuming from" in second.stdout and "at step 6" in second.stdout, second.stdout[-2000:]
    rows = [r for r in read_metrics(run_dir) if "loss" in r]
    by_step = {}
    for r in rows:
        by_step.setdefault(r["step"], []).append(r["loss"])
    twice = [s for s, losses in by_step.items() if len(losses) == 2]
    assert twice and all(s > 6 for s in twice)
    for s in twice:
        assert by_step[s][0] == by_step[s][1], (s, by_step[s])
    assert max(by_step) == 12
    # The hung life's time from its last step to the watchdog's exit is badput "stall".
    events = goodput.read_events(run_dir / goodput.EVENTS_FILE)
    hung = goodput.split_lives(events)[0]
    parts = hung.parts(hung.last_t)
    assert parts["shutdown"] == 0.0 and parts["stall"] > 1.0, parts
    assert goodput.breakdown(events)["restarts"] == 1


@pytest.mark.slow
def test_two_processes_one_hung_both_exit_and_launch_local_restarts(tmp_path):
    """Process 1's input stops; both processes end with code 75 (process 0 waits in a collective),
    `launch_local.py --restarts 1` starts the job again, and it finishes from the checkpoint with
    the losses of the steps trained twice unchanged."""
    from data.pipeline import SLOW_ONCE_ENV

    run_dir = tmp_path / "multi"
    env = without_device_count()
    env.update({**_planted_hang_env("600@1+8"), "PYTHONPATH": str(ROOT)})
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "launch_local.py"), "--processes", "2", "--devices-per-process", "2",
         "--restarts", "1", "--log-dir", str(run_dir / "logs"), "--", f"hydra.run.dir={run_dir}", "mesh=fsdp",
         "data.seq_len=64", "data.global_batch_size=8", "data.num_shards=4", "logger.wandb.mode=disabled",
         *HANG_RUN],
        capture_output=True, text=True, env={**env, SLOW_ONCE_ENV: str(tmp_path / "hung")}, timeout=600)
    logs = "\n".join(p.read_text() for p in sorted((run_dir / "logs").glob("*.log")))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:] + logs[-3000:]
    assert "restart 1 of 1" in result.stderr
    assert (run_dir / "hang_stacks_p1.txt").exists()
    assert "The last start ended in a hang: process 1 (" in result.stdout, result.stdout[-3000:]
    assert "hang: process 1" in logs and "exiting with code 75" in logs     # process 0 failed with it
    exits = [e for e in goodput.read_events(run_dir / goodput.EVENTS_FILE) if e["event"] == "exit"]
    assert [e["reason"] for e in exits] == ["hang", "clean"], exits
    by_step = {}
    for r in read_metrics(run_dir):
        if "loss" in r:
            by_step.setdefault(r["step"], []).append(r["loss"])
    twice = [s for s, losses in by_step.items() if len(losses) == 2]
    assert twice
    for s in twice:
        assert by_step[s][0] == by_step[s][1], (s, by_step[s])
    assert max(by_step) == 12


def test_jax_calls_a_host_dead_only_after_the_watchdogs_could_have_fired():
    # A frozen host must end the others through their watchdogs (exit 75, stacks, restart), not
    # through JAX's heartbeat timeout (abort, exit 134): the heartbeat waits longer.
    assert heartbeat_over(None) > hang_timeout(None, []) == MIN_TIMEOUT_S
    assert heartbeat_over(6) == 100                 # never below JAX's own default
    assert heartbeat_over(900) > 900

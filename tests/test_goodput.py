"""Goodput across restarts (model/runtime/goodput.py), the slowest host (model/runtime/meters.py) and the run
report (scripts/report.py).

    pytest tests/test_goodput.py -q                 # the ledger on hand-built events (fast)
    pytest tests/test_goodput.py -q -m slow         # real runs: SIGKILL + resume, 2 processes, Chromium

The real run is train.py as a command (its life counts from the process's start), killed with
SIGKILL mid-run and started again, with a slow evaluation and a planted slow input stage
(JAXPT_TEST_SLOW_H2D, data/pipeline.py).
"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from run_helpers import MICRO, read_metrics, without_device_count

from model.runtime import goodput
from model.runtime.meters import IntervalMeter
from tests import forked

ROOT = Path(__file__).resolve().parents[1]


def ev(event, t, **fields):
    return {"event": event, "t": t, **fields}


# Life 1: new run, killed after the row of step 9 (last save at 5). Life 2 resumes at 5, exits
# cleanly at step 10 (one step after its last row).
HAND_BUILT = [
    ev("start", 0.0), ev("distributed", 2.0), ev("listing", 3.0),
    ev("restore", 5.0, step=0, tier="init", seconds=1.0),
    ev("compile", 10.0, step=1),
    ev("interval", 20.0, step=5, interval_s=10.0, data_wait_s=2.0, stall_s=0.0),     # steps 2..5
    ev("save", 22.0, step=5, blocked_s=1.0),
    ev("eval", 25.0, step=5, seconds=3.0),
    ev("interval", 40.0, step=9, interval_s=17.0, data_wait_s=1.0, stall_s=4.0),     # steps 6..9
    ev("start", 50.0), ev("distributed", 52.0),
    ev("restore", 60.0, step=5, tier="latest", seconds=6.0),
    ev("compile", 70.0, step=6),
    ev("interval", 80.0, step=9, interval_s=10.0, data_wait_s=0.0, stall_s=0.0),     # steps 7..9
    ev("exit", 85.0, reason="clean", step=10, saved=10),
]


def test_ledger_on_hand_built_lives():
    b = goodput.breakdown(HAND_BUILT)
    s = b["seconds"]
    assert b["wall_s"] == 85.0 and b["restarts"] == 1
    assert s["startup"] == pytest.approx(10.0 + (20.0 - 6.0))      # a new run's init is start-up
    assert s["restore"] == pytest.approx(6.0)
    assert s["data_wait"] == pytest.approx(2.0)                      # the 1 s of steps 6..9 was lost
    assert s["checkpoint"] == pytest.approx(1.0) and s["eval"] == pytest.approx(3.0)
    assert s["stall"] == pytest.approx(0.0)
    # Steps 6..9 were trained again: all of their interval (productive 11 + wait 1 + stall 4) is lost.
    assert b["lost_steps"] == 4 and s["lost"] == pytest.approx(16.0)
    assert s["dead"] == pytest.approx(10.0)
    # Life 2: 10 s for steps 7..9, and step 10 after its last row at that pace; the rest closing.
    assert s["productive"] == pytest.approx(8.0 + 10.0 + 10.0 / 3)
    assert s["shutdown"] == pytest.approx(5.0 - 10.0 / 3)
    assert sum(s.values()) == pytest.approx(b["wall_s"], rel=1e-9)
    assert b["goodput"] == pytest.approx(s["productive"] / 85.0)
    assert [life["reason"] for life in b["lives"]] == ["killed", "clean"]
    assert [sum(life["parts"].values()) for life in b["lives"]] == pytest.approx([40.0 + 10.0, 35.0])


def test_a_beat_after_the_last_row_makes_a_killed_lifes_last_steps_lost_not_dead():
    # Life 1 logs a row at step 4 (1 s a step), saves at 5, and a beat sees step 7 done before
    # the kill; life 2 resumes at 5: steps 6..7 were trained twice (2 s lost, at the life's pace).
    events = [ev("start", 0.0), ev("restore", 1.0, step=0, tier="init", seconds=0.0), ev("compile", 2.0, step=1),
              ev("interval", 5.0, step=4, interval_s=3.0, data_wait_s=0.0, stall_s=0.0),    # steps 2..4
              ev("save", 6.0, step=5, blocked_s=0.0), ev("beat", 8.0, step=7),
              ev("start", 20.0), ev("restore", 21.0, step=5, tier="latest", seconds=1.0), ev("compile", 22.0, step=6),
              ev("exit", 23.0, reason="clean", step=6, saved=6)]
    b = goodput.breakdown(events)
    assert b["lost_steps"] == 2 and b["seconds"]["lost"] == pytest.approx(2.0)
    assert b["seconds"]["dead"] == pytest.approx(12.0)                  # from the beat to the next start
    assert sum(b["seconds"].values()) == pytest.approx(b["wall_s"], rel=1e-9)
    without = goodput.breakdown([e for e in events if e["event"] != "beat"])
    assert without["lost_steps"] == 0 and without["seconds"]["dead"] == pytest.approx(14.0)


def test_event_log_beats_at_most_every_beat_s_with_a_completed_step(tmp_path, monkeypatch):
    class Out:                       # a step's output: ready or still running on the device
        def __init__(self, ready):
            self.ready = ready

        def is_ready(self):
            return self.ready

    clock = [100.0]
    monkeypatch.setattr(goodput.time, "monotonic", lambda: clock[0])
    log = goodput.EventLog(from_process_start=False)
    log.open(tmp_path, enabled=True)
    log.beat(1, Out(True))                      # nothing seen before: no beat
    clock[0] += goodput.BEAT_S
    log.beat(2, Out(False))                     # step 1's output is ready: a beat for step 1
    clock[0] += 1.0
    log.beat(3, Out(True))                      # too soon after the last beat
    clock[0] += goodput.BEAT_S
    log.beat(4, Out(True))                      # step 3's output is ready: a beat for step 3
    clock[0] += goodput.BEAT_S
    log.beat(5, Out(True))                      # step 4 ready
    clock[0] += goodput.BEAT_S
    log.beat(6, Out(False)); log.beat(7, Out(True))    # noqa: E702 - step 5 ready at the first call
    got = [e["step"] for e in goodput.read_events(tmp_path / goodput.EVENTS_FILE) if e["event"] == "beat"]
    assert got == [1, 3, 4, 5]


def test_a_rollback_counts_the_steps_rolled_back_as_lost():
    # Rows at steps 3 and 5 (checkpoint at 3), a divergence found at step 7 rolls back to 3:
    # steps 4..5 of the row at 5 and 6..7 since it are lost, with the 2 s reload.
    events = [
        ev("start", 0.0), ev("restore", 1.0, step=0, tier="init", seconds=0.0), ev("compile", 2.0, step=1),
        ev("interval", 6.0, step=3, interval_s=4.0, data_wait_s=0.0, stall_s=0.0),      # steps 2..3
        ev("save", 6.5, step=3, blocked_s=0.5),
        ev("interval", 10.0, step=5, interval_s=4.0, data_wait_s=1.0, stall_s=0.0),     # steps 4..5
        ev("rollback", 16.0, step=3, from_step=7, seconds=2.0),
        ev("interval", 20.0, step=5, interval_s=4.0, data_wait_s=0.0, stall_s=0.0),     # steps 4..5 again
        ev("exit", 20.0, reason="clean", step=5, saved=3),
    ]
    b = goodput.breakdown(events)
    s = b["seconds"]
    assert b["lost_steps"] == 4
    assert s["lost"] == pytest.approx((4.0 - 0.5 - 1.0) + 1.0 + 6.0)    # the row at 5, all since it
    assert s["productive"] == pytest.approx(4.0 + 4.0)
    assert s["checkpoint"] == pytest.approx(0.5) and s["data_wait"] == pytest.approx(0.0)
    assert sum(s.values()) == pytest.approx(b["wall_s"], rel=1e-9)


def test_ledger_of_a_run_in_progress_counts_to_now_and_keeps_the_log_order():
    running = HAND_BUILT[:-1]
    b = goodput.breakdown(running, now=100.0)
    assert b["wall_s"] == 100.0 and b["lives"][-1]["reason"] == "running"
    assert sum(b["seconds"].values()) == pytest.approx(100.0)
    # A restarted process whose start time reads early (before the killed life's last row) opens
    # its life after that row: the killed life keeps its steps, so they count as lost.
    early = [dict(e, t=35.0) if i == 9 else e for i, e in enumerate(HAND_BUILT)]
    assert early[9]["event"] == "start"
    b = goodput.breakdown(early)
    assert b["lost_steps"] == 4 and b["seconds"]["lost"] == pytest.approx(16.0)
    assert b["seconds"]["dead"] == 0.0 and sum(b["seconds"].values()) == pytest.approx(b["wall_s"])
    # A life that died during start-up is all start-up (it never compiled).
    b = goodput.breakdown(HAND_BUILT[:3] + [ev("start", 30.0), ev("compile", 40.0, step=1)])
    assert b["lives"][0]["parts"]["startup"] == 3.0 and b["seconds"]["dead"] == 27.0
    m = goodput.metrics(b)
    assert set(m) >= {f"goodput/{k}_s" for k in goodput.CAUSES} | {"goodput/goodput", "goodput/productive_s"}
    assert len(goodput.summary(b).splitlines()) == 3


def test_event_log_buffers_until_open_appends_and_skips_a_cut_line(tmp_path):
    (tmp_path / goodput.EVENTS_FILE).write_text(json.dumps(ev("start", 1.0)) + "\n" + '{"event": "inter')
    log = goodput.EventLog(from_process_start=False)
    log.add("distributed")
    log.open(tmp_path, enabled=True)
    log.add("restore", step=0, tier="init", seconds=0.0)
    log.add("compile", step=1)
    row = log.row({"step": 2, "interval_s": 0.5, "data_wait_s": 0.1, "stall_s": 0.2, "eval_s": 0.3})
    assert row["goodput/restarts"] == 1 and row["goodput/stall_s"] == pytest.approx(0.2)
    log.exit("hang", step=2)
    got = goodput.read_events(tmp_path / goodput.EVENTS_FILE)
    assert [e["event"] for e in got] == ["start", "start", "distributed", "restore", "compile", "interval",
                                         "stall", "eval", "exit"]
    assert got[-1]["reason"] == "hang" and got[-1]["step"] == 2
    other = goodput.EventLog(from_process_start=False)     # a process other than 0 writes nothing
    other.open(tmp_path / "nowhere", enabled=False)
    other.add("compile", step=1)
    assert not (tmp_path / "nowhere").exists()


def test_meter_counts_a_stall_over_three_medians():
    meter = IntervalMeter(schedule=None, tokens_per_step=1, flops_per_step=1.0, peak_total=None,
                          device_count=1, stop_on_nan=False)
    assert [meter._stall(1.0, 10) for _ in range(4)] == [0.0] * 4
    assert meter._stall(2.9, 10) == 0.0                      # under 3x the median step (0.1 s)
    assert meter._stall(5.0, 10) == pytest.approx(5.0 - 1.0)  # 0.5 s a step: 0.4 s over the median


def test_a_start_that_fails_after_the_log_opened_records_its_exit(tmp_path):
    """A failure between the log's opening and the first step (here a task file that is missing,
    found after the listing) still ends its life with an exit event: no life is left looking killed."""
    from run_helpers import make_cfg

    import train as train_mod

    cfg = make_cfg(tmp_path / "run", *RUN, "eval.tasks=[{name: gone, path: /nonexistent/task.jsonl}]")
    with pytest.raises(train_mod.ConfigError, match="eval.tasks.gone..path='/nonexistent/task.jsonl': no such file"):
        train_mod.train(cfg)
    got = goodput.read_events(tmp_path / "run" / goodput.EVENTS_FILE)
    assert [e["event"] for e in got][:1] == ["start"] and got[-1]["event"] == "exit", got
    assert got[-1]["reason"] == "crash" and got[-1]["error"] == "ConfigError" and got[-1]["step"] is None


# ====================================================================== real runs
RUN = ["model=tiny", *MICRO, "data.seq_len=64", "data.global_batch_size=8", "data.num_shards=4", "data.num_workers=0",
       "data.prefetch=1", "train.steps=14", "train.log_every=1", "checkpoint.every=6", "train.eval_every=7",
       "train.eval_batches=8",
       "optimizer.warmup_steps=2", "logger.wandb.mode=disabled", "logger.progress_bar=false"]
PLANTED_S = 2.0     # seconds a batch slower in the h2d stage: well over the step, even on a loaded machine


def cli(run_dir):
    return [sys.executable, str(ROOT / "train.py"), f"hydra.run.dir={run_dir}", *RUN]


@pytest.mark.slow
def test_sigkill_restart_eval_and_slow_stage_add_up_and_report_renders(tmp_path):
    run_dir = tmp_path / "run"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT), goodput_env(): str(PLANTED_S)}
    first = forked.Popen(cli(run_dir), env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 400
    while time.time() < deadline and first.poll() is None:
        if (run_dir / "metrics.jsonl").exists() and any(r.get("step", 0) >= 9 and "loss" in r
                                                        for r in read_metrics(run_dir)):
            break
        time.sleep(0.05)
    assert first.poll() is None, first.communicate()[0][-3000:]
    first.send_signal(signal.SIGKILL)
    t_kill = time.time()
    first.wait()
    second = forked.run(cli(run_dir), env=env, cwd=tmp_path, capture_output=True, text=True, timeout=500)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "Goodput" in second.stdout and "Lost to restarts and rollbacks" in second.stdout

    events = goodput.read_events(run_dir / goodput.EVENTS_FILE)
    kinds = [e["event"] for e in events]
    assert kinds.count("start") == 2 and kinds.count("exit") == 1 and events[-1]["reason"] == "clean"
    assert kinds.index("exit") > kinds.index("start", 1)            # the killed life left no exit
    b = goodput.breakdown(events)
    assert [life["reason"] for life in b["lives"]] == ["killed", "clean"]
    assert abs(sum(b["seconds"].values()) - b["wall_s"]) <= 0.01 * b["wall_s"]
    # The first start counts from its process's creation (imports included), before any event.
    assert events[0]["t"] < events[1]["t"]

    # Lost work: the first life's steps after the checkpoint the second one resumed from, timed
    # independently: from the end of that save to the kill, less the evaluations in between.
    resumed = next(e for e in events if e["event"] == "restore" and e["tier"] != "init")
    save = next(e for e in events if e["event"] == "save" and e["step"] == resumed["step"])
    evals = sum(e["seconds"] for e in events if e["event"] == "eval" and save["t"] < e["t"] < t_kill)
    truth = t_kill - save["t"] - evals
    rows = [r for r in read_metrics(run_dir) if "interval_s" in r]
    restart = next(i for i in range(1, len(rows)) if rows[i]["step"] <= rows[i - 1]["step"])
    first_rows, second_rows = rows[:restart], rows[restart:]
    one_step = max(r["interval_s"] - r["checkpoint_save_s"] for r in first_rows)
    assert b["lost_steps"] >= 2
    assert abs(b["seconds"]["lost"] - truth) <= one_step + 0.5, (b["seconds"], truth, one_step)

    # The slow evaluation and the planted input stage land where they belong.
    eval_events = [e for e in events if e["event"] == "eval"]
    assert len(eval_events) == sum(1 for r in read_metrics(run_dir) if "eval_loss" in r) >= 3   # 7, 7 again, 14
    assert b["seconds"]["eval"] == pytest.approx(sum(e["seconds"] for e in eval_events), rel=1e-6)
    # Once the batches made ahead during a pause (compile, save, eval) are used up, every step
    # waits for its slowed batch: the ledger's data wait is the rows' (of the steps not lost), and
    # holds at least a few planted batches' worth.
    kept = [r for r in first_rows if r["step"] <= resumed["step"]] + second_rows
    assert b["seconds"]["data_wait"] == pytest.approx(sum(r["data_wait_s"] for r in kept), rel=0.01)
    assert b["seconds"]["data_wait"] > 1.5 * PLANTED_S, b["seconds"]
    bounds = [r.get("input/bound") for r in rows]
    assert bounds.count("h2d") > len(bounds) / 2, bounds
    # goodput/* in every metrics row: the last one (step 14) is the whole run but its shutdown.
    last = read_metrics(run_dir)[-1]
    assert last["step"] == 14 and last["goodput/restarts"] == 1
    assert 0.9 * b["wall_s"] < last["goodput/wall_s"] <= b["wall_s"]
    assert last["goodput/lost_s"] == pytest.approx(b["seconds"]["lost"], rel=1e-6)

    check_report_in_chromium(run_dir, tmp_path)


def test_report_draws_each_start_as_its_own_line():
    """A killed life's last rows and the next start's first rows (it resumed behind them) are two
    lines in the report's plots, as is a rollback inside one start; one uninterrupted start is one."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from run_helpers import load_script

    report = load_script("report")
    life = lambda r, steps, loss0: [{"step": s, "loss": loss0 - s / 100, "tokens_per_s": 1000.0 + s,    # noqa: E731
                                     "data_wait_frac": 0.01, "goodput/restarts": r} for s in steps]
    killed_then_resumed = life(0, [10, 20, 30], 8.0) + life(1, [22, 24, 30, 40], 7.0)
    rolled_back = life(0, [10, 20, 30], 8.0) + life(0, [24, 30], 6.0)        # a rollback to 20 inside one start
    eval_only = {"step": 25, "eval_loss": 7.5, "goodput/restarts": 0}     # eval due where no row is
    assert [[r["step"] for r in p] for p in report.starts(killed_then_resumed)] == [[10, 20, 30], [22, 24, 30, 40]]
    assert [[r["step"] for r in p] for p in report.starts(rolled_back)] == [[10, 20, 30], [24, 30]]
    # An evaluation-only row between two meter rows stays in its start.
    assert len(report.starts(life(0, [10, 20], 8.0) + [eval_only] + life(0, [30], 8.0))) == 1
    for rows, lines in ((killed_then_resumed, 2), (rolled_back, 2), (life(0, [10, 20, 30], 8.0), 1)):
        fig, axes = plt.subplots(1, 3)
        report.plot_loss(axes[0], rows, None)
        report.plot_throughput(axes[1], rows, None)
        report.plot_data_wait(axes[2], rows, None)
        for ax in axes:
            assert len(ax.get_lines()) == lines, (ax.get_title(), len(ax.get_lines()))
            xs = [list(line.get_xdata()) for line in ax.get_lines()]
            assert all(x == sorted(x) for x in xs), xs           # no line runs backwards
        assert [t.get_text() for t in axes[0].get_legend().get_texts()] == ["train loss"]
        plt.close(fig)


def goodput_env():
    from data.pipeline import SLOW_STAGE_ENV

    return SLOW_STAGE_ENV


def check_report_in_chromium(run_dir, tmp_path):
    out, png = tmp_path / "report.html", tmp_path / "quick.png"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "report.py"), str(run_dir), "--out", str(out),
                        "--png", str(png)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-2000:]
    assert png.stat().st_size > 20_000
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if browser is None:
        pytest.skip("no headless Chromium here (CI installs it: .ci/run)")
    flags = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--enable-logging=stderr",
             "--window-size=1400,2400", f"--user-data-dir={tmp_path / 'chromium'}"]
    # Four plots, and the held-out loss by position when the evaluations report it (eval_loss_pos/*).
    n = 4 + any(k.startswith("eval_loss_pos/") for r in read_metrics(run_dir) for k in r)
    assert out.read_text().count('<img class="plot"') == n
    # The page's own script counts the plots the browser decoded (complete, naturalWidth > 0).
    dom = subprocess.run(flags + ["--dump-dom", out.as_uri()], capture_output=True, text=True, timeout=120)
    body = re.search(r"<body[^>]*>", dom.stdout)
    assert body is not None and f'data-plots="{n}/{n}"' in body[0], (body[0][:300] if body else dom.stdout[-500:],
                                                                 dom.stderr[-2000:])
    assert "Uncaught" not in dom.stderr, dom.stderr[-2000:]
    rects = [tuple(map(int, r.split(","))) for r in re.search(r'data-rects="([^"]*)"', dom.stdout)[1].split(";")]
    shot = tmp_path / "shot.png"
    subprocess.run(flags + [f"--screenshot={shot}", out.as_uri()], capture_output=True, timeout=120)
    from PIL import Image

    img = Image.open(shot).convert("L")
    assert img.size == (1400, 2400)
    # Every plot drew: each one lies in the screenshot, is of a plot's size and holds ink (axes,
    # lines, text) over at least 2% of its area, where a blank or broken image holds none.
    assert len(rects) == n
    for x, y, w, h in rects:
        assert w > 300 and h > 150 and x + w <= img.size[0] and y + h <= img.size[1], rects
        cell = img.crop((x + 2, y + 2, x + w - 2, y + h - 2))
        dark = sum(1 for p in cell.getdata() if p < 200)
        assert dark > 0.02 * cell.size[0] * cell.size[1], ((x, y, w, h), dark)
    shutil.copy(shot, run_dir / "report_screenshot.png")


@pytest.mark.slow
def test_two_processes_name_the_slow_host(tmp_path):
    from data.pipeline import SLOW_STAGE_ENV

    run_dir = tmp_path / "multi"
    env = without_device_count()
    env.update({SLOW_STAGE_ENV: f"{PLANTED_S}@1", "PYTHONPATH": str(ROOT)})     # process 1's input only
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "launch_local.py"), "--processes", "2", "--devices-per-process", "2",
         "--log-dir", str(run_dir / "logs"), "--", f"hydra.run.dir={run_dir}", "mesh=fsdp", "data.seq_len=64",
         "data.global_batch_size=8", "data.num_shards=4", "data.num_workers=0", "data.prefetch=1", "train.steps=10",
         "train.log_every=1",
         "train.eval_every=0", "checkpoint.every=100", "logger.wandb.mode=disabled", "logger.progress_bar=false"],
        capture_output=True, text=True, env=env, timeout=600)
    logs = "\n".join(p.read_text() for p in sorted((run_dir / "logs").glob("*.log")))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:] + logs[-3000:]
    rows = [r for r in read_metrics(run_dir) if "interval_s" in r]
    # Once the batches made during the compile are used up, process 1 waits for every batch; the
    # other host waits in the step's collectives, not for data.
    named = [r["host/slowest_data_wait"] for r in rows if r["host/max_data_wait_s"] > 0.25 * PLANTED_S]
    assert len(named) >= 3 and set(named) == {1}, [(r["host/slowest_data_wait"], r["host/max_data_wait_s"])
                                                   for r in rows]
    assert all(r["host/max_data_wait_s"] >= r["host/min_data_wait_s"] for r in rows)
    # One writer: process 0's single start and exit.
    kinds = [e["event"] for e in goodput.read_events(run_dir / goodput.EVENTS_FILE)]
    assert kinds.count("start") == 1 and kinds.count("exit") == 1
    # The report's table of slowest hosts puts process 1 first.
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "report.py"), str(run_dir)], capture_output=True,
                       text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-2000:]
    page = (run_dir / "report.html").read_text()
    hosts = page[page.index("slowest host per interval"):]
    assert hosts.index("process 1") < hosts.index("</table>"), hosts[:600]
    assert "process 0" not in hosts[:hosts.index("</table>")] or hosts.index("process 1") < hosts.index("process 0")

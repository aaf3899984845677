"""Where the run's hours went: the event log of every start of a run (`<run_dir>/events.jsonl`)
and the goodput/badput ledger computed from it, across all restarts.

One JSON object per line, one clock (wall time, time.time(), so lives of different processes and
hosts line up), written by process 0 only, appended by every start:
  start        the process's start (its creation time: imports count as start-up)
  distributed  jax.distributed is up          listing   the run's file list is known
  restore      step, tier ("latest", "resume_from", "init_from", "init"), seconds
  compile      the first step has run (compile included)
  interval     one log row: step, interval_s, data_wait_s (slowest host), stall_s
  eval         step, seconds              save    step, blocked_s
  rollback     step (rolled back to), from_step, seconds (train.on_divergence=rollback)
  stall        step, seconds (time over 3x the median step, see model/runtime/meters.py)
  beat         step: the last step known completed, at most every BEAT_S seconds between
               log rows (a killed life's steps after its last row count as lost, not dead)
  exit         reason (clean | preempted | crash | hang), error (the exception's type),
               step (last completed), saved (last saved)
A process killed by SIGKILL (or a lost VM) writes no exit: its life ends at its last event (a
beat at most BEAT_S before the kill), and the time to the next start is dead time.

The ledger splits the wall time from the first start to now into productive step time and
badput by cause (CAUSES); the parts add up to the wall time by construction (each life's span
is cut into pieces, and the gaps between lives are dead time). Events are rare (phases, log
rows, saves, a beat every few seconds), so the log costs nothing per step: BENCHMARKS.md "Goodput".
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

EVENTS_FILE = "events.jsonl"
# Badput causes, in the order reports stack them.
CAUSES = ("startup", "restore", "data_wait", "checkpoint", "eval", "stall", "lost", "dead", "shutdown")
BEAT_S = 5.0            # seconds between beats: how much of a killed life's last work can go unseen


def process_start_time() -> float:
    """When this process was created (wall clock): the imports before train() count as start-up.

    Read as the process's age on the boot clock (/proc/self/stat, in clock ticks) taken from now:
    psutil's create_time() adds that age to a boot time rounded to whole seconds, so it can place a
    restarted process up to a second early, before the last events of the life it follows."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])      # field 22, starttime
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - max(0.0, age)
    except (OSError, ValueError, IndexError, AttributeError):
        pass
    try:
        import psutil

        return float(psutil.Process(os.getpid()).create_time())
    except Exception:  # noqa: BLE001 - psutil is a dependency; a sandbox may still hide /proc
        return time.time()


def read_events(path: Path) -> list[dict]:
    """The events of a log; a line cut short by a kill (the last one) is skipped."""
    out = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    except FileNotFoundError:
        pass
    return out


def _last_byte(path: Path) -> bytes:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1)


# ====================================================================== the ledger (pure)
class Life:
    """One process life's events, folded as they come (O(1) per event)."""

    def __init__(self, start: dict):
        self.start = float(start["t"])
        self.last_t = self.start
        self.ready = None           # compile done: the loop starts
        self.restore_s = 0.0
        self.start_step = 0
        self.exit = None
        self.last_step = None       # the last step known completed (interval, save or exit)
        self.saved = None
        self.mark = None            # the end of the last interval
        self.mark_step = None
        self.sums = dict.fromkeys(("productive", "data_wait", "stall", "eval", "checkpoint", "lost"), 0.0)
        self.pending = {"eval": 0.0, "checkpoint": 0.0}     # since the last interval
        self.intervals = []         # (first step, last step, productive, data_wait, stall) per interval
        self.steps = 0              # steps in the intervals
        self._lost = {}             # lost(resumed_at), computed once for a finished life
        self.rolled_back = 0        # steps trained and then rolled back (train.on_divergence)

    def add(self, e: dict) -> None:
        kind, t = e.get("event"), float(e.get("t", self.last_t))
        self.last_t = max(self.last_t, t)
        if kind == "restore":
            # A new run's initialisation is start-up; reading a checkpoint is restore.
            self.restore_s = float(e.get("seconds", 0.0)) if e.get("tier") != "init" else 0.0
            self.start_step = int(e.get("step", 0))
            self.last_step = self.start_step
        elif kind == "compile":
            self.ready = self.mark = t
            self.mark_step = int(e.get("step", self.start_step + 1))
            self.last_step = self.mark_step
        elif kind == "eval":
            self.pending["eval"] += float(e.get("seconds", 0.0))
        elif kind == "save":
            self.pending["checkpoint"] += float(e.get("blocked_s", 0.0))
            self.saved = int(e["step"])
            self.last_step = max(self.last_step or 0, self.saved)
        elif kind == "interval" and self.mark is not None:
            span = t - self.mark
            wait, stall = float(e.get("data_wait_s", 0.0)), float(e.get("stall_s", 0.0))
            productive = span - wait - stall - self.pending["eval"] - self.pending["checkpoint"]
            for k, v in (("productive", productive), ("data_wait", wait), ("stall", stall),
                         ("eval", self.pending["eval"]), ("checkpoint", self.pending["checkpoint"])):
                self.sums[k] += v
            step = int(e["step"])
            self.intervals.append((self.mark_step + 1, step, productive, wait, stall))
            self.steps += step - self.mark_step
            self.pending = {"eval": 0.0, "checkpoint": 0.0}
            self.mark, self.mark_step, self.last_step = t, step, step
        elif kind == "rollback" and self.mark is not None:
            # Everything since the last row (the steps rolled back, the reload) is lost, and so
            # are the logged intervals past the step rolled back to.
            target = int(e["step"])
            for k in ("eval", "checkpoint"):
                self.sums[k] += self.pending[k]
            self.sums["lost"] += t - self.mark - self.pending["eval"] - self.pending["checkpoint"]
            self.pending = {"eval": 0.0, "checkpoint": 0.0}
            self.rolled_back += int(e.get("from_step", self.mark_step)) - self.mark_step
            kept = []
            for first, last, productive, wait, stall in self.intervals:
                n, gone = last - first + 1, max(0, last - max(first - 1, target))
                if gone:
                    for k, v in (("productive", productive), ("data_wait", wait), ("stall", stall)):
                        self.sums[k] -= v * gone / n
                        self.sums["lost"] += v * gone / n
                    self.steps -= gone
                    self.rolled_back += gone
                if gone < n:
                    keep = (n - gone) / n
                    kept.append((first, last - gone, productive * keep, wait * keep, stall * keep))
            self.intervals = kept
            self.mark, self.mark_step, self.last_step = t, target, target
        elif kind == "beat" and self.mark is not None:
            self.last_step = max(self.last_step or 0, int(e["step"]))
        elif kind == "exit":
            self.exit = e
            if e.get("step") is not None:
                self.last_step = int(e["step"])
            if e.get("saved") is not None:
                self.saved = int(e["saved"])

    def parts(self, end: float) -> dict:
        """This life's seconds by part, from its start to `end` (they add up to end - start)."""
        ready = self.ready if self.ready is not None else end
        out = dict.fromkeys(("productive",) + CAUSES, 0.0)
        out["restore"] = min(self.restore_s, max(0.0, ready - self.start))
        out["startup"] = max(0.0, ready - self.start) - out["restore"]
        if self.ready is None:
            return out
        for k, v in self.sums.items():
            out[k] += v
        # After the last log row: saves and evals there, the steps trained since (at this life's
        # productive pace), and the rest (the final checkpoint wait, closing) is shutdown.
        tail = max(0.0, end - self.mark)
        for k in ("eval", "checkpoint"):
            take = min(tail, self.pending[k])
            out[k] += take
            tail -= take
        steps = self.steps
        extra = max(0, (self.last_step or 0) - self.mark_step)
        if steps and extra:
            take = min(tail, extra * self.sums["productive"] / steps)
            out["productive"] += take
            tail -= take
        # A hang: from the last step to the watchdog's exit nothing trained; a stall, not a shutdown.
        hung = self.exit is not None and self.exit.get("reason") == "hang"
        out["stall" if hung else "shutdown"] += tail
        return out

    def lost(self, resumed_at: int) -> tuple[int, dict]:
        """Steps after `resumed_at` that this life trained (and the next one trains again), and
        their seconds by part (taken pro rata from the intervals holding them)."""
        if resumed_at in self._lost:
            return self._lost[resumed_at]
        seconds = {"productive": 0.0, "data_wait": 0.0, "stall": 0.0}
        steps = 0
        for first, last, productive, wait, stall in self.intervals:
            n = last - first + 1
            overlap = max(0, last - max(first - 1, resumed_at))
            if n > 0 and overlap:
                steps += overlap
                for k, v in (("productive", productive), ("data_wait", wait), ("stall", stall)):
                    seconds[k] += v * overlap / n
        # Steps after the last row that a beat (or the exit) saw, at this life's productive pace.
        tail = max(0, (self.last_step or 0) - max(self.mark_step or 0, resumed_at))
        if tail and self.steps:
            steps += tail
            seconds["productive"] += tail * self.sums["productive"] / self.steps
        self._lost[resumed_at] = steps, seconds
        return steps, seconds


def split_lives(events: list[dict]) -> list[Life]:
    """The lives of a log in its order (each life's process appends its own events in turn; a
    sort by time could fold the last events of a killed life into the next one when its start
    time is a little early). A start is never before the end of the life it follows."""
    lives = []
    for e in events:
        fold(lives, e)
    return lives


def fold(lives: list[Life], e: dict) -> None:
    """Adds one event to the lives so far (a start opens the next life)."""
    if e.get("event") == "start":
        if lives:
            e = {**e, "t": max(float(e["t"]), lives[-1].last_t)}
        lives.append(Life(e))
    elif lives:
        lives[-1].add(e)


def combine(lives: list[Life], now: float | None = None) -> dict:
    """The run's breakdown from its lives: seconds by part (productive + CAUSES), the wall time,
    goodput, the lost steps, and one dict per life (for the report's bar per restart)."""
    total = dict.fromkeys(("productive",) + CAUSES, 0.0)
    per_life, lost_steps = [], 0
    for i, life in enumerate(lives):
        lost_steps += life.rolled_back
        last = i == len(lives) - 1
        end = life.exit["t"] if life.exit else life.last_t
        if last and now is not None and life.exit is None:
            end = max(end, now)
        parts = life.parts(float(end))
        if not last:
            nxt = lives[i + 1]
            steps, lost = life.lost(nxt.start_step)
            lost_steps += steps
            for k, v in lost.items():
                v = min(v, parts[k])        # the tail's pace is an estimate: never more than was counted
                parts[k] -= v
                parts["lost"] += v
            parts["dead"] = max(0.0, nxt.start - float(end))
        reason = (life.exit or {}).get("reason") or ("running" if last and life.exit is None else "killed")
        per_life.append({"start": life.start, "end": float(end), "reason": reason,
                         "start_step": life.start_step, "last_step": life.last_step, "saved": life.saved,
                         "parts": parts})
        for k, v in parts.items():
            total[k] += v
    wall = (per_life[-1]["end"] - per_life[0]["start"]) if per_life else 0.0
    return {"wall_s": wall, "seconds": total, "goodput": total["productive"] / wall if wall > 0 else 0.0,
            "lost_steps": lost_steps, "restarts": max(0, len(lives) - 1), "lives": per_life}


def breakdown(events: list[dict], now: float | None = None) -> dict:
    """Goodput and badput of a run from its events (a pure function; `now`: the end of a run still
    in progress, default the last event)."""
    return combine(split_lives(events), now)


def metrics(b: dict) -> dict:
    """The flat `goodput/*` keys of a breakdown (metrics.jsonl, wandb)."""
    row = {"goodput/goodput": b["goodput"], "goodput/wall_s": b["wall_s"],
           "goodput/restarts": b["restarts"], "goodput/lost_steps": b["lost_steps"]}
    for k, v in b["seconds"].items():
        row[f"goodput/{k}_s"] = v
    return row


def summary(b: dict) -> str:
    """Three lines for the end of a run."""
    s, wall = b["seconds"], b["wall_s"] or 1.0
    top = sorted(CAUSES, key=lambda k: -s[k])[:4]
    return (f"Goodput {b['goodput']:.1%}: {s['productive']:.0f} s of {b['wall_s']:.0f} s trained the model "
            f"(over {b['restarts'] + 1} starts, {b['restarts']} restarts)\n"
            "Badput: " + ", ".join(f"{k} {s[k]:.0f} s ({s[k] / wall:.1%})" for k in top) + "\n"
            f"Lost to restarts and rollbacks: {b['lost_steps']} steps trained twice ({s['lost']:.0f} s); "
            f"dead time between lives {s['dead']:.0f} s")


# ====================================================================== the log (process 0)
class EventLog:
    """The run's event log. Created first thing in train() (events before the run directory is
    known are kept and written by open()); on other processes than 0 it only forwards rows."""

    def __init__(self, *, from_process_start: bool = True):
        self._file = None
        self._buffer = []
        self._lives = []
        self.enabled = True
        self._beat_candidate = None     # (step, an output of it) from the last beat() call
        self._beat_t = 0.0
        self.step = None                # the loop's step (at(), beat(), a rollback): the exit event names it
        t0 = process_start_time() if from_process_start else time.time()
        self.add("start", t=t0, pid=os.getpid())

    def open(self, run_dir: Path, *, enabled: bool) -> None:
        """Appends to `<run_dir>/events.jsonl` (process 0); earlier lives are read back for the ledger."""
        self.enabled = enabled
        buffered, self._buffer = self._buffer, []
        if not enabled:
            return
        path = Path(run_dir) / EVENTS_FILE
        self._lives = split_lives(read_events(path))
        # One write per event, line-buffered: a SIGKILL loses at most the event being written.
        self._file = open(path, "a", buffering=1)
        if self._file.tell() and _last_byte(path) != b"\n":
            self._file.write("\n")         # a line cut short by a kill stays a line of its own
        for e in buffered:
            self._write(e)

    def _write(self, e: dict) -> None:
        fold(self._lives, e)
        self._file.write(json.dumps(e) + "\n")

    def add(self, event: str, *, t: float | None = None, **fields) -> None:
        if event == "rollback":
            self.step = fields["step"]
        if not self.enabled:
            return
        e = {"event": event, "t": time.time() if t is None else t, **fields}
        if self._file is None:
            self._buffer.append(e)
        else:
            self._write(e)

    def at(self, step: int) -> None:
        """The loop starts at `step`: an exit from here on names it (None before)."""
        self.step = step

    def beat(self, step: int, done) -> None:
        """Called every step with its step number and one of its outputs (a jax.Array): at most
        every BEAT_S seconds, a beat naming the newest step seen completed. A step's output is only
        asked whether it is ready (no wait, no transfer); the step before the last that was asked
        counts when it is."""
        self.step = step
        if self._file is None:
            return
        now = time.monotonic()
        seen, self._beat_candidate = self._beat_candidate, (step, done)
        if seen is None or now - self._beat_t < BEAT_S:
            return
        ready = getattr(seen[1], "is_ready", None)
        if ready is None or ready():
            self._beat_t = now
            self.add("beat", step=seen[0])

    def breakdown(self) -> dict:
        return combine(self._lives, time.time())

    def row(self, row: dict) -> dict:
        """A metrics row (model/runtime/meters.py): its interval, stall and evaluation as events; returns
        the row with the run's goodput/* so far."""
        if not self.enabled:
            return row
        now = time.time()
        eval_s = row.get("eval_s") or 0.0
        if "interval_s" in row:
            # The row was cut before the evaluation that follows it.
            self.add("interval", t=now - eval_s, step=row["step"], interval_s=row["interval_s"],
                     data_wait_s=row.get("data_wait_s", 0.0), stall_s=row.get("stall_s", 0.0))
            if row.get("stall_s"):
                self.add("stall", t=now - eval_s, step=row["step"], seconds=row["stall_s"])
        if "eval_s" in row:
            self.add("eval", t=now, step=row["step"], seconds=eval_s)
        return {**row, **metrics(self.breakdown())}

    def on_exit(self, preempted):
        """An ExitStack.push callback: the exit event (clean, preempted or crash with the
        exception's type) at the loop's step (`self.step`) and the three-line summary;
        `preempted.fired` tells a preemption. (The metrics rows carry goodput/* up to the last
        row; the exit's own figures are in the summary and the event log, so metrics.jsonl keeps
        one row per logged step.)"""
        def hook(exc_type, exc, tb):
            reason = (getattr(exc_type, "exit_reason", "crash") if exc_type
                      else ("preempted" if preempted.fired else "clean"))
            self.exit(reason, step=self.step, error=exc_type.__name__ if exc_type else None)
            return False
        return hook

    def exit(self, reason: str, *, step: int | None, error: str | None = None) -> None:
        """reason: clean | preempted | crash | hang (a hang watchdog calls this itself)."""
        if not self.enabled or self._file is None:
            return
        saved = self._lives[-1].saved if self._lives else None
        self.add("exit", reason=reason, step=step, saved=saved, **({"error": error} if error else {}))
        print(summary(self.breakdown()), flush=True)
        self._file.close()
        self._file = None
        self.enabled = False

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

"""The hang watchdog: a hung host (a collective that never returns, a stuck read on a bucket, a
frozen VM) otherwise holds the whole pod idle until someone notices.

Every process runs one: when no training step completes within the timeout, it writes the Python
stacks of all its threads to `<run_dir>/hang_stacks_p<i>.txt`, a small report to
`<checkpoint.dir>/hang_reports/p<i>.json` (the one directory every host shares), the run's exit
event (reason "hang"), and exits with EXIT_HANG. `scripts/tpu.py run --restarts N` and
`scripts/launch_local.py --restarts N` start the run again on that code; it resumes from the
newest checkpoint that restores, and its first lines name the host that stopped first
(`announce_last_hang`).

The timeout (`train.hang_timeout_s`, null = automatic) is max(MIN_TIMEOUT_S, STEP_FACTOR x the
median step time of the log intervals so far). It is armed from the first completed step (so
never during restore or compile) and paused around evaluation, synchronous saves and a switch
of the input worker count, whose length has nothing to do with a step's. An asynchronous save
stays under it: it blocks briefly, in barriers with the other hosts, where a frozen peer hangs
it like a step.
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
import traceback
from pathlib import Path

from etils import epath

# EX_TEMPFAIL from sysexits.h: "try again later". The launchers restart on it.
EXIT_HANG = 75
MIN_TIMEOUT_S = 600.0
STEP_FACTOR = 20.0
REPORTS_DIR = "hang_reports"


class PeerHung(RuntimeError):
    """This process failed because another one hung and left (its collectives broke): the run
    exits with EXIT_HANG on every host alike, so the launchers restart all of them."""
    exit_reason = "hang"       # the run's exit event (model/runtime/goodput.py EventLog.on_exit)


def hang_timeout(fixed_s: float | None, step_times: list[float]) -> float:
    """The timeout in seconds: `fixed_s` when set, else max(10 min, 20 x the median step)."""
    if fixed_s is not None:
        return float(fixed_s)
    if not step_times:
        return MIN_TIMEOUT_S
    median = sorted(step_times)[len(step_times) // 2]
    return max(MIN_TIMEOUT_S, STEP_FACTOR * median)


def heartbeat_over(fixed_s: float | None) -> int:
    """jax.distributed's heartbeat timeout for a run: twice the longest the watchdog can wait
    (its fixed timeout, else MIN_TIMEOUT_S; the automatic one grows past that only with slow
    steps) and at least JAX's 100 s, so the hosts' watchdogs end a hang before JAX calls a
    frozen host dead and aborts the others without stacks or a restart."""
    return int(max(100.0, 2 * hang_timeout(fixed_s, []) + 60))


def poll_interval(timeout_s: float) -> float:
    return min(5.0, max(0.05, timeout_s / 20))


def thread_stacks() -> str:
    """The Python stack of every thread of this process, named, innermost frame last."""
    names = {t.ident: t.name for t in threading.enumerate()}
    out = []
    for ident, frame in sys._current_frames().items():
        out.append(f"--- thread {names.get(ident, '?')} (ident {ident})\n")
        out.extend(traceback.format_stack(frame))
    return "".join(out)


class Watchdog:
    """One per process. The loop calls beat(step) after each step and step_time(seconds) with
    each log interval's step time; `with paused():` around work that is not a step."""

    HISTORY = 50

    def __init__(self, timeout_s: float | None, *, run_dir: Path, reports_dir: Path, process_index: int,
                 on_hang=None, process_count: int = 1):
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"train.hang_timeout_s={timeout_s} must be positive (or null: automatic)")
        self.fixed_s = timeout_s
        # The reports live beside the checkpoints, which may be on a bucket (gs://): epath reads both.
        self.run_dir, self.reports_dir = Path(run_dir), epath.Path(reports_dir)
        self.process_index, self.process_count = process_index, process_count
        self.slice = _this_slice()        # named in the report: a multislice job loses whole slices
        self.on_hang = on_hang            # on_hang(last_step): the run's exit event
        self._lock = threading.Lock()
        self._last = None                 # monotonic time of the last beat; None: not armed
        self._last_wall = None
        self._step = None
        self._paused = 0
        self._step_times = []
        self._stop = threading.Event()
        self._thread = None
        self._started = time.time()
        self._firing = threading.Event()    # set when this watchdog fires: its exit wins

    def timeout_s(self) -> float:
        with self._lock:
            return hang_timeout(self.fixed_s, self._step_times)

    def beat(self, step: int) -> None:
        """A step completed (its dispatch returned): arms the watchdog on the first call."""
        now = time.monotonic()
        with self._lock:
            self._step, self._last, self._last_wall = step, now, time.time()
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="hang-watchdog", daemon=True)
            self._thread.start()

    def step_time(self, seconds: float) -> None:
        if seconds and seconds > 0:
            with self._lock:
                self._step_times.append(float(seconds))
                del self._step_times[:-self.HISTORY]

    @contextlib.contextmanager
    def paused(self):
        with self._lock:
            self._paused += 1
        try:
            yield
        finally:
            with self._lock:
                self._paused -= 1
                if self._last is not None:
                    self._last = time.monotonic()     # the pause is not a step's time

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _watch(self) -> None:
        while True:
            timeout = self.timeout_s()
            if self._stop.wait(poll_interval(timeout)):
                return
            with self._lock:
                idle = time.monotonic() - self._last if self._last is not None and not self._paused else 0.0
            if idle > timeout:
                self._fire(idle, timeout)

    def peer_hung(self) -> dict | None:
        """Another process's hang report written during this process's life (None: none)."""
        for f in self.reports_dir.glob("p*.json"):
            try:
                r = json.loads(f.read_text())
            except (OSError, ValueError):
                continue
            if r.get("process") != self.process_index and not r.get("peer") and \
                    float(r.get("fired_at", 0.0)) >= self._started:
                return r
        return None

    def check_peer_hang(self, error: BaseException) -> None:
        """Raises PeerHung (from `error`) when a peer's hang explains this process's failure,
        after writing this process's own report (marked peer: it did not hang itself)."""
        if self._firing.is_set():
            # This process's own watchdog fired (the main thread failed while it wrote the stacks:
            # a frozen process that runs again): its report stands and its os._exit ends the process.
            time.sleep(60)
        peer = self.peer_hung()
        if peer is None:
            return
        self._report(timeout=self.timeout_s(), stacks=None, peer=True)
        raise PeerHung(f"process {peer['process']} ({peer.get('host', '?')}) hung after step "
                       f"{peer.get('last_step')} and left; this process failed with it "
                       f"({type(error).__name__}) after step {self._step}: exiting with code {EXIT_HANG} "
                       f"like it (scripts/tpu.py run --restarts N starts the run again)") from error

    def exit_hook(self, exc_type, exc, tb) -> bool:
        """An ExitStack.push callback, pushed after the run's exit event so that it runs first:
        a failure that a peer's hang explains leaves as PeerHung (exit code EXIT_HANG). Any other
        failure of a multi-host run leaves a report too, marked `failed`: a host lost with its VM
        breaks its peers' collectives ("Connection reset by peer") before any watchdog fires, and
        the next start names it as the one that wrote none (announce_last_hang)."""
        if isinstance(exc, Exception) and not isinstance(exc, PeerHung):
            self.check_peer_hang(exc)
            if self.process_count > 1:
                self._report(timeout=self.timeout_s(), stacks=None, peer=False,
                             failed=" ".join(f"{type(exc).__name__}: {exc}".split())[:300])
        return False

    def _report(self, *, timeout: float, stacks: Path | None, peer: bool, late_s: float = 0.0,
                failed: str | None = None) -> None:
        with contextlib.suppress(Exception):
            self.reports_dir.mkdir(parents=True, exist_ok=True)
            report = {"process": self.process_index, "slice": self.slice, "host": socket.gethostname(),
                      "pid": os.getpid(),
                      "last_step": self._step, "last_step_time": self._last_wall, "fired_at": time.time(),
                      "timeout_s": timeout, "late_s": late_s, "poll_s": poll_interval(timeout),
                      "stacks": str(stacks) if stacks else None, "peer": peer, "failed": failed}
            tmp = self.reports_dir / f".p{self.process_index}.json.tmp"
            tmp.write_text(json.dumps(report))
            tmp.replace(self.reports_dir / f"p{self.process_index}.json")

    def _fire(self, idle: float, timeout: float) -> None:
        """Stacks, report, exit event, and out: the main thread is stuck, so nothing unwinds."""
        self._firing.set()
        host = socket.gethostname()
        stacks = self.run_dir / f"hang_stacks_p{self.process_index}.txt"
        line = (f"hang: no step completed for {idle:.0f} s after step {self._step} "
                f"(train.hang_timeout_s: {timeout:.0f} s; process {self.process_index} on {host}); "
                f"Python stacks in {stacks}; exiting with code {EXIT_HANG} "
                f"(scripts/tpu.py run --restarts N starts the run again)")
        with contextlib.suppress(Exception):
            stacks.parent.mkdir(parents=True, exist_ok=True)
            stacks.write_text(f"{line}\n\n{thread_stacks()}")
        # late_s: how long after its due time it fired; far more than its polling interval means
        # this process itself was not running (a frozen VM, SIGSTOP): it stopped first.
        self._report(timeout=timeout, stacks=stacks, peer=False, late_s=idle - timeout)
        print(line, file=sys.stderr, flush=True)
        if self.on_hang is not None:
            with contextlib.suppress(Exception):
                self.on_hang(self._step)
        _stop_children()
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(EXIT_HANG)


def _this_slice() -> int:
    """This process's slice (model/sharding.py slice_of), found at start: the watchdog's thread
    reports while the main thread is stuck, and asks JAX nothing then."""
    try:
        import jax

        from model import sharding

        return sharding.slice_of(jax.local_devices()[0])
    except Exception:  # noqa: BLE001 - a name in a report, never a reason to fail
        return 0


def _slices_of_processes() -> dict[int, int]:
    """{process: slice} of the running job (every process's devices), {} when JAX cannot say."""
    try:
        import jax

        from model import sharding

        return {d.process_index: sharding.slice_of(d) for d in jax.devices()}
    except Exception:  # noqa: BLE001
        return {}


def _stop_children() -> None:
    """The input worker processes would outlive an os._exit: they go first."""
    try:
        import psutil

        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(Exception):
                child.kill()
    except Exception:  # noqa: BLE001 - best effort on the way out
        pass


def announce_last_hang(reports_dir: Path, process_count: int) -> str | None:
    """At the start of a run (process 0): if the last life ended in a hang, one line naming the
    host that stopped first, and the reports moved to `hang_reports/seen-<time>/` so the next
    start does not name them again. The host that stopped first is one that wrote no report
    (frozen, or lost with its VM), else one that failed (an error) before any watchdog fired
    ("The last start ended in a failure", its error named), else one whose own watchdog fired far
    later than due (it was frozen itself), else the one whose last step is the earliest. Over
    several slices the line names the slice too, and a whole slice that wrote no report as that
    slice (all its hosts lost together: a preempted or failed slice); the silent processes'
    slices are the running job's."""
    reports_dir = epath.Path(reports_dir)
    files = sorted(reports_dir.glob("p*.json"))
    if not files:
        return None
    reports = []
    for f in files:
        try:
            reports.append(json.loads(f.read_text()))
        except (OSError, ValueError):
            continue
    seen = reports_dir / time.strftime("seen-%Y%m%dT%H%M%S")
    seen.mkdir(parents=True, exist_ok=True)
    for f in files:
        with contextlib.suppress(OSError):
            f.replace(seen / f.name)
    if not reports:
        return None
    reported = {int(r["process"]) for r in reports}
    silent = [p for p in range(process_count) if p not in reported]
    slices = _slices_of_processes()
    multislice = len(set(slices.values())) > 1 or any(r.get("slice") for r in reports)

    def where(r):
        return f"{r.get('host', '?')}, slice {r.get('slice', 0)}" if multislice else r.get("host", "?")

    def when(r):
        return time.strftime("%H:%M:%S", time.gmtime(r["last_step_time"])) if r.get("last_step_time") else "?"

    def why(r):
        return " (failed when a peer left)" if r.get("peer") else f" (failed: {r['failed']})" if r.get("failed") else ""

    others = "; ".join(f"process {r['process']} ({where(r)}) last completed step {r.get('last_step')} "
                       f"at {when(r)} UTC{why(r)}" for r in sorted(reports, key=lambda r: r["process"]))
    # peer: failed because another hung and left; failed: an error of its own (or a lost peer's)
    failed = [r for r in reports if r.get("failed")]
    hung_own = [r for r in reports if not r.get("peer") and not r.get("failed")]
    hung = hung_own or reports

    def fired(r):
        return float(r.get("fired_at", 0.0))

    first_failed = min(failed, key=fired) if failed else None

    frozen = [r for r in hung if float(r.get("late_s", 0.0)) > 2 * float(r.get("poll_s", 5.0)) + 1.0]
    lost_slices = sorted({slices[p] for p in silent if p in slices} if multislice else set())
    whole = [s for s in lost_slices if all(p in silent for p, q in slices.items() if q == s)]
    if whole:
        # A slice none of whose hosts reported went first (a lost slice); a host of another slice
        # may have crashed on the broken collectives without a report.
        in_whole = [p for p in silent if slices.get(p) in whole]
        rest = [p for p in silent if p not in in_whole]
        first = (f"slice {', '.join(map(str, whole))} (process {', '.join(map(str, in_whole))}) wrote no hang "
                 f"report (all its hosts frozen or lost together): it stopped first"
                 + (f" (process {', '.join(map(str, rest))} of another slice wrote none either)" if rest else ""))
    elif silent:
        first = (f"process {', '.join(map(str, silent))} wrote no hang report (frozen, or lost with its "
                 f"VM): it stopped first")
    elif first_failed and all(fired(first_failed) < fired(h) for h in hung_own):
        # Every process reported and one failed before any watchdog fired: it went first (the
        # others' collectives broke when it left, or hung waiting for it, or they failed alike).
        r = first_failed
        return (f"The last start ended in a failure: process {r['process']} ({where(r)}) failed first, after step "
                f"{r.get('last_step')}: {r['failed']}; {others}. Reports: {seen}")
    elif frozen:
        r = max(frozen, key=lambda r: float(r["late_s"]))
        first = (f"process {r['process']} ({where(r)}) stopped first (it was frozen: its own "
                 f"watchdog ran {float(r['late_s']):.0f} s late)")
    else:
        r = min(hung, key=lambda r: (r.get("last_step") or 0, r.get("last_step_time") or 0.0))
        first = f"process {r['process']} ({where(r)}) stopped first (the earliest last step)"
    return f"The last start ended in a hang: {first}; {others}. Reports and stacks: {seen}"

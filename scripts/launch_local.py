#!/usr/bin/env python3
"""Run a multi-process (multi-host style) training job on this one machine.

    python scripts/launch_local.py --processes 2 --devices-per-process 4 -- name=smoke train.steps=20

starts P copies of

    python train.py <overrides> distributed.coordinator_address=localhost:PORT \
        distributed.num_processes=P distributed.process_id=i distributed.local_device_count=D

with JAX_PLATFORMS=cpu, so each process sees D fake CPU devices and they form one P*D-device
mesh through jax.distributed: the same code path a TPU pod takes, minus the TPUs.

* Logs: one file per process, runs/<name>/logs/process_{i}.log (the run directory Hydra will use,
  worked out from the config and the overrides; or --log-dir). Process 0 also
  streams to this console; the other processes stay quiet (their log tail is printed if they fail).
* A free port is picked when --port is not given.
* If one process fails, the others are stopped (SIGTERM, then SIGKILL after --failure-grace
  seconds) and the launcher exits with the failing process's exit code.
* Ctrl-C / SIGTERM: SIGTERM is forwarded to every process (so train.py can checkpoint); whatever
  is still alive after --grace-period seconds is killed. A second Ctrl-C kills at once.
* --restarts N: when a process exits with code 75 (train.py's hang watchdog, model/runtime/watchdog.py),
  all processes are stopped and the job starts again (a new coordinator port, logs appended), up
  to N times in all; the run resumes from its newest checkpoint. The same when the processes were
  preempted (a SIGTERM that reached train.py, not the launcher): with N > 0 they run with
  JAXPT_EXIT_PREEMPTED=1 and exit 76 (model/runtime/distributed.py EXIT_PREEMPTED) once they have saved,
  the launcher waits up to --grace-period for all of them and starts the job again, which resumes
  from the step just saved. A SIGTERM or Ctrl-C to the launcher itself is a stop: no restart.
* A lost host under --restarts N: a process killed by a signal from outside (its VM gone: SIGKILL)
  while the others run. The launcher names it (and its slice: a lost slice is all its processes
  killed together), leaves the others to leave on their own, through their hang watchdog (75,
  train.hang_timeout_s), the preemption path or their broken collective (a failure, or an abort
  in Gloo: SIGABRT is a process's own crash, never a lost host), up to --lost-host-wait seconds,
  names how each left, then starts the job again as after a hang; the next start names who
  stopped first (train.py, events.jsonl).
* --slices S: a multislice job rehearsed on this machine: the P processes form S simulated slices of
  P/S consecutive processes each (process i in slice i // (P/S), told by distributed.slice_index,
  as CPU devices carry no slice_index). The mesh groups the devices by slice exactly as a real
  multislice job's (model/sharding.py: mesh.dcn_data/dcn_fsdp across slices).
* Overrides are passed as argv lists (never through a shell), so any value is safe.
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from model.runtime.distributed import EXIT_PREEMPTED, EXIT_PREEMPTED_ENV
from model.runtime.watchdog import EXIT_HANG
from train import PROJECT_ROOT as REPO_ROOT  # the repo root (the project is installed)

DISTRIBUTED_KEYS = ("coordinator_address", "num_processes", "process_id", "local_device_count", "slice_index")


# ----------------------------------------------------------------------------------------------
# Helpers (importable for tests)
# ----------------------------------------------------------------------------------------------
def free_port() -> int:
    """A TCP port that was free a moment ago (the coordinator binds it right after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def distributed_overrides(port: int, num_processes: int, process_id: int, devices: int,
                          slices: int = 1) -> list[str]:
    """The process's distributed.* settings; over several simulated slices also its slice (the
    processes split into `slices` runs of consecutive ids)."""
    told = [f"distributed.slice_index={process_id // (num_processes // slices)}"] if slices > 1 else []
    return [
        f"distributed.coordinator_address=localhost:{port}",
        f"distributed.num_processes={num_processes}",
        f"distributed.process_id={process_id}",
        f"distributed.local_device_count={devices}",
        *told,
    ]


def _strip_hydra_quotes(value: str) -> str:
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        return value[1:-1]
    return value


def run_dir_from_overrides(overrides: list[str], project_root: Path = REPO_ROOT) -> Path | None:
    """Resolve hydra.run.dir the way train.py will see it; None if it cannot be worked out.

    First asks Hydra itself (compose the real config tree with these overrides, so a name set by
    an experiment file counts; ${project_root:} = the program's directory, as train.py defines
    it); falls back to `hydra.run.dir=` / `name=` overrides (runs/<name> is the convention).
    """
    config_dir = REPO_ROOT / "configs"
    if (config_dir / "train.yaml").exists():
        try:
            from hydra import compose, initialize_config_dir
            from hydra.core.global_hydra import GlobalHydra
            from omegaconf import OmegaConf

            if not OmegaConf.has_resolver("project_root"):
                OmegaConf.register_new_resolver("project_root", lambda: str(project_root))
            GlobalHydra.instance().clear()
            with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
                cfg = compose(config_name="train", overrides=list(overrides), return_hydra_config=True)
                run_dir = str(cfg.hydra.run.dir)
            GlobalHydra.instance().clear()
            if run_dir:
                return Path(run_dir)
        except Exception:  # config tree incomplete, interpolation needs a live Hydra run, ...
            pass
    for ov in overrides:
        key, sep, value = ov.partition("=")
        if sep and key.lstrip("+") == "hydra.run.dir":
            return Path(_strip_hydra_quotes(value))
    for ov in overrides:
        key, sep, value = ov.partition("=")
        if sep and key.lstrip("+") == "name":
            return project_root / "runs" / _strip_hydra_quotes(value)
    return None


def child_env(base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONUNBUFFERED"] = "1"
    # The device count comes from distributed.local_device_count; an inherited XLA flag would only
    # confuse whoever reads the environment.
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", "")).strip()
    if flags:
        env["XLA_FLAGS"] = flags
    else:
        env.pop("XLA_FLAGS", None)
    return env


def exit_code(returncode: int) -> int:
    """Shell convention: a child killed by signal N becomes 128+N."""
    return 128 - returncode if returncode < 0 else returncode


# Signals a process raises against itself (abort, a bad access): its own crash, not a lost host.
OWN_CRASH = {signal.SIGABRT, signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE}


def how_it_ended(returncode: int) -> str:
    """A child's end in words: 'exit code 1', 'killed by signal 6 (SIGABRT)'."""
    if returncode >= 0:
        return f"exit code {returncode}"
    try:
        name = f" ({signal.Signals(-returncode).name})"
    except ValueError:
        name = ""
    return f"killed by signal {-returncode}{name}"


def _set_parent_death_signal() -> None:
    """Linux: children get SIGTERM if the launcher itself is SIGKILLed (no orphaned trainers)."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


# ----------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------
class Launcher:
    def __init__(self, commands: list[list[str]], log_paths: list[Path], env: dict[str, str],
                 grace_period: float, failure_grace: float, echo=sys.stdout.buffer, append: bool = False,
                 lost_host_wait: float | None = None, slice_of=lambda i: 0):
        self.commands = commands
        self.log_paths = log_paths
        self.env = env
        self.grace_period = grace_period
        self.failure_grace = failure_grace
        self.echo = echo
        self.procs: list[subprocess.Popen] = []
        self.log_files = []
        self.threads: list[threading.Thread] = []
        self.signals: list[int] = []
        self.append = append            # a restart appends to the logs of the lives before
        self.lost_host_wait = lost_host_wait    # None: a lost host fails the job (no --restarts)
        self.slice_of = slice_of        # process -> its (simulated) slice, for the messages

    # -- process control ---------------------------------------------------------------------
    def start(self) -> None:
        for i, (cmd, log_path) in enumerate(zip(self.commands, self.log_paths, strict=False)):
            log_path.parent.mkdir(parents=True, exist_ok=True)
            log = open(log_path, "ab" if self.append else "wb")
            self.log_files.append(log)
            kwargs = dict(env=self.env, stdin=subprocess.DEVNULL, start_new_session=True,
                          preexec_fn=_set_parent_death_signal)
            if i == 0:
                proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **kwargs)
                t = threading.Thread(target=self._tee, args=(proc.stdout, log), daemon=True)
                t.start()
                self.threads.append(t)
            else:
                proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, **kwargs)
            self.procs.append(proc)

    def _tee(self, pipe, log) -> None:
        for line in iter(pipe.readline, b""):
            log.write(line)
            log.flush()
            try:
                self.echo.write(line)
                self.echo.flush()
            except (BrokenPipeError, ValueError):
                pass
        pipe.close()

    def _signal_all(self, sig: int) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig)  # the whole group: data-loader workers too
                except (ProcessLookupError, PermissionError):
                    try:
                        p.send_signal(sig)
                    except ProcessLookupError:
                        pass

    def _alive(self) -> bool:
        return any(p.poll() is None for p in self.procs)

    def stop_all(self, grace: float) -> None:
        """SIGTERM everyone, wait up to `grace` seconds (cut short by another signal), SIGKILL."""
        self._signal_all(signal.SIGTERM)
        n_signals = len(self.signals)
        deadline = time.monotonic() + grace
        while self._alive() and time.monotonic() < deadline and len(self.signals) == n_signals:
            time.sleep(0.1)
        if self._alive():
            log(f"killing {sum(p.poll() is None for p in self.procs)} process(es) still running")
            self._signal_all(signal.SIGKILL)
        for p in self.procs:
            p.wait()

    def _on_signal(self, signum, frame) -> None:
        self.signals.append(signum)
        if len(self.signals) > 1:
            log("second signal: killing all processes now")

    # -- main loop ---------------------------------------------------------------------------
    def run(self) -> int:
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            self.start()
            rc = self._watch()
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            for t in self.threads:
                t.join(timeout=5)
            for f in self.log_files:
                f.close()
        return rc

    def _watch(self) -> int:
        preempted_since = None
        lost_since = None
        while True:
            if self.signals:
                sig = self.signals[0]
                log(f"got {signal.Signals(sig).name}: sending SIGTERM to all processes "
                    f"(grace period {self.grace_period:g}s)")
                self.stop_all(self.grace_period)
                return 128 + sig
            codes = [p.poll() for p in self.procs]
            failed = [i for i, c in enumerate(codes) if c not in (None, 0, EXIT_PREEMPTED)]
            # Killed by a signal from outside: a lost host. A process's own crash (an abort in
            # the collectives' library when its peer vanished mid-message) is a failure, which
            # a lost peer may have caused: it does not hide the lost host, even in one poll.
            lost = [i for i in failed if codes[i] < 0 and -codes[i] not in OWN_CRASH]
            if lost and self.lost_host_wait is not None and (lost_since is not None or len(lost) < len(codes)):
                if lost_since is None:
                    lost_since = time.monotonic()
                    slices = sorted({self.slice_of(i) for i in lost})
                    log(f"process {', '.join(map(str, lost))} (slice {', '.join(map(str, slices))}) lost first "
                        f"(killed by signal {-codes[lost[0]]}); the others leave through their watchdog or "
                        f"preemption (up to {self.lost_host_wait:g}s)")
                if all(c is not None for c in codes):
                    # How the others left tells the user which way out each took: its watchdog
                    # (a hang code), its broken collective (a failure code) or a crash in the
                    # collectives' library (a signal, with no report of its own).
                    log("the others left: " + "; ".join(
                        f"process {i} (slice {self.slice_of(i)}) {how_it_ended(codes[i])}"
                        for i in range(len(codes)) if i not in lost))
                    return EXIT_HANG        # every host gone: start the job again, as after a hang
                if time.monotonic() - lost_since > self.lost_host_wait:
                    log(f"others still running {self.lost_host_wait:g}s after a lost host; stopping them")
                    self.stop_all(self.failure_grace)
                    return EXIT_HANG
                time.sleep(0.1)
                continue
            if failed:
                # A hang anywhere decides the exit code: the others fail because of it.
                hung = [i for i in failed if exit_code(codes[i]) == EXIT_HANG]
                i = (hung or failed)[0]
                rc = exit_code(codes[i])
                log(f"process {i} exited with code {rc}; stopping the others")
                self._print_tail(i)
                self.stop_all(self.failure_grace)
                return rc
            if all(c is not None for c in codes):
                return EXIT_PREEMPTED if EXIT_PREEMPTED in codes else 0
            if EXIT_PREEMPTED in codes:
                # Preempted, saved: the others saved the same step and are leaving too.
                if preempted_since is None:
                    preempted_since = time.monotonic()
                elif time.monotonic() - preempted_since > self.grace_period:
                    log(f"a process was preempted (exit code {EXIT_PREEMPTED}) and others still run after "
                        f"{self.grace_period:g}s; stopping them")
                    self.stop_all(self.failure_grace)
                    return EXIT_PREEMPTED
            time.sleep(0.1)

    def _print_tail(self, i: int, n: int = 40) -> None:
        if i == 0:
            return  # process 0 already streamed to the console
        try:
            self.log_files[i].flush()
            lines = self.log_paths[i].read_bytes().decode(errors="replace").splitlines()[-n:]
        except OSError:
            return
        if lines:
            log(f"last {len(lines)} lines of {self.log_paths[i]}:")
            sys.stderr.write("".join(f"  | {line}\n" for line in lines))
            sys.stderr.flush()


def log(msg: str) -> None:
    sys.stderr.write(f"[launch_local] {msg}\n")
    sys.stderr.flush()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Start P local processes of train.py that form one jax.distributed job.",
        usage="%(prog)s --processes P --devices-per-process D [options] -- <hydra overrides>",
    )
    p.add_argument("--processes", "-p", type=int, required=True, help="number of processes (P)")
    p.add_argument("--devices-per-process", "-d", type=int, required=True,
                   help="fake CPU devices per process (D); the mesh has P*D devices")
    p.add_argument("--slices", type=int, default=1,
                   help="simulated slices (S): the processes form S slices of P/S processes each, joined as a "
                        "multislice job's slices are (default 1)")
    p.add_argument("--port", type=int, default=None, help="coordinator port (default: a free one)")
    p.add_argument("--log-dir", type=Path, default=None,
                   help="per-process logs go here (default: <hydra.run.dir>/logs, i.e. runs/<name>/logs)")
    p.add_argument("--program", default="train.py",
                   help="Python script to run (default: train.py at the repo root)")
    p.add_argument("--grace-period", type=float, default=30.0,
                   help="seconds between SIGTERM and SIGKILL on Ctrl-C/SIGTERM (default 30)")
    p.add_argument("--failure-grace", type=float, default=5.0,
                   help="seconds the survivors get after one process failed (default 5)")
    p.add_argument("--restarts", type=int, default=0,
                   help=f"start the job again, up to N times in all, when a process exits with code {EXIT_HANG} "
                        f"(train.py's hang watchdog) or the processes were preempted (exit code {EXIT_PREEMPTED} "
                        f"with ${EXIT_PREEMPTED_ENV}=1, which N > 0 sets); default 0")
    p.add_argument("--lost-host-wait", type=float, default=300.0,
                   help="with --restarts: seconds the other processes get to leave on their own (watchdog, "
                        "preemption) after one was killed from outside, before they are stopped and the job "
                        "starts again (default 300)")
    p.add_argument("overrides", nargs="*", help=argparse.SUPPRESS)
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    if "--" in argv:
        i = argv.index("--")
        own, rest = argv[:i], argv[i + 1:]
    else:
        own, rest = argv, []
    parser = build_parser()
    args = parser.parse_args(own)
    args.overrides = list(args.overrides) + rest
    if args.processes < 1:
        parser.error("--processes must be >= 1")
    if args.devices_per_process < 1:
        parser.error("--devices-per-process must be >= 1")
    if args.slices < 1 or args.processes % args.slices:
        parser.error(f"--slices {args.slices} must be >= 1 and divide --processes {args.processes}")
    for ov in args.overrides:
        key = ov.partition("=")[0].lstrip("+~")
        if key in {f"distributed.{k}" for k in DISTRIBUTED_KEYS}:
            parser.error(f"{key} is set by the launcher; remove the override {ov!r}")
    return args


def resolve_program(program: str) -> str:
    if os.path.exists(program):
        return program
    candidate = REPO_ROOT / program
    if candidate.exists():
        return str(candidate)
    raise SystemExit(f"[launch_local] program not found: {program}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else list(argv))
    program = resolve_program(args.program)
    port = args.port or free_port()

    log_dir = args.log_dir
    if log_dir is None:
        run_dir = run_dir_from_overrides(args.overrides, Path(program).resolve().parent)
        if run_dir is None:
            run_dir = Path(program).resolve().parent / "runs" / time.strftime("launch_local_%Y%m%d_%H%M%S")
            log(f"could not work out the run directory from the config; logs go to {run_dir}/logs")
        log_dir = run_dir / "logs"

    P, D = args.processes, args.devices_per_process
    log_paths = [Path(log_dir) / f"process_{i}.log" for i in range(P)]
    env = child_env()
    if args.restarts > 0:
        env[EXIT_PREEMPTED_ENV] = "1"   # a preempted train.py exits EXIT_PREEMPTED, not 0: restart it
    rc = 0
    for life in range(args.restarts + 1):
        if life:
            port = free_port()      # the last life's coordinator may still hold its port
            why = "hang or lost host" if rc == EXIT_HANG else "preempted"
            log(f"a process exited with code {rc} ({why}): restart {life} of {args.restarts}")
        commands = [[sys.executable, program, *args.overrides, *distributed_overrides(port, P, i, D, args.slices)]
                    for i in range(P)]
        layout = f"{args.slices} slices x {P // args.slices} processes" if args.slices > 1 else f"{P} processes"
        log(f"{layout} x {D} CPU devices, coordinator localhost:{port}, logs in {log_dir}/")
        launcher = Launcher(commands, log_paths, env, args.grace_period, args.failure_grace,
                            append=life > 0, lost_host_wait=args.lost_host_wait if args.restarts > 0 else None,
                            slice_of=lambda i: i // (P // args.slices))
        rc = launcher.run()
        if rc not in (EXIT_HANG, EXIT_PREEMPTED) or launcher.signals:
            break
    if rc == EXIT_PREEMPTED:
        log("preempted: all processes saved and exited; no restart left")
        rc = 0
    if rc == 0:
        log("all processes finished")
    return rc


if __name__ == "__main__":
    sys.exit(main())

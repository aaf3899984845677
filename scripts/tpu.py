#!/usr/bin/env python3
"""Drive a multi-host Cloud TPU pod (e.g. v4-32 = 4 hosts x 4 chips) with `gcloud compute tpus tpu-vm`.

    python scripts/tpu.py create --name my-pod --zone us-central2-b [--spot]
    python scripts/tpu.py setup  --name my-pod --zone us-central2-b [--extras tpu,gcs] [--mount-bucket my-bucket]
    python scripts/tpu.py sync   --name my-pod --zone us-central2-b
    python scripts/tpu.py run    --name my-pod --zone us-central2-b --env-from-local WANDB_API_KEY \
                                 -- experiment=v4_32_llama_1b
    python scripts/tpu.py logs   --name my-pod --zone us-central2-b [--worker 1] [--follow]
    python scripts/tpu.py stop   --name my-pod --zone us-central2-b
    python scripts/tpu.py delete --name my-pod --zone us-central2-b

Several slices (a multislice job over the data-center network): --slices N on every subcommand.
`create` asks for the N slices as one queued resource (`gcloud compute tpus queued-resources create
NAME --node-count N --node-prefix NAME`: slices NAME-0 .. NAME-{N-1}, granted all together or not at
all); setup/sync/run/stop act on every worker of every slice, `logs --slice i` reads slice i, and
`delete` removes the queued resource with its slices. `run` gives each worker the Megascale
settings the TPU VM does not already provide (MEGASCALE_NUM_SLICES, MEGASCALE_SLICE_ID,
MEGASCALE_PORT, and MEGASCALE_COORDINATOR_ADDRESS from --megascale-coordinator): one
jax.distributed job over all hosts of all slices. --restarts restarts every slice together: when a
host of one slice dies the others leave through the hang watchdog (75) or the preemption path (76)
and every worker's loop starts train.py again; the processes meet at jax.distributed's start.

`setup` installs what was tested: the synced project with its pinned extras, `pip install -e
".[tpu,gcs]"` (--extras: jax[tpu] at the version the memory plans were compiled with, and gcsfs for
gs:// data and checkpoints), in one pip resolution with any --pip-arg requirement, so nothing moves a
pin; then every worker prints its jax, jaxlib and libtpu versions.

Every subcommand takes --dry-run: the gcloud commands are printed (one per line, shell-quoted)
instead of run; secrets passed with --env-from-local are shown as ***.
--name/--zone/--project default to $JAXPT_TPU_NAME/$JAXPT_TPU_ZONE/$JAXPT_TPU_PROJECT.

Everything sent to the workers' shells is quoted with shlex.quote, so a Hydra override such as
"name=x; rm -rf ~" reaches train.py as one inert argument.

Layout on every worker (--remote-dir, default ~/jaxpt):
    ~/jaxpt/                      the synced code (pip install -e ".[tpu,gcs]" by `setup`)
    ~/jaxpt/logs/worker_<hostname>.log   stdout+stderr of train.py on that worker (appended; each
                                  launch ends with "=== <time> train.py exited with code N ===",
                                  under --restarts each life, then "=== restart i of N (...) ===")
    ~/jaxpt/logs/train.pid        pid of the detached train.py (its process group: the launch's)
    ~/jaxpt/logs/stop_requested   written by `stop` (and by `run` as it stops a stale launch): the
                                  --restarts loop does not start train.py again after it
    ~/jaxpt/runs/<name>/          Hydra run directory (checkpoints should go to gs://)
"""
from __future__ import annotations

import argparse
import fnmatch
import os
import re
import shlex
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Callable, Sequence

try:
    import tomllib
except ModuleNotFoundError:   # Python 3.10: --extras goes unchecked here (pip still refuses a typo)
    tomllib = None

from model.runtime.distributed import EXIT_PREEMPTED, EXIT_PREEMPTED_ENV
from model.runtime.watchdog import EXIT_HANG
from model.tpu_flags import init_args as libtpu_init_args
from train import PROJECT_ROOT as REPO_ROOT  # the repo root (the project is installed)

PROGRAM = "train.py"
# Put before the user's overrides on `run` (a later value of the same key wins). A detached run
# writes to a log file, where a progress bar is one ever-growing line of \r-updates that `logs`
# cannot tail: train.py prints a plain line per log step instead.
DETACHED_OVERRIDES = ("logger.progress_bar=false",)
MASK = "***"
REMOTE_TARBALL = "jaxpt-sync.tar.gz"  # in the worker's home directory
# Never shipped to the workers (matched against every path component).
SYNC_EXCLUDES = (
    ".git", "runs", "outputs", "multirun", "wandb", "__pycache__", ".pytest_cache", ".mypy_cache",
    ".ruff_cache", ".venv", "venv", ".whl", "*.egg-info", "*.pyc", ".DS_Store", "checkpoints",
    "logs", ".ipynb_checkpoints",
)
SECRET_NAME = re.compile(r"(KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL)", re.IGNORECASE)
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# A python interpreter whose script is train.py: "python3 -u /x/train.py ...". Anchored at the start
# so the `bash -c '... train.py ...'` shell that runs this very command never matches.
PROGRAM_REGEX = r"^([^ ]*/)?python[0-9.]*( +-[^ ]+)* +([^ ]*/)?train\.py( |$)"
# A deliberate stop, for the --restarts loop (train_wrapper): relative to the code dir.
STOP_MARKER = "logs/stop_requested"
# What `setup` installs beside the project: its optional dependencies from pyproject.toml, pinned
# there (tpu: jax[tpu] at the version the memory plans were compiled with; gcs: gcsfs for gs://).
DEFAULT_EXTRAS = "tpu,gcs"
EXTRA_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
# Printed by every worker after the install: what it will run train.py with.
VERSIONS_PY = ('import importlib.metadata as m, jax; '
               'v = {(d.metadata["Name"] or "").lower(): d.version for d in m.distributions()}; '
               'print(", ".join(n + " " + v.get(n, "not installed") for n in ("jax", "jaxlib", "libtpu")))')

Runner = Callable[[list[str]], int]


def log(msg: str) -> None:
    sys.stderr.write(f"[tpu] {msg}\n")
    sys.stderr.flush()


# ----------------------------------------------------------------------------------------------
# Quoting helpers
# ----------------------------------------------------------------------------------------------
def remote_path(path: str) -> str:
    """Shell-quote a path for a remote bash, keeping a leading ~ expandable ("$HOME"/...)."""
    if path == "~":
        return '"$HOME"'
    if path.startswith("~/"):
        rest = path[2:].strip("/")
        return '"$HOME"/' + shlex.quote(rest) if rest else '"$HOME"'
    return shlex.quote(path)


class EnvVar:
    def __init__(self, name: str, value: str, secret: bool):
        if not ENV_NAME.match(name):
            raise SystemExit(f"[tpu] invalid environment variable name: {name!r}")
        self.name, self.value, self.secret = name, value, secret

    def export(self, reveal: bool) -> str:
        value = shlex.quote(self.value) if (reveal or not self.secret) else MASK
        return f"export {self.name}={value}"


def collect_env(args: argparse.Namespace, dry_run: bool) -> list[EnvVar]:
    out: list[EnvVar] = []
    for item in getattr(args, "env", None) or []:
        name, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"[tpu] --env expects KEY=VALUE, got {item!r} (use --env-from-local NAME "
                             "to forward a variable from this machine)")
        out.append(EnvVar(name, value, secret=bool(SECRET_NAME.search(name))))
    for name in getattr(args, "env_from_local", None) or []:
        if name not in os.environ:
            if not dry_run:
                raise SystemExit(f"[tpu] --env-from-local {name}: not set in the local environment")
            log(f"warning: {name} is not set locally (dry run continues)")
        out.append(EnvVar(name, os.environ.get(name, ""), secret=True))
    return out


# ----------------------------------------------------------------------------------------------
# Remote scripts (bash, run on every worker)
# ----------------------------------------------------------------------------------------------
def join_commands(parts: Sequence[str]) -> str:
    """Join shell commands on one line: `;` between them, except after a backgrounding `&`."""
    out = ""
    for part in parts:
        if out:
            out += " " if out.endswith("&") and not out.endswith("&&") else "; "
        out += part
    return out


def _stop_function(grace: int) -> str:
    """bash function stop_training: SIGTERM to our train.py processes, then wait until their
    whole process group is gone (input workers included); SIGKILL the group after `grace` s.

    Candidates: the pid file and any `python ... train.py` process; only those whose working
    directory is the code dir and whose command line names train.py are touched.
    SIGTERM goes to train.py alone, never to its group: the group also holds its input worker
    processes, and those must keep serving batches until train.py has agreed on a step with the
    other hosts and saved it (killed early, they leave train.py waiting on a dead pipeline).
    A group is only killed when it is not the group of this very script.
    First of all it writes STOP_MARKER (when logs/ exists, i.e. something was launched here): a
    deliberate stop, which the --restarts loop (train_wrapper) must not answer with a restart,
    though train.py exits with EXIT_PREEMPTED on the SIGTERM as on a preemption. Written before
    anything else, so that it is there even when train.py leaves on its peers' agreement to stop
    before this host's SIGTERM.
    """
    regex = shlex.quote(PROGRAM_REGEX)
    marker = shlex.quote(STOP_MARKER)
    return (
        "stop_training() { "
        f"if [ -d logs ]; then : > {marker}; fi; "
        'local here; here=$(pwd -P); local cands=""; local pids=""; local groups=""; local p; local g; '
        'local mine; mine=$(ps -o pgid= -p $$ | tr -d " "); '
        '[ -f logs/train.pid ] && cands=$(cat logs/train.pid); '
        f"cands=\"$cands $(pgrep -f {regex} || true)\"; "
        "for p in $cands; do "
        '[ "$p" = "$$" ] && continue; '
        '[ "$(readlink /proc/$p/cwd 2>/dev/null)" = "$here" ] || continue; '
        "tr '\\0' ' ' < /proc/$p/cmdline 2>/dev/null | grep -q 'train\\.py' || continue; "
        'case " $pids " in *" $p "*) continue;; esac; pids="$pids $p"; '
        'g=$(ps -o pgid= -p "$p" | tr -d " "); [ -n "$g" ] && [ "$g" != "$mine" ] && groups="$groups -$g"; '
        "done; "
        'if [ -z "$pids" ]; then echo "$(hostname): no training process running"; rm -f logs/train.pid; return 0; fi; '
        'echo "$(hostname): SIGTERM to$pids"; '
        'kill -TERM $pids 2>/dev/null; '
        f"local i=0; while [ $i -lt {int(grace)} ]; do "
        'local alive=0; for p in $pids; do kill -0 "$p" 2>/dev/null && alive=1; done; '
        'for g in $groups; do kill -0 -- "$g" 2>/dev/null && alive=1; done; '
        "[ $alive = 0 ] && break; sleep 1; i=$((i+1)); done; "
        f'if [ $i -ge {int(grace)} ]; then '
        f'echo "$(hostname): still running after {int(grace)} s: SIGKILL to$pids$groups"; '
        'kill -KILL $pids 2>/dev/null; for g in $groups; do kill -KILL -- "$g" 2>/dev/null; done; fi; '
        "rm -f logs/train.pid; return 0; }"
    )


def _cd(remote_dir: str, must_exist: bool = True) -> str:
    rd = remote_path(remote_dir)
    if must_exist:
        return (f"cd {rd} || {{ echo \"$(hostname): {shlex.quote(remote_dir)} missing: run "
                f"'tpu.py sync' first\" >&2; exit 1; }}")
    return f"mkdir -p {rd} && cd {rd}"


def train_wrapper(restarts: int) -> str:
    """Runs train.py inside the detached session and appends its exit code to the log, so that
    `logs` tells a clean stop (code 0) from a crash or a kill. train.py runs as a child (its pid
    goes to logs/train.pid, where `stop` sends SIGTERM); this wrapper stays to wait for it, and
    starts it again, up to `restarts` times in all, when it exits with EXIT_HANG (the hang
    watchdog: model/runtime/watchdog.py) or with EXIT_PREEMPTED (saved on a preemption; with restarts,
    $JAXPT_EXIT_PREEMPTED=1 asks train.py for that code instead of 0). Not after a deliberate
    stop: with STOP_MARKER there (written by `stop`, removed as the wrapper starts) the loop ends
    whatever the code. A preempted exit that is not restarted ends the wrapper with 0.
    Every worker restarts on its own; the new processes meet again at jax.distributed's start and
    resume from the newest checkpoint (a preempted run: the step it just saved)."""
    n = int(restarts)
    marker = shlex.quote(STOP_MARKER)
    return (f"rm -f {marker}; "
            + (f"export {EXIT_PREEMPTED_ENV}=1; " if n > 0 else "")
            + 'n=0; while :; do "$@" & echo $! > logs/train.pid; wait $!; rc=$?; '
            'echo "=== $(date -u +%Y-%m-%dT%H:%M:%SZ) train.py exited with code $rc ==="; '
            f'case $rc in {EXIT_HANG}) why="hang watchdog";; {EXIT_PREEMPTED}) why=preempted;; *) why="";; esac; '
            f'if [ -n "$why" ] && [ "$n" -lt {n} ]; then '
            f'if [ -f {marker} ]; then echo "=== stop requested: no restart ==="; '
            f'else n=$((n+1)); echo "=== restart $n of {n} ($why, exit code $rc) ==="; continue; fi; fi; '
            f'if [ "$rc" -eq {EXIT_PREEMPTED} ]; then exit 0; fi; '
            'exit $rc; done')


# Where a TPU VM keeps its own settings (jax reads MEGASCALE_* from the environment, then from here).
TPU_ENV_URL = "http://metadata.google.internal/computeMetadata/v1/instance/attributes/tpu-env"
MEGASCALE_PORT = 8081


def megascale_exports(args: argparse.Namespace, slice_id: int) -> list[str]:
    """Shell lines giving a worker of slice `slice_id` the Megascale settings of an N-slice job, each
    only where neither its environment nor its TPU VM's metadata (tpu-env) already has it. Without
    --megascale-coordinator and with no address from the VM, the worker stops in one line."""
    if args.slices == 1:
        return []
    values = {"MEGASCALE_NUM_SLICES": str(args.slices), "MEGASCALE_SLICE_ID": str(slice_id),
              "MEGASCALE_PORT": str(MEGASCALE_PORT)}
    if args.megascale_coordinator:
        values["MEGASCALE_COORDINATOR_ADDRESS"] = args.megascale_coordinator
    lines = [f"tpu_env=$(curl -sf -m 5 -H 'Metadata-Flavor: Google' {shlex.quote(TPU_ENV_URL)} 2>/dev/null || true)"]
    for key, value in values.items():
        lines.append(f'if [ -z "${{{key}:-}}" ]; then case "$tpu_env" in *{key}*) ;; '
                     f"*) export {key}={shlex.quote(value)};; esac; fi")
    lines.append('if [ -z "${MEGASCALE_COORDINATOR_ADDRESS:-}" ]; then case "$tpu_env" in '
                 "*MEGASCALE_COORDINATOR_ADDRESS*) ;; *) echo \"$(hostname): this TPU VM does not name the "
                 "Megascale coordinator: pass --megascale-coordinator (the address of worker 0 of slice 0)\" >&2; "
                 "exit 2;; esac; fi")
    return lines


def run_script(args: argparse.Namespace, env: Sequence[EnvVar], reveal: bool, slice_id: int = 0) -> str:
    overrides = " ".join(shlex.quote(o) for o in (*DETACHED_OVERRIDES, *args.overrides))
    py = shlex.quote(args.python)
    parts = [
        _cd(args.remote_dir),
        "mkdir -p logs",
        _stop_function(args.stale_grace),
        "stop_training",
        *megascale_exports(args, slice_id),
        *[e.export(reveal) for e in env],
        'log="logs/worker_$(hostname).log"',
        'echo "=== $(date -u +%Y-%m-%dT%H:%M:%SZ) start ===" >> "$log"',
        # setsid: a session and process group of its own, which a dropped ssh does not reach.
        " ".join(x for x in ("setsid nohup bash -c", shlex.quote(train_wrapper(args.restarts)), "jaxpt-train",
                             py, PROGRAM, overrides) if x)
        + ' >> "$log" 2>&1 < /dev/null &',
        "pid=$!",
    ]
    if args.startup_check > 0:
        parts += [
            f"sleep {int(args.startup_check)}",
            'if ! kill -0 "$pid" 2>/dev/null; then wait "$pid"; rc=$?; '
            'echo "$(hostname): train.py exited early (code $rc); log tail:" >&2; '
            'tail -n 40 "$log" >&2; exit $(( rc == 0 ? 1 : rc )); fi',
        ]
    parts.append('echo "$(hostname): train.py running (process group $pid), log: $(pwd)/$log"')
    return join_commands(parts)


def stop_script(args: argparse.Namespace) -> str:
    rd = remote_path(args.remote_dir)
    return join_commands([
        f"cd {rd} 2>/dev/null || {{ echo \"$(hostname): nothing to stop\"; exit 0; }}",
        _stop_function(args.grace_period),
        "stop_training",
    ])


def logs_script(args: argparse.Namespace) -> str:
    tail = f"tail -n {int(args.lines)}" + (" -F" if args.follow else "")
    return f'{_cd(args.remote_dir)}; {tail} "logs/worker_$(hostname).log"'


def setup_script(args: argparse.Namespace) -> str:
    py = shlex.quote(args.python)
    parts = ["set -eo pipefail"]
    if args.mount_bucket:
        bucket = args.mount_bucket.removeprefix("gs://").strip("/")
        mount = args.mount_point or "~/folder-for-bucket"
        mp = remote_path(mount)
        apt = "sudo apt-get -o DPkg::Lock::Timeout=600 -q"
        parts += [
            "if ! command -v gcsfuse >/dev/null; then "
            'echo "deb [signed-by=/usr/share/keyrings/cloud.google.asc] '
            'https://packages.cloud.google.com/apt gcsfuse-$(lsb_release -c -s) main" '
            "| sudo tee /etc/apt/sources.list.d/gcsfuse.list >/dev/null; "
            "curl -fsSL https://packages.cloud.google.com/apt/doc/apt-key.gpg "
            "| sudo tee /usr/share/keyrings/cloud.google.asc >/dev/null; "
            f"{apt} update && {apt} install -y gcsfuse; fi",
            f"mkdir -p {mp}",
            f"mountpoint -q {mp} || gcsfuse --implicit-dirs {shlex.quote(bucket)} {mp}",
            f'echo "$(hostname): gs://{shlex.quote(bucket)} mounted on {shlex.quote(mount)}"',
        ]
    parts.append(_cd(args.remote_dir))
    if not args.no_install:
        # One resolution: the --pip-arg requirements are solved together with the extras' pins.
        install = [args.python, "-m", "pip", "install", "-q", "-e", install_target(args.extras), *args.pip_arg]
        parts += [f"{py} -m pip install -q --upgrade pip", shlex.join(install)]
    # What every worker will run train.py with (and a check that its python imports jax).
    parts.append(f"{py} -c {shlex.quote(VERSIONS_PY)} | sed \"s/^/$(hostname): /\"")
    return join_commands(parts)


def parse_extras(text: str) -> list[str]:
    """--extras "tpu,gcs" -> ["tpu", "gcs"]; "" -> [] (the project alone)."""
    extras = [e.strip() for e in text.split(",") if e.strip()]
    for e in extras:
        if not EXTRA_NAME.match(e):
            raise SystemExit(f"[tpu] --extras {text!r}: {e!r} is not an extra's name")
    return extras


def install_target(extras: str) -> str:
    """What `pip install -e` gets: the synced project with its extras, e.g. ".[tpu,gcs]"."""
    names = parse_extras(extras)
    return f".[{','.join(names)}]" if names else "."


def project_extras(source: str | Path) -> dict[str, list[str]]:
    """The optional dependencies pyproject.toml declares in `source` (what `setup` ships)."""
    path = Path(source) / "pyproject.toml"
    if not path.is_file():
        raise SystemExit(f"[tpu] {path} not found: --source must be the project to install")
    with path.open("rb") as f:
        return dict(tomllib.load(f)["project"].get("optional-dependencies", {}))


def check_extras(args: argparse.Namespace) -> None:
    """Fail before any gcloud call on an extra the shipped pyproject.toml does not declare."""
    names = parse_extras(args.extras)
    if tomllib is None or not names:
        return
    known = project_extras(args.source)
    unknown = [e for e in names if e not in known]
    if unknown:
        raise SystemExit(f"[tpu] --extras {args.extras!r}: {', '.join(unknown)} not in {args.source}/pyproject.toml "
                         f"(its extras: {', '.join(sorted(known))})")


def extract_script(args: argparse.Namespace) -> str:
    return (f"{_cd(args.remote_dir, must_exist=False)} && tar -xzf \"$HOME\"/{REMOTE_TARBALL} "
            f"&& rm -f \"$HOME\"/{REMOTE_TARBALL} && echo \"$(hostname): code synced to $(pwd)\"")


# ----------------------------------------------------------------------------------------------
# gcloud commands
# ----------------------------------------------------------------------------------------------
def _gcloud_tpus(args: argparse.Namespace, kind: str, verb: str, *rest: str) -> list[str]:
    """`gcloud compute tpus KIND VERB ...` with the zone and project when given."""
    cmd = ["gcloud", "compute", "tpus", kind, verb, *rest]
    if args.zone:
        cmd += ["--zone", args.zone]
    if args.project:
        cmd += ["--project", args.project]
    return cmd


def _base(args: argparse.Namespace, verb: str, *rest: str) -> list[str]:
    return _gcloud_tpus(args, "tpu-vm", verb, *rest)


def slice_names(args: argparse.Namespace) -> list[str]:
    """The TPU VMs of the job: the one named --name, or with --slices N the queued resource's N
    slices, NAME-0 .. NAME-{N-1} (the names --node-prefix NAME gives them)."""
    n = int(getattr(args, "slices", 1))
    return [args.name] if n == 1 else [f"{args.name}-{i}" for i in range(n)]


def ssh_cmd(args: argparse.Namespace, command: str, worker: str = "all", node: str | None = None) -> list[str]:
    return _base(args, "ssh", node or args.name) + [f"--worker={worker}", "--command", command]


def scp_cmd(args: argparse.Namespace, local: str, remote: str, node: str | None = None) -> list[str]:
    return _base(args, "scp", local, f"{node or args.name}:{remote}") + ["--worker=all"]


def _queued(args: argparse.Namespace, verb: str, *rest: str) -> list[str]:
    return _gcloud_tpus(args, "queued-resources", verb, *rest)


def create_cmd(args: argparse.Namespace) -> list[str]:
    if args.slices > 1:
        # A multislice job is a queued resource: its slices are granted together or not at all.
        cmd = _queued(args, "create", args.name) + [
            "--node-count", str(args.slices), "--node-prefix", args.name,
            "--accelerator-type", args.accelerator_type, "--runtime-version", args.version]
    else:
        cmd = _base(args, "create", args.name) + ["--accelerator-type", args.accelerator_type,
                                                  "--version", args.version]
    if args.spot:
        cmd.append("--spot")
    if args.preemptible:
        cmd.append("--preemptible")
    return cmd + list(args.create_arg)


def delete_cmd(args: argparse.Namespace) -> list[str]:
    if args.slices > 1:   # the queued resource and, --force, the slices it holds
        return _queued(args, "delete", args.name) + ["--force", "--quiet"]
    return _base(args, "delete", args.name) + ["--quiet"]


def make_tarball(root: Path, dest: Path, extra_excludes: Sequence[str] = ()) -> int:
    """Pack the repo (minus SYNC_EXCLUDES/extra_excludes) into dest; returns the file count."""
    patterns = tuple(SYNC_EXCLUDES) + tuple(extra_excludes)

    def excluded(rel: str) -> bool:
        return any(fnmatch.fnmatch(part, pat) for part in Path(rel).parts for pat in patterns) or \
            any(fnmatch.fnmatch(rel, pat) for pat in extra_excludes)

    count = 0
    with tarfile.open(dest, "w:gz") as tar:
        for dirpath, dirnames, filenames in os.walk(root):
            rel_dir = os.path.relpath(dirpath, root)
            dirnames[:] = sorted(d for d in dirnames
                                 if not excluded(os.path.normpath(os.path.join(rel_dir, d))))
            for fn in sorted(filenames):
                rel = os.path.normpath(os.path.join(rel_dir, fn))
                full = os.path.join(dirpath, fn)
                if excluded(rel):
                    continue
                tar.add(full, arcname=rel, recursive=False)
                count += 1
    return count


# ----------------------------------------------------------------------------------------------
# Execution
# ----------------------------------------------------------------------------------------------
class Executor:
    def __init__(self, args: argparse.Namespace, runner: Runner | None, secrets: Sequence[str] = ()):
        self.dry_run = args.dry_run
        self.retries = max(0, args.retries)
        self.retry_delay = args.retry_delay
        self.runner = runner or (lambda cmd: subprocess.call(cmd))
        self.secrets = [s for s in secrets if s]

    def mask(self, text: str) -> str:
        for s in self.secrets:
            text = text.replace(s, MASK)
        return text

    def __call__(self, cmd: list[str], shown: list[str] | None = None, retry: str | None = None) -> int:
        """Run cmd (print `shown` instead on --dry-run). retry: None, 'ssh' (exit 255) or 'any'."""
        display = self.mask(shlex.join(shown if shown is not None else cmd))
        if self.dry_run:
            print(display, flush=True)
            return 0
        attempts = 1 + (self.retries if retry else 0)
        rc = 1
        for attempt in range(1, attempts + 1):
            rc = self.runner(cmd)
            if rc == 0:
                return 0
            retriable = retry == "any" or (retry == "ssh" and rc == 255)
            if not retriable or attempt == attempts:
                break
            log(f"command failed (exit {rc}), retry {attempt}/{attempts - 1} in {self.retry_delay:g}s: "
                f"{display[:200]}")
            time.sleep(self.retry_delay)
        log(f"command failed (exit {rc}): {display[:500]}")
        return rc


def do_sync(args: argparse.Namespace, ex: Executor) -> int:
    root = Path(args.source).resolve()
    tmpdir = tempfile.mkdtemp(prefix="jaxpt-sync-")
    tarball = Path(tmpdir) / REMOTE_TARBALL
    try:
        if ex.dry_run:
            log(f"dry run: would pack {root} (excluding {', '.join(SYNC_EXCLUDES + tuple(args.exclude))})")
        else:
            n = make_tarball(root, tarball, args.exclude)
            log(f"packed {n} files from {root} ({tarball.stat().st_size / 1e6:.1f} MB)")
        for node in slice_names(args):
            rc = ex(scp_cmd(args, str(tarball), REMOTE_TARBALL, node), retry="any")
            if rc:
                return rc
            rc = ex(ssh_cmd(args, extract_script(args), node=node), retry="ssh")
            if rc:
                return rc
        return 0
    finally:
        if tarball.exists():
            tarball.unlink()
        os.rmdir(tmpdir)


def cmd_create(args, ex):
    return ex(create_cmd(args))


def cmd_setup(args, ex):
    if not args.no_install:
        check_extras(args)
    if not args.no_sync:
        rc = do_sync(args, ex)
        if rc:
            return rc
    return on_every_slice(args, ex, lambda node, i: ssh_cmd(args, setup_script(args), node=node))


def on_every_slice(args, ex, make, shown=None) -> int:
    """make(node, slice index) on every slice in turn; the first failure's exit code."""
    for i, node in enumerate(slice_names(args)):
        rc = ex(make(node, i), shown=shown(node, i) if shown else None, retry="ssh")
        if rc:
            return rc
    return 0


def cmd_sync(args, ex):
    return do_sync(args, ex)


def with_overlap_flags(env: list[EnvVar]) -> list[EnvVar]:
    """The run's environment with libtpu's collective/compute overlap flags in LIBTPU_INIT_ARGS
    (model/tpu_flags.py; compile_tpu.py compiles with the same): added to a LIBTPU_INIT_ARGS given
    with --env, where a flag it names keeps its given value."""
    given = [e for e in env if e.name == "LIBTPU_INIT_ARGS"]
    rest = [e for e in env if e.name != "LIBTPU_INIT_ARGS"]
    value = libtpu_init_args(given[-1].value if given else None)
    return [*rest, EnvVar("LIBTPU_INIT_ARGS", value, secret=bool(given) and given[-1].secret)]


def cmd_run(args, ex):
    env = with_overlap_flags(collect_env(args, ex.dry_run))
    ex.secrets += [e.value for e in env if e.secret and e.value]
    rc = on_every_slice(args, ex, lambda node, i: ssh_cmd(args, run_script(args, env, True, i), node=node),
                        shown=lambda node, i: ssh_cmd(args, run_script(args, env, False, i), node=node))
    if rc == 0 and not ex.dry_run:
        log(f"started; follow with: python scripts/tpu.py logs --name {shlex.quote(args.name)} --follow")
    return rc


def cmd_logs(args, ex):
    node = slice_names(args)[args.slice]
    return ex(ssh_cmd(args, logs_script(args), worker=str(args.worker), node=node),
              retry=None if args.follow else "ssh")


def cmd_stop(args, ex):
    return on_every_slice(args, ex, lambda node, i: ssh_cmd(args, stop_script(args), node=node))


def cmd_delete(args, ex):
    if not (args.yes or ex.dry_run):
        answer = input(f"Delete TPU {args.name}? Worker disks (logs, local runs/) are lost. [y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            log("aborted")
            return 1
    return ex(delete_cmd(args))


# ----------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------
def _add_common(p: argparse.ArgumentParser, top: bool) -> None:
    """Shared settings; accepted before or after the subcommand."""
    def d(value):
        return value if top else argparse.SUPPRESS

    g = p.add_argument_group("pod settings")
    g.add_argument("--name", default=d(os.environ.get("JAXPT_TPU_NAME")),
                   help="TPU VM name (default $JAXPT_TPU_NAME)")
    g.add_argument("--zone", default=d(os.environ.get("JAXPT_TPU_ZONE")),
                   help="zone, e.g. us-central2-b (default $JAXPT_TPU_ZONE, else gcloud's config)")
    g.add_argument("--project", default=d(os.environ.get("JAXPT_TPU_PROJECT")),
                   help="GCP project (default $JAXPT_TPU_PROJECT, else gcloud's config)")
    g.add_argument("--slices", type=int, default=d(int(os.environ.get("JAXPT_TPU_SLICES", "1"))),
                   help="slices of the job (a multislice queued resource NAME-0..NAME-{N-1}; default "
                        "$JAXPT_TPU_SLICES, else 1)")
    g.add_argument("--remote-dir", default=d("~/jaxpt"), help="code directory on every worker (default ~/jaxpt)")
    g.add_argument("--python", default=d("python3"), help="python on the workers (default python3)")
    g.add_argument("--retries", type=int, default=d(2), help="retries for failed ssh/scp (default 2)")
    g.add_argument("--retry-delay", type=float, default=d(10.0), help="seconds between retries (default 10)")
    g.add_argument("--dry-run", action="store_true", default=d(False),
                   help="print the gcloud commands instead of running them")


class Removed(argparse.Action):
    """An option that no longer exists: using it, in any form, is an error that says what replaced it."""

    def __init__(self, option_strings, dest, message: str, **kwargs):
        super().__init__(option_strings, dest, nargs="?", **kwargs)
        self.message = message

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} was removed: {self.message}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tpu.py", description="Create, provision and drive a multi-host TPU pod with gcloud.",
        epilog="Hydra overrides for `run` go after `--`.")
    _add_common(parser, top=True)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name, help_):
        sp = sub.add_parser(name, help=help_, description=help_)
        _add_common(sp, top=False)
        return sp

    p = add("create", "create the TPU VM (all hosts of the pod)")
    p.add_argument("--accelerator-type", default="v4-32", help="default v4-32 (4 hosts x 4 chips)")
    p.add_argument("--version", default="tpu-ubuntu2204-base", help="TPU software version / runtime")
    pre = p.add_mutually_exclusive_group()
    pre.add_argument("--spot", action="store_true", help="Spot TPU (cheap, can be preempted)")
    pre.add_argument("--preemptible", action="store_true", help="preemptible TPU (legacy Spot)")
    p.add_argument("--create-arg", action="append", default=[],
                   help="extra argument for `gcloud ... create`, e.g. --create-arg=--network=my-net")

    p = add("setup", "sync the code, then pip install it (editable) with its pinned extras on all workers, "
                     "print every worker's jax/jaxlib/libtpu versions; optional gcsfuse mount")
    p.add_argument("--no-sync", action="store_true", help="skip the code sync before installing")
    p.add_argument("--no-install", action="store_true",
                   help="skip pip install (an image with the dependencies baked in; the simulated pod in tests)")
    p.add_argument("--extras", default=DEFAULT_EXTRAS, metavar="A,B",
                   help="the project's optional dependencies to install, pinned in pyproject.toml: "
                        f'pip install -e ".[A,B]" (default {DEFAULT_EXTRAS}: jax[tpu] at the version the plans '
                        "were compiled with, and gcsfs for gs:// data and checkpoints; '' for the project alone)")
    p.add_argument("--jax-extra", action=Removed, help=argparse.SUPPRESS,
                   message="it installed an unpinned jax[EXTRA] over the project's pin. setup now installs the "
                           f'project\'s pinned extras: --extras (default {DEFAULT_EXTRAS}, i.e. pip install -e '
                           f'".[{DEFAULT_EXTRAS}]"); --extras gcs installs no TPU jax')
    p.add_argument("--pip-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for that same pip install, repeatable: a requirement "
                        "(--pip-arg 'wandb==0.19.1') or a pip option (--pip-arg=--no-cache-dir); resolved together "
                        "with the extras' pins, so a requirement that conflicts with a pin fails the install "
                        "instead of replacing it")
    p.add_argument("--mount-bucket", default=None, help="gcsfuse-mount this GCS bucket on all workers")
    p.add_argument("--mount-point", default=None,
                   help="where to mount it on every worker (default ~/folder-for-bucket, "
                        "where configs/data/redpajama_v2.yaml looks)")
    _add_sync_opts(p)

    p = add("sync", "copy the code (minus runs/, .git, caches) to all workers")
    _add_sync_opts(p)

    p = add("run", "stop stale train.py, then start `python train.py <overrides>` detached on all workers")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="export on the workers (values of *KEY*/*TOKEN*/*SECRET* names are masked)")
    p.add_argument("--env-from-local", action="append", default=[], metavar="NAME",
                   help="export NAME with its value from this machine's environment (masked as ***)")
    p.add_argument("--stale-grace", type=int, default=30,
                   help="seconds a stale train.py gets after SIGTERM before SIGKILL (default 30)")
    p.add_argument("--restarts", type=int, default=0,
                   help=f"start train.py again, up to N times in all, when it exits with code {EXIT_HANG} "
                        f"(the hang watchdog: train.hang_timeout_s) or {EXIT_PREEMPTED} (preempted after "
                        f"saving: with N > 0, ${EXIT_PREEMPTED_ENV}=1 asks train.py for that code instead "
                        "of 0); it resumes from the newest checkpoint. Never after `stop`; default 0")
    p.add_argument("--megascale-coordinator", default=None, metavar="HOST[:PORT]",
                   help="with --slices N: the Megascale coordinator (worker 0 of slice 0) for workers whose TPU "
                        "VM does not name one")
    p.add_argument("--startup-check", type=int, default=5,
                   help="seconds to wait before checking train.py is still alive (0: don't; default 5)")
    p.add_argument("overrides", nargs="*", help="Hydra overrides (put them after --)")

    p = add("logs", "tail a worker's training log")
    p.add_argument("--worker", default="0", help="worker index, or 'all' (default 0)")
    p.add_argument("--slice", type=int, default=0, help="with --slices N: which slice's worker (default 0)")
    p.add_argument("--lines", "-n", type=int, default=100)
    p.add_argument("--follow", "-f", action="store_true")

    p = add("stop", "SIGTERM train.py on all workers (checkpoint), SIGKILL after the grace period")
    p.add_argument("--grace-period", type=int, default=120, help="seconds before SIGKILL (default 120)")

    p = add("delete", "delete the TPU VM")
    p.add_argument("--yes", "-y", action="store_true", help="don't ask for confirmation")
    return parser


def _add_sync_opts(p: argparse.ArgumentParser) -> None:
    p.add_argument("--source", default=str(REPO_ROOT), help="local directory to ship (default: the repo)")
    p.add_argument("--exclude", action="append", default=[], metavar="GLOB",
                   help="also leave out paths/names matching GLOB")


COMMANDS = {"create": cmd_create, "setup": cmd_setup, "sync": cmd_sync, "run": cmd_run,
            "logs": cmd_logs, "stop": cmd_stop, "delete": cmd_delete}


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    argv = list(argv)
    rest: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, rest = argv[:i], argv[i + 1:]
    parser = build_parser()
    args = parser.parse_args(argv)
    if rest and args.command != "run":
        parser.error("only `run` takes Hydra overrides after --")
    if args.command == "run":
        args.overrides = list(args.overrides) + rest
        flags = [o for o in args.overrides if o.startswith("-")]
        if flags:
            parser.error(f"{flags[0]!r} after --: tpu.py options go before --, Hydra overrides after it")
    if not args.name:
        parser.error("--name is required (or set $JAXPT_TPU_NAME)")
    if args.slices < 1:
        parser.error(f"--slices {args.slices}: expected 1 or more")
    if args.command == "create" and args.slices > 1 and args.preemptible:
        parser.error("--preemptible: a queued resource (--slices > 1) takes --spot instead")
    if args.command == "logs" and not 0 <= args.slice < args.slices:
        parser.error(f"--slice {args.slice}: the job has slices 0..{args.slices - 1}")
    return args


def main(argv: Sequence[str] | None = None, runner: Runner | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    ex = Executor(args, runner)
    try:
        return COMMANDS[args.command](args, ex)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

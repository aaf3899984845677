"""`python train.py` for the tests, forked from a Python that has already imported what train.py
imports: a drop-in for subprocess.Popen / subprocess.run on `[sys.executable, ".../train.py", ...]`.

Why: the suite starts ~130 train.py processes. Each spent ~3 s of CPU importing jax, flax, optax,
orbax, grain and hydra before its first line of work (docs/development.md, "Where the time goes").
Here a fork server (one per test worker and environment, LATE_ENV_PREFIXES aside) imports them
once, and each run is a fork of it that runs train.py as `__main__` (runpy), exactly as
`python train.py ARGS` would after those imports: its own session (process group), cwd,
environment, stdin/stdout/stderr (the caller's file descriptors, passed over a Unix socket), exit
code (a signal's as -N, as Popen gives), atexit handlers and threads joined at exit. Its input
workers spawn as usual. The server never starts a JAX backend (checked before it serves), so
each fork starts its own, with its own XLA_FLAGS.

What differs from a fresh interpreter, and why it does not matter to a test: the fork's parent is
the server (os.getppid), its command line is the server's, import-time warnings went to the
server's log, and every fork of one server shares its string-hash seed (the server's is random).
JAXPT_TEST_FORK=0 runs every train.py as a fresh process instead; anything but that exact form
(other scripts, other Popen arguments) always does.
"""
from __future__ import annotations

import atexit
import itertools
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV_SWITCH = "JAXPT_TEST_FORK"
# What train.py imports on its way to the first step (the cost each fork skips); none of them
# starts a backend or a thread at import.
PRELOAD = ("numpy", "jax", "jax.numpy", "flax.nnx", "optax", "orbax.checkpoint", "grain", "tokenizers", "hydra",
           "omegaconf", "train", "model.llama", "model.step", "model.flops", "model.runtime.checkpoint",
           "data.host", "data.pipeline")
MAX_MESSAGE = 1 << 20
READY_TIMEOUT_S = 180


# ---------------------------------------------------------------- the server (python -m tests.forked FD)
def _serve(sock: socket.socket) -> None:
    import importlib
    import select

    try:
        for name in PRELOAD:
            importlib.import_module(name)
        from jax._src import xla_bridge

        if xla_bridge._backends:     # noqa: SLF001  a started backend cannot be forked
            raise RuntimeError(f"a JAX backend started while importing {PRELOAD}")
    except BaseException as e:      # noqa: BLE001  the client falls back to fresh processes
        sock.send(json.dumps({"error": f"{type(e).__name__}: {e}"}).encode())
        return
    sock.send(b'{"ready": true}')
    children: dict[int, int] = {}   # pid -> request id
    while True:
        readable, _, _ = select.select([sock], [], [], 0.05 if children else 1.0)
        if readable:
            msg, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 3)
            if not msg:             # the test worker closed its end: nothing more to start
                return
            req = json.loads(msg)
            pid = os.fork()
            if pid == 0:
                sock.close()
                _run_child(req, fds)          # raises SystemExit: the interpreter's own exit follows
            for fd in fds:
                os.close(fd)
            children[pid] = req["id"]
            sock.send(json.dumps({"id": req["id"], "pid": pid}).encode())
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            sock.send(json.dumps({"id": children.pop(pid), "rc": os.waitstatus_to_exitcode(status)}).encode())


def _run_child(req: dict, fds: list[int]) -> None:
    import runpy

    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in set(fds):
        if fd > 2:
            os.close(fd)
    os.setsid()                      # its own process group: a killpg reaches it and its workers only
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    script = req["argv"][1]
    sys.argv = list(req["argv"][1:])
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    if "multiprocessing.process" in sys.modules:   # spawned input workers resolve paths from here
        sys.modules["multiprocessing.process"].ORIGINAL_DIR = req["cwd"]
    runpy.run_path(script, run_name="__main__")
    raise SystemExit(0)


# ---------------------------------------------------------------- the client (in a test worker)
class _Server:
    """One fork server, started with one environment; forks report their pid and exit code here."""

    def __init__(self, env: dict):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.log = tempfile.NamedTemporaryFile(prefix="jaxpt-fork-server-", suffix=".log", delete=False)
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.forked", str(theirs.fileno())],
                                     pass_fds=[theirs.fileno()], env=env, cwd=ROOT, stdin=subprocess.DEVNULL,
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        theirs.close()
        self.sock = ours
        self.sock.settimeout(READY_TIMEOUT_S)
        try:
            hello = json.loads(self.sock.recv(MAX_MESSAGE) or b'{"error": "the server exited"}')
        except (OSError, ValueError) as e:
            hello = {"error": repr(e)}
        self.sock.settimeout(None)
        self.error = hello.get("error")
        self.ids = itertools.count()
        self.send_lock = threading.Lock()
        self.cond = threading.Condition()
        self.pids: dict[int, int] = {}
        self.exits: dict[int, int] = {}
        self.alive = self.error is None
        if self.alive:
            threading.Thread(target=self._read, name="fork-server-reader", daemon=True).start()
        else:
            self.close()

    def _read(self) -> None:
        while True:
            try:
                msg = self.sock.recv(MAX_MESSAGE)
            except OSError:
                msg = b""
            with self.cond:
                if not msg:
                    self.alive = False
                    self.cond.notify_all()
                    return
                m = json.loads(msg)
                (self.pids if "pid" in m else self.exits)[m["id"]] = m.get("pid", m.get("rc"))
                self.cond.notify_all()

    def fork(self, argv: list[str], cwd: str, env: dict, fds: list[int]) -> tuple[int, int]:
        """-> (request id, pid)"""
        rid = next(self.ids)
        payload = json.dumps({"id": rid, "argv": argv, "cwd": cwd, "env": env}).encode()
        with self.send_lock:
            socket.send_fds(self.sock, [payload], fds)
        with self.cond:
            while rid not in self.pids:
                if not self.alive:
                    raise RuntimeError(f"the fork server died (its log: {self.log.name})")
                self.cond.wait()
        return rid, self.pids[rid]

    def exit_code(self, rid: int, timeout: float | None) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.cond:
            while rid not in self.exits:
                if not self.alive:
                    raise RuntimeError(f"the fork server died before its fork exited (its log: {self.log.name})")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self.cond.wait(left)
            return self.exits[rid]

    def busy(self) -> bool:
        with self.cond:
            return len(self.exits) < len(self.pids)

    def close(self) -> None:
        try:        # shutdown, not close alone: the reader thread's recv holds the socket open
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


# Variables nothing reads at import (XLA's flags when a backend starts, the project's own where it
# runs): a fork sets them, so forks differing only in these share a server. Every other variable
# can act at start-up or import (PYTHON*, JAX_*, LD_*, thread counts), so a server is per value.
LATE_ENV_PREFIXES = ("XLA_FLAGS", "JAXPT_")

_servers: dict[tuple, _Server] = {}
_servers_lock = threading.Lock()
KEEP_SERVERS = 4        # per test worker; one that has running forks is never closed


def _server_for(env: dict) -> _Server | None:
    key = tuple(sorted((k, v) for k, v in env.items() if not k.startswith(LATE_ENV_PREFIXES)))
    with _servers_lock:
        server = _servers.get(key)
        if server is None:
            idle = [k for k, s in _servers.items() if not s.busy()]
            while len(_servers) >= KEEP_SERVERS and idle:
                _servers.pop(idle.pop(0)).close()
            server = _servers[key] = _Server(dict(key))
        return server if server.alive else None


@atexit.register
def _close_servers() -> None:
    for server in _servers.values():
        server.close()


class ForkedProcess:
    """What a test uses of subprocess.Popen, for a fork of the server."""

    def __init__(self, args, server: _Server, rid: int, pid: int, pipes: dict, text: bool):
        self.args, self.pid, self.returncode = args, pid, None
        self._server, self._rid = server, rid
        mode = "r" if text else "rb"
        self.stdout = os.fdopen(pipes["stdout"], mode) if "stdout" in pipes else None
        self.stderr = os.fdopen(pipes["stderr"], mode) if "stderr" in pipes else None
        self.stdin = None
        self._readers: dict[str, threading.Thread] = {}
        self._read: dict[str, object] = {}

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.exit_code(self._rid, timeout=0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._server.exit_code(self._rid, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def communicate(self, input=None, timeout: float | None = None):   # noqa: A002  Popen's name
        assert input is None, "forked train.py runs read no stdin"
        deadline = None if timeout is None else time.monotonic() + timeout
        for name in ("stdout", "stderr"):
            stream = getattr(self, name)
            if stream is not None and name not in self._readers:
                t = threading.Thread(target=lambda s=stream, n=name: self._read.__setitem__(n, s.read()), daemon=True)
                self._readers[name] = t
                t.start()
        for t in self._readers.values():
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        for name in ("stdout", "stderr"):
            stream = getattr(self, name)
            if stream is not None and not stream.closed:
                stream.close()
        return self._read.get("stdout"), self._read.get("stderr")

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        import signal

        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        import signal

        self.send_signal(signal.SIGKILL)


def _forkable(args, stdin, kwargs) -> bool:
    return (os.environ.get(ENV_SWITCH, "1") != "0" and not kwargs and stdin in (None, subprocess.DEVNULL)
            and isinstance(args, (list, tuple)) and len(args) >= 2 and str(args[0]) == sys.executable
            and Path(str(args[1])).name == "train.py")


def Popen(args, *, stdin=None, stdout=None, stderr=None, cwd=None, env=None, text=False,   # noqa: N802
          start_new_session=False, **kwargs):
    """subprocess.Popen(args, ...), forked from a server when args is `[sys.executable, .../train.py, ...]`.
    A fork always gets its own session (start_new_session=True or not): a killpg never reaches the server."""
    if not _forkable(args, stdin, kwargs):
        return subprocess.Popen(args, stdin=stdin, stdout=stdout, stderr=stderr, cwd=cwd, env=env, text=text,
                                start_new_session=start_new_session, **kwargs)
    env = dict(os.environ if env is None else env)
    server = _server_for(env)
    if server is None:       # the server could not start (its log says why): a fresh process
        return subprocess.Popen(args, stdin=stdin, stdout=stdout, stderr=stderr, cwd=cwd, env=env, text=text,
                                start_new_session=start_new_session)
    to_close, pipes = [], {}

    def fd_for(target, default_fd: int, name: str) -> int:
        if target is None:
            return default_fd
        if target == subprocess.DEVNULL:
            fd = os.open(os.devnull, os.O_RDWR)
            to_close.append(fd)
            return fd
        if target == subprocess.PIPE:
            r, w = os.pipe()
            pipes[name] = r
            to_close.append(w)
            return w
        return target if isinstance(target, int) else target.fileno()

    fds = [fd_for(subprocess.DEVNULL, 0, "stdin")]
    fds.append(fd_for(stdout, 1, "stdout"))
    fds.append(fds[1] if stderr == subprocess.STDOUT else fd_for(stderr, 2, "stderr"))
    try:
        rid, pid = server.fork([str(a) for a in args], str(cwd or os.getcwd()), env, fds)
    finally:
        for fd in to_close:
            os.close(fd)
    return ForkedProcess(args, server, rid, pid, pipes, text)


def run(args, *, capture_output=False, timeout=None, check=False, stdout=None, stderr=None, **kwargs):
    """subprocess.run(args, ...) over this module's Popen."""
    if capture_output:
        stdout = stderr = subprocess.PIPE
    p = Popen(args, stdout=stdout, stderr=stderr, **kwargs)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        raise
    result = subprocess.CompletedProcess(args, p.returncode, out, err)
    if check:
        result.check_returncode()
    return result


if __name__ == "__main__":
    _serve(socket.socket(fileno=int(sys.argv[1])))

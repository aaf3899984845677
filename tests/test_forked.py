"""tests/forked.py: a train.py forked from the pre-imported server behaves as `python train.py`
does for what the tests read: its argv, cwd, environment, output streams, exit code (a signal's
as -N), atexit handlers, its own process group, and no JAX backend inherited.

A stand-in script named train.py (the form forked.Popen routes) reports what it sees, so these
run in seconds; the real train.py runs through the same path in every whole-run test."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests import forked

PROBE = """
import atexit, json, os, sys
import jax                                   # already imported by the server: no import cost here
from jax._src import xla_bridge
mode = sys.argv[1]
atexit.register(lambda: open(os.path.join(os.getcwd(), "atexit.txt"), "w").write("ran"))
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "env": os.environ.get("PROBE_VALUE"),
                  "main": __name__, "backends": len(xla_bridge._backends), "pgid": os.getpgid(0) == os.getpid(),
                  "path0": sys.path[0]}), flush=True)
print("to stderr", file=sys.stderr, flush=True)
if mode == "exit3":
    sys.exit(3)
if mode == "raise":
    raise ValueError("planted")
if mode == "sleep":
    import time
    time.sleep(120)
"""


@pytest.fixture
def probe(tmp_path):
    script = tmp_path / "bin" / "train.py"
    script.parent.mkdir()
    script.write_text(PROBE)
    return script


def test_a_fork_sees_its_own_argv_cwd_env_and_streams_and_exits_as_python_would(probe, tmp_path):
    env = {**os.environ, "PROBE_VALUE": "x y"}
    r = forked.run([sys.executable, str(probe), "exit3", "a b"], capture_output=True, text=True, cwd=tmp_path,
                   env=env, timeout=120)
    seen = json.loads(r.stdout.splitlines()[0])
    assert r.returncode == 3 and r.stderr.strip() == "to stderr", r.stderr
    assert seen["argv"] == [str(probe), "exit3", "a b"] and seen["cwd"] == str(tmp_path) and seen["env"] == "x y"
    assert seen["main"] == "__main__" and seen["path0"] == str(probe.parent)
    assert seen["backends"] == 0 and seen["pgid"]        # no backend inherited; its own process group
    assert (tmp_path / "atexit.txt").read_text() == "ran"
    assert (forked._server_for(env) is not None) is (os.environ.get(forked.ENV_SWITCH, "1") != "0")

    r = forked.run([sys.executable, str(probe), "raise"], capture_output=True, text=True, cwd=tmp_path, env=env,
                   timeout=120)
    assert r.returncode == 1 and "ValueError: planted" in r.stderr.splitlines()[-1]


def test_a_signal_ends_a_fork_as_it_ends_a_process_and_a_log_file_takes_both_streams(probe, tmp_path):
    log = open(tmp_path / "log.txt", "w")
    p = forked.Popen([sys.executable, str(probe), "sleep"], cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT,
                     start_new_session=True)
    assert isinstance(p, forked.ForkedProcess) is (os.environ.get(forked.ENV_SWITCH, "1") != "0")
    deadline = time.time() + 120
    while "to stderr" not in (tmp_path / "log.txt").read_text():
        assert time.time() < deadline and p.poll() is None
        time.sleep(0.05)
    with pytest.raises(subprocess.TimeoutExpired):
        p.wait(timeout=0.1)
    os.killpg(p.pid, signal.SIGKILL)       # its own group: the server and the test worker live on
    assert p.wait(timeout=60) == -signal.SIGKILL
    assert json.loads((tmp_path / "log.txt").read_text().splitlines()[0])["argv"][1] == "sleep"


def test_anything_else_is_a_plain_subprocess(probe, tmp_path, monkeypatch):
    other = probe.with_name("other.py")
    other.write_text(PROBE)
    # in tmp_path: the probe's atexit handler writes atexit.txt into its working directory
    p = forked.Popen([sys.executable, str(other), "exit3"], cwd=tmp_path, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL)
    assert isinstance(p, subprocess.Popen) and p.wait(timeout=120) == 3
    monkeypatch.setenv(forked.ENV_SWITCH, "0")
    p = forked.Popen([sys.executable, str(probe), "exit3"], cwd=tmp_path, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL)
    assert isinstance(p, subprocess.Popen) and p.wait(timeout=120) == 3


def test_the_suites_processes_write_pythons_bytecode_cache(tmp_path):
    """tests/conftest.py turns the bytecode cache on for every process the suite starts, even where
    the environment sets PYTHONDONTWRITEBYTECODE (this machine image and CI's do): a module a child
    imports leaves its .pyc, so the next process reads it instead of compiling the source again."""
    (tmp_path / "probe_module.py").write_text("VALUE = 1\n")
    subprocess.run([sys.executable, "-c", "import probe_module"], cwd=tmp_path, env=os.environ, check=True)
    assert list((tmp_path / "__pycache__").glob("probe_module.*.pyc")), "the child compiled without caching"
    assert not sys.dont_write_bytecode

"""Launchers: scripts/tpu.py (pod, via gcloud) and scripts/launch_local.py (P local processes).

No network and no gcloud binary: tpu.py is driven with --dry-run, or with a runner that executes
the --command a worker would receive in a local bash (remote dir = a tmp dir, python = a recorder).
launch_local.py runs real small programs written into tmp_path (--program).
The whole pod path (a fake gcloud, the real train.py on 2 simulated workers) is test_pod_sim.py.
"""
import importlib.metadata
import importlib.util
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tarfile
import textwrap
import time
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parent.parent
LAUNCH_LOCAL = REPO / "scripts" / "launch_local.py"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


tpu = _load("tpu")
launch_local = _load("launch_local")

POD = ["--name", "pod-1", "--zone", "us-central2-b"]
NASTY = [
    "name='x; rm -rf ~'",
    "name=x; rm -rf ~",
    "a=$(touch PWNED)",
    "b=`touch PWNED`",
    'c="; touch PWNED; echo "',
    "d=it's ok && touch PWNED",
    "e=${HOME}|touch PWNED",
]
SECRET = "s3cr3t-W4ndB-value"


def no_runner(cmd):
    raise AssertionError(f"dry run must not execute anything: {cmd}")


def dry(capsys, *argv):
    rc = tpu.main(["--dry-run", *argv], runner=no_runner)
    out, err = capsys.readouterr()
    assert rc == 0, err
    return [shlex.split(line) for line in out.splitlines()], out + err


def remote_command(argv):
    assert argv[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh"]
    return argv[argv.index("--command") + 1]


# ------------------------------------------------------------------------------------------------
# tpu.py: dry runs
# ------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_create_dry_run(capsys):
    cmds, _ = dry(capsys, "create", *POD, "--project", "proj", "--spot")
    assert cmds == [["gcloud", "compute", "tpus", "tpu-vm", "create", "pod-1", "--zone", "us-central2-b",
                     "--project", "proj", "--accelerator-type", "v4-32",
                     "--version", "tpu-ubuntu2204-base", "--spot"]]
    cmds, _ = dry(capsys, "create", *POD, "--accelerator-type", "v4-8", "--version", "v2-alpha-tpuv4",
                  "--preemptible")
    assert cmds[0][-5:] == ["--accelerator-type", "v4-8", "--version", "v2-alpha-tpuv4", "--preemptible"]


def test_common_options_before_subcommand(capsys):
    cmds, _ = dry(capsys, *POD, "delete")
    assert cmds == [["gcloud", "compute", "tpus", "tpu-vm", "delete", "pod-1", "--zone", "us-central2-b",
                     "--quiet"]]


@pytest.mark.slow
def test_sync_and_setup_dry_run(capsys):
    cmds, _ = dry(capsys, "sync", *POD)
    assert len(cmds) == 2
    scp, ssh = cmds
    assert scp[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "scp"]
    assert scp[5].endswith(".tar.gz") and scp[6] == "pod-1:jaxpt-sync.tar.gz"
    assert "--worker=all" in scp
    assert ssh[:9] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "pod-1", "--zone", "us-central2-b",
                       "--worker=all"]
    assert "tar -xzf" in remote_command(ssh) and '"$HOME"/jaxpt' in remote_command(ssh)

    cmds, _ = dry(capsys, "setup", *POD, "--mount-bucket", "gs://my-bucket")
    assert len(cmds) == 3  # sync (scp + extract) then install
    script = remote_command(cmds[2])
    assert "pip install -q -e '.[tpu,gcs]';" in script
    assert "gcsfuse --implicit-dirs my-bucket \"$HOME\"/folder-for-bucket" in script
    cmds, _ = dry(capsys, "setup", *POD, "--no-sync")
    assert len(cmds) == 1 and "gcsfuse" not in remote_command(cmds[0])


@pytest.mark.slow
def test_run_logs_stop_dry_run(capsys):
    cmds, _ = dry(capsys, "run", *POD, "--", "experiment=v4_32_llama_1b", "train.steps=10")
    assert len(cmds) == 1
    argv = cmds[0]
    assert argv[:10] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "pod-1", "--zone", "us-central2-b",
                         "--worker=all", "--command"]
    script = remote_command(argv)
    assert "stop_training" in script and "setsid nohup bash -c" in script and " python3 train.py " in script
    assert 'logs/worker_$(hostname).log' in script
    assert script.index("stop_training;") < script.index("setsid nohup")  # stale ones killed first
    words = shlex.split(script)
    i = words.index("train.py")
    assert words[i + 1:i + 4] == ["logger.progress_bar=false", "experiment=v4_32_llama_1b", "train.steps=10"]

    cmds, _ = dry(capsys, "logs", *POD, "--worker", "2", "-f")
    assert "--worker=2" in cmds[0] and "tail -n 100 -F" in remote_command(cmds[0])
    cmds, _ = dry(capsys, "stop", *POD, "--grace-period", "60")
    assert "--worker=all" in cmds[0]
    assert "kill -TERM" in remote_command(cmds[0]) and "-lt 60" in remote_command(cmds[0])


@pytest.mark.slow
def test_generated_scripts_are_valid_bash(capsys, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", SECRET)
    for argv in (["run", *POD, "--env-from-local", "WANDB_API_KEY", "--", *NASTY],
                 ["setup", *POD, "--mount-bucket", "b"], ["sync", *POD], ["logs", *POD], ["stop", *POD]):
        cmds, _ = dry(capsys, *argv)
        for c in cmds:
            if c[4] == "ssh":
                r = subprocess.run(["bash", "-n", "-c", remote_command(c)], capture_output=True, text=True)
                assert r.returncode == 0, (argv[0], r.stderr)


# ------------------------------------------------------------------------------------------------
# tpu.py setup: the pod installs what was tested
# ------------------------------------------------------------------------------------------------
def pyproject():
    tomllib = pytest.importorskip("tomllib")   # Python 3.11+
    with open(REPO / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def pinned(requirements, name):
    """The version `name==X` is pinned to among requirement strings (extras ignored)."""
    pins = [Requirement(r) for r in requirements if Requirement(r).name == name]
    assert len(pins) == 1 and len(pins[0].specifier) == 1, (name, requirements)
    spec = next(iter(pins[0].specifier))
    assert spec.operator == "==", (name, str(spec))
    return spec.version


def setup_install(capsys, *argv):
    """The `pip install` line of the setup script a dry run prints, as words."""
    cmds, _ = dry(capsys, "setup", *POD, "--no-sync", *argv)
    lexer = shlex.shlex(remote_command(cmds[0]), posix=True, punctuation_chars=";")
    lexer.whitespace_split = True
    commands, words = [], []
    for token in lexer:     # a quoted ";" stays inside its word
        if token == ";":
            commands.append(words)
            words = []
        else:
            words.append(token)
    lines = [c for c in [*commands, words] if "-e" in c]
    assert len(lines) == 1, remote_command(cmds[0])
    return lines[0]


def test_setup_installs_the_pinned_extras(capsys):
    words = setup_install(capsys)
    assert words == ["python3", "-m", "pip", "install", "-q", "-e", ".[tpu,gcs]"]
    assert setup_install(capsys, "--extras", "gpu")[-1] == ".[gpu]"
    assert setup_install(capsys, "--extras", "")[-1] == "."
    # --pip-arg: more words for the same pip call, each one argument whatever it holds
    words = setup_install(capsys, "--pip-arg", "wandb==0.19.1", "--pip-arg=--no-cache-dir", "--pip-arg", NASTY[1])
    assert words[6:] == [".[tpu,gcs]", "wandb==0.19.1", "--no-cache-dir", NASTY[1]]


@pytest.mark.parametrize("argv", [["--jax-extra", "tpu"], ["--jax-extra="], ["--jax-extra"],
                                  ["--extras", "tpu,nope"], ["--extras", "tpu;rm"]])
def test_setup_refuses_unpinned_jax_and_unknown_extras(capsys, argv):
    with pytest.raises(SystemExit) as e:
        tpu.main(["setup", *POD, "--dry-run", *argv], runner=no_runner)
    err = capsys.readouterr().err + str(e.value.code)
    assert e.value.code != 0
    if argv[0].startswith("--jax-extra"):
        assert "--jax-extra was removed" in err and "--extras" in err
    else:
        assert "--extras" in err and "nope" in err or "not an extra" in err


def test_setup_pins_are_the_tested_pins(capsys):
    """The extras `setup` installs exist in pyproject.toml; the tpu extra pins jax[tpu] to the jax the
    memory plans were compiled with ([tool.jaxpt.measured], as BENCHMARKS.md states it and, where
    libtpu is installed, as this venv compiles them); the gpu extra pins the same jax, which the core
    requirement admits; BENCHMARKS.md's GPU sections name the stack the note says they ran on."""
    project = pyproject()
    extras = project["project"]["optional-dependencies"]
    measured = project["tool"]["jaxpt"]["measured"]
    target = setup_install(capsys)[-1]
    installed = target[target.index("[") + 1:-1].split(",")
    assert set(installed) <= set(extras), installed
    assert "tpu" in installed and "gcs" in installed
    assert [Requirement(r).name for r in extras["gcs"]] == ["gcsfs"]

    jax_pin = pinned(extras["tpu"], "jax")
    assert Requirement(extras["tpu"][0]).extras == {"tpu"}
    assert jax_pin == measured["tpu_plans"]["jax"]
    benchmarks = (REPO / "BENCHMARKS.md").read_text()
    stated = set(re.findall(r"libtpu ([0-9][0-9.]*), jax ([0-9][0-9.]*[0-9])", benchmarks))
    assert stated == {(measured["tpu_plans"]["libtpu"], jax_pin)}, stated
    try:
        libtpu = importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        libtpu = None
    if libtpu is not None:     # this venv compiles plans (tests/test_compile_tpu.py): with the pinned stack
        assert (importlib.metadata.version("jax"), libtpu) == (jax_pin, measured["tpu_plans"]["libtpu"])

    assert pinned(extras["gpu"], "jax") == jax_pin
    core = [Requirement(r) for r in project["project"]["dependencies"] if Requirement(r).name == "jax"]
    assert len(core) == 1 and core[0].specifier.contains(jax_pin)
    gpu_stacks = set(re.findall(r"Device: one \*\*NVIDIA[^\n]*\n?[^\n]*?jax\s+([0-9.]*[0-9])\s+\(CUDA (\d+)\)",
                                benchmarks))
    assert gpu_stacks == {(measured["gpu"]["jax"], measured["gpu"]["cuda"])}, gpu_stacks


@pytest.mark.slow
def test_setup_pip_line_resolves_to_this_venv(capsys, tmp_path):
    """The very pip command `setup` sends, run (--dry-run, no index) on the tarball `sync` ships: the
    only thing it would install is the project itself, i.e. every pin of the extras is what this
    tested venv already holds. A pin moved away from the tested stack fails here."""
    # the line installs the tpu extra: its pins are compared where that extra is installed (CI)
    pytest.importorskip("libtpu", reason='needs the tpu extra: pip install -e ".[dev,tpu]"')
    tarball = tmp_path / "code.tar.gz"
    tpu.make_tarball(REPO, tarball)
    code = tmp_path / "jaxpt"
    with tarfile.open(tarball) as tar:
        tar.extractall(code, filter="data")
    words = setup_install(capsys)
    assert words[:3] == ["python3", "-m", "pip"]
    report = tmp_path / "report.json"
    cmd = [sys.executable, *words[1:], "--dry-run", "--no-index", "--no-build-isolation", "--report", str(report)]
    r = subprocess.run(cmd, cwd=code, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    would = {i["metadata"]["name"]: i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}
    assert would == {"jaxpt": pyproject()["project"]["version"]}


def test_setup_prints_each_workers_versions(tmp_path, capsys):
    """The script's last part, run for real in a local bash: the worker's jax, jaxlib and libtpu."""
    outputs = []

    def local_worker(cmd):
        r = subprocess.run(["bash", "-c", remote_command(cmd)], cwd=tmp_path, capture_output=True, text=True,
                           timeout=120)
        outputs.append(r.stdout + r.stderr)
        return r.returncode

    assert tpu.main(["setup", *POD, "--no-sync", "--no-install", "--remote-dir", str(tmp_path),
                     "--python", sys.executable], runner=local_worker) == 0, outputs

    def version(name):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    want = ", ".join(f"{n} {version(n)}" for n in ("jax", "jaxlib", "libtpu"))
    assert outputs[0].splitlines() == [f"{os.uname().nodename}: {want}"]


def test_overrides_cannot_inject(capsys):
    cmds, _ = dry(capsys, "run", *POD, "--", *NASTY)
    words = shlex.split(remote_command(cmds[0]))
    i = words.index("train.py")
    assert words[i + 2:i + 2 + len(NASTY)] == NASTY  # each one a single, unchanged argument
    assert words[i + 2 + len(NASTY)] == ">>"


def test_secret_never_printed(capsys, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", SECRET)
    cmds, text = dry(capsys, "run", *POD, "--env-from-local", "WANDB_API_KEY", "--env", "HF_TOKEN=hf-abc123",
                     "--env", "XLA_FLAGS=--foo", "--", "name=x")
    assert SECRET not in text and "hf-abc123" not in text
    script = remote_command(cmds[0])
    assert "export WANDB_API_KEY=***" in script and "export HF_TOKEN=***" in script
    assert "export XLA_FLAGS=--foo" in script  # not a secret-looking name: shown

    # The real command carries the value; a failure message still masks it.
    seen = []

    def failing(cmd):
        seen.append(cmd)
        return 255

    rc = tpu.main(["run", *POD, "--env-from-local", "WANDB_API_KEY", "--retries", "1", "--retry-delay", "0",
                   "--", "name=x"], runner=failing)
    out, err = capsys.readouterr()
    assert rc == 255 and len(seen) == 2
    assert f"export WANDB_API_KEY={SECRET}" in remote_command(seen[0])
    assert "failed" in err and SECRET not in out + err


def test_missing_local_env_is_an_error(monkeypatch):
    monkeypatch.delenv("JAXPT_NOT_SET_ANYWHERE", raising=False)
    with pytest.raises(SystemExit):
        tpu.main(["run", *POD, "--env-from-local", "JAXPT_NOT_SET_ANYWHERE"], runner=lambda c: 0)
    with pytest.raises(SystemExit):
        tpu.main(["run", *POD, "--env", "BAD NAME=1", "--dry-run"], runner=no_runner)
    with pytest.raises(SystemExit):  # an option after -- would otherwise silently become an override
        tpu.main(["run", *POD, "--", "name=x", "--dry-run"], runner=no_runner)


def test_retries_only_for_connection_failures(capsys):
    codes = iter([255, 255, 0])
    calls = []

    def flaky(cmd):
        calls.append(cmd)
        return next(codes)

    assert tpu.main(["stop", *POD, "--retry-delay", "0"], runner=flaky) == 0
    assert len(calls) == 3  # default --retries 2
    calls.clear()
    assert tpu.main(["stop", *POD, "--retry-delay", "0"], runner=lambda c: calls.append(c) or 1) == 1
    assert len(calls) == 1  # the remote command itself failed: no retry
    calls.clear()
    assert tpu.main(["sync", *POD, "--retry-delay", "0", "--retries", "1"],
                    runner=lambda c: calls.append(c) or 1) == 1
    assert len(calls) == 2  # scp failures are retried


def test_sync_tarball_excludes(tmp_path, capsys):
    src = tmp_path / "src"
    for rel in ["train.py", "model/llama.py", "configs/train.yaml", ".git/HEAD", "runs/a/ckpt",
                "model/__pycache__/x.pyc", "jaxpt.egg-info/PKG-INFO", "wandb/run/x", "notes/skip.me"]:
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text("x")
    names = []

    def runner(cmd):
        if cmd[4] == "scp":
            with tarfile.open(cmd[5]) as tar:
                names.extend(tar.getnames())
        return 0

    assert tpu.main(["sync", *POD, "--source", str(src), "--exclude", "*.me"], runner=runner) == 0
    assert sorted(names) == ["configs/train.yaml", "model/llama.py", "train.py"]


# ------------------------------------------------------------------------------------------------
# tpu.py: the worker-side scripts, executed for real in a local bash
# ------------------------------------------------------------------------------------------------
FAKE_PYTHON = """\
#!{python}
import json, os, signal, sys, time
def on_term(*_):
    open("terminated", "w").write("1")
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
json.dump({{"argv": sys.argv[1:], "key": os.environ.get("WANDB_API_KEY")}}, open("argv.json", "w"))
print("hello from fake train", flush=True)
time.sleep(60)
"""


@pytest.mark.slow
def test_worker_scripts_run_and_stop(tmp_path, monkeypatch, capsys):
    """run: the overrides reach 'python' verbatim (nothing injected), detached, logged, pid file;
    stop: SIGTERM reaches the process (it can checkpoint) and it is gone afterwards."""
    monkeypatch.chdir(tmp_path)
    remote = tmp_path / "remote"
    remote.mkdir()
    fake = tmp_path / "fakepython"
    fake.write_text(FAKE_PYTHON.format(python=sys.executable))
    fake.chmod(0o755)
    monkeypatch.setenv("WANDB_API_KEY", SECRET)

    def local_worker(cmd):  # what `gcloud ... ssh --command C` does on one worker: bash -c C
        return subprocess.run(["bash", "-c", remote_command(cmd)], cwd=tmp_path, timeout=60).returncode

    common = [*POD, "--remote-dir", str(remote), "--python", str(fake)]
    nasty = NASTY + ["f=line1\nline2"]
    assert tpu.main(["run", *common, "--startup-check", "1", "--env-from-local", "WANDB_API_KEY",
                     "--", *nasty], runner=local_worker) == 0
    try:
        deadline = time.time() + 20
        while not (remote / "argv.json").exists() and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)
        rec = json.loads((remote / "argv.json").read_text())
        assert rec["argv"] == ["train.py", "logger.progress_bar=false", *nasty]
        assert rec["key"] == SECRET
        assert not list(tmp_path.rglob("PWNED"))
        pid = int((remote / "logs" / "train.pid").read_text())
        os.kill(pid, 0)  # running, detached
        logs = list((remote / "logs").glob("worker_*.log"))
        assert len(logs) == 1 and "hello from fake train" in logs[0].read_text()
    finally:
        assert tpu.main(["stop", *common, "--grace-period", "10"], runner=local_worker) == 0
    assert (remote / "terminated").exists()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert not (remote / "logs" / "train.pid").exists()
    assert (remote / "logs" / "stop_requested").exists()      # the --restarts loop does not restart
    assert not list(tmp_path.rglob("PWNED"))


FAKE_PYTHON_WITH_WORKER = """\
#!{python}
import signal, subprocess, sys, time
# Its "input worker": a child in the same process group, told apart by the SIGTERM it must not get.
worker = subprocess.Popen([sys.executable, "-c", "import os, signal, sys, time\\n"
                           "signal.signal(signal.SIGTERM, "
                           "lambda *a: (open('worker_terminated', 'w').close(), sys.exit(0)))\\n"
                           "open('worker.pid', 'w').write(str(os.getpid()))\\n"
                           "time.sleep(120)"])
def on_term(*_):
    open("terminated", "w").close()
    sys.exit(0)     # leaves its worker behind: `stop` has to wait for the group and kill it
signal.signal(signal.SIGTERM, on_term)
time.sleep(120)
"""


def alive_not_zombie(pid):
    """A killed orphan stays a zombie until PID 1 reaps it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
def test_stop_terms_train_py_alone_then_kills_its_group(tmp_path):
    """SIGTERM goes to train.py only (its input workers keep serving until it has saved), `stop`
    waits for the whole process group and SIGKILLs what is left after the grace period; the log
    records train.py's exit code."""
    remote = tmp_path / "remote"
    remote.mkdir()
    fake = tmp_path / "fakepython"
    fake.write_text(FAKE_PYTHON_WITH_WORKER.format(python=sys.executable))
    fake.chmod(0o755)
    outputs = []

    def local_worker(cmd):
        r = subprocess.run(["bash", "-c", remote_command(cmd)], cwd=tmp_path, timeout=60, capture_output=True,
                           text=True, start_new_session=True)
        outputs.append(r.stdout + r.stderr)
        return r.returncode

    common = [*POD, "--remote-dir", str(remote), "--python", str(fake)]
    assert tpu.main(["run", *common, "--startup-check", "0"], runner=local_worker) == 0
    deadline = time.time() + 30
    while not (remote / "worker.pid").exists() and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)
    worker_pid = int((remote / "worker.pid").read_text())
    assert tpu.main(["stop", *common, "--grace-period", "2"], runner=local_worker) == 0
    assert (remote / "terminated").exists() and not (remote / "worker_terminated").exists()
    assert "SIGKILL" in outputs[-1]
    deadline = time.time() + 10        # SIGKILL is delivered asynchronously
    while alive_not_zombie(worker_pid) and time.time() < deadline:
        time.sleep(0.05)
    assert not alive_not_zombie(worker_pid)
    log = next((remote / "logs").glob("worker_*.log")).read_text()
    assert "train.py exited with code 0" in log.rstrip().splitlines()[-1]


@pytest.mark.slow
def test_run_reports_early_crash(tmp_path, monkeypatch, capsys):
    remote = tmp_path / "remote"
    remote.mkdir()
    fake = tmp_path / "crashpython"
    fake.write_text(f"#!{sys.executable}\nimport sys\nprint('boom: bad config', flush=True)\nsys.exit(7)\n")
    fake.chmod(0o755)

    def local_worker(cmd):
        return subprocess.run(["bash", "-c", remote_command(cmd)], cwd=tmp_path, timeout=60,
                              capture_output=True, text=True).returncode

    rc = tpu.main(["run", *POD, "--remote-dir", str(remote), "--python", str(fake), "--startup-check", "1",
                   "--retry-delay", "0"], runner=local_worker)
    assert rc == 7


# A stand-in for train.py under the --restarts loop: start k exits with line k of ./codes ("stop":
# first writes the marker, as `stop` does before its SIGTERM, then exits as a preempted run).
FAKE_EXITS = """\
n=$(( $(cat starts 2>/dev/null || echo 0) + 1 )); echo $n > starts
echo "start $n ${JAXPT_EXIT_PREEMPTED:-unset}" >> env.txt
code=$(sed -n "${n}p" codes)
if [ "$code" = stop ]; then : > logs/stop_requested; code=76; fi
exit $code
"""


def run_wrapper(tmp_path, restarts, codes, stale_marker=False):
    """The --restarts loop of `tpu.py run` (train_wrapper) around FAKE_EXITS, as the detached
    session runs it: (its exit code, its output, the program's starts as 'n env' lines)."""
    work = tmp_path / f"w{len(list(tmp_path.iterdir()))}"
    (work / "logs").mkdir(parents=True)
    (work / "codes").write_text("\n".join(codes) + "\n")
    (work / "fake.sh").write_text(FAKE_EXITS)
    if stale_marker:
        (work / "logs" / "stop_requested").write_text("")
    r = subprocess.run(["bash", "-c", tpu.train_wrapper(restarts), "jaxpt-train", "bash", "fake.sh"], cwd=work,
                       capture_output=True, text=True, timeout=30)
    return r.returncode, r.stdout + r.stderr, (work / "env.txt").read_text().splitlines()


def test_wrapper_restarts_on_hang_and_preemption_never_after_stop(tmp_path):
    """train_wrapper: 75 (hang) and 76 (preempted, saved) start train.py again, against one count;
    a preempted exit with no restart left ends it with 0; after `stop` (its marker) no restart,
    but a marker left from before the launch does not count; any other code ends it as it is."""
    rc, out, starts = run_wrapper(tmp_path, 2, ["76", "75", "0"])
    assert rc == 0 and starts == ["start 1 1", "start 2 1", "start 3 1"], out
    assert "=== restart 1 of 2 (preempted, exit code 76) ===" in out
    assert "=== restart 2 of 2 (hang watchdog, exit code 75) ===" in out
    assert out.rstrip().splitlines()[-1].endswith("train.py exited with code 0 ===")

    rc, out, starts = run_wrapper(tmp_path, 1, ["76", "76"])       # no restart left: saved, a clean end
    assert rc == 0 and len(starts) == 2 and out.count("=== restart") == 1, out
    assert out.rstrip().splitlines()[-1].endswith("train.py exited with code 76 ===")

    rc, out, starts = run_wrapper(tmp_path, 2, ["stop", "0"])        # a deliberate stop: no restart
    assert rc == 0 and len(starts) == 1, out
    assert "=== restart" not in out and out.rstrip().splitlines()[-1] == "=== stop requested: no restart ==="
    rc, out, starts = run_wrapper(tmp_path, 2, ["75", "0"], stale_marker=True)
    assert rc == 0 and len(starts) == 2 and "restart 1 of 2 (hang watchdog" in out, out

    rc, out, starts = run_wrapper(tmp_path, 2, ["3", "0"])           # a crash is not restarted
    assert rc == 3 and len(starts) == 1 and "restart" not in out, out
    # Without restarts train.py is not asked for 76: a preempted run exits 0, as `stop` expects.
    rc, out, starts = run_wrapper(tmp_path, 0, ["0"])
    assert rc == 0 and starts == ["start 1 unset"], out


def test_preempted_exit_code_only_when_asked(monkeypatch):
    from model.runtime.distributed import EXIT_PREEMPTED, EXIT_PREEMPTED_ENV, preempted_exit_code

    monkeypatch.delenv(EXIT_PREEMPTED_ENV, raising=False)
    assert preempted_exit_code() == 0             # a plain `python train.py`: SIGTERM, save, exit 0
    monkeypatch.setenv(EXIT_PREEMPTED_ENV, "0")
    assert preempted_exit_code() == 0
    monkeypatch.setenv(EXIT_PREEMPTED_ENV, "1")
    assert preempted_exit_code() == EXIT_PREEMPTED == 76


# ------------------------------------------------------------------------------------------------
# launch_local.py
# ------------------------------------------------------------------------------------------------
PROGRAM = """\
import json, os, signal, sys, time
args = dict(a.split("=", 1) for a in sys.argv[1:] if "=" in a)
pid = int(args["distributed.process_id"])
out = os.environ["OUT_DIR"]
def on_term(*_):
    open(os.path.join(out, f"term_{{pid}}"), "w").write("1")
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
json.dump({{"argv": sys.argv[1:], "os_pid": os.getpid(), "jax_platforms": os.environ.get("JAX_PLATFORMS")}},
          open(os.path.join(out, f"started_{{pid}}.json"), "w"))
print(f"process {{pid}} says hi", flush=True)
{body}
"""


def write_program(tmp_path, body):
    prog = tmp_path / "prog.py"
    prog.write_text(PROGRAM.format(body=textwrap.dedent(body)))
    return prog


def launch(tmp_path, prog, *extra, overrides=("name=t",), **kw):
    env = dict(os.environ, OUT_DIR=str(tmp_path))
    cmd = [sys.executable, str(LAUNCH_LOCAL), "--processes", "2", "--devices-per-process", "2",
           "--program", str(prog), *extra, "--", *overrides]
    return subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, **kw)


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
def test_local_failure_stops_everyone(tmp_path):
    prog = write_program(tmp_path, """
        if pid == 1:
            time.sleep(0.5)
            print("process 1 fails", flush=True)
            sys.exit(3)
        time.sleep(60)
    """)
    t0 = time.time()
    p = launch(tmp_path, prog, "--log-dir", str(tmp_path / "logs"))
    out, err = p.communicate(timeout=60)
    assert p.returncode == 3, err
    assert time.time() - t0 < 30
    for i in range(2):
        assert (tmp_path / "logs" / f"process_{i}.log").exists()
        assert not alive(json.loads((tmp_path / f"started_{i}.json").read_text())["os_pid"])
    assert (tmp_path / "term_0").exists()  # the survivor got SIGTERM first
    assert "process 1 fails" in (tmp_path / "logs" / "process_1.log").read_text()
    assert "process 0 says hi" in out and "process 1 says hi" not in out  # only process 0 on console
    assert "process 1 exited with code 3" in err and "process 1 fails" in err  # its log tail


@pytest.mark.slow
def test_local_success_args_and_default_log_dir(tmp_path):
    prog = write_program(tmp_path, "")
    odd = "msg='a b; $(touch PWNED)'"
    p = launch(tmp_path, prog, "--port", "12345", overrides=("name=smoke", odd))
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    for i in range(2):
        rec = json.loads((tmp_path / f"started_{i}.json").read_text())
        assert rec["argv"] == ["name=smoke", odd, "distributed.coordinator_address=localhost:12345",
                               "distributed.num_processes=2", f"distributed.process_id={i}",
                               "distributed.local_device_count=2"]
        assert rec["jax_platforms"] == "cpu"
        log = tmp_path / "runs" / "smoke" / "logs" / f"process_{i}.log"
        assert f"process {i} says hi" in log.read_text()
    assert not list(tmp_path.rglob("PWNED"))


@pytest.mark.slow
def test_local_sigterm_is_forwarded(tmp_path):
    prog = write_program(tmp_path, "time.sleep(60)")
    p = launch(tmp_path, prog, "--log-dir", str(tmp_path / "logs"))
    deadline = time.time() + 30
    while not all((tmp_path / f"started_{i}.json").exists() for i in range(2)) and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 128 + signal.SIGTERM, err
    assert (tmp_path / "term_0").exists() and (tmp_path / "term_1").exists()


@pytest.mark.slow
def test_local_preempted_processes_restart(tmp_path):
    """--restarts: processes that were preempted (exit 76, asked for by $JAXPT_EXIT_PREEMPTED) are
    waited for, not stopped, and the job starts again; without --restarts they exit 0 and it ends."""
    prog = write_program(tmp_path, """
        life_file = os.path.join(out, f"life_{pid}")
        life = int(open(life_file).read()) + 1 if os.path.exists(life_file) else 1
        open(life_file, "w").write(str(life))
        if life == 1:
            time.sleep(1.0 if pid == 0 else 0)     # process 1 leaves first; process 0 still saves
            sys.exit(76 if os.environ.get("JAXPT_EXIT_PREEMPTED") == "1" else 0)
    """)
    p = launch(tmp_path, prog, "--log-dir", str(tmp_path / "logs"), "--restarts", "1")
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert "a process exited with code 76 (preempted): restart 1 of 1" in err
    assert "stopping" not in err and not (tmp_path / "term_0").exists()   # process 0 was left to finish
    assert [(tmp_path / f"life_{i}").read_text() for i in range(2)] == ["2", "2"]

    for i in range(2):
        (tmp_path / f"life_{i}").unlink()
    p = launch(tmp_path, prog, "--log-dir", str(tmp_path / "logs"))
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0 and "restart" not in err, err
    assert [(tmp_path / f"life_{i}").read_text() for i in range(2)] == ["1", "1"]


@pytest.mark.slow
def test_local_grace_period_then_kill(tmp_path):
    prog = write_program(tmp_path, """
        signal.signal(signal.SIGTERM, signal.SIG_IGN)   # a process that will not stop by itself
        time.sleep(60)
    """)
    p = launch(tmp_path, prog, "--log-dir", str(tmp_path / "logs"), "--grace-period", "1")
    deadline = time.time() + 30
    while not all((tmp_path / f"started_{i}.json").exists() for i in range(2)) and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    t0 = time.time()
    p.send_signal(signal.SIGINT)
    p.communicate(timeout=60)
    assert p.returncode == 128 + signal.SIGINT
    assert time.time() - t0 < 15
    for i in range(2):
        assert not alive(json.loads((tmp_path / f"started_{i}.json").read_text())["os_pid"])


@pytest.mark.slow
def test_local_rejects_distributed_overrides(tmp_path):
    with pytest.raises(SystemExit):
        launch_local.parse_args(["--processes", "2", "--devices-per-process", "1", "--",
                                 "distributed.process_id=3"])
    a = launch_local.parse_args(["-p", "2", "-d", "4", "--", "name=x", "+foo=bar"])
    assert a.overrides == ["name=x", "+foo=bar"]


def test_local_slices_tell_each_process_its_slice():
    # 4 processes as 2 simulated slices: consecutive processes share a slice
    told = [launch_local.distributed_overrides(1234, 4, i, 2, slices=2)[-1] for i in range(4)]
    assert told == ["distributed.slice_index=0"] * 2 + ["distributed.slice_index=1"] * 2
    assert not any("slice_index" in o for o in launch_local.distributed_overrides(1234, 4, 3, 2))
    with pytest.raises(SystemExit):   # 3 processes do not split into 2 slices
        launch_local.parse_args(["-p", "3", "-d", "1", "--slices", "2"])
    with pytest.raises(SystemExit):   # the launcher tells the slices
        launch_local.parse_args(["-p", "2", "-d", "1", "--slices", "2", "--", "distributed.slice_index=0"])


# ------------------------------------------------------------------------------------------------
# tpu.py: several slices (--slices N: one queued resource, every worker of every slice)
# ------------------------------------------------------------------------------------------------
def test_slices_create_one_queued_resource_and_delete_it(capsys):
    cmds, _ = dry(capsys, "create", *POD, "--slices", "2", "--spot")
    assert cmds == [["gcloud", "compute", "tpus", "queued-resources", "create", "pod-1", "--zone", "us-central2-b",
                     "--node-count", "2", "--node-prefix", "pod-1", "--accelerator-type", "v4-32",
                     "--runtime-version", "tpu-ubuntu2204-base", "--spot"]]
    cmds, _ = dry(capsys, "--slices", "2", "delete", *POD)
    assert cmds == [["gcloud", "compute", "tpus", "queued-resources", "delete", "pod-1", "--zone", "us-central2-b",
                     "--force", "--quiet"]]
    with pytest.raises(SystemExit):     # queued resources know --spot, not the legacy --preemptible
        tpu.parse_args(["create", *POD, "--slices", "2", "--preemptible"])
    with pytest.raises(SystemExit):
        tpu.parse_args(["logs", *POD, "--slices", "2", "--slice", "2"])


def test_slices_every_command_reaches_every_worker_of_every_slice(capsys):
    cmds, _ = dry(capsys, "sync", *POD, "--slices", "3")
    assert [(c[4], c[5] if c[4] == "ssh" else c[6].split(":")[0]) for c in cmds] == [
        (verb, f"pod-1-{i}") for i in range(3) for verb in ("scp", "ssh")]
    assert all("--worker=all" in c for c in cmds)
    for verb in ("stop", "setup"):
        cmds, _ = dry(capsys, verb, *POD, "--slices", "3", *(["--no-sync"] if verb == "setup" else []))
        assert [c[5] for c in cmds] == ["pod-1-0", "pod-1-1", "pod-1-2"] and all("--worker=all" in c for c in cmds)
    cmds, _ = dry(capsys, "logs", *POD, "--slices", "3", "--slice", "2", "--worker", "1")
    assert cmds[0][5] == "pod-1-2" and "--worker=1" in cmds[0]


def test_slices_run_gives_each_slice_its_megascale_settings_quoted(capsys):
    cmds, _ = dry(capsys, "run", *POD, "--slices", "2", "--megascale-coordinator", "10.0.0.2; touch PWNED",
                  "--restarts", "3", "--", *NASTY)
    assert [c[5] for c in cmds] == ["pod-1-0", "pod-1-1"]
    for i, c in enumerate(cmds):
        script = remote_command(c)
        assert f"export MEGASCALE_SLICE_ID={i};" in script and "export MEGASCALE_NUM_SLICES=2;" in script
        assert "export MEGASCALE_COORDINATOR_ADDRESS='10.0.0.2; touch PWNED';" in script
        words = shlex.split(script)
        j = words.index("train.py")
        assert words[j + 2:j + 2 + len(NASTY)] == NASTY
        assert subprocess.run(["bash", "-n", "-c", script], capture_output=True).returncode == 0
    assert not any("MEGASCALE" in remote_command(c) for c in dry(capsys, "run", *POD, "--", "name=x")[0])


def test_slices_megascale_settings_only_where_the_vm_has_none(tmp_path):
    """The generated lines run in bash: a value the worker's environment already has is kept, the
    others are set; with no coordinator anywhere the worker stops in one line."""
    args = tpu.parse_args(["run", *POD, "--slices", "2", "--megascale-coordinator", "10.0.0.2", "--", "x=1"])
    show = 'echo "$MEGASCALE_NUM_SLICES $MEGASCALE_SLICE_ID $MEGASCALE_PORT $MEGASCALE_COORDINATOR_ADDRESS"'
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "MEGASCALE_SLICE_ID": "7"}
    script = "; ".join([*tpu.megascale_exports(args, 1), show])
    r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert r.stdout.split() == ["2", "7", "8081", "10.0.0.2"], r.stderr
    args.megascale_coordinator = None
    r = subprocess.run(["bash", "-c", "; ".join([*tpu.megascale_exports(args, 1), show])], capture_output=True,
                       text=True, env=env, timeout=60)
    assert r.returncode == 2 and "--megascale-coordinator" in r.stderr and not r.stdout


@pytest.mark.slow
def test_local_lost_slice_waits_for_the_others_and_restarts(tmp_path):
    """--restarts: a process killed from outside (its slice lost) is named with its slice; the others
    leave on their own (here process 0 exits 75 as its hang watchdog would) and the job starts
    again. Without --restarts the job fails with the killed process's code, the others stopped."""
    prog = write_program(tmp_path, """
        life_file = os.path.join(out, f"life_{pid}")
        life = int(open(life_file).read()) + 1 if os.path.exists(life_file) else 1
        open(life_file, "w").write(str(life))
        if life == 1 and pid == 1:
            os.kill(os.getpid(), signal.SIGKILL)     # slice 1's only host goes away
        if life == 1:
            time.sleep(2.0)                         # process 0 stalls on its dead peer, then its watchdog
            sys.exit(75)
    """)
    p = launch(tmp_path, prog, "--log-dir", str(tmp_path / "logs"), "--slices", "2", "--restarts", "1")
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert "process 1 (slice 1) lost first (killed by signal 9)" in err
    assert "restart 1 of 1" in err and not (tmp_path / "term_0").exists()   # process 0 left on its own
    assert [(tmp_path / f"life_{i}").read_text() for i in range(2)] == ["2", "2"]

    for i in range(2):
        (tmp_path / f"life_{i}").unlink()
    p = launch(tmp_path, prog, "--log-dir", str(tmp_path / "logs"), "--slices", "2")
    out, err = p.communicate(timeout=60)
    assert p.returncode == 128 + signal.SIGKILL and "process 1 exited with code 137" in err, err
    assert (tmp_path / "term_0").exists()       # no restarts: the survivor is stopped at once


@pytest.mark.slow
def test_local_lost_slice_with_a_peer_aborting_at_once_still_restarts(tmp_path):
    """Gloo aborts a survivor (SIGABRT) within a millisecond of its peer's SIGKILL, as at CI in
    stop 70: the launcher, which polls every 0.1 s, mostly sees both dead at once. The abort is
    the survivor's own crash, the kill a lost slice: named, the abort told, the job restarted."""
    prog = write_program(tmp_path, """
        life_file = os.path.join(out, f"life_{pid}")
        life = int(open(life_file).read()) + 1 if os.path.exists(life_file) else 1
        open(life_file, "w").write(str(life))
        if life == 1:
            open(os.path.join(out, f"ready_{pid}"), "w").close()
            while not all(os.path.exists(os.path.join(out, f"ready_{i}")) for i in range(2)):
                time.sleep(0.001)
            if pid == 1:
                os.kill(os.getpid(), signal.SIGKILL)     # slice 1's only host goes away
            time.sleep(0.002)
            os.abort()                                  # process 0: Gloo's abort on the half-sent message
    """)
    p = launch(tmp_path, prog, "--log-dir", str(tmp_path / "logs"), "--slices", "2", "--restarts", "1")
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert "process 1 (slice 1) lost first (killed by signal 9)" in err, err
    assert "the others left: process 0 (slice 0) killed by signal 6 (SIGABRT)" in err, err
    assert "restart 1 of 1" in err and [(tmp_path / f"life_{i}").read_text() for i in range(2)] == ["2", "2"]

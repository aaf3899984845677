"""scripts/tpu.py end to end on a simulated 2-worker pod (tests/pod_sim.py: a fake `gcloud` runs
each command in the workers' homes, through their shells, with a TPU VM's environment).

    pytest tests/test_pod_sim.py -q        # about a minute on 2 cores

setup (no pip install: --no-install) -> run --restarts 2 -> logs -> a preempted host -> stop -> run.
The two train.py processes find each other from the TPU VM environment alone (no distributed.*
override), train one tiny model together, save on SIGTERM; a preemption (SIGTERM to one host's
train.py) exits 76 and the run starts again from that step, `stop` exits 76 too but ends the run;
the second run resumes from that checkpoint and exits 0. A run name holding quotes, spaces, `;`
and `$(...)` reaches train.py verbatim and never runs as a command.
"""
import json
import os
import signal
import time
from pathlib import Path

import pytest
import yaml
from pod_sim import SimPod
from run_helpers import MICRO, without_device_count

from model.runtime import distributed

# A tiny model on the bundled sample, logged every step (a SIGTERM is agreed between hosts at log
# steps) and no periodic checkpoint: the only checkpoint is the one `stop` causes.
# The progress bar is left to tpu.py, which turns it off for detached runs (`logs` shows step lines).
TINY = [*MICRO, "mesh=fsdp", "data.seq_len=64", "data.global_batch_size=16", "data.num_shards=4", "data.num_workers=1",
        "train.log_every=1", "train.eval_every=0", "checkpoint.every=1000000", "logger.wandb.mode=offline",
        "optimizer.warmup_steps=1", "optimizer.decay_steps=1000"]
# As typed on the local command line; Hydra's own quoting makes it one string value.
ODD_NAME = """name='it\\'s "odd"; $(touch PWNED) a  b'"""
ODD_NAME_VALUE = """it's "odd"; $(touch PWNED) a  b"""
# The workers' train.py waits this long before each step (tests/step_hooks.py pace): the runs train
# until the test stops them, and a tiny step takes milliseconds, so unpaced they kept both cores busy
# for the minute a journey lasts.
STEP_PACE_S = 0.2
# The suite's XLA compile level and one compilation cache for every simulated worker (tests/conftest.py):
# without them each worker's train.py compiled the same programs at the default level in its own home.
WORKER_ENV = {k: v for k, v in without_device_count().items()
              if k in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS")}
EXIT_0 = "train.py exited with code 0"
EXIT_76 = "train.py exited with code 76"


def ok(result):
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result.stdout


def wait_for_exits(pod, launches, timeout=300):
    """Until every worker's log records `launches` exits of train.py. Reads the logs directly:
    polling through `tpu.py logs` would add a python and two shells per poll to a busy machine."""
    deadline = time.time() + timeout
    while not all(worker_log(pod, w).count("train.py exited with code") >= launches for w in range(pod.workers)):
        assert time.time() < deadline, [worker_log(pod, w)[-2000:] for w in range(pod.workers)] + hang_stacks(pod)
        time.sleep(1)


def hang_stacks(pod):
    """What the hang watchdog wrote (model/runtime/watchdog.py): where each process stood, for a failure message."""
    return [f"{path}:\n{path.read_text()[-4000:]}" for w in range(pod.workers)
            for path in sorted((pod.home(w) / "jaxpt" / "runs").rglob("hang_stacks_p*.txt"))]


def worker_log(pod, w):
    return next((pod.home(w) / "jaxpt" / "logs").glob("worker_*.log")).read_text()


@pytest.fixture
def pod(tmp_path):
    pod = SimPod(tmp_path / "pod", workers=2, devices_per_worker=2, step_pace_s=STEP_PACE_S, env=WORKER_ENV)
    yield pod
    # A failed test must not leave detached train.py processes behind on a shared machine.
    pod.tpu("stop", "--grace-period", "10")


@pytest.mark.slow
def test_sync_run_logs_stop_resume_on_simulated_pod(pod, tmp_path):
    bucket = tmp_path / "bucket" / "ckpt"      # stands for gs://...: all workers write one checkpoint there

    out = ok(pod.tpu("setup", "--no-install"))
    for w in range(2):
        assert f"t1v-n-pod-sim-w-{w}: jax " in out
        assert (pod.home(w) / "jaxpt" / "train.py").exists()

    ok(pod.tpu("run", "--restarts", "2", "--", *TINY, "train.steps=1000000", f"checkpoint.dir={bucket}", ODD_NAME))
    # `logs` (worker 0 by default) shows the training progress (waited for in the log itself: a poll
    # through `logs` costs a python and two shells each time).
    deadline = time.time() + 300
    while "step 2 loss" not in (log0 := worker_log(pod, 0)):
        assert time.time() < deadline and "exited with code" not in log0, log0[-4000:]
        time.sleep(1)
    log0 = ok(pod.tpu("logs"))
    assert "step 2 loss" in log0 and "Starting a new run" in log0
    # Both workers joined one 2-process x 2-device job, from the TPU VM environment alone.
    pid = int((pod.home(0) / "jaxpt" / "logs" / "train.pid").read_text())
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]
    assert argv[-1] == ODD_NAME                 # verbatim, one argument
    assert not any(a.startswith("distributed.") for a in argv)

    # Worker 1 is preempted: both hosts save one step, exit 76, and the loops start them again.
    os.kill(int((pod.home(1) / "jaxpt" / "logs" / "train.pid").read_text()), signal.SIGTERM)
    wait_for_exits(pod, launches=1)
    preempted = int(worker_log(pod, 0).split("Preempted: saved step ")[1].split()[0])
    restarted = "=== restart 1 of 2 (preempted, exit code 76) ==="
    deadline = time.time() + 300
    while f"step {preempted + 1} loss" not in (log0 := worker_log(pod, 0)).partition(restarted)[2]:
        assert time.time() < deadline and log0.count("exited with code") == 1, log0[-4000:]
        time.sleep(1)
    second_life = log0.partition(restarted)[2]
    assert "Resuming from latest checkpoint" in second_life and f"at step {preempted}" in second_life, \
        second_life[-3000:]
    assert restarted in worker_log(pod, 1)

    out = ok(pod.tpu("stop", "--grace-period", "120"))
    assert "SIGKILL" not in out
    logs = [worker_log(pod, w) for w in range(2)]
    for log in logs:        # both lives ended preempted; `stop` left the last restart unused
        assert log.count(EXIT_76) == 2 and "restart 2 of 2" not in log, log[-3000:]
        assert log.rstrip().splitlines()[-1] == "=== stop requested: no restart ===", log[-1500:]
    saved = int(logs[0].split("Preempted: saved step ")[-1].split()[0])
    assert saved > preempted
    # One checkpoint written by a 2-process job: each process saved its data state there.
    assert sorted(f.name for f in (bucket / str(saved) / "data").glob("*.json")) == \
        ["process_0-of-2.json", "process_1-of-2.json"]
    run_dir = pod.home(0) / "jaxpt" / "runs" / ODD_NAME_VALUE
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["name"] == ODD_NAME_VALUE
    assert config["distributed"]["coordinator_address"] is None

    # A hang here (seen once in a loaded suite: both hosts stopped before the last step's row)
    # ends in a minute with every process's stacks in the failure message, not at the 300-s wait.
    ok(pod.tpu("run", "--", *TINY, f"train.steps={saved + 2}", f"checkpoint.dir={bucket}", "train.hang_timeout_s=60",
               ODD_NAME))
    wait_for_exits(pod, launches=3)           # the preempted life, the stopped one, this run
    out = ok(pod.tpu("logs", "--worker", "all"))
    assert out.count(EXIT_0) == 2, [out[-4000:]] + hang_stacks(pod)      # the second launch, both workers
    logs = [worker_log(pod, w) for w in range(2)]
    second = logs[0].split("start ===")[-1]
    assert "Resuming from latest checkpoint" in second and f"at step {saved}" in second, second[-2000:]
    assert f"Done: steps {saved}->{saved + 2}" in second
    wandb_ids = [line.split()[2].rstrip(":") for line in logs[0].splitlines() if line.startswith("wandb run ")]
    assert len(wandb_ids) == 3 and len(set(wandb_ids)) == 1      # the same wandb run continues
    assert (bucket / str(saved + 2)).is_dir()
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, saved + 3))     # continued, not restarted
    assert not list(tmp_path.rglob("PWNED"))


def test_tpu_slice_from_the_vm_environment(monkeypatch):
    """What the run reads to start jax.distributed on a pod (model/runtime/distributed.py), and its one-line errors."""
    for name in ("MEGASCALE_COORDINATOR_ADDRESS", "MEGASCALE_NUM_SLICES", "MEGASCALE_SLICE_ID",
                 "JAX_COORDINATOR_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "10.0.0.2,10.0.0.3,10.0.0.4,10.0.0.5")
    monkeypatch.setenv("TPU_WORKER_ID", "2")
    assert distributed.tpu_slice_from_env() == {"coordinator_address": "10.0.0.2:8482", "num_processes": 4,
                                               "process_id": 2}
    monkeypatch.setenv("JAX_COORDINATOR_PORT", "9999")
    assert distributed.tpu_slice_from_env()["coordinator_address"] == "10.0.0.2:9999"
    for bad in ("4", "", "w1"):
        monkeypatch.setenv("TPU_WORKER_ID", bad)
        with pytest.raises(ValueError, match="TPU_WORKER_ID"):
            distributed.tpu_slice_from_env()
    monkeypatch.setenv("MEGASCALE_COORDINATOR_ADDRESS", "10.0.0.2")    # multislice, settings in the VM's
    assert distributed.tpu_slice_from_env() is None                     # metadata: jax's own detection
    # Multislice settings in the environment (scripts/tpu.py run --slices): one job over all slices'
    # hosts, numbered slice by slice, coordinated on the Megascale coordinator's host.
    monkeypatch.setenv("TPU_WORKER_ID", "1")
    monkeypatch.setenv("MEGASCALE_COORDINATOR_ADDRESS", "10.0.1.2:8081")
    monkeypatch.setenv("MEGASCALE_NUM_SLICES", "2")
    monkeypatch.setenv("MEGASCALE_SLICE_ID", "1")
    assert distributed.tpu_slice_from_env() == {"coordinator_address": "10.0.1.2:9999", "num_processes": 8,
                                               "process_id": 5}
    monkeypatch.setenv("MEGASCALE_SLICE_ID", "2")
    with pytest.raises(ValueError, match="MEGASCALE_SLICE_ID='2' is not a slice of MEGASCALE_NUM_SLICES='2'"):
        distributed.tpu_slice_from_env()
    for name in ("MEGASCALE_COORDINATOR_ADDRESS", "MEGASCALE_NUM_SLICES", "MEGASCALE_SLICE_ID"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "10.0.0.2")             # one host: no jax.distributed
    assert distributed.tpu_slice_from_env() is None


@pytest.mark.slow
def test_a_frozen_worker_ends_in_a_hang_and_run_restarts_resumes(pod, tmp_path):
    """SIGSTOP worker 1's train.py mid-run: worker 0's watchdog ends it with code 75 and
    `tpu.py run --restarts 1` starts it again; when worker 1 runs again (SIGCONT) its own watchdog
    fires at once (late: it was frozen), it restarts too, the two meet again and the run finishes
    from the newest checkpoint, the steps trained twice at the same losses; the second start
    names worker 1 as the host that stopped first."""
    import os
    import signal

    bucket = tmp_path / "bucket" / "ckpt"
    ok(pod.tpu("setup", "--no-install"))
    ok(pod.tpu("run", "--restarts", "1", "--", *TINY, "train.steps=30", "train.hang_timeout_s=6",
               "checkpoint.every=4", f"checkpoint.dir={bucket}", "name=frozen"))
    deadline = time.time() + 300
    while "step 6 loss" not in worker_log(pod, 0):
        assert time.time() < deadline and "exited with code" not in worker_log(pod, 0), worker_log(pod, 0)[-3000:]
        time.sleep(1)
    frozen = int((pod.home(1) / "jaxpt" / "logs" / "train.pid").read_text())
    os.kill(frozen, signal.SIGSTOP)
    try:
        deadline = time.time() + 120
        while "restart 1 of 1" not in worker_log(pod, 0):
            assert time.time() < deadline, worker_log(pod, 0)[-3000:]
            time.sleep(1)
        time.sleep(5)       # worker 1 stays frozen a while after its peer left, as a stopped VM would
    finally:
        os.kill(frozen, signal.SIGCONT)
    wait_for_exits(pod, launches=2)
    logs = [worker_log(pod, w) for w in range(2)]
    for log in logs:
        exits = [line.split("code ")[1].split()[0] for line in log.splitlines() if "train.py exited with code" in line]
        assert exits == ["75", "0"], log[-3000:]
    assert "hang: no step completed" in logs[0]
    run_dirs = [pod.home(w) / "jaxpt" / "runs" / "frozen" for w in range(2)]
    assert "MainThread" in (run_dirs[0] / "hang_stacks_p0.txt").read_text()
    second = logs[0].split("restart 1 of 1")[1]
    named = second.split("The last start ended in a hang: ")[1].split(";")[0]
    assert named.startswith("process 1 (") and "stopped first (it was frozen: its own watchdog ran" in named, named
    assert "Resuming from latest checkpoint" in second and "Done: steps" in second
    by_step = {}
    for line in (run_dirs[0] / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "loss" in r:
            by_step.setdefault(r["step"], []).append(r["loss"])
    assert max(by_step) == 30
    # The second start resumes from a checkpoint the first one saved; the steps the first trained
    # after it (none when worker 1 froze right after a save) are trained again to the same losses.
    resumed_at = int(second.split("Resuming from latest checkpoint")[1].split(" at step ")[1].split()[0])
    assert resumed_at >= 4 and resumed_at % 4 == 0 and set(range(1, 31)) <= set(by_step), (resumed_at, by_step)
    twice = [s for s, losses in by_step.items() if len(losses) == 2]
    assert all(s > resumed_at and by_step[s][0] == by_step[s][1] for s in twice), {s: by_step[s] for s in twice}


@pytest.mark.slow
def test_two_slices_train_as_one_job_on_a_simulated_multislice_pod(tmp_path):
    """scripts/tpu.py --slices 2 against two simulated TPU VMs (pod-sim-0, pod-sim-1, one worker of 2
    fake chips each, no Megascale settings of their own): setup and run reach every worker of every
    slice, run gives each its slice's Megascale settings, and the two train.py form one 2-process
    job over a 2-slice mesh (the rows name the slowest host's slice) that saves one checkpoint."""
    pod = SimPod(tmp_path / "pod", workers=1, devices_per_worker=2, slices=2, step_pace_s=STEP_PACE_S, env=WORKER_ENV)
    bucket = tmp_path / "bucket" / "ckpt"
    try:
        out = ok(pod.tpu("setup", "--no-install"))
        for i in range(2):
            assert f"t1v-n-pod-sim-{i}-w-0: jax " in out
        ok(pod.tpu("run", "--megascale-coordinator", "127.0.0.1", "--", *TINY, "train.steps=4", "checkpoint.every=4",
                   f"checkpoint.dir={bucket}", ODD_NAME))
        deadline = time.time() + 300
        logs = lambda: [(pod.home(0, i) / "jaxpt" / "logs" / "worker_t1v-n-pod-sim-{}-w-0.log".format(i))  # noqa: E731
                        for i in range(2)]
        while not all(p.exists() and "train.py exited with code" in p.read_text() for p in logs()):
            assert time.time() < deadline, [p.read_text()[-3000:] for p in logs() if p.exists()]
            time.sleep(1)
        texts = [p.read_text() for p in logs()]
        assert all(EXIT_0 in t for t in texts), [t[-3000:] for t in texts]
        assert "Done: steps 0->4" in texts[0]
        assert EXIT_0 in ok(pod.tpu("logs", "--slice", "1"))
        run_dir = pod.home(0, 0) / "jaxpt" / "runs" / ODD_NAME_VALUE
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert {r["host/slowest_step_slice"] for r in rows if "loss" in r} <= {0, 1}
        assert all(r["host/slowest_step_slice"] == r["host/slowest_step"] for r in rows if "loss" in r)
        assert sorted(f.name for f in (bucket / "4" / "data").glob("*.json")) == \
            ["process_0-of-2.json", "process_1-of-2.json"]
        assert not list(tmp_path.rglob("PWNED"))
    finally:
        pod.tpu("stop", "--grace-period", "10")

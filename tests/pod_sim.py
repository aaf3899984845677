"""A simulated TPU pod on this machine, driven by the real scripts/tpu.py through a fake `gcloud`
(tests/fake_gcloud/gcloud) that is first on PATH.

Worker w is the directory <root>/worker_<w>, its home. Its login environment is what a TPU VM
gives a shell, and nothing else:
  * TPU_WORKER_ID=w, TPU_WORKER_HOSTNAMES=<one address per worker>, TPU_ACCELERATOR_TYPE: how
    a worker learns its place in the slice (jax reads the same facts; train.py starts
    jax.distributed from them);
  * its own `hostname` (t1v-n-<pod>-w-<w>), HOME, USER, SHELL, a PATH with python3;
  * for the hardware it stands for: JAX_PLATFORMS=cpu and JAX_NUM_CPU_DEVICES (fake chips), and
    JAX_COORDINATOR_PORT, jax's own setting for the coordinator port (a free one instead of
    8482, so that simulations running side by side do not collide).

By hand (rehearse the launcher on any machine; docs/tpu-pod.md "Rehearse on a simulated pod"):

    python tests/pod_sim.py /tmp/pod-sim --workers 2      # prints the two exports to use
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FAKE_GCLOUD_DIR = Path(__file__).resolve().parent / "fake_gcloud"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SimPod:
    def __init__(self, root: Path, workers: int = 2, devices_per_worker: int = 2, name: str = "pod-sim",
                 slices: int = 1, step_pace_s: float | None = None, env: dict | None = None):
        """slices > 1: a multislice job's slices, TPU VMs <name>-0 .. <name>-{slices-1} (the names a
        queued resource with --node-prefix <name> gives them), `workers` each; like a TPU VM that
        a queued resource did not give the Megascale settings, they carry none (tpu.py run does).
        step_pace_s: the workers' train.py waits this long before each step after the first
        (tests/step_hooks.py pace): a run that trains until the test stops it leaves the cores to the
        rest of the suite. env: what every worker's environment adds (the suite's CPU compile flags
        and compilation cache, tests/test_pod_sim.py)."""
        self.root, self.name, self.workers, self.slices = root, name, workers, slices
        self.step_pace_s, self.env = step_pace_s, dict(env or {})
        port = _free_port()
        nodes = {}
        for i in range(slices):
            node = name if slices == 1 else f"{name}-{i}"
            nodes[node] = {"worker_env": self._workers(node, i, workers, devices_per_worker, port)}
        pod = {"name": name, "workers": workers, **nodes[name if slices == 1 else f"{name}-0"]}
        if slices > 1:
            pod["nodes"] = nodes
        (root / "pod.json").write_text(json.dumps(pod))

    def _workers(self, node: str, slice_id: int, workers: int, devices_per_worker: int, port: int) -> list[dict]:
        python_bin = os.path.dirname(sys.executable)
        paced = {}
        if self.step_pace_s:
            from step_hooks import planted

            paced = planted(pace=str(self.step_pace_s))
        worker_env = []
        for w in range(workers):
            home = self.home(w, slice_id)
            (home / "bin").mkdir(parents=True)
            hostname = home / "bin" / "hostname"
            hostname.write_text(f"#!/bin/sh\necho t1v-n-{node}-w-{w}\n")
            hostname.chmod(0o755)
            worker_env.append({
                "HOME": str(home), "USER": "sim", "LOGNAME": "sim", "SHELL": shutil.which("bash"),
                "PATH": f"{home / 'bin'}:{python_bin}:/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8",
                "TPU_WORKER_ID": str(w), "TPU_WORKER_HOSTNAMES": ",".join(["127.0.0.1"] * workers),
                "TPU_ACCELERATOR_TYPE": f"v4-{8 * workers}",
                "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": str(devices_per_worker),
                "JAX_COORDINATOR_PORT": str(port),
                **paced, **self.env,
            })
        return worker_env

    def home(self, worker: int, slice_id: int = 0) -> Path:
        return self.root / (f"worker_{worker}" if self.slices == 1 else f"slice_{slice_id}_worker_{worker}")

    def tpu(self, command: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        """`python scripts/tpu.py COMMAND --name <pod> ARGS` against this pod; output captured."""
        env = dict(os.environ, POD_SIM_DIR=str(self.root), PATH=f"{FAKE_GCLOUD_DIR}:{os.environ['PATH']}")
        return subprocess.run([sys.executable, str(REPO / "scripts" / "tpu.py"), command, "--name", self.name,
                               "--zone", "sim-zone-a", "--slices", str(self.slices), *args], env=env,
                              capture_output=True, text=True, timeout=timeout)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Create a simulated pod for scripts/tpu.py (fake gcloud).")
    parser.add_argument("root", type=Path, help="a new, empty directory for the workers' homes")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--devices-per-worker", type=int, default=2)
    parser.add_argument("--name", default="pod-sim")
    cli = parser.parse_args()
    cli.root.mkdir(parents=True, exist_ok=False)
    SimPod(cli.root.resolve(), cli.workers, cli.devices_per_worker, cli.name)
    print(f"export POD_SIM_DIR={cli.root.resolve()} PATH={FAKE_GCLOUD_DIR}:$PATH JAXPT_TPU_NAME={cli.name}")

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

By hand (rehearse the launcher on any machine; README "Rehearse on a simulated pod"):

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
    def __init__(self, root: Path, workers: int = 2, devices_per_worker: int = 2, name: str = "pod-sim"):
        self.root, self.name, self.workers = root, name, workers
        port = _free_port()
        python_bin = os.path.dirname(sys.executable)
        worker_env = []
        for w in range(workers):
            home = self.home(w)
            (home / "bin").mkdir(parents=True)
            hostname = home / "bin" / "hostname"
            hostname.write_text(f"#!/bin/sh\necho t1v-n-{name}-w-{w}\n")
            hostname.chmod(0o755)
            worker_env.append({
                "HOME": str(home), "USER": "sim", "LOGNAME": "sim", "SHELL": shutil.which("bash"),
                "PATH": f"{home / 'bin'}:{python_bin}:/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8",
                "TPU_WORKER_ID": str(w), "TPU_WORKER_HOSTNAMES": ",".join(["127.0.0.1"] * workers),
                "TPU_ACCELERATOR_TYPE": f"v4-{8 * workers}",
                "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": str(devices_per_worker),
                "JAX_COORDINATOR_PORT": str(port),
            })
        (root / "pod.json").write_text(json.dumps({"name": name, "workers": workers, "worker_env": worker_env}))

    def home(self, worker: int) -> Path:
        return self.root / f"worker_{worker}"

    def tpu(self, command: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        """`python scripts/tpu.py COMMAND --name <pod> ARGS` against this pod; output captured."""
        env = dict(os.environ, POD_SIM_DIR=str(self.root), PATH=f"{FAKE_GCLOUD_DIR}:{os.environ['PATH']}")
        return subprocess.run([sys.executable, str(REPO / "scripts" / "tpu.py"), command, "--name", self.name,
                               "--zone", "sim-zone-a", *args], env=env, capture_output=True, text=True,
                              timeout=timeout)


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

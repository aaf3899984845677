"""In-loop tasks on 2 jax.distributed processes x 4 CPU devices equal 1 process x 8 (FSDP mesh):
the same rows are scored, each process's devices a disjoint slice of them, results replicated.

Run: pytest tests/test_tasks_multihost.py -q     (~1 min)
"""
import json
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.run_helpers import without_device_count

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def launch(n, out):
    env = without_device_count()
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "tasks_host.py"), str(i), str(n), str(port),
                               str(out)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
             for i in range(n)]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
    return json.loads(Path(out).read_text())


@pytest.mark.slow
def test_two_processes_score_as_one(tmp_path):
    one, two = launch(1, tmp_path / "one.json"), launch(2, tmp_path / "two.json")
    assert (one["processes"], two["processes"]) == (1, 2) and one["devices"] == two["devices"] == 8
    assert two["metrics"] == one["metrics"]
    np.testing.assert_allclose(two["ll"], one["ll"], rtol=1e-6, atol=1e-6)
    assert two["greedy"] == one["greedy"]

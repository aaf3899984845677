"""Shared test setup.

Eight fake CPU devices for every test, so sharding paths run everywhere. XLA reads the flag
when the backend starts, so it must be set before anything imports jax.
Run everything with: pytest  (add -x -q for a fast first failure).
"""
import os
import sys
import tempfile

import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
# One compilation cache for the session, in-process and in every train.py subprocess (they inherit
# the environment; paths.compile_cache reads it): the suite's many runs of the same tiny programs
# compile each once. Fresh per session, so no test depends on an earlier session's programs.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="jaxpt-test-xla-"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The reference: N steps straight, one process, in-process data (checkpoint every K).
    Per module, as when test_resume.py defined it and test_auto_workers.py imported it."""
    from tests.run_helpers import K, run

    run_dir = tmp_path_factory.mktemp("straight")
    run(run_dir, "data.num_workers=0", f"checkpoint.every={K}")
    return run_dir

"""Shared test setup.

Eight fake CPU devices for every test, so sharding paths run everywhere. XLA reads the flag
when the backend starts, so it must be set before anything imports jax.
Run everything with: pytest  (add -x -q for a fast first failure; -n0 to run in this process).
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

# The 8 devices' collectives in one order (model/runtime/distributed.py CPU_COLLECTIVES_FLAG), as
# train.py and the scripts set it on CPU.
from model.runtime.distributed import cpu_collectives_in_order  # noqa: E402

cpu_collectives_in_order()


# The files that take longest (several processes, kill-and-restart runs, TPU compiles; the
# durations CI prints) start first, so the test workers finish together instead of one of them
# starting a two-minute file at the end. Only the order changes; a file missing here runs later.
HEAVY_FIRST = ("test_compile_tpu.py", "test_train.py", "test_pod_sim.py", "test_show_step.py", "test_resume.py",
               "test_auto_workers.py", "test_multihost.py", "test_data_listing.py", "test_local_tier.py",
               "test_goodput.py", "test_data_mixture.py", "test_rollback.py", "test_data_records.py",
               "test_watchdog.py", "test_damaged.py", "test_data_restore.py", "test_objstore.py",
               "test_generate.py", "test_model.py", "test_data_bad.py", "test_data_mixture_change.py",
               "test_data_formats.py", "test_monitoring.py", "test_lm_eval.py", "test_sharding.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))   # stable: file order kept within


def pytest_xdist_auto_num_workers(config):
    """-n auto: one worker per core, at most one per 4 GB of memory (a worker's train.py runs
    with input workers take ~2-3 GB together), at most 8."""
    import psutil

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cores, psutil.virtual_memory().total // (4 << 30), 8))


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The reference: N steps straight, one process, in-process data (checkpoint every K).
    Per module, as when test_resume.py defined it and test_auto_workers.py imported it."""
    from tests.run_helpers import K, run

    run_dir = tmp_path_factory.mktemp("straight")
    run(run_dir, "data.num_workers=0", f"checkpoint.every={K}")
    return run_dir

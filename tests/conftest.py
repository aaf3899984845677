"""Shared test setup.

Eight fake CPU devices for every test, so sharding paths run everywhere. XLA reads the flag
when the backend starts, so it must be set before anything imports jax.
Run everything with: pytest  (add -x -q for a fast first failure; -n0 to run in this process).
"""
import os
import sys
import tempfile

import pytest

# Python's bytecode cache on, here and in every process the suite starts (train.py runs, their
# input workers, scripts), even where the environment sets PYTHONDONTWRITEBYTECODE (this machine
# image does, and uv installs without .pyc files): otherwise each of the suite's ~400 processes
# compiles jax, flax, orbax and grain from source again, 2.6 of a MICRO train.py's 7.6 CPU-s, and
# each test worker's collection 3 more (docs/development.md, "Where the time goes").
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

# XLA's CPU backend compiles at LLVM level 1 in tests: the suite's programs are tiny and compiled
# far more often than they run, and level 1 compiles them in about half the time of the default
# (level 2) while running a 30-step training loop no slower (docs/development.md, "Where the
# time goes"). Without XLA's new CPU fusion emitters a tiny train step compiles in ~40% less CPU
# (the same losses; test_context.py's in-process programs 139 -> 93 s). Subprocesses inherit both:
# tests.run_helpers.without_device_count keeps them where a test gives processes their own device count.
TEST_XLA_FLAGS = "--xla_backend_optimization_level=1 --xla_cpu_use_fusion_emitters=false"
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count=8 {TEST_XLA_FLAGS}")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
# The session's own directories, made here (by pytest-xdist's controller, before its workers start
# and inherit them) and removed when the session ends: a whole run leaves ~50 MB of compiled programs.
_MADE_FOR_THE_SESSION: list[str] = []


def _session_dir(variable: str, prefix: str) -> None:
    if variable not in os.environ:
        os.environ[variable] = tempfile.mkdtemp(prefix=prefix)
        _MADE_FOR_THE_SESSION.append(os.environ[variable])


# One compilation cache for the session, in-process and in every train.py subprocess (they inherit
# the environment; paths.compile_cache reads it): the suite's many runs of the same tiny programs
# compile each once. Fresh per session, so no test depends on an earlier session's programs.
_session_dir("JAX_COMPILATION_CACHE_DIR", "jaxpt-test-xla-")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# scripts/compile_tpu.py keeps compiled plans' figures (model/compile_cache.py): fresh per session
# too, so its CLI tests compile, and nothing reaches the home directory's cache.
_session_dir("JAXPT_TPU_COMPILE_CACHE", "jaxpt-test-tpu-compiles-")

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


def pytest_unconfigure(config):
    """The session's directories go with it, removed by the process that made them (with xdist the
    controller, after every worker has ended)."""
    import shutil

    for path in _MADE_FOR_THE_SESSION:
        shutil.rmtree(path, ignore_errors=True)


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


# ---------------------------------------------------------------- where the suite's time goes
def pytest_addoption(parser):
    parser.addoption("--file-durations", type=int, default=15, metavar="N",
                     help="print the N test files that took longest (setup + call + teardown summed; "
                          "0: none). docs/development.md holds each new file to a budget")
    parser.addoption("--cpu-log", metavar="PATH", default=None,
                     help="append a JSON line per test: the machine's CPU seconds (every process, from "
                          "/proc/stat) and wall seconds it took, fixtures included. Run with -n 1 on a quiet "
                          "machine, or each test's figure holds its neighbours' work")


def _machine_cpu_s() -> float:
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq = map(int, f.readline().split()[1:8])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    path = item.config.getoption("--cpu-log")
    if not path:
        yield
        return
    import json
    import time

    cpu, wall = _machine_cpu_s(), time.time()
    yield
    with open(path, "a") as f:
        f.write(json.dumps({"test": item.nodeid, "cpu_s": round(_machine_cpu_s() - cpu, 2),
                            "wall_s": round(time.time() - wall, 2)}) + "\n")


def pytest_terminal_summary(terminalreporter, config):
    """The slowest files, summed over their tests' phases: a file's module fixtures (a trained run,
    a compile) land in its first test's setup, so the per-test durations alone hide them."""
    n = config.getoption("--file-durations")
    per_file: dict[str, list] = {}
    for reports in terminalreporter.stats.values():
        for r in reports:
            if getattr(r, "when", None) in ("setup", "call", "teardown") and getattr(r, "nodeid", ""):
                entry = per_file.setdefault(r.nodeid.split("::")[0], [0.0, set()])
                entry[0] += r.duration
                entry[1].add(r.nodeid)
    if n <= 0 or len(per_file) < 2:
        return
    terminalreporter.write_sep("=", f"slowest {min(n, len(per_file))} test files "
                                    f"(of {len(per_file)}: {sum(v[0] for v in per_file.values()):.0f} s summed)")
    for path, (seconds, ids) in sorted(per_file.items(), key=lambda kv: -kv[1][0])[:n]:
        terminalreporter.write_line(f"{seconds:8.1f}s  {len(ids):4d} tests  {path}")

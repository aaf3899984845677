"""The distributed runtime of a run: starting `jax.distributed`, what the hosts must agree on
(process 0's decisions broadcast to all, the largest value any host reports), and the
preemption flag that makes every host save at the same step.

Nothing here knows about the model or the data: train.py passes these functions to the parts
that need hosts to agree (data/listing.py run_listing, data/autoworkers.py AutoWorkers).
"""
from __future__ import annotations

import glob
import json
import logging
import os
import signal
import sys
import threading
import traceback

# jax's coordinator port on Cloud TPU (jax/_src/clusters/cloud_tpu_cluster.py); JAX_COORDINATOR_PORT
# overrides it there and here.
TPU_COORDINATOR_PORT = 8482


def init_distributed(dcfg, heartbeat_timeout_s: int = 100) -> None:
    """jax.distributed on several hosts: explicit coordinator (`distributed.*`), or automatic on a
    TPU pod. Raises ValueError (one line) when the TPU VM environment contradicts itself.

    heartbeat_timeout_s: after this long without a heartbeat, JAX's coordination service calls a
    process dead and aborts the others (exit 134, no stacks, no restart). train.py sets it above
    the hang watchdog's timeout, so a frozen host ends the others through their watchdogs (exit
    75, stacks, a report naming it) and the launchers restart the run."""
    import jax

    if dcfg.local_device_count:
        # Fake CPU devices for multi-process runs on one machine; only possible before the
        # backend starts, which is why launch_local.py passes it per process.
        jax.config.update("jax_num_cpu_devices", int(dcfg.local_device_count))
    if jax.distributed.is_initialized():
        pass
    elif dcfg.coordinator_address:
        jax.distributed.initialize(coordinator_address=dcfg.coordinator_address,
                                   num_processes=dcfg.num_processes, process_id=dcfg.process_id,
                                   heartbeat_timeout_seconds=int(heartbeat_timeout_s))
    elif (tpu_slice := tpu_slice_from_env()) is not None:
        jax.distributed.initialize(**tpu_slice, heartbeat_timeout_seconds=int(heartbeat_timeout_s))
    elif on_tpu_vm():
        # The TPU VM's metadata describes the slice (one host or many), as MaxText relies on too.
        try:
            jax.distributed.initialize(heartbeat_timeout_seconds=int(heartbeat_timeout_s))
        except Exception as e:  # noqa: BLE001 - the device files are only a hint
            if "," in os.environ.get("TPU_WORKER_HOSTNAMES", ""):
                raise                   # certainly a multi-host slice: never run hosts apart
            print(f"warning: automatic jax.distributed.initialize() failed ({e}); running as one "
                  "process (set distributed.coordinator_address for a multi-host run)", file=sys.stderr)
    told = dcfg.get("slice_index")
    if told is None and os.environ.get("MEGASCALE_SLICE_ID", "").isdigit() and jax.default_backend() == "cpu":
        # A simulated multislice pod (tests/pod_sim.py): CPU devices cannot carry the slice the
        # Megascale settings give this host; TPU devices carry it themselves.
        told = int(os.environ["MEGASCALE_SLICE_ID"])
    tell_slices(told)


def tell_slices(slice_index) -> list[int] | None:
    """A simulated multislice job (scripts/launch_local.py --slices): every process reports the slice
    it was told (`distributed.slice_index`), all learn everyone's (one small all-gather), and the
    mesh groups the CPU devices by it (model/sharding.py) as it groups a real job's TPU devices by
    their `slice_index`. None (the default, and every real TPU job): nothing to do. Raises one line
    when the processes' slices do not form 0..S-1 of equal size, or only some processes were told.
    Returns the slice of each process (index = process_index)."""
    import jax

    from model import sharding

    told = -1 if slice_index is None else int(slice_index)
    slices = [int(row[0]) for row in gather_over_hosts([told])]
    if all(s == -1 for s in slices):
        sharding.set_process_slices(None)
        return None
    if told < 0 and slice_index is not None:
        raise ValueError(f"distributed.slice_index={slice_index} must be 0 or more")
    counts = {s: slices.count(s) for s in sorted(set(slices))}
    if -1 in counts or sorted(counts) != list(range(len(counts))) or len(set(counts.values())) > 1:
        raise ValueError(f"distributed.slice_index of processes 0..{jax.process_count() - 1} is {slices}: "
                         "every process must be told its slice, slices numbered 0..S-1, each with as many processes")
    sharding.set_process_slices(slices)
    return slices


def slice_of_this_process() -> int:
    """This process's slice: its devices' `slice_index` (a TPU multislice job), the slice it was told
    (a simulated one), else 0. For logs and metrics that name host and slice."""
    import jax

    from model import sharding

    return sharding.slice_of(jax.local_devices()[0])


def use_compile_cache(path) -> None:
    """Keep compiled programs in `path` (JAX's persistent compilation cache; None: off). Before the
    first compile: JAX opens the cache once, at the first program it compiles."""
    import jax

    if not path:
        return
    if "://" not in str(path):
        path = os.path.expanduser(str(path))
    jax.config.update("jax_compilation_cache_dir", str(path))


def tpu_slice_from_env() -> dict | None:
    """A multi-host slice as the TPU VM environment describes it (TPU_WORKER_HOSTNAMES, sorted by
    worker id, and TPU_WORKER_ID): jax.distributed.initialize's arguments, or None.

    jax reads the same variables itself, but only once a TPU backend is present; reading them
    here makes the start-up independent of the backend, so a simulated pod (CPU workers given a
    TPU VM's environment, tests/pod_sim.py) starts exactly as a real one.

    Several slices (MEGASCALE_COORDINATOR_ADDRESS, MEGASCALE_NUM_SLICES and MEGASCALE_SLICE_ID in
    the environment, as scripts/tpu.py run --slices exports them where the VM lacks them): one job
    over every host of every slice, numbered slice by slice, its coordinator on the Megascale
    coordinator's host, as jax's own Cloud TPU cluster does. Where the settings live only in the
    VM's metadata, None: jax reads them there.
    """
    hosts = [h for h in os.environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]
    megascale = [os.environ.get(k, "") for k in ("MEGASCALE_COORDINATOR_ADDRESS", "MEGASCALE_NUM_SLICES",
                                                  "MEGASCALE_SLICE_ID")]
    if os.environ.get("MEGASCALE_COORDINATOR_ADDRESS") and not all(megascale):
        return None
    if all(megascale) and hosts:
        address, slices, slice_id = megascale
        if not (slices.isdigit() and slice_id.isdigit() and int(slice_id) < int(slices)):
            raise ValueError(f"MEGASCALE_SLICE_ID={slice_id!r} is not a slice of MEGASCALE_NUM_SLICES={slices!r}")
        worker_id = os.environ.get("TPU_WORKER_ID", "")
        if not worker_id.isdigit() or int(worker_id) >= len(hosts):
            raise ValueError(f"TPU_WORKER_ID={worker_id!r} is not a worker of TPU_WORKER_HOSTNAMES "
                             f"({len(hosts)} hosts): cannot tell this host's place in the slice")
        port = os.environ.get("JAX_COORDINATOR_PORT") or TPU_COORDINATOR_PORT
        return {"coordinator_address": f"{address.split(':')[0]}:{port}", "num_processes": len(hosts) * int(slices),
                "process_id": int(slice_id) * len(hosts) + int(worker_id)}
    if len(hosts) < 2:
        return None
    worker_id = os.environ.get("TPU_WORKER_ID", "")
    if not worker_id.isdigit() or int(worker_id) >= len(hosts):
        raise ValueError(f"TPU_WORKER_ID={worker_id!r} is not a worker of TPU_WORKER_HOSTNAMES "
                         f"({len(hosts)} hosts): cannot tell this host's place in the slice")
    port = os.environ.get("JAX_COORDINATOR_PORT") or TPU_COORDINATOR_PORT
    return {"coordinator_address": f"{hosts[0].split(':')[0]}:{port}", "num_processes": len(hosts),
            "process_id": int(worker_id)}


def on_tpu_vm() -> bool:
    # Checked without starting a JAX backend: after that, initialize() is too late.
    return bool(os.environ.get("TPU_WORKER_HOSTNAMES") or glob.glob("/dev/accel[0-9]*")
                or glob.glob("/dev/vfio/[0-9]*"))


def quiet_cpu_start() -> None:
    """On a machine where no TPU can be (no TPU device files, no TPU VM environment) and no GPU
    plugin is installed, yet libtpu is (CI's venv, a laptop used for scripts/compile_tpu.py),
    JAX would probe for a TPU at start-up and libtpu would print half a dozen warning lines.
    There the run can only use the CPU: say so before JAX starts. Call it from a command's
    main(), never where JAX already runs; JAX_PLATFORMS set by the user always wins, and on a
    TPU VM or a GPU host nothing changes."""
    import importlib.util

    if not (os.environ.get("JAX_PLATFORMS") or on_tpu_vm() or importlib.util.find_spec("libtpu") is None
            or _gpu_plugin_installed()):
        os.environ["JAX_PLATFORMS"] = "cpu"
    cpu_collectives_in_order()


# XLA's CPU scheduler that favours concurrency starts a step's independent collectives in an order
# that differs between the devices of one process: with the state sharded over fsdp x context, the
# 8 fake devices of `mesh=context mesh.context=4` waited in two different collectives ("Termination
# timeout for all gather ... all reduce ...", every time). Off, they run in one order.
CPU_COLLECTIVES_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def _gpu_plugin_installed() -> bool:
    import importlib.util

    return any(importlib.util.find_spec(m) for m in ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm7_plugin",
                                                     "jax_rocm60_plugin", "jax_plugins"))


def cpu_collectives_in_order() -> None:
    """On a run that uses the CPU (JAX_PLATFORMS=cpu, or nothing else it could use), adds
    CPU_COLLECTIVES_FLAG to XLA_FLAGS before JAX starts, unless XLA_FLAGS already sets it. It touches
    only XLA's CPU compiles; a TPU VM or a GPU host is left alone."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms and platforms != "cpu":
        return
    if not platforms and (on_tpu_vm() or _gpu_plugin_installed()):
        return
    flags = os.environ.get("XLA_FLAGS", "")
    if CPU_COLLECTIVES_FLAG.split("=")[0] not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {CPU_COLLECTIVES_FLAG}".strip()


def from_process_0(make):
    """make()'s JSON result, computed on process 0 only and sent to every process. A ValueError
    raised there is raised on every process, so all hosts stop with the same one line."""
    import jax

    if jax.process_count() == 1:
        return make()
    import numpy as np
    from jax.experimental import multihost_utils

    payload = b""
    if jax.process_index() == 0:
        try:
            payload = json.dumps({"ok": make()}).encode()
        except ValueError as e:
            payload = json.dumps({"error": str(e)}).encode()
    # Two broadcasts: the length, then the bytes (every process must pass the same shape).
    n = int(multihost_utils.broadcast_one_to_all(np.int32(len(payload))))
    buf = np.frombuffer(payload, np.uint8) if payload else np.zeros(n, np.uint8)
    got = json.loads(np.asarray(multihost_utils.broadcast_one_to_all(buf), np.uint8).tobytes())
    if "error" in got:
        raise ValueError(got["error"])
    return got["ok"]


# How long a host waits for the slowest one to finish compiling a step (an 8B plan compiles for
# minutes; a host that never arrives is dead, and jax.distributed's heartbeats end the job first).
COMPILED_TOGETHER_TIMEOUT_S = 3600


def compiled_together(jitted, name: str):
    """`jitted` as the loop calls it; on several processes its first call compiles on this host,
    waits until every host has compiled (a coordination-service barrier, not a collective), then
    runs. Why: the first run of a program opens its collectives' communicators, a rendezvous that
    gives up when the hosts arrive more than ~30 s apart (Gloo on CPU hosts: "GetKeyValue() timed
    out"), and hosts compile at different speeds. jit reuses the executable compiled here. On one
    process, `jitted` itself."""
    import jax

    if jax.process_count() == 1:
        return jitted
    from orbax.checkpoint import multihost

    first = True

    def call(*args):
        nonlocal first
        if first:
            first = False
            jitted.lower(*args).compile()
            # The coordination service's barrier (sync_global_processes would be a collective).
            multihost.get_barrier_sync_fn()(key=f"jaxpt_{name}_compiled", timeout_ms=COMPILED_TOGETHER_TIMEOUT_S * 1000)
        return jitted(*args)

    return call


def max_over_hosts(value):
    """The largest `value` any process passes (a number; every process must call it). One tiny
    all-gather; on one process, the value itself."""
    import jax

    if jax.process_count() == 1:
        return value
    import numpy as np
    from jax.experimental import multihost_utils

    x = np.int32(value) if isinstance(value, (int, np.integer)) else np.float64(value)
    return np.max(multihost_utils.process_allgather(x)).item()


def gather_over_hosts(values):
    """Every process's `values` (a short list of numbers; every process must call it), one row
    per process in process order: one small all-gather. On one process, [values]."""
    import jax

    if jax.process_count() == 1:
        return [list(values)]
    import numpy as np
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(np.asarray(values, np.float64))).tolist()


def gather_json(obj) -> list:
    """Every process's `obj` (JSON-able; every process must call it), in process order: two
    small all-gathers (the lengths, then the bytes padded to the longest). On one process, [obj]."""
    import jax

    if jax.process_count() == 1:
        return [obj]
    import numpy as np
    from jax.experimental import multihost_utils

    payload = np.frombuffer(json.dumps(obj).encode(), np.uint8)
    lengths = np.asarray(multihost_utils.process_allgather(np.int32(payload.size))).reshape(-1)
    padded = np.zeros(int(lengths.max()), np.uint8)
    padded[:payload.size] = payload
    rows = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(lengths), -1)
    return [json.loads(rows[i, :n].tobytes()) for i, n in enumerate(lengths.tolist())]


# "Preempted: saved at the current step, start me again": train.py's exit code after a preemption
# when the environment asks for it (EXIT_PREEMPTED_ENV=1, set by the launchers' --restarts loops,
# which start the run again on it and on the hang watchdog's 75, model/runtime/watchdog.py). Otherwise a
# preempted run exits 0, as any clean stop.
EXIT_PREEMPTED = 76
EXIT_PREEMPTED_ENV = "JAXPT_EXIT_PREEMPTED"


def preempted_exit_code() -> int:
    """The exit code of a run that saved on a preemption: EXIT_PREEMPTED when $JAXPT_EXIT_PREEMPTED
    is set (and not 0), else 0."""
    return EXIT_PREEMPTED if os.environ.get(EXIT_PREEMPTED_ENV, "") not in ("", "0") else 0


# How long a failing process of a multi-host run waits for jax.distributed's shutdown (see exit_after_shutdown).
SHUTDOWN_WAIT_S = 15.0


def exit_after_shutdown(code: int, wait_s: float = SHUTDOWN_WAIT_S, error: BaseException | None = None):
    """Exits with `code` after jax.distributed's shutdown, waiting `wait_s` for it at most.
    `error`: an exception being handled, raised again in a single process (its traceback is
    printed first on several).

    The shutdown is a barrier of every process. After a failure one may never come: a host lost
    with its VM (its peers' collectives broke, "Connection reset by peer") or one still stuck in a
    collective. JAX's exit handler would then hold this process at that barrier until the
    heartbeat timeout (minutes of an idle pod) and abort it with a fatal error; here it leaves
    after `wait_s`, so the launcher's restart comes that much sooner. Processes that all fail
    together reach the barrier within a second and shut down as usual."""
    import jax

    if not jax.distributed.is_initialized():
        if error is not None:
            raise error
        sys.exit(code)
    if error is not None:
        traceback.print_exception(error)
    done = threading.Event()

    def shut_down():
        try:
            jax.distributed.shutdown()
        except Exception:  # noqa: BLE001 - a failed barrier is the case handled below
            return
        done.set()

    threading.Thread(target=shut_down, name="distributed-shutdown", daemon=True).start()
    if done.wait(wait_s):
        sys.exit(code)
    print(f"leaving without jax.distributed's shutdown: not every process reached it within {wait_s:g} s "
          f"(a host lost, or still in a collective); exit code {code}", file=sys.stderr, flush=True)
    logging.shutdown()          # the run's log file (Hydra's handler) is flushed and closed
    sys.stdout.flush()
    os._exit(code)


class PreemptionFlag:
    """SIGTERM (a preempted VM, `scripts/tpu.py stop`) or JAX's preemption sync point on TPU:
    save at the current step, wait for the save, exit 0 (EXIT_PREEMPTED under a launcher's
    --restarts: preempted_exit_code); the next start resumes.

    A save is collective, so every host must stop at the same step. TPU maintenance events come
    through the sync point, which agrees by design; a SIGTERM is agreed at log boundaries on
    several hosts (one tiny all-gather per interval, never per step) and at once on one host.
    """

    def __init__(self, agree_every: int):
        import jax

        self.fired = False
        self._signalled = False
        self._multi = jax.process_count() > 1
        self._agree_every = max(1, agree_every)
        self._previous = None
        try:
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        except ValueError:      # not the main thread: leave signals alone
            pass

    def _on_sigterm(self, signum, frame):
        self._signalled = True

    def check(self, step: int) -> bool:
        if self.fired:
            return True
        try:
            from jax.experimental import multihost_utils
            self.fired = bool(multihost_utils.reached_preemption_sync_point(step))
        except Exception:       # the preemption service exists only on multi-host TPU runs
            pass
        if not self.fired and self._multi:
            if step % self._agree_every == 0:
                self.fired = bool(max_over_hosts(int(self._signalled)))
        elif not self.fired:
            self.fired = self._signalled
        return self.fired

    def restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)

"""Checkpoints: one atomic Orbax step holding the train state, every host's data state and meta.

Items of a step:
  state  params, optimizer state, step (arrays; written asynchronously, read straight into
         the target shardings, so no host ever holds a whole tree)
  data   one JSON file per process with its data-iterator state, written synchronously inside
         save(), so it belongs to the same step; restore returns every process's file, so a
         run can resume on another number of hosts (train.py merges them per virtual shard)
  meta   the resolved config, the data/model fingerprint, the wandb run id, the topology
         (process count, data workers), the run's file list (train.py reuses it on resume
         instead of listing the bucket again)
There is no RNG array to save: the train step draws no random numbers and init derives its key
from `seed`, which the saved config and the fingerprint hold; the data order is a function of
(seed, virtual shard, epoch) plus the saved positions.

Atomicity. Orbax writes a step into `<step>.orbax-checkpoint-tmp-*` and renames it into place
when every item of every process is written (on gs://, a commit marker plays the rename's
role). A visible step is complete; a process killed during an asynchronous save leaves the tmp
directory, which the resume ignores and the next manager start deletes.

Resume order (`find_resume`; train.py applies init_from):
  1. the latest step in `checkpoint.dir` (a restarted or preempted run continues itself);
  2. `checkpoint.resume_from`: another run's checkpoint directory (its latest step) or one
     step directory in it (`.../checkpoints/1200`); everything is restored (fork a run);
  3. `checkpoint.init_from`: parameters only, optimizer and data start fresh (continued
     pre-training, a new data mix);
  4. from scratch.
Errors a user can fix (a missing resume_from, a fingerprint mismatch) are ValueErrors.

Damaged steps. A visible step can still fail to restore: a truncated or missing array file (a
half-written object on a bucket, a bad disk), an unreadable data-state JSON, a meta that does
not parse. `Checkpointer.restore_state` and `restore_meta_and_data(..., on_damaged=...)` turn
such a failure on any host into `DamagedCheckpoint` on every host (they agree with one tiny
all-gather before anyone acts): the step is named in one line with the reason and, with
checkpoint.on_damaged=fall_back, moved aside by process 0 (`<step>.damaged-<UTC time>` beside
it, never deleted; Orbax no longer sees it as a step), so that the run starts again from the
newest step that restores (train.py). Nothing is read twice when nothing is damaged: the guard
is a try around the one restore. Errors that say nothing about the files (out of memory, an
unreachable or forbidden bucket) are raised as they are: a step is moved aside only on evidence.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import sys
import time
from collections.abc import Callable, Mapping

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from data import carried

ITEMS = ("state", "data", "meta")
ON_DAMAGED = ("fall_back", "stop")

# Orbax saves an array replicated over several devices "replica-parallel": each replica writes a
# slice of it. For a small array that split buys nothing and costs a device slice per replica
# (and, at a process's first save, a compile per array shape and device: 64 of them for the tiny
# default model on 8 devices, 0.7 s of a 6-s test run). Arrays whose slice would be under this
# many bytes are written whole by one replica; large replicated arrays still split. The format
# on disk is the same either way. (Orbax already turns replica-parallel off on GPUs.)
MIN_REPLICA_SLICE_BYTES = 4 << 20


def use_array_handler() -> None:
    """Registers the jax.Array handler with MIN_REPLICA_SLICE_BYTES (once per process; every
    Orbax save of the process uses it, the run's and the parameter exports alike)."""
    handler = ocp.type_handlers.get_type_handler(jax.Array)
    if getattr(handler, "_min_slice_bytes_for_replica_parallel", None) != MIN_REPLICA_SLICE_BYTES:
        # Orbax warns of every override ("Type handler registry type ... overriding jax.Array"),
        # a line that means nothing to a user at every start: this override is the intended one.
        absl_log = logging.getLogger("absl")
        absl_log.addFilter(_drop_own_override)
        try:
            ocp.type_handlers.register_type_handler(
                jax.Array, ocp.type_handlers.ArrayHandler(min_slice_bytes_for_replica_parallel=MIN_REPLICA_SLICE_BYTES),
                override=True)
        finally:
            absl_log.removeFilter(_drop_own_override)


def _drop_own_override(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith(("Type handler registry type", "Type handler registry overriding"))


# Model settings that change how a step runs but not what the state holds: a run may resume
# with another attention kernel, remat policy, compute dtype, context limit, or with FP8 matmuls
# switched (current scaling: fp8 holds no state).
MODEL_RUNTIME_KEYS = frozenset({"remat", "attention", "dtype", "param_dtype", "max_seq_len", "fp8"})


@dataclasses.dataclass(frozen=True)
class ResumePoint:
    directory: str
    step: int
    source: str            # "latest" | "resume_from" | "init_from"

    def describe(self) -> str:
        return f"{self.source} checkpoint {self.directory}/{self.step}"


class Checkpointer:
    """The run's CheckpointManager plus the resume order."""

    def __init__(self, ccfg: Mapping):
        self.cfg = ccfg
        self.directory = str(ccfg["dir"])
        keep = ccfg["keep"]
        options = ocp.CheckpointManagerOptions(
            max_to_keep=int(keep) if keep else None,      # 0 / null: keep every step
            enable_async_checkpointing=bool(ccfg["async"]),
            create=True,
            # Partial steps of a killed run (`*.orbax-checkpoint-tmp-*`) are deleted at start.
            cleanup_tmp_directories=True,
        )
        use_array_handler()
        self.manager = ocp.CheckpointManager(self.directory, item_names=ITEMS, options=options)

    # ---------------------------------------------------------------- where to resume
    def find_resume(self) -> ResumePoint | None:
        return find_resume(self.cfg)

    # ---------------------------------------------------------------- restore
    def restore_meta_and_data(self, resume: ResumePoint) -> tuple[dict, list[dict] | None]:
        return restore_meta_and_data(resume, on_damaged=self.cfg.get("on_damaged", "fall_back"))

    def restore_state(self, resume: ResumePoint, abstract_state):
        """Arrays straight into the shardings carried by `abstract_state`'s ShapeDtypeStructs,
        whatever mesh or process count wrote them (Orbax reads only each device's slices).
        A damaged step raises DamagedCheckpoint on every host (module docstring)."""
        abstract_state = dict(abstract_state)
        window = abstract_state.pop("spikes", None)
        args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state))
        state = guard_damage(resume, lambda: self._restore(resume, args)["state"], item="state",
                             on_damaged=self.cfg.get("on_damaged", "fall_back"))
        if window is not None:
            state["spikes"] = self._spike_window(resume, window)
        return state

    def _spike_window(self, resume: ResumePoint, abstract):
        """train.spikes' window as the step's meta holds it; an empty one when the step was saved
        without spike skipping or with another window length (the rule warms up again)."""
        meta = self._restore(resume, ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"] or {}
        saved = meta.get("spikes")
        if not saved or len(saved.get("losses", [])) != abstract["losses"].shape[0]:
            saved = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), abstract)
            if jax.process_index() == 0:
                print("train.spikes: the checkpoint holds no loss window of this length; starting an empty one",
                      flush=True)
        return jax.tree.map(lambda a, v: jax.make_array_from_callback(
            a.shape, a.sharding, lambda idx: np.asarray(v, a.dtype)[idx]), abstract, saved)

    def restore_params(self, path: str, abstract_params, model: Mapping | None = None):
        """checkpoint.init_from: parameters only (the optimizer state is never read).

        With `model` (the run's model config), a checkpoint whose meta names another model is
        refused: a different rope_theta or norm_eps would load without a shape error into a
        different network."""
        point = _resolve("checkpoint.init_from", path, "init_from")
        if model is not None:
            meta = self._restore(point, ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"] or {}
            saved = (meta.get("config") or {}).get("model")
            diffs = fingerprint_diffs({"model": saved}, {"model": dict(model)}) if saved else []
            if diffs:
                raise ValueError(f"checkpoint.init_from={path} holds a different model:\n  " + "\n  ".join(diffs))
        target = {"params": abstract_params}
        args = ocp.args.PyTreeRestore(item=target, partial_restore=True,
                                      restore_args=ocp.checkpoint_utils.construct_restore_args(target))
        restored = self._restore(point, ocp.args.Composite(state=args))
        return restored["state"]["params"]

    def _restore(self, resume: ResumePoint, args):
        if resume.directory == self.directory:
            return self.manager.restore(resume.step, args=args)
        with _read_only_manager(resume.directory) as other:
            return other.restore(resume.step, args=args)

    # ---------------------------------------------------------------- save
    def should_save(self, step: int, last_step: int) -> bool:
        return step == last_step or (self.cfg["every"] > 0 and step % self.cfg["every"] == 0)

    def save(self, step: int, state, data_state: dict, meta: dict) -> None:
        """Starts an asynchronous save (returns once the arrays are copied off the devices and
        this process's data state is written); call on every process at the same step."""
        if "spikes" in state:
            # The loss window travels in the meta (a few hundred floats, fetched once per save), so
            # the arrays of a step are the same with spike skipping on or off.
            state = dict(state)
            meta = {**meta, "spikes": jax.tree.map(lambda a: np.asarray(a).tolist(),
                                                   jax.device_get(state.pop("spikes")))}
        saved = self.manager.save(step, force=True, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), data=DataStateSave(data_state), meta=ocp.args.JsonSave(meta)))
        if not saved:     # force=True: only a read-only manager skips
            raise RuntimeError(f"checkpoint step {step} was not saved to {self.directory}")

    def wait(self) -> None:
        """Blocks until every started save is complete (finalised and visible)."""
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()

    def exit_hook(self, exc_type, exc, tb) -> bool:
        """The run's ExitStack callback: close. After a failure on several hosts, an asynchronous
        save in flight waits at a barrier of every host, which a lost host never reaches (JAX
        would abort this one at its heartbeat timeout, minutes later): the wait is bounded like
        jax.distributed's shutdown, and the unfinished step stays a temporary directory that no
        restore reads."""
        if exc is None or jax.process_count() == 1:
            self.close()
            return False
        import threading

        from model.runtime.distributed import SHUTDOWN_WAIT_S

        closing = threading.Thread(target=self.close, name="checkpoint-close", daemon=True)
        closing.start()
        closing.join(SHUTDOWN_WAIT_S)
        return False


def find_resume(ccfg: Mapping) -> ResumePoint | None:
    """The latest complete step in checkpoint.dir, else checkpoint.resume_from, else None.
    Read-only: train.py asks before its config is known good, and a failed start must leave
    no checkpoint directory behind."""
    directory = str(ccfg["dir"])
    if epath.Path(directory).is_dir():
        with _read_only_manager(directory) as manager:
            latest = manager.latest_step()
        if latest is not None:
            return ResumePoint(directory, latest, "latest")
    if ccfg["resume_from"]:
        return _resolve("checkpoint.resume_from", ccfg["resume_from"], "resume_from")
    return None


def restore_meta_and_data(resume: ResumePoint, on_damaged: str | None = None) -> tuple[dict, list[dict] | None]:
    """The small items, read before anything else: the meta holds the run's file list (so a
    resumed run does not list its bucket again), and the input pipeline can start from the
    data states while the arrays restore.

    Returns (meta, [data state of process 0, 1, ...] as saved, or None if absent). With
    `on_damaged` (checkpoint.on_damaged; every process must call), an item that does not
    restore raises DamagedCheckpoint on every host (module docstring)."""
    def read(item, args):
        with _read_only_manager(resume.directory) as manager:
            return manager.restore(resume.step, args=ocp.args.Composite(**{item: args}))[item]

    if on_damaged is None:
        return dict(read("meta", ocp.args.JsonRestore()) or {}), read("data", DataStateRestore())
    # One item at a time, so that the line names the one that failed.
    meta = guard_damage(resume, lambda: read("meta", ocp.args.JsonRestore()), item="meta", on_damaged=on_damaged)
    states = guard_damage(resume, lambda: read("data", DataStateRestore()), item="data", on_damaged=on_damaged)
    return dict(meta or {}), states


# ---------------------------------------------------------------- damaged steps
class DamagedCheckpoint(RuntimeError):
    """A step that did not restore, raised on every host alike. `moved_to`: where the step now
    lies (train.py starts again from the newest step that restores); None: the run stops
    (checkpoint.on_damaged=stop, a resume_from step, or no step left that could restore)."""

    def __init__(self, message: str, moved_to: str | None = None):
        super().__init__(message)
        self.moved_to = moved_to


# What says nothing about the files: a transient or a setup problem, or a restore target that
# differs from what was saved (another optimizer, a model the fingerprint let through): never a
# reason to move a step aside.
_NOT_DAMAGE = ("RESOURCE_EXHAUSTED", "UNAVAILABLE", "DEADLINE_EXCEEDED", "PERMISSION_DENIED", "UNAUTHENTICATED",
               "CANCELLED", "ABORTED", "not compatible with the stored shape", "tree structure", "do not match")
# Evidence of damage without a status code: Orbax's wrapper of a failed TensorStore read, our
# data-state reader's errors, a file that vanished.
_DAMAGE_TEXT = ("Encountered error while reading", "is not JSON", "incomplete data state")
_STATUS = re.compile(r"\b(OUT_OF_RANGE|NOT_FOUND|DATA_LOSS|INVALID_ARGUMENT|FAILED_PRECONDITION|UNKNOWN): "
                     r"([^\[\n]*)")


def damage_reason(exc: BaseException) -> str | None:
    """One line saying why a restore failed when there is evidence that the files are at fault
    (missing, truncated, unparsable), else None: the error is raised as it is."""
    chain, e = [], exc
    while e is not None and len(chain) < 8:
        chain.append(e)
        e = e.__cause__ or e.__context__
    text = "\n".join(str(x) for x in chain)
    if any(isinstance(x, MemoryError) for x in chain) or any(code in text for code in _NOT_DAMAGE):
        return None
    if (m := _STATUS.search(text)) is not None:
        return f"{m.group(1)}: {m.group(2).strip()}"[:300]
    if any(isinstance(x, FileNotFoundError) for x in chain) or any(t in text for t in _DAMAGE_TEXT):
        first = next((line for line in text.splitlines() if line.strip()), type(exc).__name__)
        return first[:300]          # ours name the file ("process_1-of-2.json is not JSON (...)")
    for x in chain:
        if isinstance(x, json.JSONDecodeError):
            return f"unparsable JSON ({x})"
    return None


class _SilenceDamagedReads(logging.Filter):
    """Drops the after-the-fact reports of a damaged step's sibling reads.

    When one array of a step fails, Orbax's runner (asyncio_utils._run_sync_via_new_loop) closes
    its event loop while the step's other TensorStore reads are still in flight, and neither
    cancels nor awaits them. What follows, from several TensorStore threads at once and in pieces
    that interleave: each read callback that lands on the closed loop ("Exception ignored in:
    None ... RuntimeError: Event loop is closed", through sys.unraisablehook), each suspended read
    coroutine the interpreter collects ("Exception ignored in: <coroutine ...>"), and each task,
    future or gather whose error nobody retrieved ("Task/Future/_GatheringFuture exception was never
    retrieved" on the asyncio logger). Those reads belong to Orbax, so the reports are dropped here, whole, before
    they are written (a line filter after the fact cannot undo the interleaving):
      - a closed-loop report, while a guarded read is in flight (`reading`, set before the read
        starts: the first ones land within milliseconds of the failure, before anything is
        decided) and once any step was found damaged (`damaged`, for good: a slow bucket's read
        can land much later). It names no path, and it is never an error of ours: a callback
        that nobody waits for any more;
      - a never-retrieved or ignored-exception report that names the step being read or a
        damaged step (Orbax's and TensorStore's errors carry the step's path; its leftovers are
        collected at any later garbage collection).
    Anything else (another path, another kind of report, no step read or damaged) passes as it
    is. The sets are replaced, never changed in place: the hook runs on TensorStore's threads."""

    # asyncio names the class: Task, Future, and _GatheringFuture (an asyncio.gather nobody awaited)
    _LEFTOVER = re.compile(r"\w+ exception was never retrieved")

    def __init__(self):
        super().__init__()
        self.reading: frozenset[str] = frozenset()   # the step being read now by guard_damage (its spellings)
        self.damaged: frozenset[str] = frozenset()   # the steps found damaged (their spellings), kept for good
        self._next_hook = None

    def _names_watched_step(self, text: str) -> bool:
        steps = self.reading | self.damaged
        # The whole path, not the tail of another one (`run/checkpoints/10` in `/x/run/checkpoints/10/`
        # only when that is how the step is spelt) and not a step with more digits (`10/`, `100/`).
        return bool(steps) and re.search(r"(?<![\w.~/-])(?:" + "|".join(map(re.escape, steps)) + ")/", text) is not None

    def _drop(self, text: str, closed_loop: bool = False) -> bool:
        return (closed_loop and bool(self.reading or self.damaged)) or self._names_watched_step(text)

    def filter(self, record: logging.LogRecord) -> bool:
        text = str(record.msg)
        if not self._LEFTOVER.match(text):
            return True
        if record.exc_info and record.exc_info[1] is not None:
            text += f"\n{record.exc_info[1]}"
        return not self._drop(text)

    def unraisable(self, report) -> None:
        try:
            text = f"{report.exc_value}\n{report.err_msg or ''}"
            drop = self._drop(text, isinstance(report.exc_value, RuntimeError) and "Event loop is closed" in text)
        except Exception:  # noqa: BLE001 - a hook must not raise; the report then passes as it is
            drop = False
        if not drop:
            (self._next_hook or sys.__unraisablehook__)(report)

    def _install(self) -> None:
        if self not in logging.getLogger("asyncio").filters:
            logging.getLogger("asyncio").addFilter(self)
        # Installed again if something replaced the hook since (pytest swaps it around each test).
        if sys.unraisablehook != self.unraisable:
            self._next_hook, sys.unraisablehook = sys.unraisablehook, self.unraisable

    def watch(self, step_dir: str, *, damaged: bool = True) -> None:
        """`step_dir` is being read (damaged=False) or was found damaged (for good)."""
        self._install()
        if damaged:
            self.damaged = self.damaged | _spellings(step_dir)
        else:
            self.reading = self.reading | _spellings(step_dir)

    def forget(self, step_dir: str) -> None:
        """The read of `step_dir` is over (a step found damaged stays watched)."""
        self.reading = self.reading - _spellings(step_dir)


def _spellings(step_dir: str) -> frozenset[str]:
    """A step directory as a report may spell it: as configured, absolute, with links resolved."""
    step_dir = str(step_dir).rstrip("/")
    if "://" in step_dir:
        return frozenset({step_dir})
    return frozenset({step_dir, os.path.abspath(step_dir), os.path.realpath(step_dir)})


_damaged_reads = _SilenceDamagedReads()


def silence_leftover_reads(step_dir: str) -> None:
    """From now on, drop the leftover-read reports of `step_dir` (a step found damaged)."""
    _damaged_reads.watch(step_dir)


def guard_damage(resume: ResumePoint, read: Callable, *, item: str, on_damaged: str):
    """read()'s result, or DamagedCheckpoint on every process when read() failed on any one of
    them for a reason in the files (damage_reason). Every process must call it for the same step.

    The hosts agree (one all-gather) before anyone acts, so none loads a step another found
    damaged; process 0 alone moves the step aside, and every host waits for the move before
    it looks for the next step."""
    from model.runtime.distributed import max_over_hosts

    where = f"{resume.directory}/{resume.step}"
    # Watched from before the read: when one read fails, its siblings report on other threads at
    # once, while the failure is still on its way up (_SilenceDamagedReads).
    _damaged_reads.watch(where, damaged=False)
    reason, result = None, None
    try:
        result = read()
    except Exception as e:  # noqa: BLE001 - classified just below; anything else is re-raised
        reason = damage_reason(e)
        if reason is None:
            _damaged_reads.forget(where)
            raise
        silence_leftover_reads(where)       # at once: the hosts' agreement can take a while
    try:
        damaged = max_over_hosts(int(reason is not None))
    finally:
        _damaged_reads.forget(where)
    if not damaged:
        return result
    silence_leftover_reads(where)
    seen = (f"{item}: {reason}" if reason is not None else "on another host")
    if jax.process_count() > 1 and reason is not None:
        seen = f"process {jax.process_index()}, {seen}"
    head = f"checkpoint {where} did not restore ({seen})"
    if on_damaged == "stop" or resume.source != "latest":
        why = ("checkpoint.on_damaged=stop" if on_damaged == "stop"
               else f"{resume.source} is another run's: it is never moved; point it at another step")
        raise DamagedCheckpoint(f"{head}; stopping ({why})")
    # One name on every host: process 0's clock, agreed like the decision.
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(max_over_hosts(int(time.time()))))
    target = epath.Path(resume.directory) / f"{resume.step}.damaged-{stamp}"
    if jax.process_index() == 0:
        epath.Path(where).rename(target)
    max_over_hosts(0)           # nobody looks for the next step before the move is done
    left = complete_steps(resume.directory)
    if not left:
        raise DamagedCheckpoint(f"{head}: moved aside to {target}; no other step in {resume.directory} restores "
                                "(start again to train from scratch)")
    message = f"{head}: moved aside to {target}; resuming from step {left[-1]}"
    if reason is not None or jax.process_index() == 0:
        print(message, flush=True)
    raise DamagedCheckpoint(message, moved_to=str(target))


def complete_steps(directory: str) -> list[int]:
    """The complete (visible) steps in a checkpoint directory, sorted; [] when it does not exist.
    Read-only, like find_resume."""
    if not epath.Path(directory).is_dir():
        return []
    with _read_only_manager(directory) as manager:
        return sorted(manager.all_steps())


def split_step_dir(path: str) -> tuple[str, int | None]:
    """`.../checkpoints` -> (it, None = latest); `.../checkpoints/1200` -> (parent, 1200)."""
    p = str(path).rstrip("/")
    head, _, tail = p.rpartition("/")
    if tail.isdigit() and head:
        return head, int(tail)
    return p, None


def _read_only_manager(directory: str) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(read_only=True, create=False)
    return ocp.CheckpointManager(directory, item_names=ITEMS, options=options)


def _resolve(setting: str, path: str, source: str) -> ResumePoint:
    """A checkpoint directory (-> its latest step) or a step directory, checked to exist."""
    directory, step = split_step_dir(path)
    if not epath.Path(directory).is_dir():
        raise ValueError(f"{setting}={path}: no such checkpoint directory")
    with _read_only_manager(directory) as manager:
        steps = list(manager.all_steps())
    if not steps:
        raise ValueError(f"{setting}={path} holds no complete checkpoint")
    if step is None:
        step = max(steps)
    elif step not in steps:
        raise ValueError(f"{setting}={path}: step {step} is not a complete checkpoint "
                         f"(complete steps in {directory}: {sorted(steps)})")
    return ResumePoint(directory, step, source)


# ---------------------------------------------------------------- fingerprint
def fingerprint_diffs(saved: Mapping, current: Mapping, accepted=frozenset()) -> list[str]:
    """'section.key: checkpoint=... now=...' for every difference (runtime-only model keys and
    the `accepted` "section.key"s skipped)."""
    diffs = []
    for section in sorted(set(saved) | set(current)):
        a, b = saved.get(section) or {}, current.get(section) or {}
        if section == "model":
            a, b = _model_in_full(a), _model_in_full(b)
        for key in sorted(set(a) | set(b)):
            if (section == "model" and key in MODEL_RUNTIME_KEYS) or f"{section}.{key}" in accepted:
                continue
            if _canon(a.get(key, "<absent>")) != _canon(b.get(key, "<absent>")):
                diffs.append(f"{section}.{key}: checkpoint={a.get(key, '<absent>')!r} now={b.get(key, '<absent>')!r}")
    return diffs


def is_shape_key(key: str) -> bool:
    """Model fields a run may change together with its row length (data.shape_change=continue):
    model/llama.py ROPE_FIELDS, i.e. max_seq_len and the RoPE fields (rope_theta, rope_type and
    its llama3 / yarn fields); none of them is a shape of the parameters."""
    from model.llama import ROPE_FIELDS

    return key in ROPE_FIELDS


def model_shape_changes(saved: Mapping, current: Mapping) -> dict:
    """{"model.KEY": (checkpoint, now)} for every differing model field is_shape_key accepts."""
    a, b = _model_in_full(saved or {}), _model_in_full(current or {})
    return {f"model.{k}": (a.get(k, "<absent>"), b.get(k, "<absent>")) for k in sorted(set(a) | set(b))
            if is_shape_key(k) and _canon(a.get(k, "<absent>")) != _canon(b.get(k, "<absent>"))}


def check_fingerprint(saved: Mapping, current: Mapping, *, allow_data_change: bool,
                      accepted=frozenset(), data_hint: str | None = None) -> list[str]:
    """A resumed run must read the same data the same way into the same model.

    Raises ValueError listing every difference. With allow_data_change, differences confined
    to the `data` section (tokenizer, files, sequence length, packing, shards, seed) are
    accepted and returned: the caller must then start the data stream afresh, because the
    saved positions describe another data set. `accepted` ("data.KEY"s): differences the
    saved positions survive (a changed mixture, data/state.py mixture_changes), never listed.
    `data_hint`: what to tell of a data-only change instead of allow_data_change."""
    diffs = fingerprint_diffs(saved, current, accepted)
    data_only = all(d.startswith("data.") for d in diffs)
    if diffs and not (allow_data_change and data_only):
        if data_only:
            hint = data_hint or "set checkpoint.allow_data_change=true to continue on the changed data on purpose"
        elif allow_data_change:
            hint = "checkpoint.allow_data_change accepts data changes only; the model must match"
        else:
            hint = "the model must match; start a new run (name=...) or use checkpoint.init_from"
        raise ValueError(f"the checkpoint was written by a different setup ({hint}):\n  " + "\n  ".join(diffs))
    return diffs


def _model_in_full(model: Mapping) -> Mapping:
    """Every LlamaConfig field, defaults filled and head_dim resolved: a checkpoint written before
    a field existed (or a preset that leaves it out) names the same network as one that spells
    the default out. A mapping LlamaConfig refuses is compared as it is."""
    from model.llama import LlamaConfig

    try:
        return dataclasses.asdict(LlamaConfig.from_mapping(model))
    except (TypeError, ValueError):
        return model


def _canon(value):
    """JSON round trip: a saved tuple comes back as a list, an int key as a string."""
    return json.loads(json.dumps(value, sort_keys=True, default=_json_default))


def _json_default(obj):
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
        return float(obj)
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    raise TypeError(f"{type(obj).__name__} in a data state is not JSON-serialisable")


# ---------------------------------------------------------------- the data item's handler
class DataStateHandler(ocp.CheckpointHandler):
    """One JSON file per process, `process_{i}-of-{n}.json`. Grain's own handler reads back
    only its own process's file for the same n; this one returns every process's state, so
    another host count can resume. Synchronous: the states are small, and writing them inside
    save() ties them to the step whose arrays are being written."""

    def save(self, directory: epath.Path, args: DataStateSave):
        directory = epath.Path(directory)
        stem = f"process_{jax.process_index()}-of-{jax.process_count()}"
        state, next_batch = carried.split_arrays(args.state)
        if next_batch is not None:       # the host's next batch: arrays beside the JSON (data/carried.py)
            (directory / f"{stem}{carried.FILE_SUFFIX}").write_bytes(next_batch)
        (directory / f"{stem}.json").write_text(json.dumps(state, default=_json_default))

    def restore(self, directory: epath.Path, args: DataStateRestore | None = None) -> list[dict] | None:
        directory = epath.Path(directory)
        found = {}
        counts = set()
        for f in directory.glob("process_*-of-*.json"):
            index, count = f.name[len("process_"):-len(".json")].split("-of-")
            found[int(index)] = f
            counts.add(int(count))
        if not found:
            return None
        if len(counts) != 1 or sorted(found) != list(range(counts.pop())):
            raise ValueError(f"incomplete data state in {directory}: {sorted(f.name for f in found.values())}")
        states = []
        for i in range(len(found)):
            try:
                states.append(json.loads(found[i].read_text()))
            except json.JSONDecodeError as e:       # the line must name the file
                raise ValueError(f"{found[i].name} is not JSON ({e})") from e
        # A next batch is its host's own: read only this host's, at the host count it was saved at.
        me = jax.process_index()
        for i, state in enumerate(states):
            if i == me and len(states) == jax.process_count():
                arrays = directory / f"process_{i}-of-{len(states)}{carried.FILE_SUFFIX}"
                states[i] = carried.attach_arrays(state, arrays.read_bytes)
            else:
                states[i] = carried.drop_next(state)
        return states

    def metadata(self, directory):
        return None

    def finalize(self, directory):
        pass

    def close(self):
        pass


@ocp.args.register_with_handler(DataStateHandler, for_save=True)
@dataclasses.dataclass
class DataStateSave(ocp.args.CheckpointArgs):
    state: dict


@ocp.args.register_with_handler(DataStateHandler, for_restore=True)
@dataclasses.dataclass
class DataStateRestore(ocp.args.CheckpointArgs):
    pass


# ---------------------------------------------------------------- params for tools (generate, export, import)
def resolve_checkpoint(path) -> tuple[str, int]:
    """(manager directory, step) for a run directory (its checkpoint.dir from config.yaml, else
    <run>/checkpoints; latest step), a manager directory (latest step) or one step directory."""
    p = epath.Path(path)
    if (p / "config.yaml").is_file():
        import yaml

        run_cfg = yaml.safe_load((p / "config.yaml").read_text()) or {}
        ckpt_dir = (run_cfg.get("checkpoint") or {}).get("dir")
        p = epath.Path(ckpt_dir) if ckpt_dir and epath.Path(ckpt_dir).is_dir() else p / "checkpoints"
    point = _resolve("checkpoint", str(p), "tool")
    return point.directory, point.step


def _model_of(meta: dict, where: str, **model_overrides):
    from model.llama import LlamaConfig

    model_map = (meta.get("config") or {}).get("model")
    if not model_map:
        raise ValueError(f"{where}: its meta holds no config.model; cannot tell the model's shapes")
    return LlamaConfig.from_mapping({**model_map, **model_overrides})


class HostParams:
    """A checkpoint's parameters read one leaf at a time into host memory (numpy), never onto an
    accelerator and never the whole tree at once: what export needs for a model larger than a
    chip (an 8B's fp32 parameters are ~32 GB). Local paths and gs:// alike.

        with HostParams(path) as ckpt:       # ckpt.cfg, ckpt.meta (with step, directory)
            w = ckpt.read(("layers", "wq_dnh"))    # fp32 numpy, its stored shape
    """

    def __init__(self, path, **model_overrides):
        from model.hf import abstract_params

        self.directory, self.step = resolve_checkpoint(path)
        self._manager = _read_only_manager(self.directory)
        meta = self._manager.restore(self.step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"] or {}
        self.cfg = _model_of(meta, f"{self.directory}/{self.step}", **model_overrides)
        self.meta = dict(meta, step=self.step, directory=self.directory)
        self.abstract = abstract_params(self.cfg)

    def read(self, path: tuple) -> np.ndarray:
        """One leaf of params (`path` into the params tree) as a numpy array, in its stored dtype."""
        leaf = self.abstract
        for key in path:
            leaf = leaf[key]
        target: dict = {"params": {}}
        node = target["params"]
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = np.zeros((), leaf.dtype)      # a stand-in: only the leaf's place is read
        restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), target)
        args = ocp.args.PyTreeRestore(item=target, partial_restore=True, restore_args=restore_args)
        value = self._manager.restore(self.step, args=ocp.args.Composite(state=args))["state"]["params"]
        for key in path:
            value = value[key]
        if tuple(value.shape) != tuple(leaf.shape):
            raise ValueError(f"{self.directory}/{self.step}: params.{'.'.join(map(str, path))} has shape "
                             f"{tuple(value.shape)}, its config.model implies {tuple(leaf.shape)}")
        return value

    def close(self) -> None:
        self._manager.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def load_params(path, *, host: bool = False, **model_overrides):
    """(model config, params, meta) of a checkpoint; never reads the optimizer state.
    `model_overrides` change runtime fields (e.g. dtype="float32").

    The parameters are read leaf by leaf into host memory (HostParams), then put on the first
    device one leaf at a time (what generate.py and the evals use: the host never holds a second
    copy); host=True leaves them as numpy arrays."""
    with HostParams(path, **model_overrides) as ckpt:
        device = jax.devices()[0]
        leaves, treedef = jax.tree_util.tree_flatten_with_path(ckpt.abstract)
        values = []
        for key_path, _ in leaves:
            value = ckpt.read(tuple(_key(k) for k in key_path))
            values.append(value if host else jax.device_put(value, device))
            del value
        return ckpt.cfg, jax.tree_util.tree_unflatten(treedef, values), ckpt.meta


def _key(k):
    return getattr(k, "key", getattr(k, "idx", k))


class LazyLeaf:
    """A parameter save_params writes without holding it beforehand: `make()` returns the numpy
    array (shape and dtype as given) when the save reaches it, and it is dropped once written."""

    def __init__(self, shape, dtype, make: Callable[[], np.ndarray]):
        self.shape, self.dtype, self.make = tuple(shape), np.dtype(dtype), make
        self.size = int(np.prod(self.shape, dtype=np.int64))


class _LazyLeafHandler(ocp.type_handlers.NumpyHandler):
    """Writes LazyLeaf values one after another, each made just before it is written and freed
    after, as the numpy arrays they become (the same files and metadata as np.ndarray leaves, so
    a restore reads them as any saved array). Orbax's NumpyHandler writes all of its values
    concurrently, which would hold them all at once."""

    async def serialize(self, values, infos, args=None):
        args = args or [ocp.type_handlers.SaveArgs()] * len(values)
        return [ocp.future.CommitFutureAwaitingContractedSignals(self._one_by_one(values, infos, args),
                                                                 name="lazy_leaf_handler")]

    # Written in chunks of at most this many bytes: written whole, TensorStore held a copy of the
    # array and its compressed bytes beside it (Llama-3.2-3B's stacked MLP weight, 2.6 GiB in fp32:
    # import peaked at 7.45 GiB, 1.2 over the interpreter plus twice the largest array).
    CHUNK_BYTES = 64 << 20

    async def _one_by_one(self, values, infos, args):
        for value, info, arg in zip(values, infos, args, strict=True):
            array = value.make()
            if tuple(array.shape) != value.shape or array.dtype != value.dtype:
                raise ValueError(f"{info.name}: made {array.shape} {array.dtype}, expected {value.shape} {value.dtype}")
            if arg.chunk_byte_size is None:
                arg = dataclasses.replace(arg, chunk_byte_size=self.CHUNK_BYTES)
            await self._background_serialize([array], [info], [arg])
            del array


def _use_lazy_leaf_handler() -> None:
    """Registers _LazyLeafHandler for LazyLeaf (once per process). It shares NumpyHandler's typestr
    ("np.ndarray", what the metadata records) on purpose: a restore that looks a handler up by
    that name gets this one, whose reading is NumpyHandler's own."""
    if ocp.type_handlers.has_type_handler(LazyLeaf):
        return
    absl_log = logging.getLogger("absl")
    absl_log.addFilter(_drop_own_override)
    try:
        ocp.type_handlers.register_type_handler(LazyLeaf, _LazyLeafHandler(), override=True)
    finally:
        absl_log.removeFilter(_drop_own_override)


def _is_url(path: str) -> bool:
    return "://" in path


def save_params(directory, params, meta: dict, step: int = 0) -> str:
    """A checkpoint `checkpoint.init_from=<directory>` accepts: item "state" = {"params": ...}
    (no optimizer state, no data state) and item "meta". A local path or a gs:// URL. Leaves may
    be arrays or LazyLeaf (made and written one at a time). Refuses a directory with anything in
    it."""
    directory = os.fspath(directory)
    if not _is_url(directory):
        directory = os.path.abspath(directory)
    target = epath.Path(directory)
    if target.exists() and any(True for _ in target.iterdir()):
        raise FileExistsError(f"{directory} is not empty; choose a new directory")
    _use_lazy_leaf_handler()
    options = ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=False)
    use_array_handler()
    with ocp.CheckpointManager(directory, item_names=ITEMS, options=options) as manager:
        manager.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave({"params": params}),
                                                   meta=ocp.args.JsonSave(meta)))
        manager.wait_until_finished()
    return directory

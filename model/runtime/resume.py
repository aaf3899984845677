"""Where one start of a run begins, and what its saved data position is worth.

A start resumes, in this order: the newest local-tier step every host holds (when newer than
the durable one, model/runtime/local_tier.py) -> the latest step in checkpoint.dir -> checkpoint.resume_from
-> checkpoint.init_from (parameters only) -> from scratch. A durable step that a rollback
returned to (train.on_divergence=rollback, model/runtime/rollback.py) starts its data past the batches
rolled back. train.py reads the small items (meta, data states) here before the model is built,
so the input pipeline starts from the saved position while the arrays restore.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import jax

import data as data_lib
from model.runtime import rollback as rollback_lib
from model.runtime.checkpoint import (
    MODEL_RUNTIME_KEYS,
    Checkpointer,
    ResumePoint,
    check_fingerprint,
    find_resume,
    fingerprint_diffs,
    model_shape_changes,
    restore_meta_and_data,
)
from model.runtime.local_tier import LocalTier


@dataclasses.dataclass
class Start:
    point: ResumePoint | None       # None: parameters from init_from, or a new run
    meta: dict                      # the saved meta ({} for a new run): file list, fingerprint, wandb id
    data_states: list | None        # every host's saved data position; None: the data from its start
    rolled_past: tuple | None       # (the newest rollback record to this step, its data states)
    rollbacks: list                 # every rollback of the run so far, carried on in the meta

    @property
    def step(self) -> int | None:
        return self.point.step if self.point is not None else None


def find_start(ccfg: Mapping, abstract_state, local_tier: LocalTier | None, *,
               gather: Callable[[object], list]) -> Start:
    """The step this start resumes from and its small items. Read-only: a config mistake found
    later leaves no checkpoint directory behind. A damaged item raises DamagedCheckpoint on every
    host (model/runtime/checkpoint.py), which train() answers by starting again."""
    point = find_resume(ccfg)
    local_pick = (local_tier.pick(abstract_state, newer_than=point.step if point is not None else None,
                                  gather=gather) if local_tier is not None else None)
    if local_pick is not None:
        point = ResumePoint(str(local_tier.root), local_pick.step, "local")
        meta, states = local_pick.meta, local_pick.data_states
    elif point is not None:
        meta, states = restore_meta_and_data(point, on_damaged=ccfg.get("on_damaged", "fall_back"))
    else:
        meta, states = {}, None
    # The rollback records to this step, read once (one listing and a read per record, on gs:// too).
    records = (rollback_lib.rollbacks_of(point.directory, point.step)
               if point is not None and point.source != "local" else [])
    rolled_past = (records[-1], rollback_lib.read_states(records[-1]["dir"])) if records else None
    rollbacks = meta.get("rollbacks", [])
    if rolled_past is not None:
        states = rolled_past[1]
        rollbacks = rollbacks + [{k: v for k, v in r.items() if k != "dir"} for r in records]
    return Start(point, meta, states, rolled_past, rollbacks)


def accept_data(start: Start, fingerprint: dict, *, mixture_change: str, allow_data_change: bool,
                announce: bool, shape_change: str = "refuse", global_batch_size: int | None = None) -> list | None:
    """The data states to restore the input from, after comparing the saved fingerprint with this
    run's (data/resume.py decides what a changed mixture keeps). Raises ValueError, naming the key,
    when the saved position cannot continue on this data; updates fingerprint["data"] to the one
    this run saves. None: the data changed (checkpoint.allow_data_change) and is read afresh.

    The run's shape (data.seq_len, data.global_batch_size, the model's max_seq_len and RoPE fields)
    may change with data.shape_change=continue: the saved states are then marked with the length
    they were saved at, and each shard continues from its position re-packed at the new length
    (data/resume.py continue_at_length); the mesh and the host count may change as on any resume."""
    saved = start.meta.get("fingerprint", {})
    shape = shape_changes(start.meta, fingerprint, global_batch_size)
    if shape and shape_change != "continue" and not allow_data_change and any(
            key.split(".", 1)[1] not in MODEL_RUNTIME_KEYS for key in shape):
        others = [d for d in fingerprint_diffs(saved, fingerprint) if d.split(":", 1)[0] not in shape]
        if not others:
            raise ValueError(f"the checkpoint was written at another shape ({shape_line(shape)}): set "
                             "data.shape_change=continue to continue its data at this one")
    plan = data_lib.plan_resume(saved.get("data", {}), fingerprint["data"], mixture_change=mixture_change,
                                allow_data_change=allow_data_change, shape_change=shape_change)
    fingerprint["data"] = plan.fingerprint
    accepted = set(plan.accepted)
    if shape_change == "continue":
        accepted |= {key for key in shape if key.startswith("model.")}
    changes = check_fingerprint(saved, fingerprint, allow_data_change=allow_data_change, accepted=accepted,
                                data_hint=plan.hint)
    if plan.notes and announce:
        print("data.mixture_change=continue: " + "; ".join(plan.notes), flush=True)
    if not changes:
        if shape and shape_change == "continue" and announce:
            print(f"{shape_line(shape)}: continuing the data (data.shape_change=continue)", flush=True)
        if plan.saved_seq_len is not None and start.data_states:
            return data_lib.continue_at_length(start.data_states, plan.saved_seq_len)
        return start.data_states
    if announce:
        print("checkpoint.allow_data_change: the input pipeline starts afresh on the changed data ("
              + "; ".join(changes) + ")", flush=True)
    return None


def shape_changes(meta: dict, fingerprint: dict, global_batch_size: int | None) -> dict:
    """{"data.seq_len" | "data.global_batch_size" | "model.KEY": (checkpoint, now)}: how the run's
    shape differs from the checkpoint's (meta: the checkpoint's; the batch from its saved config)."""
    saved = meta.get("fingerprint", {})
    out = {}
    was, now = saved.get("data", {}).get("seq_len"), fingerprint["data"].get("seq_len")
    if was is not None and was != now:
        out["data.seq_len"] = (was, now)
    was = ((meta.get("config") or {}).get("data") or {}).get("global_batch_size")
    if was is not None and global_batch_size is not None and int(was) != int(global_batch_size):
        out["data.global_batch_size"] = (int(was), int(global_batch_size))
    if saved.get("model"):
        out.update(model_shape_changes(saved["model"], fingerprint["model"]))
    return out


def shape_line(shape: dict) -> str:
    """'data.seq_len 256 -> 1024, model.rope_theta 10000.0 -> 40000.0'."""
    return ", ".join(f"{key} {a} -> {b}" for key, (a, b) in shape.items())


def check_stage(stage_start, step: int | None, directory: str) -> None:
    """train.stage_start: a later stage of a staged run resumes the run at or past the step the
    stage before it ends at. Raises ValueError (one line) otherwise: started fresh it would train
    this stage's shape from step 0; from an earlier step, this stage's shape for steps that were
    the stage before's."""
    if stage_start is None:
        return
    if step is None:
        raise ValueError(f"train.stage_start={stage_start}: this stage continues the run from its step "
                         f"{int(stage_start):,} and checkpoint.dir={directory} holds no checkpoint: run the stage "
                         "before it first (same name and checkpoint.dir)")
    if step < int(stage_start):
        raise ValueError(f"train.stage_start={stage_start}: the run's latest checkpoint is step {step:,}, before "
                         f"this stage's start: finish the stage before it first (it resumes from step {step:,})")


def restore_or_init(start: Start, *, ckpt: Checkpointer, local_tier: LocalTier | None, program, seed: int,
                    init_from: str | None, model_fingerprint: dict, run_dir, announce: bool,
                    reset_optimizer: bool = False) -> tuple[dict, int]:
    """(the train state, its step): restored from the start's step, or initialised (with the
    parameters of checkpoint.init_from when set; a mismatched model raises ValueError).

    reset_optimizer (checkpoint.reset_optimizer): the optimizer state starts afresh, the schedule
    going on at the run's step (model/step.py fresh_opt_state), when the step resumed from was
    written without the setting: once, at the resume that turns it on (a later resume of this run,
    from a step it wrote, keeps its optimizer state)."""
    point = start.point
    if point is None:
        state = program.init_state(seed)
        if init_from:
            state["params"] = ckpt.restore_params(init_from, program.abstract_state["params"],
                                                  model=model_fingerprint)
        if announce:
            print(f"Initialised parameters from {init_from}; starting at step 0" if init_from
                  else f"Starting a new run in {run_dir}", flush=True)
        return state, 0
    if point.source == "local":
        state = local_tier.restore(point.step, program.abstract_state)
    else:
        state = ckpt.restore_state(point, program.abstract_state)
    step = int(jax.device_get(state["step"]))
    if announce:
        print(f"Resuming from {point.describe()} at step {step}", flush=True)
        if start.rolled_past is not None:
            record = start.rolled_past[0]
            print(f"Its data goes on past the steps rolled back at step {record['seen_at_step']} "
                  f"({record['dir']})", flush=True)
    if reset_optimizer and not ((start.meta.get("config") or {}).get("checkpoint") or {}).get("reset_optimizer"):
        state["opt_state"] = program.fresh_opt_state(state["params"], state["opt_state"])
        if announce:
            print(f"checkpoint.reset_optimizer: the optimizer state starts afresh (its learning-rate schedule "
                  f"goes on at step {step})", flush=True)
    return state, step

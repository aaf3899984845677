"""AdamW with linear warmup, cosine decay and global-norm clipping (the `optimizer` config group).

Weight decay skips the norm scales (`scale_*` leaves): decaying them pulls the norms towards
zero for no regularisation benefit, the usual Llama recipe. Masked by name, not by rank: with
scanned layers a norm scale is [layers, d], 2-D like a matrix.
"""
from collections.abc import Mapping

import jax
import optax

_KEYS = {"lr", "min_lr_ratio", "warmup_steps", "decay_steps", "b1", "b2", "eps", "weight_decay", "clip_norm"}


def resolve_warmup(opt_cfg: Mapping, total_steps: int) -> tuple[int, int, str | None]:
    """(warmup steps, decay steps, a one-line notice or None).

    A run that decays over itself (decay_steps null) and is not longer than its warmup -- a
    smoke run, `train.steps=20` with the default 30 -- warms up over the first half of the run
    instead, with a notice. An explicit decay_steps not above the warmup is a mistake: it
    raises."""
    warmup = int(opt_cfg["warmup_steps"])
    if warmup < 0:
        raise ValueError(f"optimizer.warmup_steps={warmup} must be >= 0")
    if opt_cfg["decay_steps"]:
        decay_steps = int(opt_cfg["decay_steps"])
        if warmup >= decay_steps:
            raise ValueError(f"optimizer.warmup_steps={warmup} must be below optimizer.decay_steps={decay_steps}")
        return warmup, decay_steps, None
    if warmup < total_steps:
        return warmup, total_steps, None
    capped = total_steps // 2
    return capped, total_steps, (f"note: optimizer.warmup_steps={warmup} is not below train.steps={total_steps}: "
                                 f"warming up over the first {capped} steps (half the run) instead")


def make_schedule(opt_cfg: Mapping, total_steps: int) -> optax.Schedule:
    """Linear warmup from 0 to lr, then cosine to lr * min_lr_ratio at `decay_steps` (default: the run)."""
    lr = float(opt_cfg["lr"])
    warmup, decay_steps, _ = resolve_warmup(opt_cfg, total_steps)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=lr, warmup_steps=warmup, decay_steps=decay_steps,
        end_value=lr * float(opt_cfg["min_lr_ratio"]))


def make_optimizer(opt_cfg: Mapping, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    unknown = set(opt_cfg) - _KEYS
    if unknown:
        raise ValueError(f"unknown optimizer setting(s): {', '.join(sorted('optimizer.' + k for k in unknown))}")
    schedule = make_schedule(opt_cfg, total_steps)
    def decay_mask(params):
        return jax.tree_util.tree_map_with_path(
            lambda path, _: not str(getattr(path[-1], "key", "")).startswith("scale"),
                                                params)

    tx = optax.chain(
        optax.clip_by_global_norm(float(opt_cfg["clip_norm"])),
        optax.adamw(schedule, b1=float(opt_cfg["b1"]), b2=float(opt_cfg["b2"]), eps=float(opt_cfg["eps"]),
                    weight_decay=float(opt_cfg["weight_decay"]), mask=decay_mask),
    )
    return tx, schedule

"""AdamW with linear warmup, cosine decay and global-norm clipping (the `optimizer` config group).

Weight decay skips the norm scales (`scale_*` leaves): decaying them pulls the norms towards
zero for no regularisation benefit, the usual Llama recipe. Masked by name, not by rank: with
scanned layers a norm scale is [layers, d], 2-D like a matrix.
"""
from collections.abc import Mapping

import jax
import optax

_KEYS = {"lr", "min_lr_ratio", "warmup_steps", "decay_steps", "b1", "b2", "eps", "weight_decay", "clip_norm"}


def make_schedule(opt_cfg: Mapping, total_steps: int) -> optax.Schedule:
    """Linear warmup from 0 to lr, then cosine to lr * min_lr_ratio at `decay_steps` (default: the run)."""
    lr = float(opt_cfg["lr"])
    warmup = int(opt_cfg["warmup_steps"])
    decay_steps = int(opt_cfg["decay_steps"] or total_steps)
    if warmup >= decay_steps:
        raise ValueError(f"optimizer.warmup_steps={warmup} must be below the decay length {decay_steps} "
                         "(optimizer.decay_steps, or train.steps when it is null)")
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=lr, warmup_steps=warmup, decay_steps=decay_steps,
        end_value=lr * float(opt_cfg["min_lr_ratio"]))


def make_optimizer(opt_cfg: Mapping, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    unknown = set(opt_cfg) - _KEYS
    if unknown:
        raise ValueError(f"unknown optimizer setting(s): {', '.join(sorted('optimizer.' + k for k in unknown))}")
    schedule = make_schedule(opt_cfg, total_steps)
    def decay_mask(params):
        return jax.tree_util.tree_map_with_path(lambda path, _: not str(getattr(path[-1], "key", "")).startswith("scale"),
                                                params)

    tx = optax.chain(
        optax.clip_by_global_norm(float(opt_cfg["clip_norm"])),
        optax.adamw(schedule, b1=float(opt_cfg["b1"]), b2=float(opt_cfg["b2"]), eps=float(opt_cfg["eps"]),
                    weight_decay=float(opt_cfg["weight_decay"]), mask=decay_mask),
    )
    return tx, schedule

"""libtpu's flags for overlapping collectives with compute, set for a pod run (scripts/tpu.py run)
and for the compile that plans it (scripts/compile_tpu.py), through LIBTPU_INIT_ARGS.

Without them libtpu runs most of a step's collectives synchronously: a layer's FSDP weight
all-gather waits for the layer before it to finish, and the layer waits for the gather. With them
the gathers (and reduce-scatters) become async collective fusions that progress while the
neighbouring compute runs, which is what model/predict.py's step_s assumes. The set is the one
MaxText's published TPU recipes and Google's reproducibility recipes put in LIBTPU_INIT_ARGS for
dense models on v4, v5e, v5p and v6e (async collective fusion, its all-gather and multi-step
forms, compute/collective overlap on the TensorCore, async all-gather); libtpu 0.0.42.1 accepts
each (an unknown flag stops it: "Unknown command line flag").
"""
from __future__ import annotations

import shlex

OVERLAP_FLAGS = (
    "--xla_tpu_enable_async_collective_fusion=true",
    "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true",
    "--xla_tpu_enable_async_collective_fusion_multiple_steps=true",
    "--xla_tpu_overlap_compute_collective_tc=true",
    "--xla_enable_async_all_gather=true",
)


def init_args(existing: str | None = None) -> str:
    """LIBTPU_INIT_ARGS with the overlap flags: `existing` (the user's own) first, each overlap
    flag added unless `existing` already sets that flag (to either value: the user's wins)."""
    words = shlex.split(existing or "")
    named = {w.split("=", 1)[0] for w in words}
    return " ".join(words + [f for f in OVERLAP_FLAGS if f.split("=", 1)[0] not in named])

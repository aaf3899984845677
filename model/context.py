"""Context parallelism: the order of a row's tokens over the `context` chips, and its balance.

With `act_len` mapped to mesh axis `context` (configs/mesh/*.yaml), each of the C chips of a row
holds t/C of its tokens and all-gathers the row's keys and values at every layer (model/llama.py
Block), so every query sees every key of its own document. Which tokens a chip holds decides its
share of the causal attention work: a query at position p of its document attends to p + 1 keys
(at most the sliding window), so the row's last slots hold most of the work.

Layouts (a static permutation of the row, the same for every row; `layout_index`):
- contiguous: chip i holds slots [i t/C, (i+1) t/C). No reordering; on a single document the
  last chip does 2C-1 times the first's work.
- zigzag: the row cut into 2C chunks, chip i holds chunks i and 2C-1-i (Llama 3, torchtitan).
  Exact balance on a row of one document; on packed rows it is as unbalanced as contiguous where
  a long document ends mid-row (its late chunks and the short documents after it pair badly).
- striped: chip i holds slots i, i + C, i + 2C, ... (Striped Attention, Brandon et al. 2023).
  Every document, wherever it sits in the row and however long, is dealt out evenly: each chip
  holds every C-th token of it, so its work is within about one query's keys per document of the
  mean. This is what the step uses (STEP_LAYOUT): the balance bar holds on packed rows too
  (BENCHMARKS.md, "Context parallelism").

The permutation is exact: attention's causal mask is computed from positions and segment ids,
not array slots (model/llama.py attention_mask), RoPE reads each token's own position, and the
loss and token counts are sums over tokens. The step (model/step.py) applies it on the device to
the whole batch before the forward; nothing it returns depends on the order, so nothing is undone.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from model import sharding as shd

LAYOUTS = ("contiguous", "zigzag", "striped")
STEP_LAYOUT = "striped"


def shards(mesh, rules) -> int:
    """How many chips split a row: the product of the mesh axes the rules give `act_len`."""
    return math.prod(mesh.shape[a] for a in shd.mesh_axes_for("act_len", rules))


def layout_index(t: int, c: int, layout: str = STEP_LAYOUT) -> np.ndarray:
    """[t] int: slot j of the reordered row holds the row's token index[j]; chip i of c holds
    reordered slots [i t/c, (i+1) t/c). Raises naming data.seq_len when c does not divide t."""
    if layout not in LAYOUTS:
        raise ValueError(f"context layout {layout!r}; expected one of {list(LAYOUTS)}")
    parts = 2 * c if layout == "zigzag" else c
    if t % parts:
        raise ValueError(f"data.seq_len={t} does not split into the {parts} parts mesh.context={c} needs "
                         f"({layout} order)")
    idx = np.arange(t)
    if layout == "striped":
        return idx.reshape(t // c, c).T.reshape(-1)
    if layout == "zigzag":
        chunks = idx.reshape(2 * c, t // (2 * c))
        return np.concatenate([np.concatenate([chunks[i], chunks[2 * c - 1 - i]]) for i in range(c)])
    return idx


def reorder(batch: dict, c: int, layout: str = STEP_LAYOUT) -> dict:
    """Every [b, t] array of `batch` in the layout's token order (identity when c == 1)."""
    if c == 1:
        return batch
    t = next(iter(batch.values())).shape[1]
    index = layout_index(t, c, layout)
    return {k: jnp.take(v, index, axis=1) for k, v in batch.items()}


def attention_work(segment_ids_bt, window: int | None = None):
    """[b, t] int32: how many keys each query attends to under the causal, same-document mask
    (at most `window`): its slot in its run of equal segment ids, plus one. From the row's own
    order (before `reorder`); numpy in gives numpy out (the benchmark), jax in gives jax out."""
    on_host = isinstance(segment_ids_bt, np.ndarray)
    xp = np if on_host else jnp
    b, t = segment_ids_bt.shape
    slot_bt = xp.broadcast_to(xp.arange(t, dtype=np.int32), (b, t))
    starts_bt = xp.concatenate([xp.ones((b, 1), bool), segment_ids_bt[:, 1:] != segment_ids_bt[:, :-1]], axis=1)
    marked_bt = xp.where(starts_bt, slot_bt, 0)
    run_start_bt = np.maximum.accumulate(marked_bt, axis=1) if on_host else jax.lax.cummax(marked_bt, axis=1)
    work_bt = slot_bt - run_start_bt + 1
    return work_bt if window is None else xp.minimum(work_bt, window)


def chip_work(work_bt, c: int, layout: str = STEP_LAYOUT):
    """[b, c] each chip's share of each row's attention work, `work_bt` in the row's own order."""
    b, t = work_bt.shape
    return work_bt[:, layout_index(t, c, layout)].reshape(b, c, t // c).sum(axis=2, dtype=np.float32)


def imbalance(work_bc, groups: int = 1):
    """max / mean attention work over the chips of a row group, worst over `groups` groups of
    consecutive rows (the rows one batch shard holds): 1.0 is perfect balance."""
    xp = np if isinstance(work_bc, np.ndarray) else jnp
    b, c = work_bc.shape
    per_chip_gc = work_bc.reshape(groups, b // groups, c).sum(axis=1)
    mean_g = xp.maximum(per_chip_gc.mean(axis=1), 1.0)
    return (per_chip_gc.max(axis=1) / mean_g).max()


def batch_imbalance(segment_ids_bt, c: int, groups: int, window: int | None = None, layout: str = STEP_LAYOUT):
    """The step's `context_imbalance` metric: `imbalance` of the batch's attention work over the c
    chips of each row, the rows split into `groups` batch shards (segment ids in the rows' own order)."""
    b = segment_ids_bt.shape[0]
    return imbalance(chip_work(attention_work(segment_ids_bt, window), c, layout), groups if b % groups == 0 else 1)

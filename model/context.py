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

The fused kernels read causality from slots, so under context each chip's kernel is told where its
slots sit in the row: query slot a of chip i is row token a C + i (`chip_rows`), and the gathered
keys are put back in row order (`unstripe`). Splash computes the causal (and window) mask from
those row indices in the kernel (`StripedSplashMask`); cuDNN takes it as an explicit mask.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask

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


def unstripe(x, c: int, axis: int):
    """x, a whole row along `axis` in the striped order (model.step's: chip-major, chip i's slot a
    holds row token a c + i), back in the row's own order: the inverse of layout_index(t, c, "striped")."""
    t = x.shape[axis]
    chips_first = x.reshape(*x.shape[:axis], c, t // c, *x.shape[axis + 1:])  # [..., c, t/c, ...]
    return jnp.swapaxes(chips_first, axis, axis + 1).reshape(x.shape)       # [..., t/c, c, ...] -> [..., t, ...]


def chip_rows(t_chip: int, c: int, chip):
    """[t/c] int32: the row token each of chip `chip`'s query slots holds in the striped order (a c + chip).
    `chip` may be traced (lax.axis_index inside a shard_map)."""
    return jnp.arange(t_chip, dtype=jnp.int32) * c + chip


def _row_causal(q_rows, kv_rows, window: int | None):
    """The causal (and sliding-window) mask between query and key row indices; numpy or jax arrays."""
    visible = q_rows >= kv_rows
    return visible if window is None else visible & (q_rows - kv_rows < window)


class StripedSplashMask(splash_mask.Mask):
    """Splash's mask for one chip's t/c striped queries against the whole row's t keys in row order:
    query slot a of chip i is row a c + i and sees key k when a c + i >= k (and a c + i - k < window);
    documents are splash's segment ids. The kernel computes it per block from `q_sequence`, the
    chip's row indices (`chip_rows`, set at run time from the chip's index, model/llama.py
    attention_splash), and the key index, as splash's CausalMask and LocalMask do from theirs.

    Which blocks the kernel skips (empty), computes without a mask (full) or masks is fixed on the
    host when the kernel is built, once for all c chips: a block is skipped only where it is empty on
    every chip and left unmasked only where it is full on every chip. So one kernel (one compile, one
    set of residuals for the backward pass, not c of them under a lax.switch) is exact on every chip,
    at the cost of masking a block more along the diagonal. At c = 1 it is CausalMask / LocalMask."""

    def __init__(self, shape: tuple[int, int], c: int, window: int | None = None):
        self._shape, self.c, self.window = tuple(shape), c, window
        self.q_sequence = np.arange(shape[0], dtype=np.int32) * c  # chip 0's rows; the kernel gets each chip's
        self.mask_function = functools.partial(_row_causal, window=window)

    @property
    def shape(self) -> tuple[int, int]:
        return self._shape

    def __getitem__(self, idx) -> np.ndarray:
        """A block's summary for splash's block map, not its mask: an array whose any() says some chip
        sees some of it and whose all() says every chip sees all of it. The queries of slots [a0, a1)
        over all chips are the rows [a0 c, a1 c); row - key then spans [a0 c - (k1 - 1), a1 c - 1 - k0]."""
        q_slice, kv_slice = idx
        a0, a1, _ = q_slice.indices(self._shape[0])
        k0, k1, _ = kv_slice.indices(self._shape[1])
        lo, hi = a0 * self.c - (k1 - 1), a1 * self.c - 1 - k0
        reach = math.inf if self.window is None else self.window - 1
        return np.array([hi >= 0 and lo <= reach, lo >= 0 and hi <= reach])

    def __eq__(self, other):
        return isinstance(other, StripedSplashMask) and (self._shape, self.c, self.window) == (
            other._shape, other.c, other.window)

    def __hash__(self):
        return hash((StripedSplashMask, self._shape, self.c, self.window))


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

"""The cross-entropy over the vocabulary, whole or in chunks of positions (train.loss_chunk).

A chunked loss projects onto the vocab `chunk` positions at a time, so the fp32 logits and their
gradient ([b, t, v] each: 4 GiB per chip for Llama-2's vocab at 32 x 1024 tokens, 12 GiB for Llama
3's 128k vocab at 3 x 8,192) never exist whole; each chunk's logits are computed again in the
backward pass (about 2 N_head FLOPs per token more). Same values as the whole loss.

Where the output head lives: under FSDP the head [d, v] is split over the chips like every weight.
Left to the SPMD partitioner, every chunk gathered it again in the forward and in the backward and
reduce-scattered its gradient in fp32 per chunk: on the v6e-16 8B plan at 8,192 positions in chunks
of 2,048, 27.7 of the step's 74.4 GiB per chip (BENCHMARKS.md "Predicted step times"). Here the
chunks run per chip (shard_map): the head is gathered once in the forward and once in the backward
(in the compute dtype), the chunks' head gradients add up unreduced on each chip (fp32), and one
reduce-scatter (fp32) hands each chip its part. Where the vocab itself is split (a tensor axis) or
the chunk does not split over the context axis, the partitioner's way remains (same values).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from model import sharding as shd
from model.llama import project_to_vocab


def token_losses(logits_btv, targets_bt):
    """Cross-entropy per token in fp32, and log-sum-exp (for z-loss)."""
    logits_btv = logits_btv.astype(jnp.float32)
    lse_bt = jax.nn.logsumexp(logits_btv, axis=-1)
    target_logit_bt = jnp.take_along_axis(logits_btv, targets_bt[..., None], axis=-1)[..., 0]
    return lse_bt - target_logit_bt, lse_bt


def _chunks(a_bt, n: int):
    """[b, t, ...] -> [n, b, t / n, ...]: the scan's chunks of positions."""
    b, t = a_bt.shape[:2]
    return jnp.swapaxes(a_bt.reshape(b, n, t // n, *a_bt.shape[2:]), 0, 1)


def _unchunk(a_nbc):
    """[n, b, c, ...] -> [b, n c, ...]."""
    n, b, c = a_nbc.shape[:3]
    return jnp.swapaxes(a_nbc, 0, 1).reshape(b, n * c, *a_nbc.shape[3:])


def _losses(x_btd, targets_bt, head_dv, n: int):
    """(CE, lse) [b, t] over n chunks of positions; head_dv whole, in the compute dtype."""
    def chunk(_, xy):
        x_bcd, y_bc = xy
        return None, token_losses(project_to_vocab(x_bcd, head_dv), y_bc)

    _, (ce_nbc, lse_nbc) = jax.lax.scan(chunk, None, (_chunks(x_btd, n), _chunks(targets_bt, n)))
    return _unchunk(ce_nbc), _unchunk(lse_nbc)


def _grads(x_btd, targets_bt, head_dv, g_ce_bt, g_lse_bt, n: int):
    """The chunks again: dx [b, t, d] in x's dtype and d head [d, v] summed over the chunks in fp32.
    Each chunk's logits gradient goes down to the compute dtype before its two matmuls, as
    project_to_vocab's backward does."""
    def chunk(dhead_dv, xyg):
        x_bcd, y_bc, g_ce_bc, g_lse_bc = xyg
        logits_bcv = project_to_vocab(x_bcd, head_dv)
        _, losses_vjp = jax.vjp(lambda logits: token_losses(logits, y_bc), logits_bcv)
        g_bcv = losses_vjp((g_ce_bc, g_lse_bc))[0].astype(x_bcd.dtype)
        dx_bcd = jnp.einsum("bcv,dv->bcd", g_bcv, head_dv, preferred_element_type=jnp.float32)
        dhead_dv = dhead_dv + jnp.einsum("bcd,bcv->dv", x_bcd, g_bcv, preferred_element_type=jnp.float32)
        return dhead_dv, dx_bcd.astype(x_bcd.dtype)

    xs = (_chunks(x_btd, n), _chunks(targets_bt, n), _chunks(g_ce_bt, n), _chunks(g_lse_bt, n))
    dhead_dv, dx_nbcd = jax.lax.scan(chunk, jnp.zeros(head_dv.shape, jnp.float32), xs)
    return _unchunk(dx_nbcd), dhead_dv


HEAD_GATHERS = ("once", "per_chunk")


def check_head(head: str) -> None:
    """train.loss_head, checked where train.py checks the config and where the loss is built."""
    if head not in HEAD_GATHERS:
        raise ValueError(f"train.loss_head={head!r}: expected {' or '.join(HEAD_GATHERS)}")


def chunked_token_losses(x_btd, targets_bt, head_dv, chunk: int, dtype, head: str = "once"):
    """(CE, lse) per token [b, t]: x_btd the final hidden states, head_dv the output projection
    in the parameters' dtype (cast to `dtype`, the compute dtype, before it is gathered).
    head (train.loss_head): "once" gathers the head once per pass on each chip (above; its
    gathered copy and its gradient's fp32 sum, 6 bytes per head parameter, stay on every chip for
    the pass), "per_chunk" leaves it to the partitioner (per chunk: more bytes, less memory)."""
    t = x_btd.shape[1]
    if t % chunk:
        raise ValueError(f"train.loss_chunk={chunk} does not divide the sequence length {t}")
    check_head(head)
    mesh, rules = shd.current()
    plan = _per_chip_plan(mesh, rules, chunk) if mesh is not None and head == "once" else None
    if plan is None and mesh is not None:
        # The partitioner's way: the chunk's logits re-run in the backward (remat), the head
        # gathered wherever the partitioner puts it.
        fn = jax.checkpoint(lambda x, y: token_losses(shd.constrain(
            project_to_vocab(x, head_dv.astype(dtype)), ("act_batch", "act_len", "act_vocab")), y))
        _, (ce, lse) = jax.lax.scan(lambda c, xy: (c, fn(*xy)), None, (_chunks(x_btd, t // chunk),
                                                                          _chunks(targets_bt, t // chunk)))
        return _unchunk(ce), _unchunk(lse)
    return _gathered_once(x_btd, targets_bt, head_dv, t // chunk, jnp.dtype(dtype), plan)


def _per_chip_plan(mesh, rules, chunk: int):
    """The mesh axes for the per-chip loss: (batch, length, head rows) or None where it does not
    apply (the vocab split over a mesh axis; a chunk that does not split over the context ways)."""
    def size(axes):
        return math.prod(mesh.shape[a] for a in axes)

    batch, length = shd.mesh_axes_for("act_batch", rules), shd.mesh_axes_for("act_len", rules)
    rows = tuple(a for a in shd.mesh_axes_for("embed", rules) if mesh.shape[a] > 1)
    split = shd.mesh_axes_for("vocab", rules) + shd.mesh_axes_for("act_vocab", rules) \
        + shd.mesh_axes_for("act_embed", rules)
    # The head's rows must split only over axes the rows of x split over: there the reduce-scatter
    # sums what the chips computed from different tokens, never the same sum twice.
    if size(split) > 1 or chunk % size(length) or not set(rows) <= set(batch + length):
        return None
    return batch, length, rows


def _spec(*axes):
    return PartitionSpec(*[a if a else None for a in axes])


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _gathered_once(x_btd, targets_bt, head_dv, n, dtype, plan):
    return _gathered_once_fwd(x_btd, targets_bt, head_dv, n, dtype, plan)[0]


def _gathered_once_fwd(x_btd, targets_bt, head_dv, n, dtype, plan):
    if plan is None:        # no mesh: one device
        return _losses(x_btd, targets_bt, head_dv.astype(dtype), n), (x_btd, targets_bt, head_dv)
    mesh, _ = shd.current()
    batch, length, rows = plan

    def local(x_btd, targets_bt, head_dv):
        head_dv = head_dv.astype(dtype)
        if rows:
            head_dv = jax.lax.all_gather(head_dv, rows, axis=0, tiled=True)
        return _losses(x_btd, targets_bt, head_dv, n)

    bt = _spec(batch, length)
    losses = jax.shard_map(local, mesh=mesh, in_specs=(_spec(batch, length, None), bt, _spec(rows, None)),
                           out_specs=(bt, bt), check_vma=False)(x_btd, targets_bt, head_dv)
    return losses, (x_btd, targets_bt, head_dv)


def _gathered_once_bwd(n, dtype, plan, residuals, g):
    x_btd, targets_bt, head_dv = residuals
    g_ce_bt, g_lse_bt = g
    if plan is None:
        dx_btd, dhead_dv = _grads(x_btd, targets_bt, head_dv.astype(dtype), g_ce_bt, g_lse_bt, n)
        return dx_btd, None, dhead_dv.astype(head_dv.dtype)
    mesh, _ = shd.current()
    batch, length, rows = plan
    # Every chip's rows add to the head's gradient: summed over the axes the batch and the length
    # split across, except those the head's rows split over, where the sum is a reduce-scatter.
    summed = tuple(a for a in (*batch, *length) if a not in rows)

    def local(x_btd, targets_bt, head_dv, g_ce_bt, g_lse_bt):
        head_dv = head_dv.astype(dtype)
        if rows:
            head_dv = jax.lax.all_gather(head_dv, rows, axis=0, tiled=True)
        dx_btd, dhead_dv = _grads(x_btd, targets_bt, head_dv, g_ce_bt, g_lse_bt, n)
        if rows:
            dhead_dv = jax.lax.psum_scatter(dhead_dv, rows, scatter_dimension=0, tiled=True)
        if summed:
            dhead_dv = jax.lax.psum(dhead_dv, summed)
        return dx_btd, dhead_dv

    bt = _spec(batch, length)
    btd = _spec(batch, length, None)
    dx_btd, dhead_dv = jax.shard_map(local, mesh=mesh, in_specs=(btd, bt, _spec(rows, None), bt, bt),
                                     out_specs=(btd, _spec(rows, None)), check_vma=False)(
        x_btd, targets_bt, head_dv, g_ce_bt, g_lse_bt)
    return dx_btd, None, dhead_dv.astype(head_dv.dtype)


_gathered_once.defvjp(_gathered_once_fwd, _gathered_once_bwd)

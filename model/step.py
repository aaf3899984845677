"""Train state, sharded init, loss, and the jitted train / eval steps.

Initialise from shapes (as big_vision and flax gemma do): `jax.eval_shape(init)` gives the abstract state,
the parameters' logical axis names plus the rules give its shardings, and
`jax.jit(init, out_shardings=...)` materialises every array directly in its shards. No device
ever holds a whole parameter tree, and the same abstract tree is Orbax's restore target.

TrainState is a plain dict {"params": nested dict of arrays, "opt_state": optax state,
"step": int32 scalar}: Orbax StandardSave handles it without any Flax types. With loss-spike
skipping on (train.spikes, SpikeConfig) it also holds "spikes", the trailing window of losses
the step decides on, on the device: no host round trip per step. The checkpoint keeps that
window in the step's meta, not among the arrays (model/runtime/checkpoint.py), so turning spike
skipping on or off never changes what a checkpoint's arrays are.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from model import context as ctx
from model import sharding as shd
from model.llama import Llama, LlamaConfig
from model.loss import chunked_token_losses, token_losses  # noqa: F401 - token_losses: step's API

TrainState = dict  # {"params": pytree, "opt_state": optax state, "step": int32[]}
BATCH_KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")


def as_cfg(model_cfg) -> LlamaConfig:
    return model_cfg if isinstance(model_cfg, LlamaConfig) else LlamaConfig.from_mapping(model_cfg)


@functools.lru_cache(maxsize=16)
def abstract_model(cfg: LlamaConfig):
    """(graphdef, abstract Param state) of the model; shapes only, nothing allocated."""
    model = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
    return nnx.split(model, nnx.Param)[:2]


def model_from_params(model_cfg, params) -> Llama:
    """A Llama module around `params` (plain dict of arrays): for generation/export tools."""
    cfg = as_cfg(model_cfg)
    graphdef, _ = abstract_model(cfg)
    return nnx.merge(graphdef, params)  # merge accepts the plain dict of arrays


def param_shardings(cfg: LlamaConfig, mesh: Mesh, rules) -> Any:
    """NamedSharding per parameter (same nesting as the params dict), from logical names."""
    _, abstract = abstract_model(cfg)

    def one(v: nnx.Variable):
        names = v.get_metadata().get("out_sharding") or (None,) * v.ndim
        return shd.named_sharding(mesh, rules, names, v.shape)

    return nnx.to_pure_dict(jax.tree.map(one, abstract, is_leaf=lambda x: isinstance(x, nnx.Variable)))


# ----------------------------------------------------------------------------- loss spikes


@dataclasses.dataclass(frozen=True)
class SpikeConfig:
    """train.spikes: skip the update of a step whose loss is above mean + k * std of the
    trailing `window` losses of updated steps (OLMo-core's and MaxText's rule), once the window
    holds `min_steps` of them. A non-finite loss is always skipped. The step still counts (its
    batch is consumed); parameters and optimizer state stay as they were."""

    window: int = 128
    k: float = 6.0
    min_steps: int = 32

    @classmethod
    def from_mapping(cls, m: Mapping | None) -> SpikeConfig | None:
        """None when absent or enabled=false; ValueError naming the key when a value is wrong."""
        m = dict(m or {})
        if not m.pop("enabled", False):
            return None
        unknown = set(m) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"train.spikes: unknown keys {sorted(unknown)} (window, k, min_steps)")
        c = cls(window=int(m.get("window", cls.window)), k=float(m.get("k", cls.k)),
                min_steps=int(m.get("min_steps", cls.min_steps)))
        if c.window < 2 or not 2 <= c.min_steps <= c.window or c.k <= 0:
            raise ValueError(f"train.spikes: need window >= 2, 2 <= min_steps <= window and k > 0 (got {c})")
        return c


def spike_window_init(window: int) -> dict:
    """An empty window: losses (ring buffer), seen (losses written), skipped (total), run (in a row)."""
    return {"losses": jnp.zeros((window,), jnp.float32), "seen": jnp.zeros((), jnp.int32),
            "skipped": jnp.zeros((), jnp.int32), "run": jnp.zeros((), jnp.int32)}


def spike_decision(window: dict, loss, spikes: SpikeConfig):
    """(skip: bool[], the next window) for this step's `loss`; pure jnp, runs inside the step.
    A skipped loss does not enter the window, so a spike does not widen the band for the next."""
    w = window["losses"].shape[0]
    count = jnp.minimum(window["seen"], w)
    valid = jnp.arange(w) < count
    n = jnp.maximum(count, 1).astype(jnp.float32)
    mean = jnp.where(valid, window["losses"], 0.0).sum() / n
    std = jnp.sqrt(jnp.where(valid, jnp.square(window["losses"] - mean), 0.0).sum() / n)
    loss = loss.astype(jnp.float32)
    skip = ~jnp.isfinite(loss) | ((count >= spikes.min_steps) & (loss > mean + spikes.k * std))
    losses = jnp.where(skip, window["losses"], window["losses"].at[window["seen"] % w].set(loss))
    return skip, {"losses": losses, "seen": window["seen"] + (~skip).astype(jnp.int32),
                  "skipped": window["skipped"] + skip.astype(jnp.int32),
                  "run": jnp.where(skip, window["run"] + 1, 0).astype(jnp.int32)}


def _state_shardings(cfg, tx, mesh, rules, abstract_state):
    p_sh = param_shardings(cfg, mesh, rules)
    rep = shd.replicated(mesh)
    # Optimizer leaves that mirror a parameter (Adam mu/nu, ...) take its sharding; the rest
    # (step counts, schedule state) are replicated scalars.
    opt_sh = optax.tree_map_params(
        tx, lambda _, s: s, abstract_state["opt_state"], p_sh,
        transform_non_params=lambda _: rep, is_leaf=lambda x: isinstance(x, NamedSharding))
    shardings = {"params": p_sh, "opt_state": opt_sh, "step": rep}
    if "spikes" in abstract_state:
        shardings["spikes"] = jax.tree.map(lambda _: rep, abstract_state["spikes"])
    return shardings


def _init_fn(cfg: LlamaConfig, tx: optax.GradientTransformation, spikes: SpikeConfig | None = None):
    def init(key):
        model = Llama(cfg, rngs=nnx.Rngs(params=key))
        params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        state = {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32)}
        if spikes is not None:
            state["spikes"] = spike_window_init(spikes.window)
        return state

    return init


def abstract_train_state(model_cfg, tx, mesh: Mesh, rules, spikes: SpikeConfig | None = None):
    """(TrainState of jax.ShapeDtypeStruct carrying .sharding, state shardings)."""
    cfg = as_cfg(model_cfg)
    abstract = jax.eval_shape(_init_fn(cfg, tx, spikes), jax.random.key(0))
    shardings = _state_shardings(cfg, tx, mesh, rules, abstract)
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
    return abstract, shardings


def init_train_state(model_cfg, tx, mesh: Mesh, rules, seed: int, spikes: SpikeConfig | None = None,
                     shardings=None):
    """Fresh TrainState, created already sharded (each device computes only its shards).
    `shardings`: the state's, where the caller has them (a Program does): tracing the init for
    them again costs a start-up ~0.2 s."""
    cfg = as_cfg(model_cfg)
    if shardings is None:
        _, shardings = abstract_train_state(cfg, tx, mesh, rules, spikes)
    init = jax.jit(_init_fn(cfg, tx, spikes), out_shardings=shardings)
    # The key is a host-side constant; the random draws happen inside the sharded init.
    return init(jax.random.key(seed)), shardings


def batch_sharding(mesh: Mesh, rules) -> NamedSharding:
    """[batch, seq] int32 arrays: batch split as the rules split "act_batch" (data, fsdp); whole rows
    on every chip of a row's `context` group (the step reorders them, then each keeps its share)."""
    return NamedSharding(mesh, shd.logical_to_spec(("act_batch", None), rules))


# ----------------------------------------------------------------------------- loss


def model_token_losses(model: Llama, batch, loss_chunk: int = 0, loss_head: str = "once"):
    """(CE, lse) per token [b, t] of `model` on `batch`.

    loss_chunk > 0 projects onto the vocab `loss_chunk` positions at a time (model/loss.py: the
    fp32 logits never exist whole; under FSDP the head is gathered once, not once per chunk).
    """
    x_btd = model.hidden(batch["inputs"], batch["positions"], batch["segment_ids"])
    if not loss_chunk:
        return token_losses(model.logits(x_btd), batch["targets"])
    return chunked_token_losses(x_btd, batch["targets"], model.output_head(), loss_chunk, model.cfg.dtype, loss_head)


def loss_fn(params, graphdef, batch, z_loss: float, denom=None, loss_chunk: int = 0, loss_head: str = "once"):
    """Mean CE over loss_mask tokens (+ z_loss * mean lse^2, PaLM's softmax stabiliser).

    `denom`: the token count to average over; with gradient accumulation it is the whole
    batch's, so the microbatches' losses add up to the batch mean exactly.
    """
    model = nnx.merge(graphdef, params)
    ce_bt, lse_bt = model_token_losses(model, batch, loss_chunk, loss_head)
    mask_bt = batch["loss_mask"].astype(jnp.float32)
    n_tokens = mask_bt.sum()
    denom = jnp.maximum(n_tokens if denom is None else denom, 1.0)
    ce = (ce_bt * mask_bt).sum() / denom
    zl = z_loss * (jnp.square(lse_bt) * mask_bt).sum() / denom
    return ce + zl, {"loss": ce, "z_loss": zl, "n_tokens": n_tokens}


def make_train_step(model_cfg, tx, mesh: Mesh, rules, state_shardings, z_loss: float = 0.0,
                    microbatches: int = 1, loss_chunk: int = 0, spikes: SpikeConfig | None = None,
                    loss_head: str = "once") -> Callable:
    """jitted (state, batch) -> (new_state, metrics); `state` is donated.

    microbatches > 1 accumulates gradients over that many slices of the batch (lax.scan), for
    global batches whose activations do not fit at once; the result equals one big step.
    loss_chunk, loss_head: see model_token_losses (model/loss.py). spikes: skip the update of a spike (SpikeConfig); the
    state must then hold "spikes" (init_train_state(..., spikes)); metrics gain "skipped" (0/1),
    "skipped_total" and "skipped_in_a_row". Without it the step is exactly what it was.
    """
    cfg = as_cfg(model_cfg)
    graphdef, _ = abstract_model(cfg)
    b_sh = batch_sharding(mesh, rules)
    rep = shd.replicated(mesh)
    context = ctx.shards(mesh, rules)
    batch_groups = math.prod(mesh.shape[a] for a in shd.mesh_axes_for("act_batch", rules))
    grad_fn = jax.value_and_grad(
        lambda p, batch, denom: loss_fn(p, graphdef, batch, z_loss, denom, loss_chunk, loss_head), has_aux=True)

    def grads_and_metrics(params, batch):
        with shd.activation_sharding(mesh, rules):
            # Context parallelism: each row's tokens in the balanced order (model/context.py), then
            # split over `context` by the activations' constraints. Sums over tokens: nothing to undo.
            batch = ctx.reorder(batch, context)
            if microbatches == 1:
                (_, metrics), grads = grad_fn(params, batch, None)
                return grads, metrics
            denom = batch["loss_mask"].astype(jnp.float32).sum()
            b, t = batch["inputs"].shape
            if b % microbatches:
                raise ValueError(f"batch {b} not divisible by microbatches={microbatches}")
            # [b, t] -> [m, b/m, t] taking rows m apart: each device keeps its own rows.
            mb_sh = NamedSharding(mesh, PartitionSpec(None, *b_sh.spec))
            split = lambda x: jax.lax.with_sharding_constraint(  # noqa: E731
                jnp.swapaxes(x.reshape(b // microbatches, microbatches, t), 0, 1), mb_sh)
            mbs = jax.tree.map(split, batch)

            def body(acc, mb):
                (_, m), g = grad_fn(params, mb, denom)
                return jax.tree.map(jnp.add, acc, (g, m)), None

            zeros = (jax.tree.map(jnp.zeros_like, params),
                     {"loss": 0.0, "z_loss": 0.0, "n_tokens": 0.0})
            zeros = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32) if not hasattr(x, "dtype") else x, zeros)
            (grads, metrics), _ = jax.lax.scan(body, zeros, mbs)
            return grads, metrics

    def step(state, batch):
        grads, metrics = grads_and_metrics(state["params"], batch)
        if context > 1:
            # max / mean causal attention work over a row's context chips (1.0: balanced)
            metrics = dict(metrics, context_imbalance=ctx.batch_imbalance(
                batch["segment_ids"], context, batch_groups, cfg.sliding_window))
        grads = jax.lax.with_sharding_constraint(grads, state_shardings["params"])
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        metrics = dict(metrics, grad_norm=optax.tree.norm(grads), param_norm=optax.tree.norm(params))
        new_state = {"params": params, "opt_state": opt_state, "step": state["step"] + 1}
        if spikes is not None:
            # Decided here, on the device: a select per array, no host round trip.
            skip, new_state["spikes"] = spike_decision(state["spikes"], metrics["loss"], spikes)
            keep = lambda old, new: jnp.where(skip, old, new)  # noqa: E731
            new_state["params"] = jax.tree.map(keep, state["params"], params)
            new_state["opt_state"] = jax.tree.map(keep, state["opt_state"], opt_state)
            metrics = dict(metrics, skipped=skip.astype(jnp.float32), skipped_total=new_state["spikes"]["skipped"],
                           skipped_in_a_row=new_state["spikes"]["run"])
        return new_state, metrics

    return jax.jit(step, in_shardings=(state_shardings, {k: b_sh for k in BATCH_KEYS}),
                   out_shardings=(state_shardings, rep), donate_argnums=(0,))


def make_eval_step(model_cfg, mesh: Mesh, rules, state_shardings, loss_chunk: int = 0) -> Callable:
    """jitted (params, batch) -> {"loss_sum", "n_tokens"} over loss_mask tokens, and the same by
    the input token's position in its document ("loss_by_pos", "tokens_by_pos": [t]; positions
    restart at each document and row start), for the held-out loss by position
    (model/evals/evaluate.py position_losses)."""
    cfg = as_cfg(model_cfg)
    graphdef, _ = abstract_model(cfg)
    b_sh = batch_sharding(mesh, rules)

    context = ctx.shards(mesh, rules)

    def step(params, batch):
        batch = ctx.reorder(batch, context)
        with shd.activation_sharding(mesh, rules):
            ce_bt, _ = model_token_losses(nnx.merge(graphdef, params), batch, loss_chunk)
        mask_bt = batch["loss_mask"].astype(jnp.float32)
        t = mask_bt.shape[1]
        pos_bt = jnp.clip(batch["positions"], 0, t - 1)
        by_pos = lambda x_bt: jnp.zeros(t, jnp.float32).at[pos_bt].add(x_bt)  # noqa: E731
        return {"loss_sum": (ce_bt * mask_bt).sum(), "n_tokens": mask_bt.sum(),
                "loss_by_pos": by_pos(ce_bt * mask_bt), "tokens_by_pos": by_pos(mask_bt)}

    return jax.jit(step, in_shardings=(state_shardings["params"], {k: b_sh for k in BATCH_KEYS}),
                   out_shardings=shd.replicated(mesh))


# ----------------------------------------------------------------------------- the program


@dataclasses.dataclass(frozen=True)
class Program:
    """The compiled program of a run, before any array exists: mesh, rules, the abstract train
    state with its shardings, and the jitted train and eval steps. train.py runs it;
    scripts/compile_tpu.py compiles the same object for a TPU topology, so what the compile
    check reports is what the run executes."""

    mesh: Mesh
    rules: shd.Rules
    abstract_state: TrainState   # jax.ShapeDtypeStruct leaves carrying .sharding
    state_shardings: Any
    batch_sharding: NamedSharding
    train_step: Callable         # (state, batch) -> (state, metrics); state donated
    eval_step: Callable          # (params, batch) -> {"loss_sum", "n_tokens"}
    init_state: Callable         # seed -> a fresh TrainState in its shardings
    # (params, opt_state) -> the optimizer state afresh for these params (Adam's moments and count),
    # the learning-rate schedule's count kept (checkpoint.reset_optimizer)
    fresh_opt_state: Callable | None = None

    def abstract_batch(self, global_batch: int, seq_len: int) -> dict:
        """The global batch as the input pipeline delivers it: int32 [global_batch, seq_len] per key."""
        return {k: jax.ShapeDtypeStruct((global_batch, seq_len), jnp.int32, sharding=self.batch_sharding)
                for k in BATCH_KEYS}


def build_program(model_cfg, tx, mesh_cfg: Mapping, *, global_batch: int, z_loss: float, microbatches: int,
                  loss_chunk: int = 0, spikes: SpikeConfig | None = None,
                  devices: Sequence[jax.Device] | None = None, seq_len: int | None = None,
                  loss_head: str = "once") -> Program:
    """The run's Program over `devices` (default: every process's devices).

    Raises ValueError naming the setting when the batch does not split over the mesh's batch
    shards or the microbatches, or (given seq_len) a row over its context chips; nothing is
    allocated or compiled here.
    """
    cfg = as_cfg(model_cfg)
    mesh = shd.make_mesh(mesh_cfg, devices)
    batch_ways = mesh.shape["data"] * mesh.shape["fsdp"]
    if global_batch % batch_ways:
        raise ValueError(f"data.global_batch_size={global_batch} does not divide over the {batch_ways} batch "
                         f"shards of mesh {dict(mesh.shape)} (mesh.data x mesh.fsdp)")
    if (global_batch // batch_ways) % microbatches:
        raise ValueError(f"train.microbatches={microbatches} does not divide the "
                         f"{global_batch // batch_ways} rows per batch shard")
    rules = shd.rules_from_cfg(mesh_cfg)
    if mesh.shape["context"] > 1 and "context" not in shd.mesh_axes_for("act_len", rules):
        raise ValueError(f"mesh.context={mesh.shape['context']} but mesh.rules maps act_len to "
                         f"{list(shd.mesh_axes_for('act_len', rules))}: add [act_len, context]")
    context = ctx.shards(mesh, rules)
    if seq_len is not None:
        ctx.layout_index(seq_len, context)  # raises naming data.seq_len when the chips cannot share a row
        if cfg.attention == "splash" and (seq_len // context) % 128:  # splash's blocks (segment ids: 128 lanes)
            raise ValueError(f"model.attention=splash needs each chip's part of a row, data.seq_len={seq_len} / "
                             f"mesh.context={context}, to be a multiple of 128")
    abstract_state, state_shardings = abstract_train_state(cfg, tx, mesh, rules, spikes)
    return Program(
        mesh=mesh, rules=rules, abstract_state=abstract_state, state_shardings=state_shardings,
        batch_sharding=batch_sharding(mesh, rules),
        train_step=make_train_step(cfg, tx, mesh, rules, state_shardings, z_loss=z_loss, microbatches=microbatches,
                                   loss_chunk=loss_chunk, spikes=spikes, loss_head=loss_head),
        eval_step=make_eval_step(cfg, mesh, rules, state_shardings, loss_chunk=loss_chunk),
        init_state=lambda seed: init_train_state(cfg, tx, mesh, rules, seed, spikes, shardings=state_shardings)[0],
        fresh_opt_state=jax.jit(functools.partial(fresh_opt_state, tx), out_shardings=state_shardings["opt_state"]))


def fresh_opt_state(tx: optax.GradientTransformation, params, opt_state):
    """tx's state afresh for `params`, but for the schedule's step count, taken from `opt_state`: the
    learning rate goes on where the run is while the moments (and Adam's bias-correction count)
    start again."""
    def is_schedule(x):
        return isinstance(x, optax.ScaleByScheduleState)
    return jax.tree.map(lambda old, new: old if is_schedule(old) else new, opt_state, tx.init(params),
                        is_leaf=is_schedule)

"""A search over a run's plans: mesh ways, microbatches, remat policy, loss chunk and the loss's way
with the output head, ranked by the
predicted step time (model/predict.py) of each plan's compiled train step, under the HBM limit.
scripts/compile_tpu.py --search drives it; this module holds what needs no compiler.

1. candidates(): every plan that divides. The mesh's data x fsdp x context x tensor ways multiply to
   the slice's chips; tensor divides the query and KV heads (a head is not split); context splits a
   row into equal parts (and splash's 128-token blocks); the microbatches divide the rows of a batch
   shard; the remat policies are those whose cost differs for the attention kernel (splash's dots,
   dots_all and dots_attention are one program), and offload (model/llama.py: five tensors a layer
   kept in host memory); the loss chunk is 0 (the whole row), the run's own, or the row halved down
   to 512 positions (at most 4 halvings); a chunked loss gathers the head once a pass or per chunk
   (train.loss_head: once holds the gathered head and its gradient's fp32 sum for the whole loss).
2. estimate(): per chip, the memory (the train state, the gathered weights, the activations remat
   keeps, one layer's working set and the logits) and the ICI bytes per mesh axis (FSDP's weight
   gathers and gradient reduce-scatters per pass, the head's once a pass, tensor's activation
   all-reduces, context's K/V gathers, data's gradient all-reduce), and what crosses PCIe (offload's
   tensors, out and back), priced by the same model as a compiled program. Arithmetic only: within
   16% of the compiled memory of four 1B plans (docs/tpu-pod.md "Choose a plan with --search" has
   the figures), so it prunes only plans it puts
   above PRUNE_OVER x the limit and orders the rest, never decides a fit.
3. to_compile(): the shipped plan first, then the estimated-fitting plans by estimated step, then the
   near misses, `budget` in all; compile_tpu compiles each --quick. rank() orders the compiled
   plans: every fitting plan before any that does not fit, then by predicted step (RANK_BY: the
   middle of the predicted range by default, or its lower or upper bound).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Mapping, Sequence

from model.predict import Chip, predict

# The room a plan must leave (tests/test_compile_tpu.py holds each experiment to the same): 90% of
# the usable HBM, less the 4% a --quick compile has come out below the full one.
HBM_LIMIT = 0.9
QUICK_BELOW_FULL = 0.04
QUICK_LIMIT = HBM_LIMIT * (1 - QUICK_BELOW_FULL)
# Pruned unseen: an estimate this far above the limit (the estimate overshot the compiled figure
# by up to 16% on the 1B plans of tests/test_plan_search.py; 1.25 leaves that and more).
PRUNE_OVER = 1.25
MIN_LOSS_CHUNK = 512        # below it the head is gathered too often for a saving worth having
LOSS_HEADS = ("once", "per_chunk")     # model/loss.py HEAD_GATHERS; the first is the default
# How compiled plans rank (sort_key): "mid", the default, by the middle of the predicted range (half
# the collectives' time hidden) then the lower bound; "step" by the lower bound (all of it hidden)
# then the upper; "upper" by the upper bound (none hidden) then the lower. The lower bound alone
# trusts the overlap entirely: by it the estimate ranks remat none at 8 microbatches on the v4-32
# (links busy 79-95% of compute, 2.7% less recompute) above remat dots at 2 (23%).
RANK_BY = ("mid", "step", "upper")


@dataclasses.dataclass(frozen=True, order=True)
class Plan:
    """The settings the search changes; everything else is the experiment's."""

    data: int
    fsdp: int
    context: int
    tensor: int
    microbatches: int
    remat: str
    loss_chunk: int
    loss_head: str = "once"         # train.loss_head; it matters only with a loss chunk

    @property
    def mesh(self) -> dict[str, int]:
        return {"data": self.data, "fsdp": self.fsdp, "context": self.context, "tensor": self.tensor}

    def overrides(self) -> list[str]:
        """The Hydra overrides that give a run this plan (every key: the line composes to it
        whatever the experiment set, a -1 included)."""
        return [*(f"mesh.{axis}={ways}" for axis, ways in self.mesh.items()),
                f"train.microbatches={self.microbatches}", f"model.remat={self.remat}",
                f"train.loss_chunk={self.loss_chunk}", f"train.loss_head={self.loss_head}"]

    def label(self) -> str:
        mesh = " x ".join(f"{axis} {ways}" for axis, ways in self.mesh.items() if ways > 1) or "1 chip"
        head = ", head per chunk" if self.loss_chunk and self.loss_head == "per_chunk" else ""
        return f"{mesh}, {self.microbatches} mb, remat {self.remat}, chunk {self.loss_chunk}{head}"


def plan_of(cfg) -> Plan:
    """The plan a composed run config (after its mesh is resolved: `mesh` = {axis: ways}) holds."""
    mesh = cfg["mesh"]
    return Plan(int(mesh["data"]), int(mesh["fsdp"]), int(mesh["context"]), int(mesh["tensor"]),
                int(cfg["train"]["microbatches"]), str(cfg["model"]["remat"]), int(cfg["train"]["loss_chunk"]),
                str(cfg["train"].get("loss_head", "once")))


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def remat_options(attention: str) -> tuple[str, ...]:
    """The policies whose program differs for this attention kernel (model/llama.py REMAT_POLICIES):
    dots_all keeps attention's einsums only with the XLA reference, dots_attention keeps only cuDNN's
    kernel; with splash both are dots. offload keeps five tensors a layer in host memory and
    recomputes the rest: less HBM than dots, a PCIe trip each way per step."""
    extra = {"xla": ("dots_all",), "cudnn": ("dots_attention",)}.get(attention, ())
    return ("none", "dots", "full", "offload", *extra)


def loss_chunks(seq_len: int, own: int) -> list[int]:
    halves = [seq_len >> k for k in range(1, 5) if (seq_len >> k) >= MIN_LOSS_CHUNK and seq_len % (seq_len >> k) == 0]
    return sorted({0, own, *halves})


def candidates(model, seq_len: int, global_batch: int, chips: int, own: Plan) -> list[Plan]:
    """Every plan of `chips` chips that divides (module doc, 1). model: a LlamaConfig."""
    out = []
    for tensor in divisors(chips):
        if model.n_heads % tensor or model.n_kv_heads % tensor:
            continue
        for context in divisors(chips // tensor):
            if seq_len % context or (model.attention == "splash" and (seq_len // context) % 128):
                continue
            for data in divisors(chips // (tensor * context)):
                fsdp = chips // (tensor * context * data)
                if global_batch % (data * fsdp):
                    continue
                for mb in divisors(global_batch // (data * fsdp)):
                    for remat in remat_options(model.attention):
                        for chunk in loss_chunks(seq_len, own.loss_chunk):
                            for head in LOSS_HEADS if chunk else LOSS_HEADS[:1]:
                                out.append(Plan(data, fsdp, context, tensor, mb, remat, chunk, head))
    return out


# ----------------------------------------------------------------------------- the estimate


@dataclasses.dataclass(frozen=True)
class Estimate:
    memory_bytes: float                 # per chip, the train step
    ici_bytes_by_axes: dict[str, float]  # per chip per step, keyed as model/ici.py keys them
    host_bytes: float = 0.0             # per chip per step over PCIe, both ways (remat offload)


def axes_key(mesh: Mapping[str, int], axes: Iterable[str]) -> str:
    """model/ici.py's key for a collective over `axes`: those of more than one way, in mesh order."""
    chosen = set(axes)
    return "+".join(a for a in mesh if a in chosen and mesh[a] > 1)


def estimate(plan: Plan, model, seq_len: int, global_batch: int) -> Estimate:
    """The plan's per-chip memory and ICI bytes from the model's shapes (module doc, 2). Each term
    says what it counts; the constants are the program's dtypes (fp32 state, bf16 activations)."""
    d, f, v, layers = model.d_model, model.d_ff, model.vocab_size, model.n_layers
    q, kv, t, c = model.n_heads * model.head_dim, model.n_kv_heads * model.head_dim, plan.tensor, plan.context
    params = model.num_params()
    head = d * v
    layer_params = (params - head * (1 if model.tie_embeddings else 2)) / layers
    state_ways = plan.fsdp * plan.context * plan.tensor     # the `embed` rule: fsdp x context; tensor beside it
    rows = global_batch // (plan.data * plan.fsdp) // plan.microbatches      # rows per chip per pass
    tokens = rows * seq_len / c                                                # tokens per chip per pass
    # memory: params, Adam's two moments (fp32: 12 B) and the gradients with their accumulator and
    # the update's temporaries (8 B), sharded; a layer's gathered weights in fp32 and bf16, twice
    # (the next layer's arrives while this one runs) and the head's
    state = (12 + 8) * params / state_ways + 2 * 6 * layer_params / t + 6 * head / t
    # per token per layer, bf16: none keeps every activation (the residual stream's 6 [d] and the
    # split heads' and MLP's; twice that, as the 1B compiled without remat keeps 156 KB a token and
    # layer, 2.0x this count: fp32 copies), dots the weight matmuls' outputs and the layer input,
    # full the input
    every = 6 * d + (2 * q + 2 * kv) / t + 4 * f / t
    # offload keeps its five tensors in host memory: none between the passes on the chip
    kept = {"none": 2 * every, "full": d, "offload": 0}.get(plan.remat, 3 * d + d + (q + 2 * kv + 2 * f) / t)
    activations = 2 * kept * layers * tokens
    working = 2 * every * tokens + 2 * 2 * kv / t * tokens * c   # one layer's backward (bf16); its gathered K/V
    # the fp32 logits and their bf16 gradient, over the whole row or one chunk of it
    logit_tokens = tokens if not plan.loss_chunk else tokens * plan.loss_chunk / seq_len
    logits = 6 * logit_tokens * v / t
    # a chunked loss that gathers the head once (model/loss.py) holds it whole in bf16 and its
    # gradient's fp32 sum through the loss: 6 B a head parameter (the 8B at 8k compiled 3.7 GiB above
    # its per-chunk program, 27.84 against 24.15 GiB)
    per_chunk = plan.loss_chunk and (plan.loss_head == "per_chunk" or t > 1 or plan.loss_chunk % c)
    head_whole = 6 * head if plan.loss_chunk and not per_chunk else 0.0
    memory = state + activations + working + logits + head_whole
    # ICI, per pass (x microbatches): the FSDP ways (fsdp x context) gather each layer's weights in
    # the forward and again in the backward and reduce-scatter their gradients, in fp32 when they
    # span every chip (the compiled 1B over fsdp 16: 3 x 4 B x params x 15/16 per pass, within 5%)
    # and in bf16 beside data ways (XLA's choice, libtpu 0.0.42.1: data 2 x fsdp 8 on the v5e-16
    # moved 5.5 GiB per pass, 3 x 2 B x params x 7/8); a chunked loss gathers the head once per
    # pass on each chip (model/loss.py), but per chunk where the vocab splits over tensor ways or
    # a chunk does not split over the context ways (the partitioner's way)
    ici: dict[str, float] = {}

    def add(axes, nbytes):
        key = axes_key(plan.mesh, axes)
        if key and nbytes:
            ici[key] = ici.get(key, 0.0) + nbytes * plan.microbatches

    g = plan.fsdp * plan.context
    chunks = seq_len // plan.loss_chunk if per_chunk else 1
    width = 2 if plan.data > 1 else 4
    add(("fsdp", "context"), (3 * width * params / t + 3 * width * head / t * (chunks - 1)) * (g - 1) / g)
    # tensor: each layer all-reduces its attention and MLP outputs ([tokens, d], bf16) forward and
    # backward, and again where the forward is re-run (full); the embedding lookup once each way
    if t > 1:
        reduces = layers * (6 if plan.remat == "full" else 4) + 2
        add(("tensor",), reduces * 2 * (t - 1) / t * 2 * tokens * d)
    # context: each layer gathers its K and V (bf16) forward and again to recompute (remat), and
    # reduce-scatters their gradients (fp32)
    if c > 1:
        gathers = 1 if plan.remat == "none" else 2
        add(("context",), layers * (gathers * 2 + 4) * 2 * kv / t * tokens * (c - 1))
    # data: the gradients' all-reduce over the data ways, inside the accumulation loop (per pass)
    if plan.data > 1:
        add(("data",), 4 * params / state_ways * 2 * (plan.data - 1) / plan.data)
    # PCIe: offload writes each layer's input and output projection ([d] each, whole on every tensor
    # way) and its q, k, v projections (split over tensor ways), bf16, to the host in the forward and
    # reads them back in the backward, every pass (the compiled 8B on the v6e-16 held 21.0 GiB of them)
    host = 0.0
    if plan.remat == "offload":
        host = 2 * 2 * (2 * d + (q + 2 * kv) / t) * tokens * layers * plan.microbatches
    return Estimate(memory, ici, host)


def estimated_step(est: Estimate, *, useful_flops: float, executed_flops: float, chips: int, chip: Chip,
                   links: Mapping[str, int]) -> dict:
    """model/predict.py's step on the estimated bytes (no HBM term: negligible on every plan here)."""
    return predict(useful_flops=useful_flops, executed_flops=executed_flops, chips=chips, chip=chip,
                   ici_bytes_by_axes=est.ici_bytes_by_axes, links=links, host_bytes=est.host_bytes)


# ----------------------------------------------------------------------------- choose and rank


def sort_key(predicted: Mapping[str, float], by: str = "mid") -> tuple[float, float]:
    """The predicted step a plan ranks by, and its tie-break (RANK_BY)."""
    if by not in RANK_BY:
        raise ValueError(f"rank by {by!r}: expected one of {', '.join(RANK_BY)}")
    lower, upper = predicted["step_s"], predicted["step_s_upper"]
    return {"mid": ((lower + upper) / 2, lower), "step": (lower, upper), "upper": (upper, lower)}[by]


def to_compile(estimated: Sequence[tuple[Plan, float, Mapping]], own: Plan, budget: int, capacity: float,
               by: str = "mid") -> tuple[list[Plan], int]:
    """The plans to compile, in order, and how many the estimate pruned (module doc, 3).
    estimated: (plan, estimated memory bytes, estimated prediction) each; capacity: usable HBM bytes."""
    limit = HBM_LIMIT * capacity
    kept = [(mem > limit, sort_key(pred, by), mem, plan) for plan, mem, pred in estimated
            if mem <= PRUNE_OVER * limit and plan != own]
    pruned = sum(1 for plan, mem, _ in estimated if mem > PRUNE_OVER * limit and plan != own)
    return [own, *(plan for *_, plan in sorted(kept))][:max(budget, 1)], pruned


@dataclasses.dataclass
class Result:
    """A compiled plan: whether it fits under the limit, its memory and its predicted step."""

    plan: Plan
    fits: bool
    train_fraction: float | None      # of the usable HBM, the train step (None: the compiler said no)
    eval_fraction: float | None
    predicted: dict | None            # model/predict.py's, None when nothing compiled
    note: str = ""                    # why it does not fit, or the config error that stopped it
    compiled: bool = True             # False: a check stopped it before the compiler (note says which)


def result_of(plan: Plan, compiled: Mapping | None, limit: float = QUICK_LIMIT, error: str = "") -> Result:
    """A Result from compile_tpu's compiled figures (None and `error`: the plan failed its checks)."""
    if compiled is None:
        return Result(plan, False, None, None, None, error, compiled=False)
    train, evals = compiled["train_step"], compiled["eval_step"]
    fractions = [r.get("hbm_fraction") for r in (train, evals)]
    over = [f"{step} step " + (r["compiler_says"] if "compiler_says" in r else f"at {r['hbm_fraction']:.0%} of HBM")
            for step, r in (("train", train), ("eval", evals)) if not r["fits"] or r["hbm_fraction"] > limit]
    return Result(plan, not over, *fractions, train.get("predicted"), "; ".join(over))


def rank(results: Iterable[Result], by: str = "mid") -> list[Result]:
    """Fitting plans first, by predicted step (sort_key); then the rest, by their step where they
    compiled: a plan over the limit never wins."""
    def key(r: Result):
        return (not r.fits, r.predicted is None, sort_key(r.predicted, by) if r.predicted else (math.inf,) * 2,
                r.plan)
    return sorted(results, key=key)


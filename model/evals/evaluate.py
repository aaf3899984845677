"""Downstream tasks scored by the model being trained (the lm-evaluation-harness's request model).

For each request (context, continuation): the log-likelihood of the continuation given the
context, and whether it is the greedy continuation (every continuation token is the argmax).
Multiple choice: acc = the gold choice has the highest log-likelihood; acc_norm = the highest
log-likelihood per character of the choice (the harness's `acc_norm`). Loglikelihood tasks
(LAMBADA): acc = greedy, ppl = exp(-mean log-likelihood), as the harness reports them.

How it runs (model/evals/tasks.py builds the rows):
- Requests are packed first-fit into fixed [batch_rows, seq_len] rows, one segment each (the
  segment-aware attention of model/llama.py keeps them apart), so one compiled step serves
  every batch. A multiple-choice example's choices repeat its context in separate segments:
  prefix reuse across segments would need a tree-shaped mask the model does not have; packing
  is what recovers the padding (a HellaSwag example is ~4 x 100 tokens in a 2048-token row).
- The task files are read and tokenized once, at construction, identically on every process;
  each batch of rows is one global array split over the mesh's batch shards, so every process's
  devices score a disjoint slice of the rows, and the per-token results come back replicated.
  The rows and their order do not depend on the host count, hence neither do the metrics.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from model import sharding as shd
from model.evals.tasks import (
    ON_BAD_LINE,
    Example,
    PackedRows,
    PasskeyConfig,
    Request,
    RequestEncoder,
    TaskSpec,
    pack_requests,
    passkey_examples,
    read_task,
)
from model.llama import LlamaConfig
from model.step import abstract_model, as_cfg, batch_sharding, token_losses

log = logging.getLogger(__name__)
ROW_KEYS = ("inputs", "targets", "segment_ids", "positions", "branch_ids")


# ----------------------------------------------------------------------------- config

@dataclasses.dataclass(frozen=True)
class TasksConfig:
    """The `eval` group: which tasks, how often, and the scoring shape."""

    tasks: tuple[TaskSpec, ...] = ()
    tasks_every: int = 0              # steps between evaluations (0: only at the end, when tasks are set)
    seq_len: int | None = None        # tokens per packed row (null: data.seq_len)
    batch_rows: int | None = None     # rows per scoring step (null: data.global_batch_size)
    on_bad_line: str = "error"        # error | skip (counted) for malformed task lines
    passkey: PasskeyConfig = PasskeyConfig()   # the synthetic passkey task (off: no lengths)

    @classmethod
    def from_mapping(cls, m: Mapping[str, Any] | None) -> "TasksConfig":
        """One-line ValueError naming the key for any mistake; reads no file."""
        m = dict((m or {}).items())
        unknown = set(m) - {"tasks", "tasks_every", "seq_len", "batch_rows", "on_bad_line", "passkey"}
        if unknown:
            raise ValueError(f"unknown setting(s): {', '.join(sorted('eval.' + k for k in unknown))}")
        tasks = m.get("tasks") or []
        if isinstance(tasks, Mapping) or isinstance(tasks, str):
            raise ValueError("eval.tasks must be a list of {name, path, format} entries")
        specs = tuple(TaskSpec.from_mapping(t if isinstance(t, Mapping) else _not_mapping(t, i), f"eval.tasks[{i}]")
                      for i, t in enumerate(tasks))
        names = [s.name for s in specs]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"eval.tasks: task names listed twice: {dup}")
        for key, low in (("tasks_every", 0), ("seq_len", 1), ("batch_rows", 1)):
            v = m.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < low):
                raise ValueError(f"eval.{key}={v!r}; expected an integer >= {low}" + (" or null" if low else ""))
        on_bad = m.get("on_bad_line") or "error"
        if on_bad not in ON_BAD_LINE:
            raise ValueError(f"eval.on_bad_line={on_bad!r}; expected one of {list(ON_BAD_LINE)}")
        passkey = PasskeyConfig.from_mapping(m.get("passkey"))
        if passkey.lengths and "passkey" in names:
            raise ValueError("eval.tasks: the name passkey is taken by eval.passkey; rename that task")
        return cls(tasks=specs, tasks_every=int(m.get("tasks_every") or 0), seq_len=m.get("seq_len"),
                   batch_rows=m.get("batch_rows"), on_bad_line=on_bad, passkey=passkey)

    @property
    def any(self) -> bool:
        return bool(self.tasks or self.passkey.lengths)


def _not_mapping(t, i):
    raise ValueError(f"eval.tasks[{i}] = {t!r}; expected a mapping with name, path, format")


# ----------------------------------------------------------------------------- scoring


def make_score_step(model_cfg, mesh: Mesh, rules, param_shardings):
    """jitted (params, rows) -> (log p(target) [b, t] fp32, target is the argmax [b, t] bool), replicated."""
    cfg = as_cfg(model_cfg)
    graphdef, _ = abstract_model(cfg)
    b_sh = batch_sharding(mesh, rules)

    def step(params, rows):
        with shd.activation_sharding(mesh, rules):
            model = nnx.merge(graphdef, params)
            logits_btv = model.logits(model.hidden(rows["inputs"], rows["positions"], rows["segment_ids"],
                                                     rows["branch_ids"]))
            ce_bt, _ = token_losses(logits_btv, rows["targets"])
            greedy_bt = jnp.argmax(logits_btv, axis=-1).astype(jnp.int32) == rows["targets"]
        return -ce_bt, greedy_bt

    return jax.jit(step, in_shardings=(param_shardings, {k: b_sh for k in ROW_KEYS}),
                   out_shardings=shd.replicated(mesh))


class Scorer:
    """Token requests -> [(log-likelihood, is_greedy)] on a mesh: the in-loop evaluator's and the
    lm_eval adapter's common engine. `batch_rows` must divide over the mesh's batch shards."""

    def __init__(self, model_cfg, mesh: Mesh, rules, param_shardings, *, seq_len: int, batch_rows: int):
        cfg = as_cfg(model_cfg)
        if seq_len > cfg.max_seq_len:
            raise ValueError(f"eval.seq_len={seq_len} exceeds model.max_seq_len={cfg.max_seq_len}")
        ways = mesh.shape["data"] * mesh.shape["fsdp"]
        if batch_rows % ways:
            raise ValueError(f"eval.batch_rows={batch_rows} does not divide over the {ways} batch shards of "
                             f"mesh {dict(mesh.shape)}")
        self.seq_len, self.batch_rows = seq_len, batch_rows
        self.sharding: NamedSharding = batch_sharding(mesh, rules)
        self.step = make_score_step(cfg, mesh, rules, param_shardings)

    def pack(self, requests: Sequence[Request]) -> PackedRows:
        return pack_requests(requests, self.seq_len, rows_multiple=self.batch_rows)

    def _global(self, rows_host: np.ndarray) -> jax.Array:
        # Every process holds all rows; each device takes its own block (its slice of the batch).
        return jax.make_array_from_callback(rows_host.shape, self.sharding, lambda idx: rows_host[idx])

    def score_packed(self, params, packed: PackedRows) -> tuple[np.ndarray, np.ndarray]:
        """(log-likelihood [n] float64, is_greedy [n] bool) per packed request."""
        n_rows = packed.inputs.shape[0]
        lp = np.zeros(packed.inputs.shape, np.float64)
        greedy = np.zeros(packed.inputs.shape, bool)
        for r0 in range(0, n_rows, self.batch_rows):
            sl = slice(r0, r0 + self.batch_rows)
            rows = {k: self._global(getattr(packed, k)[sl]) for k in ROW_KEYS}
            lp_bt, g_bt = jax.device_get(self.step(params, rows))
            lp[sl], greedy[sl] = lp_bt, g_bt
        # Prefix sums per row turn each request's span into two lookups.
        csum = np.concatenate([np.zeros((n_rows, 1)), np.cumsum(lp, axis=1)], axis=1)
        miss = np.concatenate([np.zeros((n_rows, 1), np.int64), np.cumsum(~greedy, axis=1)], axis=1)
        ll = csum[packed.row, packed.end] - csum[packed.row, packed.start]
        is_greedy = (miss[packed.row, packed.end] - miss[packed.row, packed.start]) == 0
        return ll, is_greedy

    def score(self, params, requests: Sequence[Request]) -> tuple[np.ndarray, np.ndarray]:
        return self.score_packed(params, self.pack(requests))


# ----------------------------------------------------------------------------- metrics


def task_metrics(examples: Sequence[Example], ll: np.ndarray, greedy: np.ndarray, kind: str) -> dict[str, float]:
    """The harness's per-task metrics from per-request results in example-then-choice order."""
    accs, norms, lls = [], [], []
    k = 0
    for ex in examples:
        m = len(ex.choices)
        ex_ll, ex_g = ll[k:k + m], greedy[k:k + m]
        k += m
        if kind == "multiple_choice":
            accs.append(float(np.argmax(ex_ll) == ex.gold))   # argmax: the first of ties, as the harness
            norms.append(float(np.argmax(ex_ll / np.asarray(ex.norm_lens)) == ex.gold))
        else:
            accs.append(float(ex_g[0]))
            lls.append(float(ex_ll[0]))
    out = {"acc": float(np.mean(accs))}
    if kind == "multiple_choice":
        out["acc_norm"] = float(np.mean(norms))
    else:
        out["ppl"] = float(math.exp(-np.mean(lls)))
    return out


def passkey_metrics(groups: Sequence[str], greedy: np.ndarray) -> dict[str, float]:
    """tasks/passkey/acc_len{L}_depth{D}: the share of that cell's keys that are the greedy
    continuation of their context (tasks/passkey/acc is over all cells)."""
    hits: dict[str, list[bool]] = {}
    for g, ok in zip(groups, greedy.tolist(), strict=True):
        hits.setdefault(g, []).append(bool(ok))
    return {f"tasks/passkey/{g}": float(np.mean(v)) for g, v in hits.items()}


class TaskEvaluator:
    """In-loop downstream evaluation of `eval.tasks`.

        evaluator = TaskEvaluator(tasks_cfg, tokenizer, model_cfg=..., mesh=..., rules=..., param_shardings=...,
                                  seq_len=..., batch_rows=...)
        metrics = evaluator.evaluate(state["params"])   # {"tasks/<name>/acc": ..., ...}; call on every process

    Reading, validating and tokenizing every task file happens here, before training starts;
    evaluate() only runs the compiled scoring step.
    """

    def __init__(self, tasks_cfg: TasksConfig, tokenizer, *, model_cfg, mesh: Mesh, rules, param_shardings,
                 seq_len: int, batch_rows: int, add_bos: bool = False):
        self.cfg = tasks_cfg
        self.scorer = Scorer(model_cfg, mesh, rules, param_shardings, seq_len=seq_len, batch_rows=batch_rows)
        encoder = RequestEncoder(tokenizer, add_bos=add_bos)
        self.tasks: list[tuple[TaskSpec, list[Example], int]] = []
        pairs: list[tuple[str, str]] = []
        for spec in tasks_cfg.tasks:
            examples, skipped = read_task(spec, tasks_cfg.on_bad_line)
            self.tasks.append((spec, examples, skipped))
            pairs.extend((ex.context, c) for ex in examples for c in ex.choices)
        # The passkey task (made here, from its seed): one loglikelihood request per example, its
        # accuracy also per (length, depth) cell.
        self.passkey_groups: list[str] = []
        if tasks_cfg.passkey.lengths:
            tasks_cfg.passkey.check_fits(seq_len)
            examples, self.passkey_groups = passkey_examples(tasks_cfg.passkey, tokenizer, add_bos)
            self.tasks.append((TaskSpec("passkey", "(synthetic: eval.passkey)", kind="loglikelihood"), examples, 0))
            pairs.extend((ex.context, ex.choices[0]) for ex in examples)
        self.requests = encoder.encode(pairs)
        self.packed = self.scorer.pack(self.requests)
        self.n_examples = sum(len(ex) for _, ex, _ in self.tasks)
        log.info("eval.tasks: %d examples, %d requests in %d rows of %d tokens (%s)", self.n_examples,
                 len(self.requests), self.packed.inputs.shape[0], seq_len,
                 ", ".join(f"{s.name}: {len(ex)}" + (f" ({sk} malformed lines skipped)" if sk else "")
                           for s, ex, sk in self.tasks))

    @classmethod
    def from_run_config(cls, cfg: Mapping, program, tokenizer) -> "TaskEvaluator | None":
        """From the run's config (`eval`, `data`, `model`) and its Program; None when eval.tasks is empty."""
        tasks_cfg = TasksConfig.from_mapping(cfg.get("eval"))
        if not tasks_cfg.any:
            return None
        data = cfg["data"]
        return cls(tasks_cfg, tokenizer, model_cfg=LlamaConfig.from_mapping(cfg["model"]), mesh=program.mesh,
                   rules=program.rules, param_shardings=program.state_shardings["params"],
                   seq_len=tasks_cfg.seq_len or int(data["seq_len"]),
                   batch_rows=tasks_cfg.batch_rows or int(data["global_batch_size"]),
                   add_bos=bool(data.get("add_bos", False)))

    def should_run(self, step: int, last_step: int) -> bool:
        every = self.cfg.tasks_every
        return step == last_step or bool(every and step % every == 0)

    def evaluate(self, params) -> dict[str, float]:
        ll, greedy = self.scorer.score_packed(params, self.packed)
        out: dict[str, float] = {}
        k = 0
        for spec, examples, _ in self.tasks:
            n = sum(len(ex.choices) for ex in examples)
            for name, value in task_metrics(examples, ll[k:k + n], greedy[k:k + n], spec.kind).items():
                out[f"tasks/{spec.name}/{name}"] = value
            if spec.name == "passkey" and self.passkey_groups:
                out.update(passkey_metrics(self.passkey_groups, greedy[k:k + n]))
            k += n
        return out


def position_losses(loss_by_pos, tokens_by_pos, buckets: int) -> dict[str, float]:
    """The held-out loss by position: `buckets` equal spans of positions 0 .. seq_len - 1 (bucket
    i: positions [i * seq_len / buckets, (i + 1) * seq_len / buckets)) -> {"eval_loss_pos/00": mean
    loss of the tokens predicted from positions in the first span, ...}. A position is the input
    token's place in its document within the row (a document continued from the previous row
    starts again at 0: the context the model sees), not its column. Spans without a token are
    left out."""
    loss_by_pos, tokens_by_pos = np.asarray(loss_by_pos, np.float64), np.asarray(tokens_by_pos, np.float64)
    t = len(loss_by_pos)
    which = np.arange(t) * buckets // t
    loss = np.bincount(which, loss_by_pos, minlength=buckets)
    n = np.bincount(which, tokens_by_pos, minlength=buckets)
    width = max(2, len(str(buckets - 1)))
    return {f"eval_loss_pos/{i:0{width}d}": float(loss[i] / n[i]) for i in range(buckets) if n[i] > 0}


class LoopEvals:
    """The training loop's evaluations: the held-out loss every `eval_every` steps
    (data/heldout.py HeldOutSet), also by position when `position_buckets` (data.eval), and the
    downstream tasks at their own interval. Their time is paused time for the meter (out of
    tokens/s and MFU) and reported as `eval_s`."""

    def __init__(self, held_out, eval_every: int | None, tasks: TaskEvaluator | None, last_step: int,
                 position_buckets: int = 0):
        self.held_out, self.every, self.tasks, self.last_step = held_out, eval_every, tasks, last_step
        self.position_buckets = position_buckets

    def due(self, step: int) -> tuple[bool, bool]:
        loss_now = self.held_out is not None and bool(self.every) and step % self.every == 0
        return loss_now, self.tasks is not None and self.tasks.should_run(step, self.last_step)

    def run(self, step: int, params, meter) -> dict:
        """{"eval_loss", "eval_loss_pos/..", "tasks/...", "eval_s"} for what is due at `step`; every
        process calls it."""
        loss_now, tasks_now = self.due(step)
        row: dict = {}
        t0 = time.perf_counter()
        if loss_now:
            sums = self.held_out.sums(params)
            row["eval_loss"] = float(sums["loss_sum"] / max(1, sums["n_tokens"]))
            if self.position_buckets:
                row.update(position_losses(sums["loss_by_pos"], sums["tokens_by_pos"], self.position_buckets))
        if tasks_now:
            row.update(self.tasks.evaluate(params))
        row["eval_s"] = time.perf_counter() - t0
        meter.paused(row["eval_s"], kind="eval")
        return row

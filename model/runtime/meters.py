"""What the training loop measures and where it goes: the interval meter (throughput, MFU, data
wait, the input's per-stage times, checkpoint and evaluation time kept apart), the metrics
logger (progress bar, metrics.jsonl, wandb) and the profiler window.

The meter's clock: an interval runs from one log row to the next; the compile step is left
out (the meter starts after it); evaluations are paused time (out of tokens/s and MFU);
checkpoint saves stay inside the interval and are reported as `checkpoint_save_s`.
"""
from __future__ import annotations

import json
import secrets
import sys
import time
from pathlib import Path
from typing import Callable


def _this_slice() -> int:
    """This process's slice (0 on one slice): its devices' slice_index, or the slice a simulated
    multislice run told it (model/sharding.py slice_of)."""
    import jax

    from model import sharding

    return sharding.slice_of(jax.local_devices()[0])


class IntervalMeter:
    """One log row per interval from the steps' device metrics and the input's statistics
    (data/pipeline.py DevicePrefetcher.stats). `over_hosts(values)` returns every host's values
    (model/runtime/distributed.py gather_over_hosts): the row's data wait is the slowest host's (the step
    runs at its pace), and on several hosts the row names the slowest one.

    Stalls: an interval whose step time (data wait and saves left out) is over STALL_FACTOR x the
    median of the last intervals' counts its excess as `stall_s`. Detected from the interval's
    timing, so no step is ever synced to the host for it."""

    STALL_FACTOR = 3.0
    STALL_HISTORY = 50

    def __init__(self, *, schedule, tokens_per_step: int, flops_per_step: float, peak_total: float | None,
                 device_count: int, stop_on_nan: bool, over_hosts: Callable = lambda v: [v]):
        self.schedule = schedule
        self._lr = None                 # the schedule as one compiled program (row())
        self.tokens_per_step = tokens_per_step
        self.flops_per_step = flops_per_step
        self.peak_total = peak_total
        self.device_count = device_count
        self.stop_on_nan = stop_on_nan
        self.over_hosts = over_hosts
        self.slice = _this_slice()       # named beside the host in the rows of a multislice job
        self.step_history = []          # the last intervals' step times (data wait and saves left out)
        self.pending = []               # device metrics of the steps since the last row, fetched lazily
        self.paused_s = 0.0             # evaluations and saves since the start, never reset
        self._mark(time.perf_counter(), {})
        self.save_s = 0.0

    def _mark(self, now: float, stats: dict) -> None:
        self.t, self.steps, self.save_s = now, 0, 0.0
        self.wait = stats.get("wait_s", 0.0)
        self.documents = stats.get("documents", 0)
        self.stage_s = stats.get("stage_s", {})

    def add(self, metrics) -> None:
        """A step's device metrics (not fetched: no host sync)."""
        self.pending.append(metrics)
        self.steps += 1

    def compiled(self, stats: dict) -> None:
        """After the first step has run (compile included): throughput counts from here."""
        self._mark(time.perf_counter(), stats)

    def paused(self, seconds: float, *, kind: str) -> None:
        """`seconds` of evaluation ("eval": out of the interval) or checkpoint saving ("save")."""
        self.paused_s += seconds
        if kind == "eval":
            self.t += seconds
        else:
            self.save_s += seconds

    def divergence(self, step: int, skips_in_a_row: int = 0):
        """The first divergence among the steps since the last row (model/runtime/rollback.py), or None.
        Fetches their scalars once; the row that follows uses them as they are."""
        import jax

        from model.runtime.rollback import find_divergence

        self.pending = jax.device_get(self.pending)
        return find_divergence(self.pending, step, skips_in_a_row)

    def rolled_back(self, stats: dict) -> None:
        """After a rollback: the steps since the last row are gone; the interval starts again."""
        self.pending = []
        self._mark(time.perf_counter(), stats)

    def row(self, step: int, stats: dict) -> dict:
        """The log row of the steps since the last one (fetches their metrics)."""
        import jax
        import numpy as np

        fetched, self.pending = jax.device_get(self.pending), []
        losses = np.array([m["loss"] for m in fetched], dtype=np.float64)
        if self.stop_on_nan and not np.all(np.isfinite(losses)):
            raise FloatingPointError(f"loss is not finite in steps {step - len(fetched) + 1}..{step}: "
                                     f"{losses.tolist()}")
        now = time.perf_counter()
        dt, n = now - self.t, self.steps
        # One small all-gather per interval: (data wait, step time) of every host.
        hosts = [tuple(v) for v in self.over_hosts([stats["wait_s"] - self.wait, dt / n if n else 0.0, self.slice])]
        wait = max(h[0] for h in hosts)
        tokens_per_s = n * self.tokens_per_step / dt if n and dt > 0 else None
        documents = stats.get("documents", 0)
        row = {
            "step": step,
            "loss": float(losses.mean()),
            "perplexity": float(np.exp(min(losses.mean(), 50.0))),
            "lr": self.lr(step - 1),
            "grad_norm": float(fetched[-1]["grad_norm"]),
            "param_norm": float(fetched[-1]["param_norm"]),
            "tokens_per_s": tokens_per_s,
            "tokens_per_s_per_device": tokens_per_s / self.device_count if tokens_per_s else None,
            "step_time_s": dt / n if n else None,
            "mfu": (self.flops_per_step * n / dt / self.peak_total
                    if (self.peak_total and n and dt > 0) else None),
            "data_wait_frac": wait / dt if dt > 0 else 0.0,
            "documents_per_s": (documents - self.documents) / dt if dt > 0 else None,
            "checkpoint_save_s": self.save_s,
            "interval_s": dt,
            "data_wait_s": wait,
            "stall_s": self._stall(dt - wait - self.save_s, n),
            "tokens_seen": step * self.tokens_per_step,
            **{f"data/{k}": v for k, v in stats.items() if isinstance(v, (int, float)) and not isinstance(v, bool)},
            **{f"data/bad_{k}": v for k, v in stats.get("bad_records", {}).items()},
            # data.quality / data.dedup: the documents each rule dropped in this interval
            **{f"data/dropped/{k}": v for k, v in stats.get("dropped_by_rule", {}).items()},
        }
        if any(float(m.get("z_loss", 0.0)) for m in fetched):
            # train.z_loss > 0: the z-loss term's mean (the `loss` column is the cross-entropy alone).
            row["z_loss"] = float(np.mean([float(m["z_loss"]) for m in fetched]))
        if "skipped" in fetched[-1]:
            # train.spikes: updates skipped in this interval and since the run began.
            row["skipped_steps"] = int(sum(float(m["skipped"]) for m in fetched))
            row["skipped_total"] = int(fetched[-1]["skipped_total"])
        if "context_imbalance" in fetched[-1]:
            # mesh.context > 1: the worst step's max / mean attention work over a row's chips
            row["context_imbalance"] = max(float(m["context_imbalance"]) for m in fetched)
        if len(hosts) > 1:
            # Where the pod stalled: the host that waited longest for its input, and the slowest step.
            slow_wait = max(range(len(hosts)), key=lambda i: hosts[i][0])
            slow_step = max(range(len(hosts)), key=lambda i: hosts[i][1])
            row.update({"host/slowest_data_wait": slow_wait, "host/max_data_wait_s": hosts[slow_wait][0],
                        "host/min_data_wait_s": min(h[0] for h in hosts),
                        "host/slowest_step": slow_step, "host/max_step_time_s": hosts[slow_step][1]})
            if any(h[2] for h in hosts):   # several slices: the slowest hosts' slices
                row.update({"host/slowest_data_wait_slice": int(hosts[slow_wait][2]),
                            "host/slowest_step_slice": int(hosts[slow_step][2])})
        if stats.get("stage_s"):
            # Where the input time went in this interval (this host), and the stage bounding it.
            from data import timing

            row.update(timing.metrics(timing.summarize(timing.sub_times(stats["stage_s"], self.stage_s), dt)))
        if stats.get("bad_examples"):
            # The first bad records' names (file:line: kind), so a skipped file is named where it is counted.
            row["data/bad_examples"] = "; ".join(stats["bad_examples"])
        self._mark(now, stats)
        return row


    def lr(self, count: int) -> float:
        """The schedule's learning rate after `count` updates. Through one jitted program: called
        eagerly, optax's schedule is a dozen primitives, each compiled on its own at the first row
        (~0.3 s of a short run's start on CPU, more on an accelerator)."""
        import jax

        if self._lr is None:
            self._lr = jax.jit(self.schedule)
        return float(self._lr(count))

    def _stall(self, busy_s: float, n: int) -> float:
        """Seconds of this interval over STALL_FACTOR x the median step (0 when none)."""
        if n <= 0:
            return 0.0
        per_step = busy_s / n
        hist = self.step_history
        stall = 0.0
        if len(hist) >= 3:
            median = sorted(hist)[len(hist) // 2]
            if per_step > self.STALL_FACTOR * median:
                stall = (per_step - median) * n
        hist.append(per_step)
        del hist[:-self.STALL_HISTORY]
        return stall


class MetricsLogger:
    """Process 0 only: a progress bar, `metrics.jsonl` in the run directory, and wandb.

    The wandb run id is kept in the checkpoint meta, so a resumed run continues the same wandb
    run. The API key comes from the environment (WANDB_API_KEY), never from config.
    """

    def __init__(self, cfg, run_dir: Path, *, enabled: bool, start_step: int, wandb_id: str | None):
        from omegaconf import OmegaConf

        self.enabled = enabled
        self.wandb_id = wandb_id
        self._bar = self._jsonl = self._wandb = None
        if not enabled:
            return
        lcfg = cfg.logger
        if lcfg.jsonl:
            self._jsonl = open(run_dir / "metrics.jsonl", "a")
        if lcfg.wandb.mode != "disabled":
            import wandb

            # Chosen here (not by wandb) so the checkpoint can carry it to a resumed run.
            alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
            self.wandb_id = wandb_id or "".join(secrets.choice(alphabet) for _ in range(8))
            # silent: the progress bar and our summary are the console; wandb's own banner and
            # end-of-run charts would bury them.
            self._wandb = wandb.init(
                project=lcfg.wandb.project, entity=lcfg.wandb.entity, name=cfg.name, tags=list(lcfg.wandb.tags),
                mode=lcfg.wandb.mode, dir=str(run_dir), id=self.wandb_id, resume="allow",
                config=OmegaConf.to_container(cfg, resolve=True), settings=wandb.Settings(silent=True))
            offline_dir = Path(self._wandb.dir).parent
            where = self._wandb.url if lcfg.wandb.mode == "online" else f"{offline_dir} (`wandb sync` it to upload)"
            print(f"wandb run {self.wandb_id}: {where}", flush=True)
        if lcfg.progress_bar:
            from tqdm import tqdm

            self._bar = tqdm(total=cfg.train.steps, initial=start_step, unit="step", dynamic_ncols=True,
                             file=sys.stdout, mininterval=1.0)

    def log(self, metrics: dict) -> None:
        if not self.enabled:
            return
        if self._jsonl:
            self._jsonl.write(json.dumps(metrics) + "\n")
            self._jsonl.flush()
        if self._wandb:
            self._wandb.log({k: v for k, v in metrics.items() if v is not None}, step=metrics["step"])
        if "loss" not in metrics:        # an evaluation-only row
            return
        tok_s = f"{metrics['tokens_per_s']:,.0f}" if metrics["tokens_per_s"] else "-"
        if self._bar:
            self._bar.set_postfix(loss=f"{metrics['loss']:.3f}", tok_s=tok_s, refresh=False)
            self._bar.update(metrics["step"] - self._bar.n)
        else:
            print(f"step {metrics['step']} loss {metrics['loss']:.4f} tok/s {tok_s}", flush=True)

    def close(self) -> None:
        if self._bar:
            self._bar.close()
        if self._jsonl:
            self._jsonl.close()
        if self._wandb:
            self._wandb.finish()


class Rows:
    """The loop's metrics rows: the meter's row every `log_every` steps and at the last step, the
    evaluations when due (with the watchdog paused), and figures carried to the next row (e.g.
    data.num_workers=auto's choice); each row goes through the event log to the logger. `last`
    is the newest meter row (the run's final loss)."""

    def __init__(self, meter: IntervalMeter, evals, logger: MetricsLogger, events, watchdog, *,
                 log_every: int, last_step: int):
        self.meter, self.evals, self.logger, self.events, self.watchdog = meter, evals, logger, events, watchdog
        self.log_every, self.last_step = log_every, last_step
        self.last: dict = {}
        self._carried: dict = {}

    def log_due(self, step: int) -> bool:
        return step % self.log_every == 0 or step == self.last_step

    def carry(self, fields: dict) -> None:
        self._carried.update(fields)

    def write(self, step: int, params, input_stats: Callable[[], dict]) -> None:
        """The row of `step`, if a row or an evaluation is due there."""
        log_now, evals_now = self.log_due(step), any(self.evals.due(step))
        if not (log_now or evals_now):
            return
        row = {"step": step}
        if log_now:
            row = self.last = self.meter.row(step, input_stats())
            self.watchdog.step_time(row["step_time_s"])
        if evals_now:
            with self.watchdog.paused():
                row.update(self.evals.run(step, params, self.meter))
        row, self._carried = {**row, **self._carried}, {}
        self.logger.log(self.events.row(row))


class Profiler:
    """`profile.steps=[a,b]`: a JAX profiler trace of steps a..b in <run_dir>/profile (TensorBoard/Perfetto)."""

    def __init__(self, steps, out_dir: Path, *, enabled: bool):
        self.window = tuple(steps) if (steps and enabled) else None
        self.out_dir = out_dir
        self.active = False

    def maybe_start(self, step: int) -> None:
        if self.window and step == self.window[0] and not self.active:
            import jax
            jax.profiler.start_trace(str(self.out_dir))
            self.active = True

    def maybe_stop(self, step: int | None) -> None:
        if self.active and (step is None or step >= self.window[1]):
            import jax
            jax.effects_barrier()
            jax.profiler.stop_trace()
            self.active = False


def dropped_line(hosts: list[dict], shown: int = 4) -> str | None:
    """The end of a run with data.quality / data.dedup: the documents dropped in this start, by
    rule (every host's `dropped_by_rule`), the rules dropping most first. None when none was."""
    rules: dict[str, int] = {}
    for h in hosts:
        for rule, n in h.get("dropped_by_rule", {}).items():
            rules[rule] = rules.get(rule, 0) + n
    total = sum(rules.values())
    if not total:
        return None
    top = sorted(rules.items(), key=lambda kv: (-kv[1], kv[0]))
    more = f"; {len(top) - shown} more rules in metrics.jsonl (data/dropped/...)" if len(top) > shown else ""
    return (f"Dropped {total} document(s) in this start (data.quality / data.dedup): "
            + "; ".join(f"{rule} {n}" for rule, n in top[:shown]) + more)


def skipped_line(hosts: list[dict], shown: int = 3) -> str | None:
    """The end of a lenient run that skipped bad records: how many in this start, of which kinds,
    and the first few `file:line: kind` (every host's `bad_records` and `bad_examples`, from the
    input's stats), then dropped_line's. None when nothing was skipped or dropped."""
    kinds: dict[str, int] = {}
    for h in hosts:
        for kind, n in h["bad_records"].items():
            kinds[kind] = kinds.get(kind, 0) + n
    total = sum(kinds.values())
    dropped = dropped_line(hosts)
    if not total:
        return dropped
    examples = [e for h in hosts for e in h["bad_examples"]]
    more = f"; {len(examples) - shown} more named in metrics.jsonl (data/bad_examples)" if len(examples) > shown else ""
    by_kind = ", ".join(f"{k} {n}" for k, n in sorted(kinds.items(), key=lambda kv: (-kv[1], kv[0])))
    return (f"Skipped {total} bad record(s) in this start ({by_kind}; data.strict=false): "
            + "; ".join(examples[:shown]) + more + (f"\n{dropped}" if dropped else ""))


def end_line(summary: dict, train_steps: int) -> str:
    """The run's last line: what this start trained, or why it had nothing to do."""
    start, step, ckpt_dir = summary["start_step"], summary["steps"], summary["checkpoint_dir"]
    if step == start:
        return (f"Nothing to do: the run is at step {step} and train.steps={train_steps} "
                f"(raise train.steps to train further); checkpoints in {ckpt_dir}")
    final = f"{summary['final_loss']:.4f}" if summary["final_loss"] is not None else "-"
    return (f"Done: steps {start}->{step}, {summary['tokens']:,} tokens in {summary['wall_s']:.0f} s, "
            f"final loss {final}; checkpoints in {ckpt_dir}")

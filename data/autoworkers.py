"""`data.num_workers=auto`: the fewest input workers that keep the train step fed.

The run starts with a provisional worker count (quick to spawn, safe for memory), measures over
its first `data.auto_measure_steps` steps after the compile what one worker delivers and what
the step consumes, then chooses

    n = the fewest workers with n x (one worker's tokens/s among n) >= HEADROOM x (the step's),

(a worker's rate by lane: its reader thread, and its tokenizer threads, fewer per worker as
more workers share the cores), capped by the host's virtual shards (a worker owns at least
one), its cores and the RAM budget (`data.ram_budget_gb`: the training process plus n workers'
resident memory). A converted
corpus (data/streams/records.py, no tokenizer) may run in-process (0 workers) when one worker's rate
covers the need: what a worker does there is cheap enough for the training process's feed
thread. Text stays in workers: tokenizing in the training process competes with the step for
its cores and the GIL, which the step time measured with the work elsewhere does not show.

The choice never changes the batches (the batch layout does not depend on the worker count,
data/host.py); train.py switches the live iterator to n workers from its consumed state.
`choose_workers` is pure (figures in, choice out); `measure_pipeline` reads the live figures.
"""
from __future__ import annotations

import dataclasses
import math
import os
import time

from data.timing import THREADS
from data.tokenizer import core_share

AUTO = "auto"
# Capacity over need: the "30% headroom" for data_wait_frac below 0.5%.
HEADROOM = 1.3
# Before anything is measured: the most workers to spawn, and the memory one is assumed to
# take (a cautious guess: with the sample's 4k-piece tokenizer a worker measured 210-245 MB RSS
# on cpu-2c; a 32k tokenizer and larger windows take more).
PROVISIONAL_MAX = 8
ASSUMED_WORKER_BYTES = 1 << 30
# data.ram_budget_gb=null: this share of the host's memory (the training process included).
DEFAULT_RAM_SHARE = 0.5


def is_auto(num_workers) -> bool:
    return num_workers == AUTO


def check_num_workers(value) -> None:
    """One line for anything that is not an integer >= 0 or "auto"."""
    if is_auto(value):
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"data.num_workers={value!r}: must be an integer >= 0 or auto")
    if value < 0:
        raise ValueError(f"data.num_workers={value}: must be >= 0 (or auto)")


def check_ram_budget(value) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"data.ram_budget_gb={value!r}: must be a number of GB > 0 (or null: "
                         f"{DEFAULT_RAM_SHARE:.0%} of this host's memory)")


def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def ram_budget_bytes(ram_budget_gb: float | None) -> int:
    if ram_budget_gb is None:
        return int(DEFAULT_RAM_SHARE * host_memory_bytes())
    return int(ram_budget_gb * (1 << 30))


def provisional_workers(shards_per_host: int, cores: int, budget_bytes: int,
                        saved: int | None = None) -> int:
    """The count to start with: a resumed run's last choice (it was right on this kind of host),
    else one worker per core but one (the training process needs a core), at most
    PROVISIONAL_MAX; never more than the host's shards or what the budget holds at an assumed
    ASSUMED_WORKER_BYTES each. At least 1: a worker must run to be measured."""
    limit = max(1, min(shards_per_host, budget_bytes // ASSUMED_WORKER_BYTES))
    if saved is not None and saved > 0:
        return int(min(saved, limit, max(cores, 1)))
    return int(max(1, min(cores - 1, PROVISIONAL_MAX, limit)))


@dataclasses.dataclass(frozen=True)
class WorkerChoice:
    num_workers: int
    reason: str          # "rate", "in-process", or the cap that bound: "shards", "cores", "RAM"
    max_workers: int     # what shards, cores and RAM allow


@dataclasses.dataclass(frozen=True)
class WorkerRates:
    """What one input process delivers, by lane (tokens/s): its reader thread (read, parse,
    pack) and one tokenizer thread. A worker's rate depends on how many tokenizer threads it
    gets, which depends on how many workers share the cores (data/tokenizer.py core_share)."""
    reader_tok_s: float
    tokenizer_tok_s: float          # per thread; inf for a converted corpus (no tokenizer)

    def at(self, num_workers: int, cores: int) -> float:
        """One worker's tokens/s when num_workers share the cores (0: the in-process reader)."""
        return min(self.reader_tok_s, self.tokenizer_tok_s * core_share(cores, num_workers))


def choose_workers(rates: WorkerRates | float, need_tok_s: float, *, shards_per_host: int, cores: int,
                   worker_rss_bytes: int, main_rss_bytes: int, budget_bytes: int,
                   in_process_ok: bool, headroom: float = HEADROOM) -> WorkerChoice:
    """The fewest workers n with n x (one worker's rate among n) >= headroom x need_tok_s, within
    the caps. rates: by lane (WorkerRates), or one figure for any n.

    in_process_ok: 0 workers is a candidate (a converted corpus), taken when the in-process
    reader's rate covers the need. When the budget holds no worker at all the run goes
    in-process (slower, but it runs) rather than over budget."""
    rate = rates.at if isinstance(rates, WorkerRates) else (lambda n, cores: rates)
    by_ram = (budget_bytes - main_rss_bytes) // max(worker_rss_bytes, 1)
    caps = {"shards": shards_per_host, "cores": max(cores, 1), "RAM": max(0, by_ram)}
    cap_name = min(caps, key=caps.get)
    n_max = int(caps[cap_name])
    if in_process_ok and rate(0, cores) >= headroom * need_tok_s:
        return WorkerChoice(0, "in-process", n_max)
    for n in range(1, n_max + 1):
        if n * rate(n, cores) >= headroom * need_tok_s:
            return WorkerChoice(n, "rate", n_max)
    return WorkerChoice(n_max, cap_name, n_max)


# ---------------------------------------------------------------- live figures
def worker_rates(per_worker_times: list[dict], seq_len: int) -> WorkerRates:
    """By lane, the tokens the workers produced over the lane's seconds: the reader thread's
    (its seconds making slabs, "make_s", less its waits for the tokenizer; in-process also the
    host stages) and the tokenizer's thread-seconds. Cumulative since the workers started, so
    their first windows count: a cautious figure. Each worker's timers travel with its slabs
    (data/timing.py), with "rows_out" and "make_s" (data/host.py)."""
    tokens = sum(t.get("rows_out", 0) for t in per_worker_times) * seq_len
    reader = sum(max(t.get("make_s", 0.0) - t.get("tokenize_wait", 0.0),      # never below its
                     sum(t.get(k, 0.0) for k in THREADS["reader"]))           # timed stages
                 + (sum(t.get(k, 0.0) for k in THREADS["host"]) if t.get("in_host") else 0.0)
                 for t in per_worker_times)
    tokenize = sum(t.get("tokenize", 0.0) for t in per_worker_times)
    return WorkerRates(reader_tok_s=tokens / reader if reader > 0 else 0.0,
                       tokenizer_tok_s=tokens / tokenize if tokenize > 0 else math.inf)


def rss_bytes(pid: int | str = "self") -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def worker_pids() -> list[int]:
    """This process's spawned multiprocessing children (Grain's input workers; the resource
    tracker excluded), from /proc."""
    me = os.getpid()
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid != me:
                continue
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read()
        except (OSError, ValueError, IndexError):
            continue
        if b"spawn_main" in cmd:
            out.append(int(name))
    return sorted(out)


@dataclasses.dataclass(frozen=True)
class PipelineFigures:
    """What this host measured: one worker's rates by lane, the step's need in tokens/s,
    resident memory of one worker (the largest) and of the training process."""
    rates: WorkerRates
    need_tok_s: float
    worker_rss_bytes: int
    main_rss_bytes: int


def measure_pipeline(host_iterator, seq_len: int, host_tokens: int, compute_s: float) -> PipelineFigures:
    """host_iterator: the live one (data/workers.py WorkerMergeIterator or the in-process
    one); host_tokens: tokens this host consumed over the `compute_s` seconds the steps took
    apart from waiting for data."""
    per_worker = host_iterator.worker_stage_times()
    rss = [rss_bytes(p) for p in worker_pids()]
    return PipelineFigures(
        rates=worker_rates(per_worker, seq_len),
        need_tok_s=host_tokens / compute_s if compute_s > 0 else math.inf,
        worker_rss_bytes=max(rss, default=ASSUMED_WORKER_BYTES),
        main_rss_bytes=rss_bytes())


def describe(choice: WorkerChoice, fig: PipelineFigures, budget_bytes: int, *,
             provisional: int, step: int, cores: int) -> str:
    """The one log line (one worker's rate as it runs among the chosen count)."""
    why = {"rate": "", "in-process": ", in-process: no tokenizer, one worker's rate covers it"}
    cap = why.get(choice.reason, f", capped by {choice.reason} at {choice.max_workers}")
    switch = (f"kept the provisional {provisional}" if choice.num_workers == provisional
              else f"switched from {provisional} after step {step}")
    workers = f"{choice.num_workers} worker" + ("" if choice.num_workers == 1 else "s")
    return (f"data.num_workers=auto: {workers} (one worker "
            f"{fig.rates.at(choice.num_workers, cores) / 1e6:.3g} M tok/s, "
            f"step needs {fig.need_tok_s / 1e6:.3g} M tok/s x {HEADROOM}, "
            f"RSS {fig.worker_rss_bytes / 2**20:.0f} MB/worker + "
            f"{fig.main_rss_bytes / 2**20:.0f} MB trainer, "
            f"budget {budget_bytes / 2**30:.3g} GB"
            f"{cap}; {switch})")


def metrics(choice: WorkerChoice, fig: PipelineFigures, budget_bytes: int, provisional: int,
            cores: int) -> dict:
    """The choice and its figures for metrics.jsonl / wandb."""
    return {"data/auto_num_workers": choice.num_workers, "data/auto_provisional_workers": provisional,
            "data/auto_worker_tok_s": fig.rates.at(choice.num_workers, cores),
            "data/auto_reader_tok_s": fig.rates.reader_tok_s,
            # null without a tokenizer (converted corpus): metrics.jsonl stays strict JSON
            "data/auto_tokenizer_thread_tok_s": (fig.rates.tokenizer_tok_s
                                                 if math.isfinite(fig.rates.tokenizer_tok_s) else None),
            "data/auto_need_tok_s": fig.need_tok_s,
            "data/auto_headroom": HEADROOM, "data/auto_worker_rss_mb": fig.worker_rss_bytes / 2**20,
            "data/auto_main_rss_mb": fig.main_rss_bytes / 2**20,
            "data/auto_ram_budget_gb": budget_bytes / 2**30, "data/auto_reason": choice.reason,
            "data/auto_max_workers": choice.max_workers}


class AutoWorkers:
    """data.num_workers=auto in a run: starts the pipeline with a provisional count; `start`
    marks the end of the compile step; after `steps` more steps, `switch` measures what the step
    consumed (tokens over the seconds not spent waiting for data, evaluations or saves) and what
    one worker delivers, agrees on a count with the other hosts (`agree`: the largest any host
    needs, model/runtime/distributed.py max_over_hosts) and, if it differs, moves the live pipeline to it
    from the consumed state (the batches do not change)."""

    def __init__(self, data_cfg, process_count: int, files, *, saved: int | None, agree=max):
        from data.streams import records
        from data.tokenizer import available_cores

        self.budget = ram_budget_bytes(data_cfg.ram_budget_gb)
        self.shards_per_host = data_cfg.num_shards // process_count
        self.cores = available_cores()
        self.provisional = provisional_workers(self.shards_per_host, self.cores, self.budget,
                                               saved if isinstance(saved, int) else None)
        self.cfg = dataclasses.replace(data_cfg, num_workers=self.provisional)
        self.steps = data_cfg.auto_measure_steps
        # 0 workers only for a converted corpus: nothing to tokenize in the training process.
        self.in_process_ok = not data_cfg.sources and records.describe(list(files)) is not None
        self.host_tokens_per_step = data_cfg.global_batch_size // process_count * data_cfg.seq_len
        self._agree = agree
        self._due = None
        self._t0 = self._wait0 = self._paused0 = None

    def announce(self) -> str:
        return (f"data.num_workers=auto: starting with {self.provisional} worker(s); choosing after "
                f"data.auto_measure_steps={self.steps} steps past the first (compiling) step")

    def start(self, step: int, wait_s: float, paused_s: float) -> None:
        """At the end of the compile step `step`: the measured steps start now."""
        self._due = step + self.steps
        self._t0, self._wait0, self._paused0 = time.perf_counter(), wait_s, paused_s

    def due(self, step: int) -> bool:
        return step == self._due

    def choose(self, batches, step: int, paused_s: float, *, announce: bool) -> tuple[int, dict]:
        """(the count every host runs, the row for the metrics) from the steps measured."""
        wall = time.perf_counter() - self._t0
        compute = wall - (batches.stats()["wait_s"] - self._wait0) - (paused_s - self._paused0)
        fig = measure_pipeline(batches.host_iterator(), self.cfg.seq_len, self.steps * self.host_tokens_per_step,
                               compute)
        choice = choose_workers(
            fig.rates, fig.need_tok_s, shards_per_host=self.shards_per_host, cores=self.cores,
            worker_rss_bytes=fig.worker_rss_bytes, main_rss_bytes=fig.main_rss_bytes,
            budget_bytes=self.budget, in_process_ok=self.in_process_ok)
        # Every host runs the same count: the largest any host needs (each host's shards and the
        # batches do not depend on it, but one setting keeps the run simple to read).
        n = int(self._agree(choice.num_workers))
        agreed = dataclasses.replace(choice, num_workers=n)
        line = describe(agreed, fig, self.budget, provisional=self.provisional, step=step, cores=self.cores)
        if n != choice.num_workers:
            line += f"; this host alone needs {choice.num_workers}, every host runs the most any needs"
        if announce:
            print(line, flush=True)
        return n, metrics(agreed, fig, self.budget, self.provisional, self.cores)

    def switch(self, batches, step: int, paused_s: float, *, restart, announce: bool):
        """(the prefetcher of the chosen count, the metrics row). `restart(cfg, shard_states,
        follows)` builds the prefetcher for `cfg` from the consumed shard states, following the
        old one (data/pipeline.py make_host_iterator, DevicePrefetcher). The old one is left
        running: the caller serves from it while the new one starts (data/feed.py Handover)."""
        from data.host import find_shard_states

        n, row = self.choose(batches, step, paused_s, announce=announce)
        if n == self.cfg.num_workers:
            return batches, row
        self.cfg = dataclasses.replace(self.cfg, num_workers=n)
        # Same batches with any worker count (data/host.py): the new pipeline starts each shard
        # where the consumed batches left it.
        shard_states = find_shard_states(batches.consumed_state())
        return restart(self.cfg, shard_states, batches), row

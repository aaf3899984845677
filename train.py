"""Pre-train a Llama-style model: `python train.py [hydra overrides]`.

The run, top to bottom (each phase is a banner below):
  config checks -> hosts and mesh -> the run's files -> model, optimizer, shardings ->
  init or restore -> jitted train step -> loop (batch, step, metrics, checkpoint, preemption).

`train(cfg)` is the whole run and is what tests call; `main` is a thin Hydra wrapper that turns
config mistakes into one error line. Defaults train the tiny model on the bundled sample on
whatever devices JAX sees; `configs/` documents every setting.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import signal
import sys
import time
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

PROJECT_ROOT = Path(__file__).resolve().parent
if not OmegaConf.has_resolver("project_root"):
    OmegaConf.register_new_resolver("project_root", lambda: str(PROJECT_ROOT))


class ConfigError(ValueError):
    """A config mistake found before anything expensive starts; `main` prints it as one line."""


def train(cfg: DictConfig) -> dict:
    """Runs (or resumes) the training run described by `cfg`; returns a summary dict."""
    # Imports here keep `python train.py --help` and config errors fast.
    import jax

    import data as data_lib
    from model import flops as flops_lib
    from model import step as step_lib
    from model.checkpoint import Checkpointer, check_fingerprint, find_resume, restore_meta_and_data
    from model.optimizer import resolve_warmup

    t_start = time.perf_counter()

    # ------------------------------------------------------------------ config checks
    # Everything here is cheap: a bad setting fails in one line before any compile or spawn.
    run_dir = Path(cfg.paths.run_dir)
    data_map = OmegaConf.to_container(cfg.data, resolve=True)
    eval_map = data_map.pop("eval", None) or {}
    try:
        if cfg.train.steps <= 0:
            raise ValueError(f"train.steps={cfg.train.steps} must be positive")
        model_cfg, tx, schedule = model_and_optimizer(cfg)
        # data.paths may be one glob or a list: DataConfig takes either.
        data_cfg = data_lib.DataConfig.from_mapping({**data_map, "tokenizer": cfg.tokenizer.path})
        eval_paths, holdout = _eval_settings(eval_map)
        if holdout and data_cfg.sources:
            raise ValueError("data.eval.holdout_files works with data.paths only: with data.sources, "
                             "hold out files through data.eval.paths (read with data.text_key)")
        _, _, warmup_notice = resolve_warmup(cfg.optimizer, cfg.train.steps)
    except (TypeError, ValueError) as e:
        raise ConfigError(str(e)) from e
    if data_cfg.seq_len > model_cfg.max_seq_len:
        raise ConfigError(f"data.seq_len={data_cfg.seq_len} exceeds model.max_seq_len={model_cfg.max_seq_len}")

    # ------------------------------------------------------------------ hosts and mesh
    _init_distributed(cfg.distributed)
    process_index, process_count = jax.process_index(), jax.process_count()
    is_main = process_index == 0
    if warmup_notice and is_main:
        print(warmup_notice, flush=True)

    try:
        data_lib.validate_settings(data_cfg, process_count)
        tokenizer = data_lib.load_tokenizer(data_cfg.tokenizer)
        program = build_program(cfg, model_cfg, tx)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(str(e)) from e
    if tokenizer.get_vocab_size() > model_cfg.vocab_size:
        raise ConfigError(f"model.vocab_size={model_cfg.vocab_size} is smaller than the tokenizer's "
                          f"{tokenizer.get_vocab_size()} pieces (tokenizer.path={data_cfg.tokenizer})")

    # ------------------------------------------------------------------ the run's files
    # One listing per run (data/listing.py), after every cheap check: a resumed run reads the list
    # saved in its checkpoint; otherwise process 0 lists and the other hosts receive the list. The
    # checkpoint is only read here: a config mistake must leave no checkpoint directory behind.
    try:
        resume = find_resume(cfg.checkpoint)
        meta, saved_data_states = restore_meta_and_data(resume) if resume is not None else ({}, None)
        saved_listing = None if cfg.checkpoint.allow_data_change else meta.get("files")
        listing = _run_listing(data_lib, data_cfg, eval_paths, saved_listing)
        data_cfg, eval_cfg, train_files, eval_files = _split_eval(data_cfg, listing, holdout)
        data_lib.check_files(data_cfg, process_count, train_files)
    except ValueError as e:
        raise ConfigError(str(e)) from e

    if is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        # The resolved config documents the run; secrets never live in it (wandb reads its key
        # from the environment).
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))

    # ------------------------------------------------------------------ model, optimizer, shardings
    mesh, rules, abstract_state = program.mesh, program.rules, program.abstract_state
    batch_sharding = program.batch_sharding
    fingerprint = {"data": data_lib.fingerprint(data_cfg, tokenizer=tokenizer, files=train_files),
                   "model": OmegaConf.to_container(cfg.model, resolve=True)}

    # ------------------------------------------------------------------ init or restore
    # Everything started from here (checkpoint manager, data workers, wandb, the profiler, the
    # SIGTERM handler) is closed on the way out, on success and on error alike.
    with contextlib.ExitStack() as cleanup:
        # From here a SIGTERM means "save at the next step and exit", also during restore/compile.
        preempted = _PreemptionFlag(agree_every=cfg.train.log_every)
        cleanup.callback(preempted.restore)
        ckpt = Checkpointer(cfg.checkpoint)
        cleanup.callback(ckpt.close)
        wandb_id = None
        data_changes = []
        try:
            if resume is not None:
                saved_fp = meta.get("fingerprint", {})
                mixture_keys, mixture_notes, data_hint = set(), [], None
                if not cfg.checkpoint.allow_data_change:
                    # The positions of parked sources travel on in the data state: so does what
                    # they were read from (data/state.py carry_parked_sources).
                    saved_data = saved_fp.get("data", {})
                    fingerprint["data"] = data_lib.carry_parked_sources(saved_data, fingerprint["data"])
                    if data_cfg.mixture_change == "continue":
                        mixture_keys, mixture_notes = data_lib.mixture_changes(saved_data, fingerprint["data"])
                    elif _could_continue(data_lib, saved_data, fingerprint["data"]):
                        data_hint = ("set data.mixture_change=continue to continue every source from its "
                                     "saved position, or checkpoint.allow_data_change=true to read the data afresh")
                data_changes = check_fingerprint(saved_fp, fingerprint,
                                                 allow_data_change=cfg.checkpoint.allow_data_change,
                                                 accepted={f"data.{k}" for k in mixture_keys}, data_hint=data_hint)
                if mixture_notes and is_main:
                    print("data.mixture_change=continue: " + "; ".join(mixture_notes), flush=True)
        except ValueError as e:
            raise ConfigError(str(e)) from e
        if resume is not None:
            wandb_id = meta.get("wandb_id")
            if data_changes:
                # The saved positions describe another data set: read the new one from its start.
                saved_data_states = None
                if is_main:
                    print("checkpoint.allow_data_change: the input pipeline starts afresh on the changed data ("
                          + "; ".join(data_changes) + ")", flush=True)

        if eval_cfg is not None and cfg.train.eval_every:
            eval_cfg, eval_files = _valid_eval_files(data_lib, eval_cfg, eval_files, announce=is_main)
        # The input pipeline starts now (worker processes spawn, the first batches get tokenized)
        # so that its start-up overlaps with restoring or initialising the model. A training shard
        # without any valid document fails its first window, so before the first step.
        debug_batches = bool(cfg.train.get("debug_batches", False))
        auto_workers = None
        if data_lib.is_auto(data_cfg.num_workers):
            # data.num_workers=auto: a provisional count now, the choice after the first steps.
            auto_workers = _AutoWorkers(data_cfg, process_count, train_files,
                                        saved=meta.get("num_workers") if resume is not None else None)
            data_cfg = auto_workers.cfg
            if is_main:
                print(auto_workers.announce(), flush=True)
        host_iter = data_lib.restore_host_iterator(data_cfg, process_index, process_count, saved_data_states,
                                                   debug=debug_batches, files=train_files, tokenizer=tokenizer)
        batches = data_lib.DevicePrefetcher(host_iter, batch_sharding, prefetch=data_cfg.prefetch)
        cleanup.callback(batches.close)

        if resume is not None:
            state = ckpt.restore_state(resume, abstract_state)
            start_step = int(jax.device_get(state["step"]))
            if is_main:
                print(f"Resuming from {resume.describe()} at step {start_step}", flush=True)
        elif cfg.checkpoint.init_from:
            state, _ = step_lib.init_train_state(model_cfg, tx, mesh, rules, cfg.seed)
            try:
                state["params"] = ckpt.restore_params(cfg.checkpoint.init_from, abstract_state["params"],
                                                      model=fingerprint["model"])
            except ValueError as e:
                raise ConfigError(str(e)) from e
            start_step = 0
            if is_main:
                print(f"Initialised parameters from {cfg.checkpoint.init_from}; starting at step 0", flush=True)
        else:
            state, _ = step_lib.init_train_state(model_cfg, tx, mesh, rules, cfg.seed)
            start_step = 0
            if is_main:
                print(f"Starting a new run in {run_dir}", flush=True)

        # ------------------------------------------------------------------ jitted steps
        # Built with the program (build_program): jax.jit compiles at the first call.
        train_step = program.train_step
        eval_set = None
        if eval_cfg is not None and cfg.train.eval_every:
            eval_set = _EvalSet(data_lib, eval_cfg, eval_files, cfg.train.eval_batches, batch_sharding,
                                program.eval_step,
                                tokenizer)
        tokens_per_step = data_cfg.global_batch_size * data_cfg.seq_len
        flops_per_step = flops_lib.flops_per_token(model_cfg, data_cfg.seq_len) * tokens_per_step
        peak = flops_lib.peak_flops(jax.devices()[0].device_kind, cfg.train.peak_flops)
        peak_total = peak * jax.device_count() if peak else None

        logger = MetricsLogger(cfg, run_dir, enabled=is_main, start_step=start_step, wandb_id=wandb_id)
        cleanup.callback(logger.close)
        # "files": the run's listing, reused by a resumed run (~70 bytes per file: 350 KB for 5000).
        meta = {"fingerprint": fingerprint, "config": OmegaConf.to_container(cfg, resolve=True),
                "wandb_id": logger.wandb_id, "process_count": process_count, "num_workers": data_cfg.num_workers,
                "files": listing}

        # ------------------------------------------------------------------ loop
        profile = _Profiler(cfg.profile.steps, run_dir / "profile", enabled=is_main)
        cleanup.callback(profile.maybe_stop, None)
        # Tests of exact resume: every process records what each step consumed (a host sync per step).
        debug_log = open(run_dir / f"debug_batches.p{process_index}.jsonl", "a") if debug_batches else None
        if debug_log is not None:
            cleanup.callback(debug_log.close)
        step = start_step
        pending = []            # device metrics of the steps since the last log, fetched lazily
        timer = {"t": time.perf_counter(), "wait": 0.0, "steps": 0, "save_s": 0.0, "documents": 0, "stage_s": {},
                 "paused_s": 0.0}   # paused_s: evaluations and saves since the start, never reset
        auto_row = {}           # data.num_workers=auto's figures, logged with the next row
        last = {}
        while step < cfg.train.steps:
            profile.maybe_start(step + 1)
            batch = next(batches)
            if debug_log is not None:
                batch = _log_debug_batch(debug_log, step + 1, batch)
            state, metrics = train_step(state, batch)
            step += 1
            pending.append(metrics)
            if step == start_step + 1:
                # Keep compilation out of the throughput figures.
                jax.block_until_ready(metrics)
                first = batches.stats()
                timer.update(t=time.perf_counter(), wait=first["wait_s"], steps=0, documents=first["documents"],
                             stage_s=first["stage_s"])
                if auto_workers is not None:
                    auto_workers.start(first["wait_s"], timer["paused_s"])
            else:
                timer["steps"] += 1
            if auto_workers is not None and step == start_step + 1 + auto_workers.steps:
                jax.block_until_ready(metrics)      # the measured steps have run, not just dispatched
                n, auto_row = auto_workers.choose(batches, step, timer["paused_s"], announce=is_main)
                if n != data_cfg.num_workers:
                    # Same batches with any worker count (data/host.py): the new pipeline starts
                    # each shard where the consumed batches left it.
                    data_cfg = auto_workers.switch_cfg(n)
                    consumed = data_lib.find_shard_states(batches.consumed_state())
                    host_iter = data_lib.make_host_iterator(data_cfg, process_index, process_count, consumed,
                                                            debug=debug_batches, files=train_files,
                                                            tokenizer=tokenizer)
                    batches.close(background=True)     # the old workers go while the new ones start
                    batches = data_lib.DevicePrefetcher(host_iter, batch_sharding, prefetch=data_cfg.prefetch,
                                                        follows=batches)
                    cleanup.callback(batches.close)
                meta["num_workers"] = n
            profile.maybe_stop(step)

            log_now = step % cfg.train.log_every == 0 or step == cfg.train.steps
            eval_now = eval_set is not None and cfg.train.eval_every and step % cfg.train.eval_every == 0
            if log_now or eval_now:
                row = {"step": step}
                if log_now:
                    fetched = jax.device_get(pending)
                    pending = []
                    row = last = _interval_metrics(step, fetched, timer, batches.stats(), schedule, tokens_per_step,
                                                   flops_per_step, peak_total, stop_on_nan=cfg.train.stop_on_nan)
                if eval_now:
                    t0 = time.perf_counter()
                    row["eval_loss"] = eval_set.loss(state["params"])
                    # Evaluation time is not training time: keep it out of tokens/s and MFU.
                    timer["t"] += time.perf_counter() - t0
                    timer["paused_s"] += time.perf_counter() - t0
                if auto_row:
                    row, auto_row = {**row, **auto_row}, {}
                logger.log(row)

            stop = preempted.check(step)
            if ckpt.should_save(step, cfg.train.steps) or stop:
                t0 = time.perf_counter()
                ckpt.save(step, state, batches.consumed_state(), meta)
                timer["save_s"] += time.perf_counter() - t0
                timer["paused_s"] += time.perf_counter() - t0
                if stop:
                    ckpt.wait()
                    if is_main:
                        print(f"Preempted: saved step {step} to {ckpt.directory}; exiting", flush=True)
                    break
        ckpt.wait()

    summary = {
        "run_dir": str(run_dir),
        "checkpoint_dir": str(ckpt.directory),
        "start_step": start_step,
        "steps": step,
        "final_loss": last.get("loss"),
        "tokens": (step - start_step) * tokens_per_step,
        "wall_s": time.perf_counter() - t_start,
        "preempted": preempted.fired,
    }
    if is_main and step == start_step:
        print(f"Nothing to do: the run is at step {step} and train.steps={cfg.train.steps} "
              f"(raise train.steps to train further); checkpoints in {ckpt.directory}", flush=True)
    elif is_main:
        final = f"{summary['final_loss']:.4f}" if summary["final_loss"] is not None else "-"
        print(f"Done: steps {start_step}->{step}, {summary['tokens']:,} tokens in {summary['wall_s']:.0f} s, "
              f"final loss {final}; checkpoints in {ckpt.directory}", flush=True)
    return summary


# ====================================================================== the program
def model_and_optimizer(cfg: DictConfig):
    """(LlamaConfig, optax optimizer, lr schedule) from cfg.model, cfg.optimizer, cfg.train.steps."""
    from model.llama import LlamaConfig
    from model.optimizer import make_optimizer

    return (LlamaConfig.from_mapping(cfg.model), *make_optimizer(cfg.optimizer, cfg.train.steps))


def build_program(cfg: DictConfig, model_cfg, tx, devices=None):
    """The run's mesh, shardings, abstract state and jitted steps (model/step.py Program) over
    `devices` (default: all). The one place where the config becomes the compiled program:
    train() runs it and scripts/compile_tpu.py compiles it for a TPU topology."""
    from model import step as step_lib

    return step_lib.build_program(model_cfg, tx, cfg.mesh, global_batch=int(cfg.data.global_batch_size),
                                  z_loss=float(cfg.train.z_loss), microbatches=int(cfg.train.microbatches),
                                  loss_chunk=int(cfg.train.loss_chunk), devices=devices)


# ====================================================================== data
def _as_list(paths) -> list:
    """One glob or a list of globs (data.eval.paths='/mnt/rp/held_out/*.json.gz' works)."""
    return [paths] if isinstance(paths, str) else list(paths or [])


def _eval_settings(eval_map: dict) -> tuple[list, int]:
    """(data.eval.paths, data.eval.holdout_files), checked without touching the files."""
    unknown = set(eval_map) - {"paths", "holdout_files"}
    if unknown:
        raise ValueError(f"unknown setting(s): {', '.join(sorted('data.eval.' + k for k in unknown))}")
    eval_paths, holdout = _as_list(eval_map.get("paths")), int(eval_map.get("holdout_files") or 0)
    if eval_paths and holdout:
        raise ValueError("set data.eval.paths or data.eval.holdout_files, not both")
    return eval_paths, holdout


def _run_listing(data_lib, data_cfg, eval_paths: list, saved: dict | None) -> dict:
    """The run's files, {"paths", "eval_paths": the patterns; "train", "eval": their files}
    ("paths" and "train" keyed by source name for a mixture).

    A resumed run reuses the listing saved with its checkpoint when it was made from the same
    patterns, and trusts it: a file deleted since then is found when read (an unreadable file,
    skipped and counted; data.strict=true stops), and files added since are not trained on.
    New patterns (a moved mount, another glob) or checkpoint.allow_data_change=true list
    afresh, and the fingerprint compares the lists. Otherwise process 0 lists and every host
    receives its listing (errors included), so the bucket is walked once per run.

    A mixture reuses the saved listing source by source: a changed mixture
    (data.mixture_change=continue) lists only its added sources (or those with new patterns),
    and "parked" keeps the patterns and files of sources no longer listed, so that listing one
    again reads the very files its parked position refers to."""
    if data_cfg.sources:
        paths = {s.name: list(s.paths) for s in data_cfg.sources}
    else:
        paths = list(data_cfg.paths)
    patterns = {"paths": paths, "eval_paths": list(eval_paths)}

    def walk() -> dict:
        if saved and all(saved.get(k) == v for k, v in patterns.items()):
            n = len(data_lib.all_files(saved["train"])) + len(saved["eval"])
            print(f"data: {n} files from the checkpoint's list (no new listing)", flush=True)
            return saved
        t0 = time.perf_counter()
        out = dict(patterns)
        if data_cfg.sources:
            known = _saved_source_listings(saved)
            train, listed, reused = {}, [], []
            for name, p in paths.items():
                if name in known and known[name]["paths"] == p:
                    train[name] = known[name]["files"]
                    reused.append(name)
                    continue
                part = data_lib.list_paths(p, f"data.sources[{name}].paths")
                train[name] = part.files
                listed.append(f"{name}: {part.describe()}")
            what = "; ".join(listed + ([f"the checkpoint's list for {', '.join(reused)}"] if reused else []))
            parked = {name: v for name, v in known.items() if name not in paths}
            if parked:
                out["parked"] = parked
        else:
            part = data_lib.list_paths(paths, "data.paths")
            train, what = part.files, part.describe()
        held_out = data_lib.list_paths(eval_paths, "data.eval.paths") if eval_paths else None
        print(f"data: listed {what}" + (f" + held-out {held_out.describe()}" if held_out else "")
              + f" in {time.perf_counter() - t0:.1f} s", flush=True)
        return {**out, "train": train, "eval": held_out.files if held_out else []}

    # Process 0 decides for all (reuse or walk): hosts whose resolved patterns differ (another
    # install directory behind ${project_root:}) must still take the same branch, or the
    # others would wait in the broadcast for a process 0 that never enters it.
    return _from_process_0(walk)


def _could_continue(data_lib, saved: dict, current: dict) -> bool:
    """Whether data.mixture_change=continue would accept this data change (for the hint)."""
    try:
        return bool(data_lib.mixture_changes(saved, current)[0])
    except ValueError:
        return False


def _saved_source_listings(saved: dict | None) -> dict:
    """{source name: {"paths", "files"}} of a saved mixture listing, listed and parked sources."""
    if not saved or not isinstance(saved.get("paths"), dict):
        return {}
    known = dict(saved.get("parked", {}))
    known.update({name: {"paths": p, "files": saved["train"][name]} for name, p in saved["paths"].items()})
    return known


def _split_eval(data_cfg, listing: dict, holdout: int):
    """(training config, held-out config or None, training files, held-out files). The held-out
    set is `data.eval.paths` (must not overlap training files), or the last
    `data.eval.holdout_files` files of the training list, removed from training. With
    data.sources the held-out files come from data.eval.paths only, read with data.text_key."""
    import dataclasses

    from data.config import all_files

    train_files, eval_files = listing["train"], listing["eval"]
    if eval_files:
        overlap = sorted(set(eval_files) & set(all_files(train_files)))
        if overlap:
            raise ValueError(f"data.eval.paths overlaps the training files (e.g. {overlap[0]}); "
                             "held-out data must not be trained on")
    elif holdout:
        if holdout >= len(train_files):
            raise ValueError(f"data.eval.holdout_files={holdout} leaves no training file "
                             f"(data.paths matches {len(train_files)})")
        eval_files, train_files = train_files[-holdout:], train_files[:-holdout]
    else:
        return data_cfg, None, train_files, []
    eval_cfg = dataclasses.replace(data_cfg, sources=(), num_workers=0,
                                   num_shards=_eval_shards(data_cfg.global_batch_size, len(eval_files)),
                                   shuffle_window=0, files_per_stream=1)
    return data_cfg, eval_cfg, train_files, eval_files


def _eval_shards(batch: int, n_files: int) -> int:
    """Virtual shards must divide the batch (fixed batch layout) and not outnumber the files; the
    largest such count spreads the fixed eval batches over the most held-out files."""
    return max(v for v in range(1, min(n_files, batch) + 1) if batch % v == 0)


def _valid_eval_files(data_lib, eval_cfg, files: list[str], *, announce: bool):
    """(held-out config, files) over those held-out files that hold a valid document, or
    (None, []) when none does. Evaluation is a view on a lenient run, not its purpose: an empty,
    truncated or corrupt held-out file is named in one line and left out, never fatal
    (data.strict=true: the first bad record raises with file:line). Reads each held-out file up to
    its first valid document, the same on every host, so all hosts agree."""
    import dataclasses

    reasons = [data_lib.no_document_reason(f, eval_cfg.text_key, eval_cfg.strict) for f in files]
    good = [f for f, why in zip(files, reasons, strict=True) if why is None]
    bad = [why for why in reasons if why is not None]
    if bad and announce:
        shown = "; ".join(bad[:3]) + (f"; and {len(bad) - 3} more" if len(bad) > 3 else "")
        outcome = "training without evaluation" if not good else f"evaluating on the other {len(good)}"
        print(f"data.eval: {len(bad)} of {len(files)} held-out file(s) hold no valid document ({shown}): "
              f"{outcome}", flush=True)
    if not good:
        return None, []
    if not bad:
        return eval_cfg, files
    return dataclasses.replace(eval_cfg, num_shards=_eval_shards(eval_cfg.global_batch_size, len(good))), good


class _AutoWorkers:
    """data.num_workers=auto in the run (the rule and its figures: data/autoworkers.py).

    Starts the pipeline with a provisional count; `start` marks the end of the compile step;
    after `steps` more steps `choose` measures what the step consumed (tokens over the seconds
    not spent waiting for data, evaluations or saves) and what one worker delivers, and returns
    the count every host agrees on (the largest any host needs) with the row for the metrics.
    """

    def __init__(self, data_cfg, process_count: int, files, *, saved: int | None):
        import dataclasses

        from data import autoworkers, records
        from data.tokenizer import available_cores

        self.budget = autoworkers.ram_budget_bytes(data_cfg.ram_budget_gb)
        self.shards_per_host = data_cfg.num_shards // process_count
        self.cores = available_cores()
        self.provisional = autoworkers.provisional_workers(self.shards_per_host, self.cores, self.budget,
                                                           saved if isinstance(saved, int) else None)
        self.cfg = dataclasses.replace(data_cfg, num_workers=self.provisional)
        self.steps = data_cfg.auto_measure_steps
        # 0 workers only for a converted corpus: nothing to tokenize in the training process.
        self.in_process_ok = not data_cfg.sources and records.describe(list(files)) is not None
        self.host_tokens_per_step = data_cfg.global_batch_size // process_count * data_cfg.seq_len
        self._t0 = self._wait0 = self._paused0 = None

    def announce(self) -> str:
        return (f"data.num_workers=auto: starting with {self.provisional} worker(s); choosing after "
                f"data.auto_measure_steps={self.steps} steps past the first (compiling) step")

    def start(self, wait_s: float, paused_s: float) -> None:
        self._t0, self._wait0, self._paused0 = time.perf_counter(), wait_s, paused_s

    def switch_cfg(self, n: int):
        import dataclasses

        self.cfg = dataclasses.replace(self.cfg, num_workers=n)
        return self.cfg

    def choose(self, batches, step: int, paused_s: float, *, announce: bool) -> tuple[int, dict]:
        import dataclasses

        import jax

        from data import autoworkers

        wall = time.perf_counter() - self._t0
        compute = wall - (batches.stats()["wait_s"] - self._wait0) - (paused_s - self._paused0)
        fig = autoworkers.measure_pipeline(batches.host_iterator(), self.cfg.seq_len,
                                           self.steps * self.host_tokens_per_step, compute)
        choice = autoworkers.choose_workers(
            fig.rates, fig.need_tok_s, shards_per_host=self.shards_per_host, cores=self.cores,
            worker_rss_bytes=fig.worker_rss_bytes, main_rss_bytes=fig.main_rss_bytes,
            budget_bytes=self.budget, in_process_ok=self.in_process_ok)
        n = choice.num_workers
        if jax.process_count() > 1:
            # Every host runs the same count: the largest any host needs (each host's shards and
            # the batches do not depend on it, but one setting keeps the run simple to read).
            import numpy as np
            from jax.experimental import multihost_utils

            n = int(np.max(multihost_utils.process_allgather(np.int32(n))))
        agreed = dataclasses.replace(choice, num_workers=n)
        line = autoworkers.describe(agreed, fig, self.budget, provisional=self.provisional, step=step,
                                    cores=self.cores)
        if n != choice.num_workers:
            line += f"; this host alone needs {choice.num_workers}, every host runs the most any needs"
        if announce:
            print(line, flush=True)
        row = autoworkers.metrics(agreed, fig, self.budget, self.provisional, self.cores)
        return n, row


# ====================================================================== hosts
def _init_distributed(dcfg: DictConfig) -> None:
    """jax.distributed on several hosts: explicit coordinator, or automatic on a TPU pod."""
    import jax

    if dcfg.local_device_count:
        # Fake CPU devices for multi-process runs on one machine; only possible before the
        # backend starts, which is why launch_local.py passes it per process.
        jax.config.update("jax_num_cpu_devices", int(dcfg.local_device_count))
    if jax.distributed.is_initialized():
        return
    if dcfg.coordinator_address:
        jax.distributed.initialize(coordinator_address=dcfg.coordinator_address,
                                   num_processes=dcfg.num_processes, process_id=dcfg.process_id)
    elif (tpu_slice := _tpu_slice_from_env()) is not None:
        jax.distributed.initialize(**tpu_slice)
    elif _on_tpu_vm():
        # The TPU VM's metadata describes the slice (one host or many), as MaxText relies on too.
        try:
            jax.distributed.initialize()
        except Exception as e:  # noqa: BLE001 - the device files are only a hint
            if "," in os.environ.get("TPU_WORKER_HOSTNAMES", ""):
                raise                   # certainly a multi-host slice: never run hosts apart
            print(f"warning: automatic jax.distributed.initialize() failed ({e}); running as one "
                  "process (set distributed.coordinator_address for a multi-host run)", file=sys.stderr)


# jax's coordinator port on Cloud TPU (jax/_src/clusters/cloud_tpu_cluster.py); JAX_COORDINATOR_PORT
# overrides it there and here.
TPU_COORDINATOR_PORT = 8482


def _tpu_slice_from_env() -> dict | None:
    """A multi-host slice as the TPU VM environment describes it (TPU_WORKER_HOSTNAMES, sorted by
    worker id, and TPU_WORKER_ID): jax.distributed.initialize's arguments, or None.

    jax reads the same variables itself, but only once a TPU backend is present; reading them
    here makes the start-up independent of the backend, so a simulated pod (CPU workers given a
    TPU VM's environment, tests/pod_sim.py) starts exactly as a real one. Multislice runs
    (MEGASCALE_*) are left to jax.
    """
    hosts = [h for h in os.environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]
    if len(hosts) < 2 or os.environ.get("MEGASCALE_COORDINATOR_ADDRESS"):
        return None
    worker_id = os.environ.get("TPU_WORKER_ID", "")
    if not worker_id.isdigit() or int(worker_id) >= len(hosts):
        raise ConfigError(f"TPU_WORKER_ID={worker_id!r} is not a worker of TPU_WORKER_HOSTNAMES "
                          f"({len(hosts)} hosts): cannot tell this host's place in the slice")
    port = os.environ.get("JAX_COORDINATOR_PORT") or TPU_COORDINATOR_PORT
    return {"coordinator_address": f"{hosts[0].split(':')[0]}:{port}", "num_processes": len(hosts),
            "process_id": int(worker_id)}


def _on_tpu_vm() -> bool:
    # Checked without starting a JAX backend: after that, initialize() is too late.
    import glob

    return bool(os.environ.get("TPU_WORKER_HOSTNAMES") or glob.glob("/dev/accel[0-9]*")
                or glob.glob("/dev/vfio/[0-9]*"))


def _from_process_0(make):
    """make()'s JSON result, computed on process 0 only and sent to every process. A ValueError
    raised there is raised on every process, so all hosts stop with the same one line."""
    import jax

    if jax.process_count() == 1:
        return make()
    import numpy as np
    from jax.experimental import multihost_utils

    payload = b""
    if jax.process_index() == 0:
        try:
            payload = json.dumps({"ok": make()}).encode()
        except ValueError as e:
            payload = json.dumps({"error": str(e)}).encode()
    # Two broadcasts: the length, then the bytes (every process must pass the same shape).
    n = int(multihost_utils.broadcast_one_to_all(np.int32(len(payload))))
    buf = np.frombuffer(payload, np.uint8) if payload else np.zeros(n, np.uint8)
    got = json.loads(np.asarray(multihost_utils.broadcast_one_to_all(buf), np.uint8).tobytes())
    if "error" in got:
        raise ValueError(got["error"])
    return got["ok"]


# ====================================================================== exact-resume tests
def _host_rows(arr):
    """This process's rows of a batch-sharded global array, in order (replicas dropped)."""
    import numpy as np

    parts = {s.index[0].start or 0: np.asarray(s.data) for s in arr.addressable_shards}
    return np.concatenate([parts[k] for k in sorted(parts)])


def _log_debug_batch(f, step: int, batch: dict) -> dict:
    """train.debug_batches: one line per step and process: a hash of the host batch, and per
    row [virtual shard, first and last document id, hash of its tokens]. Returns the batch
    without the debug-only keys."""
    import numpy as np

    from model.step import BATCH_KEYS

    local = {k: np.ascontiguousarray(_host_rows(batch[k])) for k in BATCH_KEYS}
    doc_ids, shards = np.asarray(batch["doc_ids"]), np.asarray(batch["row_shard"])
    digest = hashlib.sha256(b"".join(local[k].tobytes() for k in BATCH_KEYS)).hexdigest()[:16]
    rows = []
    for b in range(len(shards)):
        real = doc_ids[b][doc_ids[b] >= 0]
        h = hashlib.sha256(local["inputs"][b].tobytes() + local["targets"][b].tobytes()
                           + np.ascontiguousarray(doc_ids[b]).tobytes()).hexdigest()[:16]
        rows.append([int(shards[b]), int(real[0]) if real.size else -1, int(real[-1]) if real.size else -1, h])
    f.write(json.dumps({"step": step, "batch_hash": digest, "rows": rows}) + "\n")
    f.flush()
    return {k: batch[k] for k in BATCH_KEYS}


# ====================================================================== preemption
class _PreemptionFlag:
    """SIGTERM (a preempted VM, `scripts/tpu.py stop`) or JAX's preemption sync point on TPU:
    save at the current step, wait for the save, exit 0; the next start resumes.

    A save is collective, so every host must stop at the same step. TPU maintenance events come
    through the sync point, which agrees by design; a SIGTERM is agreed at log boundaries on
    several hosts (one tiny all-gather per interval, never per step) and at once on one host.
    """

    def __init__(self, agree_every: int):
        import jax

        self.fired = False
        self._signalled = False
        self._multi = jax.process_count() > 1
        self._agree_every = max(1, agree_every)
        self._previous = None
        try:
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        except ValueError:      # not the main thread: leave signals alone
            pass

    def _on_sigterm(self, signum, frame):
        self._signalled = True

    def check(self, step: int) -> bool:
        if self.fired:
            return True
        try:
            from jax.experimental import multihost_utils
            self.fired = bool(multihost_utils.reached_preemption_sync_point(step))
        except Exception:       # the preemption service exists only on multi-host TPU runs
            pass
        if not self.fired and self._multi:
            if step % self._agree_every == 0:
                import numpy as np
                from jax.experimental import multihost_utils
                self.fired = bool(np.max(multihost_utils.process_allgather(np.int32(self._signalled))))
        elif not self.fired:
            self.fired = self._signalled
        return self.fired

    def restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


# ====================================================================== profiling
class _Profiler:
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


# ====================================================================== evaluation
class _EvalSet:
    """A fixed set of held-out batches, built once and kept on device, so every evaluation sees
    the same tokens. Every host reads the same eval rows and keeps its slice of each batch: the
    held-out set may be a single file, fewer than the hosts."""

    def __init__(self, data_lib, eval_cfg, files: list[str], n_batches: int, sharding, eval_step, tokenizer):
        import jax

        local = eval_cfg.global_batch_size // jax.process_count()
        lo = jax.process_index() * local
        it = data_lib.make_host_iterator(eval_cfg, 0, 1, files=files, tokenizer=tokenizer)
        self.batches = []
        for _ in range(n_batches):
            rows = next(it)
            self.batches.append({k: jax.make_array_from_process_local_data(sharding, v[lo:lo + local])
                                 for k, v in rows.items()})
        if hasattr(it, "close"):
            it.close()
        self.eval_step = eval_step

    def loss(self, params) -> float:
        import jax

        sums = jax.device_get([self.eval_step(params, b) for b in self.batches])
        return float(sum(s["loss_sum"] for s in sums) / max(1, sum(s["n_tokens"] for s in sums)))


# ====================================================================== metrics
def _interval_metrics(step, fetched, timer, stats, schedule, tokens_per_step, flops_per_step, peak_total,
                      *, stop_on_nan: bool) -> dict:
    """One log row from the steps since the last one. Throughput excludes the compile step."""
    import jax
    import numpy as np

    losses = np.array([m["loss"] for m in fetched], dtype=np.float64)
    if stop_on_nan and not np.all(np.isfinite(losses)):
        raise FloatingPointError(f"loss is not finite in steps {step - len(fetched) + 1}..{step}: {losses.tolist()}")
    now = time.perf_counter()
    dt, n = now - timer["t"], timer["steps"]
    wait = stats["wait_s"] - timer["wait"]
    if jax.process_count() > 1:
        # The step runs at the pace of the slowest host: report its wait.
        from jax.experimental import multihost_utils
        wait = float(np.max(multihost_utils.process_allgather(np.float64(wait))))
    tokens_per_s = n * tokens_per_step / dt if n and dt > 0 else None
    documents = stats.get("documents", 0)
    row = {
        "step": step,
        "loss": float(losses.mean()),
        "perplexity": float(np.exp(min(losses.mean(), 50.0))),
        "lr": float(schedule(step - 1)),
        "grad_norm": float(fetched[-1]["grad_norm"]),
        "param_norm": float(fetched[-1]["param_norm"]),
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_per_device": tokens_per_s / jax.device_count() if tokens_per_s else None,
        "step_time_s": dt / n if n else None,
        "mfu": flops_per_step * n / dt / peak_total if (peak_total and n and dt > 0) else None,
        "data_wait_frac": wait / dt if dt > 0 else 0.0,
        "documents_per_s": (documents - timer["documents"]) / dt if dt > 0 else None,
        "checkpoint_save_s": timer["save_s"],
        "tokens_seen": step * tokens_per_step,
        **{f"data/{k}": v for k, v in stats.items() if isinstance(v, (int, float)) and not isinstance(v, bool)},
        **{f"data/bad_{k}": v for k, v in stats.get("bad_records", {}).items()},
    }
    if stats.get("stage_s"):
        # Where the input time went in this interval (this host), and the stage bounding it.
        from data import timing

        row.update(timing.metrics(timing.summarize(timing.sub_times(stats["stage_s"], timer["stage_s"]), dt)))
    if stats.get("bad_examples"):
        # The first bad records' names (file:line: kind), so a skipped file is named where it is counted.
        row["data/bad_examples"] = "; ".join(stats["bad_examples"])
    timer.update(t=now, wait=stats["wait_s"], steps=0, save_s=0.0, documents=documents,
                 stage_s=stats.get("stage_s", {}))
    return row


# ====================================================================== metrics
class MetricsLogger:
    """Process 0 only: a progress bar, `metrics.jsonl` in the run directory, and wandb.

    The wandb run id is kept in the checkpoint meta, so a resumed run continues the same wandb
    run. The API key comes from the environment (WANDB_API_KEY), never from config.
    """

    def __init__(self, cfg: DictConfig, run_dir: Path, *, enabled: bool, start_step: int, wandb_id: str | None):
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


# ====================================================================== CLI
@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def main(cfg: DictConfig) -> None:
    from data import BadDataError

    try:
        train(cfg)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        sys.exit(2)
    except BadDataError as e:
        # Bad data (data.strict=true, or a virtual shard without any valid document) names its
        # file and line in its message; it arrives from an input worker process as itself, and
        # the traceback would bury that one line under Grain's and our frames.
        print(f"data error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()

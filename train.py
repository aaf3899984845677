"""Pre-train a Llama-style model: `python train.py [hydra overrides]`.

The run, top to bottom (each phase is a banner below):
  config checks -> hosts and mesh -> the run's files -> model, optimizer, shardings ->
  init or restore -> jitted train step -> loop (batch, step, meter, eval, preemption, save).

`train(cfg)` is the whole run and is what tests call; `main` is a thin Hydra wrapper that turns
config mistakes into one error line. Defaults train the tiny model on the bundled sample on
whatever devices JAX sees; `configs/` documents every setting. The helpers live beside what
they serve: data decisions in data/ (listing, held-out split, resume plan, auto workers, the
batch log), the hosts' runtime in model/runtime/distributed.py, the loop's meters in model/runtime/meters.py.
"""
from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError

PROJECT_ROOT = Path(__file__).resolve().parent
if not OmegaConf.has_resolver("project_root"):
    OmegaConf.register_new_resolver("project_root", lambda: str(PROJECT_ROOT))


class ConfigError(ValueError):
    """A config mistake found before anything expensive starts; `main` prints it as one line."""


def train(cfg: DictConfig) -> dict:
    """Runs (or resumes) the training run described by `cfg`; returns a summary dict.

    A checkpoint step that does not restore has been moved aside on every host when
    DamagedCheckpoint arrives here (model/runtime/checkpoint.py): the run starts again, from the newest
    step that restores (each pass moves one step, so this ends)."""
    from model.runtime.checkpoint import DamagedCheckpoint

    while True:
        try:
            return run(cfg)
        except DamagedCheckpoint as e:
            if e.moved_to is None:
                raise


def run(cfg: DictConfig) -> dict:
    """One start of the run: config checks, hosts, files, restore, the loop (train() above)."""
    # Imports here keep `python train.py --help` and config errors fast.
    import jax
    from etils import epath

    import data as data_lib
    from model import flops as flops_lib
    from model.evals.evaluate import LoopEvals, TaskEvaluator, TasksConfig
    from model.optimizer import resolve_warmup
    from model.runtime import distributed, goodput
    from model.runtime import resume as resume_lib
    from model.runtime import rollback as rollback_lib
    from model.runtime.checkpoint import Checkpointer
    from model.runtime.local_tier import LocalTier
    from model.runtime.meters import IntervalMeter, MetricsLogger, Profiler, end_line
    from model.runtime.watchdog import REPORTS_DIR, Watchdog, announce_last_hang, heartbeat_over

    t_start = time.perf_counter()
    # The run's event log (model/runtime/goodput.py): a command's life counts from its process's start.
    events = goodput.EventLog(from_process_start=__name__ == "__main__")

    # ------------------------------------------------------------------ config checks
    # Everything here is cheap: a bad setting fails in one line before any compile or spawn.
    run_dir = Path(cfg.paths.run_dir)
    data_map = OmegaConf.to_container(cfg.data, resolve=True)
    eval_map = data_map.pop("eval", None) or {}
    try:
        if cfg.train.steps <= 0:
            raise ValueError(f"train.steps={cfg.train.steps} must be positive")
        hang_timeout_s = cfg.train.get("hang_timeout_s")
        if hang_timeout_s is not None and not float(hang_timeout_s) > 0:
            raise ValueError(f"train.hang_timeout_s={hang_timeout_s} must be positive (null: automatic)")
        on_divergence = cfg.train.get("on_divergence", "stop")
        divergence_skips = int(cfg.train.get("divergence_skips") or 0)
        rollback_lib.check_settings(on_divergence, divergence_skips)
        LocalTier.check_settings(cfg.checkpoint)
        if cfg.checkpoint.get("on_damaged", "fall_back") not in ("fall_back", "stop"):
            raise ValueError(f"checkpoint.on_damaged={cfg.checkpoint.on_damaged} must be fall_back or stop")
        model_cfg, tx, schedule = model_and_optimizer(cfg)
        # data.paths may be one glob or a list: DataConfig takes either.
        data_cfg = data_lib.DataConfig.from_mapping({**data_map, "tokenizer": cfg.tokenizer.path})
        eval_paths, holdout = data_lib.eval_settings(eval_map)
        if holdout and data_cfg.sources:
            raise ValueError("data.eval.holdout_files works with data.paths only: with data.sources, "
                             "hold out files through data.eval.paths (read with data.text_key)")
        _, _, warmup_notice = resolve_warmup(cfg.optimizer, cfg.train.steps)
        TasksConfig.from_mapping(OmegaConf.to_container(cfg.eval, resolve=True))   # eval.tasks, read later
    except (TypeError, ValueError) as e:
        raise ConfigError(str(e)) from e
    if data_cfg.seq_len > model_cfg.max_seq_len:
        raise ConfigError(f"data.seq_len={data_cfg.seq_len} exceeds model.max_seq_len={model_cfg.max_seq_len}")

    # ------------------------------------------------------------------ hosts and mesh
    try:
        distributed.init_distributed(cfg.distributed, heartbeat_timeout_s=heartbeat_over(hang_timeout_s))
    except ValueError as e:
        raise ConfigError(str(e)) from e
    distributed.use_compile_cache(cfg.paths.get("compile_cache"))
    events.add("distributed")
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
    # One listing per run (data/listing.py run_listing), after every cheap check: a resumed run
    # reads the list saved in its checkpoint; otherwise process 0 lists and the other hosts
    # receive the list. The checkpoint is only read here: a config mistake must leave no
    # checkpoint directory behind.
    try:
        # The local tier (model/runtime/local_tier.py) wins when every host holds a newer step there.
        local_tier = LocalTier.from_config(cfg.checkpoint, process_index)
        start = resume_lib.find_start(cfg.checkpoint, program.abstract_state, local_tier,
                                      gather=distributed.gather_json)
        meta = start.meta
        saved_listing = None if cfg.checkpoint.allow_data_change else meta.get("files")
        listing = data_lib.run_listing(data_cfg.patterns(), eval_paths, saved_listing,
                                       from_process_0=distributed.from_process_0)
        data_cfg, eval_cfg, train_files, eval_files = data_lib.split_eval(data_cfg, listing, holdout)
        data_lib.check_files(data_cfg, process_count, train_files)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    events.add("listing")

    if is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        # The resolved config documents the run; secrets never live in it (wandb reads its key
        # from the environment).
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    events.open(run_dir, enabled=is_main)

    # ------------------------------------------------------------------ model, optimizer, shardings
    abstract_state = program.abstract_state
    batch_sharding = program.batch_sharding
    fingerprint = {"data": data_lib.fingerprint(data_cfg, tokenizer=tokenizer, files=train_files),
                   "model": OmegaConf.to_container(cfg.model, resolve=True)}

    # ------------------------------------------------------------------ init or restore
    # Everything started from here (checkpoint manager, data workers, wandb, the profiler, the
    # SIGTERM handler) is closed on the way out, on success and on error alike.
    with contextlib.ExitStack() as cleanup:
        # From here a SIGTERM means "save at the next step and exit", also during restore/compile.
        preempted = distributed.PreemptionFlag(agree_every=cfg.train.log_every)
        cleanup.callback(preempted.restore)
        # On the way out, last: the exit event (clean, preempted, crash from here on) and the goodput summary.
        step = None
        cleanup.push(events.on_exit(lambda: step, preempted))
        ckpt = Checkpointer(cfg.checkpoint)
        cleanup.callback(ckpt.close)
        # Hung hosts (model/runtime/watchdog.py): armed from the first completed step, paused around
        # work that is not a step; its reports go where every host writes (the checkpoint dir).
        hang_reports = epath.Path(ckpt.directory) / REPORTS_DIR    # checkpoint.dir may be gs://
        if is_main and (line := announce_last_hang(hang_reports, process_count)):
            print(line, flush=True)
            events.add("last_hang", line=line)     # the goodput log names who stopped first
        watchdog = Watchdog(hang_timeout_s, run_dir=run_dir, reports_dir=hang_reports, process_index=process_index,
                            on_hang=lambda last_step: events.exit("hang", step=last_step))
        cleanup.callback(watchdog.close)
        saved_data_states = None
        if start.point is not None:
            try:    # what the saved data position is worth on this data (model/runtime/resume.py, data/resume.py)
                saved_data_states = resume_lib.accept_data(start, fingerprint, mixture_change=data_cfg.mixture_change,
                                                           allow_data_change=cfg.checkpoint.allow_data_change,
                                                           announce=is_main)
            except ValueError as e:
                raise ConfigError(str(e)) from e

        if eval_cfg is not None and cfg.train.eval_every:
            eval_cfg, eval_files = data_lib.valid_eval_files(eval_cfg, eval_files, announce=is_main)
        # The input pipeline starts now (worker processes spawn, the first batches get tokenized)
        # so that its start-up overlaps with restoring or initialising the model. A training shard
        # without any valid document fails its first window, so before the first step.
        debug_batches = bool(cfg.train.get("debug_batches", False))
        auto_workers = None
        if data_lib.is_auto(data_cfg.num_workers):
            # data.num_workers=auto: a provisional count now, the choice after the first steps.
            auto_workers = data_lib.AutoWorkers(data_cfg, process_count, train_files,
                                                saved=meta.get("num_workers") if start.point is not None else None,
                                                agree=distributed.max_over_hosts)
            data_cfg = auto_workers.cfg
            if is_main:
                print(auto_workers.announce(), flush=True)

        def restart(cfg_, shard_states, follows):
            """The same batches from the consumed `shard_states` with another worker count."""
            host_iter = data_lib.make_host_iterator(cfg_, process_index, process_count, shard_states,
                                                    debug=debug_batches, files=train_files, tokenizer=tokenizer)
            return data_lib.DevicePrefetcher(host_iter, batch_sharding, prefetch=cfg_.prefetch, follows=follows)

        batches = data_lib.DevicePrefetcher(
            data_lib.restore_host_iterator(data_cfg, process_index, process_count, saved_data_states,
                                           debug=debug_batches, files=train_files, tokenizer=tokenizer),
            batch_sharding, prefetch=data_cfg.prefetch)
        cleanup.callback(batches.close)

        t_restore = time.time()
        try:
            state, start_step = resume_lib.restore_or_init(
                start, ckpt=ckpt, local_tier=local_tier, program=program, seed=cfg.seed,
                init_from=cfg.checkpoint.init_from, model_fingerprint=fingerprint["model"], run_dir=run_dir,
                announce=is_main)
        except ValueError as e:
            if start.point is not None:
                raise
            raise ConfigError(str(e)) from e     # checkpoint.init_from holds another model
        events.add("restore", step=start_step, tier=start.point.source if start.point is not None else "init",
                   seconds=time.time() - t_restore)

        # ------------------------------------------------------------------ jitted steps
        # Built with the program (build_program): jax.jit compiles at the first call.
        train_step = program.train_step
        held_out = None
        if eval_cfg is not None and cfg.train.eval_every:
            held_out = data_lib.HeldOutSet(eval_cfg, eval_files, cfg.train.eval_batches, batch_sharding,
                                           program.eval_step, tokenizer)
        try:    # downstream tasks (eval.tasks): read and packed now, so a bad line stops before step 1
            tasks = TaskEvaluator.from_run_config(OmegaConf.to_container(cfg, resolve=True), program, tokenizer)
        except (OSError, ValueError) as e:
            raise ConfigError(str(e)) from e
        evals = LoopEvals(held_out, cfg.train.eval_every, tasks, cfg.train.steps)
        tokens_per_step = data_cfg.global_batch_size * data_cfg.seq_len
        peak = flops_lib.peak_flops(jax.devices()[0].device_kind, cfg.train.peak_flops)
        meter = IntervalMeter(
            schedule=schedule, tokens_per_step=tokens_per_step,
            flops_per_step=flops_lib.flops_per_token(model_cfg, data_cfg.seq_len) * tokens_per_step,
            peak_total=peak * jax.device_count() if peak else None, device_count=jax.device_count(),
            stop_on_nan=cfg.train.stop_on_nan and on_divergence == "stop", over_hosts=distributed.gather_over_hosts)
        rollback = None
        if on_divergence == "rollback":
            rollback = rollback_lib.Rollback(ckpt, abstract_state, run_dir=run_dir, process_index=process_index,
                                             process_count=process_count, barrier=lambda: distributed.max_over_hosts(0),
                                             resumed_from=start.step if start.rolled_past is not None else None)
            cleanup.callback(rollback.close)
            if local_tier is not None:
                rollback.on_rollback = local_tier.drop_after
        if local_tier is not None:
            cleanup.callback(local_tier.wait)
        plant = rollback_lib.planted_divergence()     # tests only: JAXPT_TEST_DIVERGE_AT

        logger = MetricsLogger(cfg, run_dir, enabled=is_main, start_step=start_step, wandb_id=meta.get("wandb_id"))
        cleanup.callback(logger.close)
        # "files": the run's listing, reused by a resumed run (~70 bytes per file: 350 KB for 5000).
        meta = {"fingerprint": fingerprint, "config": OmegaConf.to_container(cfg, resolve=True),
                "wandb_id": logger.wandb_id, "process_count": process_count, "num_workers": data_cfg.num_workers,
                "files": listing, "rollbacks": start.rollbacks}

        # ------------------------------------------------------------------ loop
        profile = Profiler(cfg.profile.steps, run_dir / "profile", enabled=is_main)
        cleanup.callback(profile.maybe_stop, None)
        # Tests of exact resume: every process records what each step consumed (a host sync per step).
        batch_log = None
        if debug_batches:
            batch_log = data_lib.BatchLog(run_dir / f"debug_batches.p{process_index}.jsonl")
            cleanup.callback(batch_log.close)
        step = start_step
        cleanup.push(watchdog.exit_hook)    # runs first: a failure caused by a peer's hang exits as one
        auto_row = {}           # data.num_workers=auto's figures, logged with the next row
        last = {}
        drawn = 0               # batches drawn in this start (rolled-back ones included)
        # An async save blocks the loop briefly, in Orbax's barriers with the other hosts: a peer
        # frozen there is a hang like one in a step, so the watchdog stays armed. A synchronous
        # save writes the whole state in the loop and is paused like an evaluation.
        save_guard = contextlib.nullcontext if cfg.checkpoint["async"] else watchdog.paused
        while step < cfg.train.steps:
            profile.maybe_start(step + 1)
            batch = next(batches)
            drawn += 1
            if batch_log is not None:
                batch = batch_log.log(step + 1, batch)
            state, metrics = train_step(state, batch)
            if drawn in plant:
                state, metrics = rollback_lib.plant(state, metrics)
            step += 1
            meter.add(metrics)
            if step == start_step + 1:
                # Keep compilation out of the throughput figures.
                jax.block_until_ready(metrics)
                meter.compiled(batches.stats())
                events.add("compile", step=step)
                if auto_workers is not None:
                    auto_workers.start(step, batches.stats()["wait_s"], meter.paused_s)
            watchdog.beat(step)
            events.beat(step, metrics["loss"])      # a killed life's last steps count as lost work
            if auto_workers is not None and auto_workers.due(step):
                jax.block_until_ready(metrics)      # the measured steps have run, not just dispatched
                with watchdog.paused():
                    batches, auto_row = auto_workers.switch(batches, step, meter.paused_s, restart=restart,
                                                            announce=is_main)
                meta["num_workers"] = auto_workers.cfg.num_workers
                cleanup.callback(batches.close)     # the one replaced is closing in the background
            profile.maybe_stop(step)

            log_now = step % cfg.train.log_every == 0 or step == cfg.train.steps
            save_now = ckpt.should_save(step, cfg.train.steps)
            local_now = local_tier is not None and local_tier.should_save(step) and not save_now
            if (log_now or save_now or local_now) and (rollback is not None or meter.stop_on_nan):
                # Divergence (model/runtime/rollback.py): looked for where a row is logged or a step saved.
                div = meter.divergence(step, divergence_skips)
                if div is not None and rollback is None:
                    raise rollback_lib.Diverged(f"{div.reason}; step {step} is not saved (train.on_divergence=stop; "
                                                "rollback reloads the newest checkpoint before it)")
                if div is not None:
                    state, step, record = rollback.recover(div, step, batches, meter=meter, events=events,
                                                           paused=watchdog.paused, announce=is_main)
                    meta["rollbacks"] = meta["rollbacks"] + [record]
                    continue
            evals_now = any(evals.due(step))
            if log_now or evals_now:
                row = {"step": step}
                if log_now:
                    row = last = meter.row(step, batches.stats())
                    watchdog.step_time(row["step_time_s"])
                if evals_now:
                    with watchdog.paused():
                        row.update(evals.run(step, state["params"], meter))
                row, auto_row = {**row, **auto_row}, {}
                logger.log(events.row(row))

            if local_now:       # not collective, and the loop waits for the shards' hand-over only
                t0 = time.perf_counter()
                local_tier.save(step, state, batches.consumed_state(), meta)
                meter.paused(time.perf_counter() - t0, kind="save")
                events.add("save", step=step, tier="local", blocked_s=time.perf_counter() - t0)
            stop = preempted.check(step)
            if save_now or stop:
                t0 = time.perf_counter()
                with save_guard():
                    ckpt.save(step, state, batches.consumed_state(), meta)
                meter.paused(time.perf_counter() - t0, kind="save")
                events.add("save", step=step, blocked_s=time.perf_counter() - t0)
                if stop:
                    watchdog.close()
                    ckpt.wait()
                    if is_main:
                        print(f"Preempted: saved step {step} to {ckpt.directory}; exiting", flush=True)
                    break
        watchdog.close()        # the last save's wait is not a step
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
    if is_main:
        print(end_line(summary, cfg.train.steps), flush=True)
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
                                  loss_chunk=int(cfg.train.loss_chunk), devices=devices,
                                  spikes=step_lib.SpikeConfig.from_mapping(cfg.train.get("spikes")))


# ====================================================================== CLI
@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def main(cfg: DictConfig) -> None:
    from model.runtime.distributed import preempted_exit_code, quiet_cpu_start

    quiet_cpu_start()           # before anything imports JAX
    from data import BadDataError
    from model.runtime.checkpoint import DamagedCheckpoint
    from model.runtime.rollback import Diverged
    from model.runtime.watchdog import EXIT_HANG, PeerHung

    try:
        summary = train(cfg)
    except (ConfigError, InterpolationResolutionError) as e:
        # One line: e.g. an unset ${oc.env:JAX_COORDINATOR_ADDRESS} (configs/experiment/gpu_multihost_llama_1b.yaml)
        # comes from OmegaConf over three.
        print(f"config error: {' '.join(str(e).split())}", file=sys.stderr)
        sys.exit(2)
    except BadDataError as e:
        # Bad data (data.strict=true, or a virtual shard without any valid document) names its
        # file and line in its message; it arrives from an input worker process as itself, and
        # the traceback would bury that one line under Grain's and our frames.
        print(f"data error: {e}", file=sys.stderr)
        sys.exit(1)
    except DamagedCheckpoint as e:
        # checkpoint.on_damaged=stop, or no step left that restores: the line says which step and why.
        print(f"checkpoint error: {e}", file=sys.stderr)
        sys.exit(1)
    except (Diverged, FloatingPointError) as e:
        # train.on_divergence: the steps and what diverged, in one line (model/runtime/rollback.py).
        print(f"diverged: {' '.join(str(e).split())}", file=sys.stderr)
        sys.exit(1)
    except PeerHung as e:
        # Another host hung and left: every host exits with the hang's code, and restarts (model/runtime/watchdog.py).
        print(f"hang: {e}", file=sys.stderr)
        sys.exit(EXIT_HANG)
    if summary.get("preempted") and (code := preempted_exit_code()):
        # Saved on a preemption: 0, or EXIT_PREEMPTED where a launcher's --restarts loop asked for it.
        sys.exit(code)


if __name__ == "__main__":
    main()

"""Pre-train a Llama-style model: `python train.py [hydra overrides]`.

The run, top to bottom (each phase is a banner below):
  config checks -> hosts and mesh -> model, optimizer, program -> the run's files ->
  input started -> init or restore -> evaluators and meters -> loop.
The loop: next batch, step, meter, watchdog beat; then each component is asked whether it is
due (the auto worker count, divergence, the row and evaluations, saves, the preemption exit).

`train(cfg)` is the whole run and is what tests call; `main` is a thin Hydra wrapper that turns
config mistakes into one error line. Defaults train the tiny model on the bundled sample on
whatever devices JAX sees; `configs/` documents every setting. The helpers live beside what
they serve: the input in data/ (data/feed.py starts it), the network and its program in model/,
the run's machinery in model/runtime/ (hosts, checkpoints and saves, resume, rollback, watchdog,
goodput, meters), evaluation in model/evals/.
"""
from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path
from typing import NamedTuple

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
    """One start of the run, in the phases below (train() above starts it again after a damaged step)."""
    # Imports here keep `python train.py --help` and config errors fast.
    import jax
    from etils import epath

    import data as data_lib
    from data.batch_log import logging_step
    from model import flops as flops_lib
    from model.evals.evaluate import LoopEvals, TaskEvaluator
    from model.runtime import distributed, goodput, seam
    from model.runtime import resume as resume_lib
    from model.runtime import rollback as rollback_lib
    from model.runtime.checkpoint import Checkpointer
    from model.runtime.local_tier import LocalTier
    from model.runtime.meters import IntervalMeter, MetricsLogger, Profiler, Rows, end_line, skipped_line
    from model.runtime.saves import Saves
    from model.runtime.watchdog import REPORTS_DIR, Watchdog, announce_last_hang, heartbeat_over

    t_start = time.perf_counter()
    # The run's event log (model/runtime/goodput.py): a command's life counts from its process's start.
    events = goodput.EventLog(from_process_start=__name__ == "__main__")

    # ------------------------------------------------------------------ config checks
    # Everything here is cheap: a bad setting fails in one line before any compile or spawn.
    s = check_config(cfg)

    # ------------------------------------------------------------------ hosts and mesh
    with config_errors(ValueError):
        distributed.init_distributed(cfg.distributed, heartbeat_timeout_s=heartbeat_over(s.hang_timeout_s))
    distributed.use_compile_cache(cfg.paths.get("compile_cache"))
    events.add("distributed")
    process_index, process_count = jax.process_index(), jax.process_count()
    is_main = process_index == 0
    if s.warmup_notice and is_main:
        print(s.warmup_notice, flush=True)

    # ------------------------------------------------------------------ model, optimizer, program
    # The mesh over the hosts' devices, the shardings, the abstract state and the jitted steps
    # (model/step.py Program; jax.jit compiles at the first call). Built before the run's files:
    # the local tier's pick checks its shards against the abstract state.
    # The checks that need the hosts and devices come first (check_plan: scripts/compile_tpu.py runs
    # the same ones for a planned slice before it is rented).
    program, tokenizer = check_plan(cfg, s, process_count)

    # ------------------------------------------------------------------ the run's files
    # One listing per run (data/listing.py run_listing), after every cheap check: a resumed run
    # reads the list saved in its checkpoint; otherwise process 0 lists and the other hosts
    # receive the list. The checkpoint is only read here: a config mistake must leave no
    # checkpoint directory behind.
    with config_errors(ValueError):
        # The local tier (model/runtime/local_tier.py) wins when every host holds a newer step there.
        local_tier = LocalTier.from_config(cfg.checkpoint, process_index)
        start = resume_lib.find_start(cfg.checkpoint, program.abstract_state, local_tier,
                                      gather=distributed.gather_json)
        resume_lib.check_stage(cfg.train.get("stage_start"), start.step, str(cfg.checkpoint.dir))
        saved_listing = None if cfg.checkpoint.allow_data_change else start.meta.get("files")
        listing = data_lib.run_listing(s.data.patterns(), s.eval_paths, saved_listing,
                                       from_process_0=distributed.from_process_0)
        data_cfg, eval_cfg, train_files, eval_files = data_lib.split_eval(s.data, listing, s.holdout,
                                                                          s.eval_min_doc_tokens)
        data_lib.check_files(data_cfg, process_count, train_files)
    events.add("listing")
    if is_main:
        s.run_dir.mkdir(parents=True, exist_ok=True)
        # The resolved config documents the run; secrets never live in it (wandb reads its key
        # from the environment).
        (s.run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    events.open(s.run_dir, enabled=is_main)
    fingerprint = {"data": data_lib.fingerprint(data_cfg, tokenizer=tokenizer, files=train_files),
                   "model": OmegaConf.to_container(cfg.model, resolve=True)}

    # Everything started from here (checkpoint manager, data workers, wandb, the profiler, the
    # SIGTERM handler) is closed on the way out, on success and on error alike.
    with contextlib.ExitStack() as cleanup:
        # From here a SIGTERM means "save at the next step and exit", also during restore/compile.
        preempted = distributed.PreemptionFlag(agree_every=cfg.train.log_every)
        cleanup.callback(preempted.restore)
        # On the way out, last: the exit event (clean, preempted, crash from here on) and the goodput summary.
        cleanup.push(events.on_exit(preempted))
        ckpt = Checkpointer(cfg.checkpoint)
        cleanup.push(ckpt.exit_hook)     # closes; bounded after a failure on several hosts
        # Hung hosts (model/runtime/watchdog.py): armed from the first completed step, paused around
        # work that is not a step; its reports go where every host writes (the checkpoint dir).
        hang_reports = epath.Path(ckpt.directory) / REPORTS_DIR    # checkpoint.dir may be gs://
        if is_main and (line := announce_last_hang(hang_reports, process_count)):
            print(line, flush=True)
            events.add("last_hang", line=line)     # the goodput log names who stopped first
        watchdog = Watchdog(s.hang_timeout_s, run_dir=s.run_dir, reports_dir=hang_reports, process_index=process_index,
                            process_count=process_count, on_hang=lambda last_step: events.exit("hang", step=last_step))
        cleanup.callback(watchdog.close)

        # ------------------------------------------------------------------ input started
        # The input starts now (worker processes spawn, the first batches get tokenized) so that
        # its start-up overlaps with restoring or initialising the model. A training shard without
        # any valid document fails its first window, so before the first step.
        saved_data_states = None
        if start.point is not None:
            with config_errors(ValueError):   # what the saved data position is worth on this data
                saved_data_states = resume_lib.accept_data(
                    start, fingerprint, mixture_change=data_cfg.mixture_change, shape_change=data_cfg.shape_change,
                    global_batch_size=data_cfg.global_batch_size, allow_data_change=cfg.checkpoint.allow_data_change,
                    announce=is_main)
        batches = data_lib.Feed(
            data_cfg, process_index, process_count, saved_data_states, files=train_files, tokenizer=tokenizer,
            sharding=program.batch_sharding, debug=bool(cfg.train.get("debug_batches", False)),
            saved_workers=start.meta.get("num_workers") if start.point is not None else None,
            agree=distributed.max_over_hosts, announce=is_main, data_fingerprint=fingerprint["data"])
        cleanup.callback(batches.close)
        if is_main and batches.carried:
            print("input: the checkpoint carried the next batch; nothing is tokenized before the first step",
                  flush=True)

        # ------------------------------------------------------------------ init or restore
        t_restore = time.time()
        try:
            state, start_step = resume_lib.restore_or_init(
                start, ckpt=ckpt, local_tier=local_tier, program=program, seed=cfg.seed,
                init_from=cfg.checkpoint.init_from, model_fingerprint=fingerprint["model"], run_dir=s.run_dir,
                announce=is_main, reset_optimizer=bool(cfg.checkpoint.get("reset_optimizer", False)))
        except ValueError as e:
            if start.point is not None:
                raise
            raise ConfigError(str(e)) from e     # checkpoint.init_from holds another model
        events.add("restore", step=start_step, tier=start.point.source if start.point is not None else "init",
                   seconds=time.time() - t_restore)

        # ------------------------------------------------------------------ evaluators and meters
        held_out = None
        if eval_cfg is not None and cfg.train.eval_every:
            eval_cfg, eval_files = data_lib.valid_eval_files(eval_cfg, eval_files, announce=is_main)
        if eval_cfg is not None and cfg.train.eval_every:
            held_out = data_lib.HeldOutSet(eval_cfg, eval_files, cfg.train.eval_batches, program.batch_sharding,
                                           distributed.compiled_together(program.eval_step, "eval_step"), tokenizer)
        with config_errors(OSError, ValueError):   # downstream tasks: read and packed now, a bad line stops here
            tasks = TaskEvaluator.from_run_config(OmegaConf.to_container(cfg, resolve=True), program, tokenizer)
        tokens_per_step = data_cfg.global_batch_size * data_cfg.seq_len
        peak = flops_lib.peak_flops(jax.devices()[0].device_kind, cfg.train.peak_flops)
        meter = IntervalMeter(
            schedule=s.schedule, tokens_per_step=tokens_per_step,
            flops_per_step=flops_lib.flops_per_token(s.model, data_cfg.seq_len) * tokens_per_step,
            peak_total=peak * jax.device_count() if peak else None, device_count=jax.device_count(),
            stop_on_nan=cfg.train.stop_on_nan and s.on_divergence == "stop", over_hosts=distributed.gather_over_hosts)
        rollback = None
        if s.on_divergence == "rollback":
            rollback = rollback_lib.Rollback(
                ckpt, program.abstract_state, run_dir=s.run_dir, process_index=process_index,
                process_count=process_count, barrier=lambda: distributed.max_over_hosts(0),
                resumed_from=start.step if start.rolled_past is not None else None)
            cleanup.callback(rollback.close)
            if local_tier is not None:
                rollback.on_rollback = local_tier.drop_after
        if local_tier is not None:
            cleanup.callback(local_tier.wait)
        divergence = rollback_lib.DivergenceCheck(meter, rollback, skips=s.divergence_skips, rollbacks=start.rollbacks)
        saves = Saves(ckpt, local_tier, last_step=cfg.train.steps, meter=meter, events=events, watchdog=watchdog)
        logger = MetricsLogger(cfg, s.run_dir, enabled=is_main, start_step=start_step,
                               wandb_id=start.meta.get("wandb_id"))
        cleanup.callback(logger.close)
        evals = LoopEvals(held_out, cfg.train.eval_every, tasks, cfg.train.steps, s.position_buckets)
        rows = Rows(meter, evals, logger, events,
                    watchdog, log_every=cfg.train.log_every, last_step=cfg.train.steps)
        profile = Profiler(cfg.profile.steps, s.run_dir / "profile", enabled=is_main)
        cleanup.callback(profile.maybe_stop, None)
        train_step = distributed.compiled_together(program.train_step, "train_step")
        if cfg.train.get("debug_batches", False):      # what each step consumed (data/batch_log.py)
            train_step = logging_step(train_step, s.run_dir / f"debug_batches.p{process_index}.jsonl", cleanup)
        train_step = seam.around_step(train_step, process_index)     # the tests' one seam (model/runtime/seam.py)

        def save_meta() -> dict:
            """What a checkpoint carries beside the arrays; "files" is the run's listing, reused by
            a resumed run (~70 bytes per file: 350 KB for 5000)."""
            return {"fingerprint": fingerprint, "config": OmegaConf.to_container(cfg, resolve=True),
                    "wandb_id": logger.wandb_id, "process_count": process_count,
                    "num_workers": batches.num_workers, "files": listing, "rollbacks": divergence.rollbacks}

        # ------------------------------------------------------------------ loop
        cleanup.push(watchdog.exit_hook)    # runs first: a failure caused by a peer's hang exits as one
        step = start_step
        events.at(step)
        while step < cfg.train.steps:
            profile.maybe_start(step + 1)
            state, metrics = train_step(state, next(batches))
            step += 1
            meter.add(metrics)
            if step == start_step + 1:          # compilation stays out of the throughput figures
                jax.block_until_ready(metrics)
                meter.compiled(batches.stats())
                events.add("compile", step=step)
                batches.compiled(step, meter.paused_s)
            watchdog.beat(step)
            events.beat(step, metrics["loss"])      # a killed life's last steps count as lost work
            if batches.switch_due(step):            # data.num_workers=auto chooses
                jax.block_until_ready(metrics)      # the measured steps have run, not just dispatched
                with watchdog.paused():
                    rows.carry(batches.switch(step, meter.paused_s))
            profile.maybe_stop(step)
            if (rows.log_due(step) or saves.due(step)) and (rolled := divergence.check(
                    step, batches, events=events, paused=watchdog.paused, announce=is_main)):
                state, step = rolled
                continue
            rows.write(step, state["params"], batches.stats)
            stop = preempted.check(step)
            for tier in saves.due(step, preempted=stop):
                saves.save(tier, step, state, batches.saved_state(), save_meta())
            if stop:
                break
        watchdog.close()        # the last save's wait is not a step
        saves.wait()
        if preempted.fired and is_main:
            print(f"Preempted: saved step {step} to {ckpt.directory}; exiting", flush=True)
        input_stats = batches.stats()
        skipped = skipped_line(distributed.gather_json(
            {k: input_stats[k] for k in ("bad_records", "bad_examples", "dropped_by_rule")}))   # every host's

    summary = {
        "run_dir": str(s.run_dir),
        "checkpoint_dir": str(ckpt.directory),
        "start_step": start_step,
        "steps": step,
        "final_loss": rows.last.get("loss"),
        "tokens": (step - start_step) * tokens_per_step,
        "wall_s": time.perf_counter() - t_start,
        "preempted": preempted.fired,
    }
    if is_main:
        if skipped:         # beside the goodput lines (printed as the run closed)
            print(skipped, flush=True)
        print(end_line(summary, cfg.train.steps), flush=True)
    return summary


# ====================================================================== config checks
class Settings(NamedTuple):
    """The run's checked settings (check_config)."""
    run_dir: Path
    model: object                   # model/llama.py LlamaConfig
    tx: object                      # the optax optimizer
    schedule: object                # its learning-rate schedule
    data: object                    # data/config.py DataConfig (data.eval taken out)
    eval_paths: list
    holdout: int
    hang_timeout_s: float | None
    on_divergence: str
    divergence_skips: int
    warmup_notice: str | None
    eval_min_doc_tokens: int = 0    # data.eval.min_doc_tokens: the held-out documents' length bucket
    position_buckets: int = 0       # data.eval.position_buckets: the held-out loss by position


@contextlib.contextmanager
def config_errors(*kinds):
    """Mistakes of these kinds raised inside are config errors: one line from main()."""
    try:
        yield
    except kinds as e:
        raise ConfigError(str(e)) from e


def check_config(cfg: DictConfig) -> Settings:
    """Every setting checked that can be without hosts, files or devices; raises ConfigError."""
    from data.heldout import data_settings, eval_options
    from model.evals.evaluate import TasksConfig
    from model.loss import check_head
    from model.optimizer import resolve_warmup
    from model.runtime import rollback as rollback_lib
    from model.runtime.local_tier import LocalTier

    with config_errors(TypeError, ValueError):
        if cfg.train.steps <= 0:
            raise ValueError(f"train.steps={cfg.train.steps} must be positive")
        stage_start = cfg.train.get("stage_start")
        if stage_start is not None and not 0 < int(stage_start) < cfg.train.steps:
            raise ValueError(f"train.stage_start={stage_start}: the step this stage resumes at must be between 0 and "
                             f"train.steps={cfg.train.steps} (null: not a later stage)")
        hang_timeout_s = cfg.train.get("hang_timeout_s")
        if hang_timeout_s is not None and not float(hang_timeout_s) > 0:
            raise ValueError(f"train.hang_timeout_s={hang_timeout_s} must be positive (null: automatic)")
        on_divergence = cfg.train.get("on_divergence", "stop")
        divergence_skips = int(cfg.train.get("divergence_skips") or 0)
        rollback_lib.check_settings(on_divergence, divergence_skips)
        LocalTier.check_settings(cfg.checkpoint)
        check_head(cfg.train.loss_head)
        if cfg.checkpoint.get("on_damaged", "fall_back") not in ("fall_back", "stop"):
            raise ValueError(f"checkpoint.on_damaged={cfg.checkpoint.on_damaged} must be fall_back or stop")
        model_cfg, tx, schedule = model_and_optimizer(cfg)
        data_cfg, eval_paths, holdout = data_settings(OmegaConf.to_container(cfg.data, resolve=True),
                                                      cfg.tokenizer.path)
        _, _, warmup_notice = resolve_warmup(cfg.optimizer, cfg.train.steps)
        TasksConfig.from_mapping(OmegaConf.to_container(cfg.eval, resolve=True))   # eval.tasks, read later
        eval_min_doc_tokens, position_buckets = eval_options(OmegaConf.to_container(cfg.data, resolve=True).get("eval"))
    if data_cfg.seq_len > model_cfg.max_seq_len:
        raise ConfigError(f"data.seq_len={data_cfg.seq_len} exceeds model.max_seq_len={model_cfg.max_seq_len}")
    loss_chunk = int(cfg.train.loss_chunk)
    if loss_chunk < 0 or (loss_chunk and data_cfg.seq_len % loss_chunk):
        raise ConfigError(f"train.loss_chunk={loss_chunk} must divide data.seq_len={data_cfg.seq_len} "
                          "(0: the whole sequence at once)")
    if position_buckets > data_cfg.seq_len:
        raise ConfigError(f"data.eval.position_buckets={position_buckets} exceeds data.seq_len={data_cfg.seq_len}: "
                          "at most one bucket per position")
    return Settings(Path(cfg.paths.run_dir), model_cfg, tx, schedule, data_cfg, eval_paths, holdout,
                    hang_timeout_s, on_divergence, divergence_skips, warmup_notice, eval_min_doc_tokens,
                    position_buckets)


def check_plan(cfg: DictConfig, s: Settings, process_count: int, devices=None, *, hub_tokenizer: bool = True):
    """The checks that need the run's host count and devices, after check_config: the data settings
    over `process_count` hosts (the virtual shards over the hosts and their workers, the batch over
    the hosts), the tokenizer against the model (its vocabulary within model.vocab_size, its EOS, a
    BOS when data.add_bos), the mesh over `devices` (default: all) and the batch over the mesh's data
    axes and train.microbatches. Returns (the Program, nothing compiled; the tokenizer, None when
    it is a hub id and hub_tokenizer is false: not checked). train.py runs it at the run's hosts;
    scripts/compile_tpu.py at a planned slice's, over its abstract devices, before anything is rented."""
    import data as data_lib
    from data.tokenizer import tokenizer_file

    with config_errors(FileNotFoundError, ValueError):
        data_lib.validate_settings(s.data, process_count)
        tokenizer = None
        if hub_tokenizer or tokenizer_file(s.data.tokenizer) is not None:
            tokenizer = data_lib.load_tokenizer(s.data.tokenizer)
            data_lib.check_tokenizer(s.data, tokenizer, s.model.vocab_size)
        program = build_program(cfg, s.model, s.tx, devices)
    return program, tokenizer


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
                                  loss_chunk=int(cfg.train.loss_chunk), loss_head=str(cfg.train.loss_head),
                                  devices=devices, seq_len=int(cfg.data.seq_len),
                                  spikes=step_lib.SpikeConfig.from_mapping(cfg.train.get("spikes")))


# ====================================================================== CLI
@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def main(cfg: DictConfig) -> None:
    from model.runtime.distributed import exit_after_shutdown, preempted_exit_code, quiet_cpu_start

    quiet_cpu_start()           # before anything imports JAX
    from data import BadDataError
    from model.runtime.checkpoint import DamagedCheckpoint
    from model.runtime.rollback import Diverged
    from model.runtime.watchdog import EXIT_HANG, PeerHung

    # Every failure leaves through exit_after_shutdown: on several hosts, a host lost with its VM
    # would otherwise hold this one at jax.distributed's shutdown for minutes.
    try:
        summary = train(cfg)
    except (ConfigError, InterpolationResolutionError) as e:
        # One line: e.g. an unset ${oc.env:JAX_COORDINATOR_ADDRESS} (configs/experiment/gpu_multihost_llama_1b.yaml)
        # comes from OmegaConf over three.
        print(f"config error: {' '.join(str(e).split())}", file=sys.stderr)
        exit_after_shutdown(2)
    except BadDataError as e:
        # Bad data (data.strict=true, or a virtual shard without any valid document) names its
        # file and line in its message; it arrives from an input worker process as itself, and
        # the traceback would bury that one line under Grain's and our frames.
        print(f"data error: {e}", file=sys.stderr)
        exit_after_shutdown(1)
    except DamagedCheckpoint as e:
        # checkpoint.on_damaged=stop, or no step left that restores: the line says which step and why.
        print(f"checkpoint error: {e}", file=sys.stderr)
        exit_after_shutdown(1)
    except (Diverged, FloatingPointError) as e:
        # train.on_divergence: the steps and what diverged, in one line (model/runtime/rollback.py).
        print(f"diverged: {' '.join(str(e).split())}", file=sys.stderr)
        exit_after_shutdown(1)
    except PeerHung as e:
        # Another host hung and left: every host exits with the hang's code, and restarts (model/runtime/watchdog.py).
        print(f"hang: {e}", file=sys.stderr)
        exit_after_shutdown(EXIT_HANG)
    except Exception as e:
        exit_after_shutdown(1, error=e)     # one process: raised for Hydra to report, as before
    if summary.get("preempted") and (code := preempted_exit_code()):
        # Saved on a preemption: 0, or EXIT_PREEMPTED where a launcher's --restarts loop asked for it.
        sys.exit(code)


if __name__ == "__main__":
    from model.runtime.cli import compose_once

    compose_once()      # Hydra composes the config once per start, not twice (~0.5 s)
    main()

"""End to end: configs compose, `train(cfg)` trains, checkpoints, resumes, and bad input fails early.

    pytest tests/test_train.py -q
"""
import os
import subprocess
import sys

import pytest
from omegaconf import OmegaConf
from run_helpers import (
    CONFIGS,
    MICRO,
    ROOT,
    TINY_FAST,
    main_in_process,
    make_cfg,
    read_metrics,
    run_cli,
    without_device_count,
)

import train as train_mod
from tests import forked


def group_options(group):
    return sorted(p.stem for p in (CONFIGS / group).glob("*.yaml"))


# ---------------------------------------------------------------- configs compose
@pytest.mark.parametrize("group", ["model", "data", "tokenizer", "optimizer", "mesh", "checkpoint", "logger", "debug"])
def test_every_group_option_composes(group, tmp_path):
    options = group_options(group)
    assert options, f"configs/{group} is empty"
    for option in options:
        cfg = make_cfg(tmp_path, f"{group}={option}")
        # Resolving catches broken interpolations, not just YAML syntax.
        resolved = OmegaConf.to_container(cfg, resolve=True)
        # `debug` files are global deltas; the others fill their group.
        assert group == "debug" or resolved[group], (group, option)


@pytest.mark.parametrize("experiment", group_options("experiment"))
def test_every_experiment_composes(experiment, tmp_path, monkeypatch):
    # The multi-host GPU form reads its coordinator from the environment (the launcher's).
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "host0:12345")
    cfg = make_cfg(tmp_path, f"experiment={experiment}")
    resolved = OmegaConf.to_container(cfg, resolve=True)
    import data as data_lib
    from model.llama import LlamaConfig

    LlamaConfig.from_mapping(cfg.model)
    data_map = {k: v for k, v in resolved["data"].items() if k != "eval"}
    data_lib.DataConfig.from_mapping({**data_map, "tokenizer": resolved["tokenizer"]["path"]})


def test_a_start_composes_the_config_once(tmp_path):
    """model/runtime/cli.py skips the compose in Hydra's get_mode, which only reads hydra.mode: no
    config sets it, so Hydra's own answer is None, as the shortcut's is without composing; an
    override that names hydra.mode still gets Hydra's answer."""
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_config_search_path
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode

    from model.runtime import cli

    for path in CONFIGS.rglob("*.yaml"):
        node = OmegaConf.load(path)
        mode = node.get("mode") if path.parent.name == "hydra" else OmegaConf.select(node, "hydra.mode")
        assert mode is None, f"{path} sets hydra.mode: model/runtime/cli.py's shortcut would ignore it"
    hydra_app = Hydra.create_main_hydra2("train", create_config_search_path(str(CONFIGS)))
    composed = []
    compose_config = hydra_app.compose_config
    hydra_app.compose_config = lambda *a, **k: composed.append(k["overrides"]) or compose_config(*a, **k)
    composes_twice = Hydra.get_mode
    overrides = [f"paths.run_dir={tmp_path}"]
    try:
        assert hydra_app.get_mode("train", overrides) is None and composed == [overrides]   # Hydra's own
        cli.compose_once()
        assert hydra_app.get_mode("train", overrides) is None and composed == [overrides]   # nothing composed
        assert hydra_app.get_mode("train", ["hydra.mode=MULTIRUN"]) == RunMode.MULTIRUN
        assert composed[-1] == ["hydra.mode=MULTIRUN"]
    finally:
        Hydra.get_mode = composes_twice
        GlobalHydra.instance().clear()


# ---------------------------------------------------------------- the GPU host recipe
@pytest.mark.parametrize("gpus, microbatches", [(8, 2), (4, 4), (2, 8), (1, 16)])
def test_readme_gpu_overrides_build_for_their_device_count(gpus, microbatches, tmp_path):
    """docs/gpus.md: gpu_8_llama_1b with the table's train.microbatches for 1, 2 and 4 GPUs builds
    its program (mesh, shardings, batch split; no compile) on that many devices, 16 rows a GPU a pass."""
    import jax

    cfg = make_cfg(tmp_path, "experiment=gpu_8_llama_1b", f"train.microbatches={microbatches}")
    model_cfg, tx, _ = train_mod.model_and_optimizer(cfg)
    program = train_mod.build_program(cfg, model_cfg, tx, devices=jax.devices()[:gpus])
    assert program.mesh.devices.size == gpus
    assert cfg.data.global_batch_size // (microbatches * gpus) == 16


# configs/experiment/gpu_8_llama_1b.yaml with the model, data and tokenizer shrunk to the sample; the
# mesh, remat, microbatches, attention and data.num_workers=auto are the experiment's own.
GPU_SHRUNK = ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=128",
              "model.vocab_size=4096", "tokenizer=sample",
              "data.paths=[${project_root:}/data/sample/*/en_head.json.gz]",
              "data.eval.holdout_files=1", "data.seq_len=64", "data.global_batch_size=16", "data.num_shards=8",
              "train.steps=4", "train.log_every=2", "train.eval_every=0", "checkpoint.every=0",
              "logger.wandb.mode=disabled", "optimizer.warmup_steps=2"]


@pytest.mark.slow
def test_gpu_experiment_runs_on_8_fake_devices(tmp_path, capfd, monkeypatch):
    import jax

    from model import llama

    monkeypatch.setattr(llama, "_NOTICES_SHOWN", set())   # once per process: count this run's

    assert jax.device_count() == 8   # tests/conftest.py: 8 fake CPU devices, one process
    cfg = make_cfg(tmp_path, "experiment=gpu_8_llama_1b", *GPU_SHRUNK)
    assert (cfg.mesh.fsdp, cfg.model.attention, cfg.model.remat, cfg.train.microbatches) == (
        -1, "cudnn", "dots_attention", 2)
    summary = train_mod.train(cfg)
    assert summary["steps"] == 4
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [2, 4] and all(r["loss"] > 0 for r in rows)
    err = capfd.readouterr().err
    # No GPU here: cuDNN falls back to the XLA reference, and says so once.
    assert err.count("model.attention=cudnn unavailable (the devices are cpu, not NVIDIA GPUs)") == 1, err


def test_multihost_gpu_form_takes_its_coordinator_from_the_launcher(tmp_path, monkeypatch):
    overrides = ("experiment=gpu_multihost_llama_1b", "data.global_batch_size=512")
    monkeypatch.delenv("JAX_COORDINATOR_ADDRESS", raising=False)
    cfg = make_cfg(tmp_path, *overrides)
    # Unset: the run stops at start-up naming the variable, instead of every host training alone.
    with pytest.raises(Exception, match="JAX_COORDINATOR_ADDRESS"):
        _ = cfg.distributed.coordinator_address
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "host0:12345")
    cfg = make_cfg(tmp_path, *overrides, "distributed.num_processes=2", "distributed.process_id=1")
    resolved = train_mod.OmegaConf.to_container(cfg, resolve=True)
    assert resolved["distributed"] == {"coordinator_address": "host0:12345", "num_processes": 2, "process_id": 1,
                                       "local_device_count": None, "slice_index": None}
    # The single-host recipe underneath: the same model, mesh, kernel and rows per GPU.
    model, mesh = resolved["model"], resolved["mesh"]
    assert (model["d_model"], mesh["fsdp"], model["attention"]) == (2048, -1, "cudnn")
    assert resolved["name"] == "gpu_multihost_llama_1b" and resolved["data"]["seq_len"] == 2048
    # An explicit override wins over the environment.
    cfg = make_cfg(tmp_path, *overrides, "distributed.coordinator_address=10.0.0.1:999")
    assert cfg.distributed.coordinator_address == "10.0.0.1:999"


@pytest.mark.slow
def test_multihost_gpu_form_joins_two_processes_through_the_environment(tmp_path):
    """Two train.py processes x 4 fake CPU devices, the coordinator only in JAX_COORDINATOR_ADDRESS:
    one job of 8 devices (both processes write their data state into the one checkpoint)."""
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = without_device_count()
    env.update(JAX_PLATFORMS="cpu", JAX_COORDINATOR_ADDRESS=f"localhost:{port}")
    run_dir = tmp_path / "run"
    shrunk = [o for o in GPU_SHRUNK if not o.startswith("checkpoint.")]
    procs = [forked.Popen(
        [sys.executable, str(ROOT / "train.py"), "experiment=gpu_multihost_llama_1b", *shrunk,
         f"hydra.run.dir={run_dir}", f"checkpoint.dir={tmp_path}/shared_ckpt", "checkpoint.every=4",
         "data.num_workers=0", "logger.progress_bar=false", "distributed.num_processes=2",
         f"distributed.process_id={i}", "distributed.local_device_count=4"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path) for i in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outs)
    data_dir = tmp_path / "shared_ckpt" / "4" / "data"
    assert sorted(p.name for p in data_dir.glob("process_*.json")) == ["process_0-of-2.json", "process_1-of-2.json"]
    assert [r["step"] for r in read_metrics(run_dir)] == [2, 4]


# ---------------------------------------------------------------- train, resume, loss falls
@pytest.mark.slow
def test_train_checkpoints_and_resumes(tmp_path):
    run_dir = tmp_path / "run"
    first = train_mod.train(make_cfg(run_dir, *TINY_FAST, "train.steps=6"))
    assert first["start_step"] == 0 and first["steps"] == 6
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()) == ["6"]
    assert (run_dir / "config.yaml").exists()
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [4, 6]
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s", "data_wait_frac"):
        assert key in rows[0], key

    second = train_mod.train(make_cfg(run_dir, *TINY_FAST))
    assert second["start_step"] == 6 and second["steps"] == 12
    assert [r["step"] for r in read_metrics(run_dir)] == [4, 6, 8, 12]

    # Exact equivalence with an uninterrupted run (same batches, same losses) is checked with
    # killed processes in test_resume.py; here: the resumed state is the saved one, not a fresh init.
    rows = read_metrics(run_dir)
    assert rows[2]["loss"] < rows[0]["loss"]


@pytest.mark.slow
def test_loss_falls_on_the_sample(tmp_path):
    # seq 128 (the sample's 256 halved): the same fall in 30 steps (8.20 -> 6.21) at 60% of the CPU
    summary = train_mod.train(make_cfg(tmp_path, "train.steps=30", "train.log_every=5", "train.eval_every=25",
                                       "data.seq_len=128", "checkpoint.every=0", "logger.wandb.mode=offline",
                                       "data.num_workers=1"))
    rows = read_metrics(tmp_path)
    first, final = rows[0]["loss"], rows[-1]["loss"]
    assert summary["final_loss"] == final
    # A uniform guess over 4096 pieces is ln 4096 = 8.3; the sample is learnable well below that.
    assert final < first - 1.5, (first, final)
    evals = [r for r in rows if "eval_loss" in r]
    assert [r["step"] for r in evals] == [25] and evals[0]["eval_loss"] < first
    assert list((tmp_path / "wandb").glob("offline-run-*")), "wandb offline run missing"


@pytest.mark.slow
def test_a_short_run_with_its_own_held_out_files_just_works(tmp_path, capsys):
    """Two start-up conveniences in one 3-step run (they were two runs; each check is unchanged):
    - `python train.py train.steps=3` with the default 30-step warmup and decay over the run warms
      up over the first half of the run, says so in one line, and trains;
    - 3 held-out files and a batch of 16: the eval set picks a shard count that divides the batch
      instead of failing on a data.num_shards the user never set."""
    sample = "${project_root:}/data/sample"
    summary = train_mod.train(make_cfg(tmp_path, "train.steps=3", "train.log_every=1", "train.eval_every=3",
                                       "checkpoint.every=0", "logger.wandb.mode=disabled", "data.num_workers=0",
                                       "optimizer.warmup_steps=30", "optimizer.decay_steps=null",
                                       f"data.paths=['{sample}/000[0-4]/en_head.json.gz']", "data.eval.holdout_files=0",
                                       f"data.eval.paths=['{sample}/000[5-7]/en_head.json.gz']"))
    assert summary["steps"] == 3
    notes = [line for line in capsys.readouterr().out.splitlines() if "optimizer.warmup_steps" in line]
    assert notes == ["note: optimizer.warmup_steps=30 is not below train.steps=3: warming up over the first "
                     "1 steps (half the run) instead"]
    rows = read_metrics(tmp_path)
    lrs = [r["lr"] for r in rows]
    assert lrs[0] == 0.0 and lrs[1] == pytest.approx(3.0e-3) and 0 < lrs[2] < lrs[1]
    assert [r["step"] for r in rows if "eval_loss" in r] == [3] and rows[-1]["eval_loss"] > 0


# ---------------------------------------------------------------- bad input fails in one line
BAD_CONFIGS = [
    (["data.paths=[/nonexistent/dir/*.json.gz]"], "data.paths"),
    (["tokenizer.path=/nonexistent/tokenizer.json"], "tokenizer.path"),
    (["data.global_batch_size=15"], "global_batch_size"),
    (["data.eval.holdout_files=0", "data.eval.paths=[${project_root:}/data/sample/0003/en_head.json.gz]"], "overlaps"),
    (["data.num_workers=8"], "data.num_shards"),
    (["data.num_workers=many"], "data.num_workers='many': must be an integer >= 0 or auto"),
    (["data.paths=@/nonexistent/train_files.txt"],
     "data.paths: cannot read the file list @/nonexistent/train_files.txt"),
    # An explicit decay shorter than the warmup is a mistake, not a smoke run.
    (["train.steps=5", "optimizer.decay_steps=20"], "optimizer.warmup_steps=30 must be below optimizer.decay_steps=20"),
    (["checkpoint.on_damaged=ignore"], "checkpoint.on_damaged=ignore must be fall_back or stop"),
    (["train.spikes.enabled=true", "train.spikes.min_steps=1"], "train.spikes: need window >= 2, 2 <= min_steps"),
    # train.py's check_plan (scripts/compile_tpu.py runs the same before a slice is rented)
    (["model.vocab_size=1000"], "model.vocab_size=1000 is smaller than the tokenizer's 4096 pieces"),
    (["train.loss_chunk=100"], "train.loss_chunk=100 must divide data.seq_len=256"),
    (["train.loss_head=twice"], "train.loss_head='twice': expected once or per_chunk"),
]


def assert_nothing_started(run_dir):
    # Nothing expensive started: no checkpoint, no metrics.
    assert not (run_dir / "checkpoints").exists()
    assert not (run_dir / "metrics.jsonl").exists()


@pytest.mark.parametrize("overrides, needle", BAD_CONFIGS)
def test_bad_config_fails_fast_with_one_line(tmp_path, capsys, overrides, needle):
    # in-process (run_helpers.main_in_process); the test below runs two on the command line
    code, lines = main_in_process(capsys, tmp_path / "run", *overrides)
    assert code == 2
    assert len(lines) == 1 and lines[0].startswith("config error:") and needle in lines[0], lines
    assert_nothing_started(tmp_path / "run")


@pytest.mark.slow
@pytest.mark.parametrize("overrides, needle", [
    BAD_CONFIGS[2],
    # Hydra's own check, before main runs
    (["data.nonsense_key=1"], "nonsense_key"),
])
def test_bad_config_on_the_command_line_fails_with_one_line(tmp_path, overrides, needle):
    result = run_cli(tmp_path, *overrides)
    assert result.returncode != 0
    assert needle in result.stderr, result.stderr
    assert_nothing_started(tmp_path / "run")


@pytest.mark.slow
def test_multihost_gpu_experiment_without_its_coordinator_is_one_line(tmp_path, monkeypatch):
    # configs/experiment/gpu_multihost_llama_1b.yaml reads ${oc.env:JAX_COORDINATOR_ADDRESS}.
    monkeypatch.delenv("JAX_COORDINATOR_ADDRESS", raising=False)
    result = run_cli(tmp_path, "experiment=gpu_multihost_llama_1b")
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("config error:") and "JAX_COORDINATOR_ADDRESS" in errors[0], errors


@pytest.mark.slow
def test_a_cpu_start_with_libtpu_installed_prints_no_tpu_warnings(tmp_path):
    # CI's venv has libtpu (.[tpu]) on a machine without a TPU: JAX_PLATFORMS unset, a mistake
    # found after JAX has started must still print one line, with none of libtpu's warnings.
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    result = subprocess.run([sys.executable, str(ROOT / "train.py"), f"hydra.run.dir={tmp_path}/run",
                             "logger.wandb.mode=disabled", "data.global_batch_size=15"],
                            capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1 and "global_batch_size" in lines[0], result.stderr[-3000:]


@pytest.mark.slow
def test_compile_cache_keeps_the_programs_and_null_turns_it_off(tmp_path, monkeypatch):
    """paths.compile_cache: a run writes its compiled programs there (a restart loads them,
    with the same losses); null writes none."""
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")   # else JAX's own setting names the cache
    monkeypatch.setenv("HOME", str(tmp_path / "home"))   # where the default (~/.cache/...) would go
    cache = tmp_path / "xla"
    for d in "abc":
        (tmp_path / d).mkdir()
    args = [*MICRO, "data.seq_len=64", "train.steps=4", "train.log_every=2", "checkpoint.every=0", "data.num_workers=0",
            "optimizer.warmup_steps=1", "train.eval_every=0", f"paths.compile_cache={cache}"]
    first = run_cli(tmp_path / "a", *args)
    assert first.returncode == 0, first.stderr[-2000:]
    kept = sorted(os.listdir(cache))
    assert kept, "no compiled program was kept"
    again = run_cli(tmp_path / "b", *args)
    assert again.returncode == 0, again.stderr[-2000:]
    assert [r["loss"] for r in read_metrics(tmp_path / "a" / "run")] == \
        [r["loss"] for r in read_metrics(tmp_path / "b" / "run")]
    assert sorted(os.listdir(cache)) == kept, "the second start compiled its programs again"
    # null: the run's setting (train.py hands it to use_compile_cache before its first compile)
    # keeps nothing, in the default place either. A program compiled after it, in a fresh process
    # (JAX opens its cache once); a whole third run would only compile the same programs again.
    script = ("import sys; sys.path.insert(0, sys.argv[1]); from tests.run_helpers import make_cfg; "
              "from model.runtime.distributed import use_compile_cache; import jax, jax.numpy as jnp; "
              "cfg = make_cfg(sys.argv[2], 'paths.compile_cache=null'); "
              "assert cfg.paths.compile_cache is None; use_compile_cache(cfg.paths.compile_cache); "
              "print(jax.jit(lambda x: jnp.sin(x) * 2)(jnp.arange(3.0)))")
    off = subprocess.run([sys.executable, "-c", script, str(ROOT), str(tmp_path / "c")], capture_output=True,
                         text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=300)
    assert off.returncode == 0, off.stderr[-2000:]
    assert not (tmp_path / "home" / ".cache").exists(), "null still kept programs (in the default place)"

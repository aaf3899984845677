"""End to end: configs compose, `train(cfg)` trains, checkpoints, resumes, and bad input fails early.

    pytest tests/test_train.py -q
"""

import pytest
from omegaconf import OmegaConf
from run_helpers import CONFIGS, TINY_FAST, make_cfg, read_metrics, run_cli

import train as train_mod


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
def test_every_experiment_composes(experiment, tmp_path):
    cfg = make_cfg(tmp_path, f"experiment={experiment}")
    resolved = OmegaConf.to_container(cfg, resolve=True)
    import data as data_lib
    from model.llama import LlamaConfig

    LlamaConfig.from_mapping(cfg.model)
    data_map = {k: v for k, v in resolved["data"].items() if k != "eval"}
    data_lib.DataConfig.from_mapping({**data_map, "tokenizer": resolved["tokenizer"]["path"]})


# ---------------------------------------------------------------- train, resume, loss falls
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


def test_loss_falls_on_the_sample(tmp_path):
    summary = train_mod.train(make_cfg(tmp_path, "train.steps=60", "train.log_every=10", "checkpoint.every=0",
                                       "logger.wandb.mode=offline", "data.num_workers=1"))
    rows = read_metrics(tmp_path)
    first, final = rows[0]["loss"], rows[-1]["loss"]
    assert summary["final_loss"] == final
    # A uniform guess over 4096 pieces is ln 4096 = 8.3; the sample is learnable well below that.
    assert final < first - 1.5, (first, final)
    evals = [r for r in rows if "eval_loss" in r]
    assert [r["step"] for r in evals] == [50] and evals[0]["eval_loss"] < first
    assert list((tmp_path / "wandb").glob("offline-run-*")), "wandb offline run missing"


def test_a_run_shorter_than_the_warmup_just_works(tmp_path, capsys):
    # `python train.py train.steps=3` with the default 30-step warmup and decay over the run:
    # warms up over the first half of the run, says so in one line, and trains.
    summary = train_mod.train(make_cfg(tmp_path, "train.steps=3", "train.log_every=1", "train.eval_every=0",
                                       "checkpoint.every=0", "logger.wandb.mode=disabled", "data.num_workers=0",
                                       "optimizer.warmup_steps=30", "optimizer.decay_steps=null"))
    assert summary["steps"] == 3
    notes = [line for line in capsys.readouterr().out.splitlines() if "optimizer.warmup_steps" in line]
    assert notes == ["note: optimizer.warmup_steps=30 is not below train.steps=3: warming up over the first "
                     "1 steps (half the run) instead"]
    lrs = [r["lr"] for r in read_metrics(tmp_path)]
    assert lrs[0] == 0.0 and lrs[1] == pytest.approx(3.0e-3) and 0 < lrs[2] < lrs[1]


# ---------------------------------------------------------------- bad input fails in one line
@pytest.mark.parametrize("overrides, needle", [
    (["data.paths=[/nonexistent/dir/*.json.gz]"], "data.paths"),
    (["tokenizer.path=/nonexistent/tokenizer.json"], "tokenizer.path"),
    (["data.global_batch_size=15"], "global_batch_size"),
    (["data.nonsense_key=1"], "nonsense_key"),
    (["data.eval.holdout_files=0", "data.eval.paths=[${project_root:}/data/sample/0003/en_head.json.gz]"], "overlaps"),
    (["data.num_workers=8"], "data.num_shards"),
    (["data.num_workers=many"], "data.num_workers='many': must be an integer >= 0 or auto"),
    (["data.paths=@/nonexistent/train_files.txt"],
     "data.paths: cannot read the file list @/nonexistent/train_files.txt"),
    # An explicit decay shorter than the warmup is a mistake, not a smoke run.
    (["train.steps=5", "optimizer.decay_steps=20"], "optimizer.warmup_steps=30 must be below optimizer.decay_steps=20"),
    (["checkpoint.on_damaged=ignore"], "checkpoint.on_damaged=ignore must be fall_back or stop"),
    (["train.spikes.enabled=true", "train.spikes.min_steps=1"], "train.spikes: need window >= 2, 2 <= min_steps"),
])
def test_bad_config_fails_fast_with_one_line(tmp_path, overrides, needle):
    result = run_cli(tmp_path, *overrides)
    assert result.returncode != 0
    assert needle in result.stderr, result.stderr
    # Nothing expensive started: no checkpoint, no metrics.
    assert not (tmp_path / "run" / "checkpoints").exists()
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_eval_files_need_not_divide_the_batch(tmp_path):
    # 3 held-out files and a batch of 16: the eval set picks a shard count that divides the batch
    # instead of failing on a data.num_shards the user never set.
    sample = "${project_root:}/data/sample"
    train_mod.train(make_cfg(tmp_path, *TINY_FAST, "train.steps=3", "train.log_every=3", "train.eval_every=3",
                             f"data.paths=['{sample}/000[0-4]/en_head.json.gz']", "data.eval.holdout_files=0",
                             f"data.eval.paths=['{sample}/000[5-7]/en_head.json.gz']"))
    [row] = read_metrics(tmp_path)
    assert row["eval_loss"] > 0

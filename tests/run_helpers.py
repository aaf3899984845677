"""Helpers the tests of whole runs share: the composed config, a CLI run, the metrics it wrote."""
import json
import os
import subprocess
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"

# A short run of the tiny model that still logs, checkpoints and resumes.
TINY_FAST = ["train.steps=12", "train.log_every=4", "checkpoint.every=6", "logger.wandb.mode=disabled",
             "data.num_workers=0", "optimizer.warmup_steps=2"]


def make_cfg(run_dir, *overrides):
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose("train", overrides=[f"paths.run_dir={run_dir}", "logger.progress_bar=false", *overrides])


def read_metrics(run_dir):
    with open(Path(run_dir) / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def run_cli(tmp_path, *overrides):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, str(ROOT / "train.py"), f"hydra.run.dir={tmp_path}/run",
                           "logger.wandb.mode=disabled", *overrides],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)

"""The context-extension recipe of docs/long-context.md "Extend the context", as a user runs it: the
page's two commands (stage 1 at 256 x 16 on configs/data/sample_buckets.yaml, stage 2 the same run
resumed with experiment=sample_extend_1024), read from the page and shortened by a few overrides.

    pytest -n0 tests/test_extend_recipe.py -q        (~3 min on 2 shared cores)

The figures that say the extension took (loss by position against a control) are
scripts/bench/bench_extend.py's, in BENCHMARKS.md.
"""
import json
import re
import shlex
import sys
from pathlib import Path

import pytest

import train  # noqa: F401 - registers ${project_root:}
from tests import forked
from tests.run_helpers import make_cfg, without_device_count

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "long-context.md"
K, N = 4, 8           # stage 1's steps; stage 2's last step
SHORT = ["logger.wandb.mode=disabled", "logger.progress_bar=false", "data.num_workers=0", "train.log_every=2"]


def recipe() -> list[list[str]]:
    """The overrides of each `python train.py` line of the section's first bash block."""
    section = PAGE.read_text().split("\n## Extend the context\n", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    lines = [shlex.split(line, comments=True) for line in block.splitlines()]
    return [args[2:] for args in lines if args[:2] == ["python", "train.py"]]


def share(sources, name: str) -> float:
    return next(s.weight for s in sources if s.name == name) / sum(s.weight for s in sources)


def test_the_stages_keep_tokens_per_step_raise_the_base_and_weigh_long_documents_up(tmp_path):
    stage1, stage2 = (make_cfg(tmp_path, *args) for args in recipe())
    assert stage1.name == stage2.name
    assert stage1.data.seq_len * stage1.data.global_batch_size == stage2.data.seq_len * stage2.data.global_batch_size
    assert (stage1.data.seq_len, stage2.data.seq_len) == (256, 1024) == (stage1.model.max_seq_len,
                                                                        stage2.model.max_seq_len)
    assert stage2.model.rope_theta == 4 * stage1.model.rope_theta
    assert stage1.train.steps < stage2.train.steps == stage1.optimizer.decay_steps == stage2.optimizer.decay_steps
    assert stage2.train.stage_start == stage1.train.steps and stage1.train.stage_start is None
    # the same buckets, long documents' share of the rows raised
    assert [(s.name, list(s.paths), s.get("min_tokens", 0), s.get("max_tokens", 0)) for s in stage1.data.sources] == \
        [(s.name, list(s.paths), s.get("min_tokens", 0), s.get("max_tokens", 0)) for s in stage2.data.sources]
    assert (share(stage1.data.sources, "long"), share(stage2.data.sources, "long")) == (0.25, 0.75)
    assert stage2.data.eval.min_doc_tokens > stage2.data.seq_len


@pytest.mark.slow
def test_the_recipe_runs_as_documented(tmp_path):
    """Stage 2 resumes stage 1's run and says what changed; its held-out rows carry the loss by
    position over rows of 1024 and the passkey cells at the end."""
    stage1, stage2 = recipe()
    # One device, as on a laptop: stage 2's 4 rows over the suite's 8 would not divide.
    env = {**without_device_count(), "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    run_dir = tmp_path / "run"

    def launch(*args: str, rc: int = 0) -> str:
        r = forked.run([sys.executable, str(ROOT / "train.py"), f"hydra.run.dir={run_dir}", *args, *SHORT],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
        assert r.returncode == rc, r.stdout[-3000:] + r.stderr[-3000:]
        return r.stdout + r.stderr

    # stage 2 before stage 1 stops in one line (train.stage_start), nothing trained, no checkpoint left
    stage2_short = (*stage2, f"train.steps={N}", f"train.stage_start={K}")
    early = launch(*stage2_short, rc=2)
    assert f"config error: train.stage_start={K}: this stage continues the run from its step {K}" in early, early
    assert not (run_dir / "checkpoints").exists()
    launch(*stage1, f"train.steps={K}")
    out = launch(*stage2_short, "train.eval_every=2", "train.eval_batches=1", "eval.passkey.samples=1")
    assert f"Resuming from latest checkpoint {run_dir}/checkpoints/{K} at step {K}" in out, out
    assert "data.mixture_change=continue: source short share 0.75 -> 0.25; source long share 0.25 -> 0.75" in out
    assert ("data.seq_len 256 -> 1024, data.global_batch_size 16 -> 4, model.max_seq_len 256 -> 1024, "
            "model.rope_theta 10000.0 -> 40000.0: continuing the data (data.shape_change=continue)") in out, out
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for step, want in ((K, 0.25), (N, 0.75)):   # rows counted from each start: 64 in stage 1, 16 in stage 2
        last = next(r for r in rows if r["step"] == step)
        assert last["data/source/long/rows"] == want * last["data/rows"], last
    evals = [r for r in rows if "eval_loss" in r]
    assert [r["step"] for r in evals] == list(range(K + 2, N + 1, 2))
    for r in evals:   # positions 0-255, 256-511, 512-767, 768-1023, each measured
        assert sorted(k for k in r if k.startswith("eval_loss_pos/")) == [f"eval_loss_pos/{i:02d}" for i in range(4)]
        assert all(0 < r[f"eval_loss_pos/{i:02d}"] < 10 for i in range(4)), r
    cells = {f"tasks/passkey/acc_len{n}_depth{d}" for n in (256, 1024) for d in (0, 50, 100)}
    assert cells <= set(evals[-1]) and not any(k.startswith("tasks/") for r in evals[:-1] for k in r)

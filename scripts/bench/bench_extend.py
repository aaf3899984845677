"""Context extension, measured: the tiny model trained at seq 256, then extended to 1024 as
configs/experiment/sample_extend_1024.yaml does (rope_theta x4, long documents weighed up), against a
control that keeps training at 256 for the same steps. The held-out loss by position in the document
(eval_loss_pos/00..03: positions 0-255, 256-511, 512-767, 768-1023 of held-out documents of 1025+
tokens, in rows of 1024) from each run's metrics.jsonl. Every run is `python train.py` in a subprocess.

  python scripts/bench/bench_extend.py --out /tmp/bench_extend [--stage1 200 --stage2 100] [--yarn]

Run again with the same --out, it keeps the runs that finished (the table is read from their files).

  stage 1     data=sample_buckets, --stage1 steps at 256 x 16 (one cosine over both stages)
  extended    stage 1 resumed with experiment=sample_extend_1024 for --stage2 steps (1024 x 4, rope_theta 40000,
              long 3:1): evaluated every --stage2 / 2 steps
  control     a copy of stage 1 resumed at 256 x 16 for the same steps, the same mixture change
  yarn        (--yarn) as extended, rope_theta kept and YaRN (factor 4, original 256) instead
A run's parameters are evaluated at 1024 without training by a probe: a copy of its directory resumed
at 1024 x 4 (the RoPE fields given) for one step at optimizer.lr=0 (AdamW's update, weight decay
included, is lr times something: the parameters stay), evaluated at that step. Probes: stage 1 as
it is (rope_theta 10000), stage 1 at rope_theta 40000 (right after the switch; with --yarn, with YaRN
too), the control at the end (rope_theta 10000). The LAST printed line is one JSON object of every row.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXPERIMENT = "sample_extend_1024"
QUIET = ["logger.progress_bar=false", "logger.wandb.mode=disabled"]
EVAL = ["data.eval.min_doc_tokens=1025", "data.eval.position_buckets=4"]
# The experiment's 1024 x 4 shape with stage 1's mixture and RoPE (a probe overrides the fields it tests).
AT_1024 = [f"experiment={EXPERIMENT}", "data.sources.0.weight=3", "data.sources.1.weight=1",
           "model.rope_theta=10000.0", "eval.passkey.lengths=[]"]
# The control's stage 2: the experiment's data change at stage 1's shape and RoPE.
AT_256 = [f"experiment={EXPERIMENT}", "data.seq_len=256", "data.global_batch_size=16", "model.max_seq_len=256",
          "model.rope_theta=10000.0", "eval.passkey.lengths=[]", "train.eval_every=0"]
YARN = ["model.rope_theta=10000.0", "model.rope_type=yarn", "model.rope_factor=4", "model.rope_original_max_len=256"]
BUCKETS = ("0-255", "256-511", "512-767", "768-1023")


def train(run_dir: Path, last: int, *overrides: str, log: Path, start_from: Path | None = None) -> float | None:
    """`python train.py` in `run_dir` (its checkpoints there too; a copy of `start_from` first) up to
    step `last`; its output to `log`; seconds. A run that has its checkpoint `last` already (an earlier
    invocation with the same --out) is kept: None."""
    if (run_dir / "checkpoints" / str(last)).is_dir():
        return None
    if run_dir.exists():
        shutil.rmtree(run_dir)          # cut short: again from its start
    if start_from is not None:
        shutil.copytree(start_from, run_dir)
    cmd = [sys.executable, str(ROOT / "train.py"), f"hydra.run.dir={run_dir}", *QUIET, *overrides]
    t0 = time.perf_counter()
    with open(log, "a") as out:
        out.write("$ " + " ".join(cmd) + "\n")
        out.flush()
        rc = subprocess.run(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}).returncode
    if rc:
        sys.exit(f"train.py exited {rc} in {run_dir}: see {log}")
    return time.perf_counter() - t0


def eval_row(run_dir: Path, step: int) -> dict:
    """metrics.jsonl's row with the held-out loss at `step` (the last such, a probe's copy included)."""
    rows = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if r.get("step") == step and "eval_loss" in r]
    if not rows:
        sys.exit(f"{run_dir}/metrics.jsonl: no eval_loss at step {step}")
    return rows[-1]


def probe(src: Path, dst: Path, step: int, *rope: str, log: Path) -> dict:
    """src's parameters at `step` evaluated in rows of 1024 with the RoPE fields `rope`."""
    train(dst, step + 1, *AT_1024, *rope, *EVAL, "data.shape_change=continue", "optimizer.lr=0",
          f"train.steps={step + 1}", "train.eval_every=1", f"optimizer.decay_steps={step + 1}", log=log,
          start_from=src)
    return eval_row(dst, step + 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="a new directory for the runs")
    ap.add_argument("--stage1", type=int, default=200, help="steps at 256 x 16")
    ap.add_argument("--stage2", type=int, default=100, help="steps after the switch (even)")
    ap.add_argument("--eval-batches", type=int, default=8, help="held-out batches of 4 rows of 1024")
    ap.add_argument("--yarn", action="store_true", help="also extend with YaRN instead of rope_theta")
    args = ap.parse_args()
    s1, s2, total = args.stage1, args.stage2, args.stage1 + args.stage2
    if s2 % 2 or s1 % (s2 // 2):
        ap.error("--stage2 must be even and --stage1 a multiple of half of it (the extended run's evaluations)")
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "train.log"
    schedule = [f"optimizer.decay_steps={total}", f"train.eval_batches={args.eval_batches}"]
    seconds = {}

    stage1 = args.out / "stage1"
    seconds["stage 1"] = train(stage1, s1, f"name={EXPERIMENT}", "data=sample_buckets", f"train.steps={s1}",
                               "train.eval_every=0", *schedule, log=log)
    rows = {"stage 1, rope_theta 10000": probe(stage1, args.out / "probe_stage1", s1, log=log),
            "stage 1, rope_theta 40000 (the switch)": probe(stage1, args.out / "probe_switch", s1,
                                                            "model.rope_theta=40000.0", log=log)}
    if args.yarn:
        rows["stage 1, YaRN x4 (the other switch)"] = probe(stage1, args.out / "probe_yarn", s1, *YARN, log=log)
    arms = {"extended": []} | ({"yarn": YARN} if args.yarn else {})
    for arm, rope in arms.items():
        run_dir = args.out / arm
        seconds[arm] = train(run_dir, total, f"experiment={EXPERIMENT}", f"train.steps={total}",
                             f"train.eval_every={s2 // 2}", *schedule, *EVAL, *rope, log=log, start_from=stage1)
        label = "rope_theta 40000" if arm == "extended" else "YaRN x4"
        for step in (s1 + s2 // 2, total):
            rows[f"{arm} ({label}), +{step - s1} steps at 1024"] = eval_row(run_dir, step)
    control = args.out / "control"
    seconds["control"] = train(control, total, *AT_256, f"train.steps={total}", *schedule, log=log,
                               start_from=stage1)
    rows[f"control, +{s2} steps at 256, rope_theta 10000"] = probe(control, args.out / "probe_control", total,
                                                                   log=log)

    print(f"{'parameters (evaluated in rows of 1024)':<52} {'all':>6} " + " ".join(f"{b:>8}" for b in BUCKETS))
    table = {}
    for label, r in rows.items():
        pos = [r.get(f"eval_loss_pos/{i:02d}") for i in range(len(BUCKETS))]
        table[label] = {"eval_loss": r["eval_loss"], **dict(zip(BUCKETS, pos, strict=True)),
                        **{k: v for k, v in r.items() if k.startswith("tasks/passkey/acc")}}
        print(f"{label:<52} {r['eval_loss']:6.3f} " + " ".join(f"{p:8.3f}" for p in pos))
    print("seconds: " + ", ".join(f"{k} {'(kept)' if v is None else f'{v:.0f}'}" for k, v in seconds.items()))
    print(json.dumps({"stage1": s1, "stage2": s2, "rows": table, "seconds": seconds}))


if __name__ == "__main__":
    main()

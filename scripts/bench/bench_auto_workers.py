#!/usr/bin/env python3
"""data.num_workers=auto against fixed worker counts: real `train.py` runs, one per setting.

Each run trains the same model on the same data for --steps steps (no evaluation, no
checkpoints) and is read back from its metrics.jsonl: for auto, the count it chose and its
figures; for every run, data_wait_frac and tokens/s over the log rows after auto's decision
(the same steps for every setting, so the compile, the provisional pipeline and the switch
stay out of the comparison; the switch's own stall is printed apart).

    python scripts/bench/bench_auto_workers.py                                     # the bundled sample
    python scripts/bench/bench_auto_workers.py --settings auto,0,1,2 --steps 60 -- data.seq_len=512

Arguments after `--` are Hydra overrides for every run. Prints one line per run, then a table.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from train import PROJECT_ROOT as ROOT  # the project is installed editable


def run(setting: str, steps: int, log_every: int, measure: int, overrides: list[str], out: Path) -> dict:
    run_dir = out / f"workers_{setting}"
    cmd = [sys.executable, str(ROOT / "train.py"), f"hydra.run.dir={run_dir}", f"name=bench_{setting}",
           f"train.steps={steps}", f"train.log_every={log_every}", "train.eval_every=0", "checkpoint.every=0",
           "logger.wandb.mode=disabled", "logger.progress_bar=false", f"data.num_workers={setting}",
           f"data.auto_measure_steps={measure}", *overrides]
    t0 = time.perf_counter()
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=out, env=env)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"workers={setting}: train.py failed\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    line = next((x for x in proc.stdout.splitlines() if x.startswith("data.num_workers=auto: ") and "(" in x
                 and "starting with" not in x), "")
    return {"setting": setting, "rows": rows, "wall_s": wall, "line": line}


def after(rows: list[dict], first_step: int) -> dict:
    """data_wait_frac (wait over wall, pooled) and tokens/s over the log rows past first_step."""
    prev = {b["step"]: a["step"] for a, b in zip(rows, rows[1:], strict=False)}
    kept = [(r, r["step"] - prev[r["step"]]) for r in rows
            if r["step"] > first_step and r["step"] in prev and r.get("step_time_s")]
    wall = sum(r["step_time_s"] * n for r, n in kept)
    wait = sum(r["data_wait_frac"] * r["step_time_s"] * n for r, n in kept)
    tokens = sum(r["tokens_per_s"] * r["step_time_s"] * n for r, n in kept)
    return {"steps": sum(n for _, n in kept), "wait_frac": wait / wall if wall else float("nan"),
            "tokens_per_s": tokens / wall if wall else float("nan"),
            "worst_wait_frac": max((r["data_wait_frac"] for r, _ in kept), default=float("nan"))}


def main() -> None:
    from model.runtime.distributed import quiet_cpu_start

    quiet_cpu_start()   # no libtpu warnings on a machine without a TPU (JAX_PLATFORMS, if set, wins)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--settings", default="auto,0,1,2", help="comma-separated: auto and worker counts")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--measure", type=int, default=8, help="data.auto_measure_steps")
    ap.add_argument("--out", default=None, help="run directories (default: a temporary one)")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for every run (after --)")
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="bench_auto_"))
    out.mkdir(parents=True, exist_ok=True)
    # Compared from the first log row past auto's decision (step 1 + measure), in every run.
    first = -(-(1 + args.measure + 1) // args.log_every) * args.log_every
    results = []
    for setting in args.settings.split(","):
        r = run(setting.strip(), args.steps, args.log_every, args.measure, args.overrides, out)
        r.update(after(r["rows"], first))
        auto = next((row for row in r["rows"] if "data/auto_num_workers" in row), None)
        r["chosen"] = auto["data/auto_num_workers"] if auto else None
        results.append(r)
        print(f"workers={r['setting']}: {r['steps']} steps past step {first}: data_wait_frac "
              f"{r['wait_frac']:.4f} (worst row {r['worst_wait_frac']:.4f}), "
              f"{r['tokens_per_s']:,.0f} tokens/s, "
              f"wall {r['wall_s']:.0f} s" + (f"\n  {r['line']}" if r["line"] else ""), flush=True)
    print(f"\n| setting | workers | data_wait_frac (steps {first + 1}-{args.steps}) | worst row | tokens/s |")
    print("| --- | --- | --- | --- | --- |")
    for r in results:
        n = r["chosen"] if r["setting"] == "auto" else r["setting"]
        print(f"| {r['setting']} | {n} | {r['wait_frac']:.4f} | {r['worst_wait_frac']:.4f} "
              f"| {r['tokens_per_s']:,.0f} |")


if __name__ == "__main__":
    main()

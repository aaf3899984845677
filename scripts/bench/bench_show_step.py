"""How long `scripts/show_step.py` takes to answer, as a user runs it. The LAST printed line is
one JSON object.

  python ../shared/bench/make_corpus.py /tmp/ss/bench --shards 8 --docs 2000
  python train.py hydra.run.dir=/tmp/ss/benchrun logger.wandb.mode=disabled \
      "data.paths=['/tmp/ss/bench/*/en_head.json.gz']" data.eval.holdout_files=0 \
      tokenizer.path=$PWD/../shared/bench/llama_style_tokenizer.json model.vocab_size=32000 \
      model.max_seq_len=1024 model.d_model=32 model.n_layers=1 model.d_ff=64 model.n_heads=2 \
      model.n_kv_heads=1 data.seq_len=1024 data.global_batch_size=16 data.num_shards=8 \
      data.num_workers=1 train.loss_chunk=256 train.steps=100 checkpoint.every=50 train.eval_every=0
  python scripts/bench/bench_show_step.py /tmp/ss/benchrun --steps 100,51,50,1 --reps 3

Each measurement is the whole command in a fresh process (imports, checkpoint reads, file
listing and fingerprint, the replay, reading the documents' first characters): per step, the
whole global batch and one row (`--row`), best and worst of --reps. Step c + 1 right after a
checkpoint c replays nothing; step c + every (the next checkpoint's step) replays every - 1
batches from c: the deepest replay of the run.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from train import PROJECT_ROOT  # the repo root (the project is installed editable)

SCRIPT = PROJECT_ROOT / "scripts" / "show_step.py"


def timed(run_dir: str, step: int, row: int | None) -> tuple[float, dict]:
    cmd = [sys.executable, str(SCRIPT), run_dir, "--step", str(step), "--json"]
    if row is not None:
        cmd += ["--row", str(row)]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        raise SystemExit(f"show_step failed: {res.stderr.strip()}")
    return wall, json.loads(res.stdout)


def main(argv=None) -> int:
    from model.runtime.distributed import quiet_cpu_start

    quiet_cpu_start()   # no libtpu warnings on a machine without a TPU (JAX_PLATFORMS, if set, wins)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir")
    ap.add_argument("--steps", default="100,51,1", help="comma-separated global steps")
    ap.add_argument("--row", type=int, default=0, help="the row timed alone")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    out = {}
    for step in (int(s) for s in args.steps.split(",")):
        for row in (None, args.row):
            walls, res = [], None
            for _ in range(args.reps):
                wall, res = timed(args.run_dir, step, row)
                walls.append(wall)
            key = f"step_{step}" + ("_all_rows" if row is None else f"_row_{row}")
            out[key] = {"best_s": round(min(walls), 2), "worst_s": round(max(walls), 2),
                        "replayed_batches": res["replayed_batches"], "from_step": res["from_step"],
                        "rows": len(res["rows"])}
            print(f"{key:24s} best {min(walls):6.2f} s  worst {max(walls):6.2f} s  "
                  f"(from step {res['from_step']}, {res['replayed_batches']} batches replayed, "
                  f"{len(res['rows'])} rows)", flush=True)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""File-system calls per data file of a short `train.py` run, counted by strace (issue #13 §2).

Runs train.py (this checkout, or --code DIR: another checkout, e.g. an older commit exported
with `git archive`) under `strace -f -e trace=%file`, every process followed, and sorts each
system call that names a file of the corpus: metadata calls (stat family, access, readlink)
and opens. A second run resumes the first (one more step), to show what a resumed run costs.

    python ../shared/bench/make_corpus.py /tmp/c5000 --shards 5000 --docs 4   # 5000 tiny files
    python scripts/bench/bench_listing.py /tmp/c5000 --out /tmp/listing/run5000
    python scripts/bench/bench_listing.py /tmp/c5000 --out /tmp/listing/old5000 --code /tmp/listing/before

Prints one line per run and the figures as JSON. Needs strace (apt-get install strace).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from train import PROJECT_ROOT as ROOT  # the project is installed editable

# System calls that read a file's metadata without reading the file.
METADATA = {"stat", "lstat", "newfstatat", "fstatat64", "statx", "access", "faccessat", "faccessat2",
            "readlink", "readlinkat"}
OPEN = {"open", "openat", "openat2"}
_CALL = re.compile(r'^(?:\[pid\s+\d+\]\s+)?(?:\d+\s+)?(\w+)\((?:AT_FDCWD|\d+)?,?\s*"([^"]*)"')


def count(trace: Path, corpus: str, n_files: int) -> dict:
    """Calls on the corpus's files (per file: over all n_files); directory opens (listing)
    separately."""
    per_file: dict = collections.defaultdict(collections.Counter)
    dir_reads = 0
    with open(trace, errors="replace") as f:
        for line in f:
            m = _CALL.match(line)
            if not m or not m.group(2).startswith(corpus):
                continue
            call, path = m.groups()
            if call in OPEN and "O_DIRECTORY" in line:
                dir_reads += 1
            elif call in METADATA:
                per_file[path]["metadata"] += 1
            elif call in OPEN:
                per_file[path]["open"] += 1
    files = [p for p in per_file if p.endswith((".json.gz", ".jsonl", ".jsonl.zst"))]
    meta = [per_file[p]["metadata"] for p in files]
    opens = [per_file[p]["open"] for p in files]
    n = max(1, n_files)
    return {"files_seen": len(files), "metadata_calls": sum(meta), "metadata_per_file": sum(meta) / n,
            "max_metadata_one_file": max(meta, default=0), "opens": sum(opens), "opens_per_file": sum(opens) / n,
            "directory_reads": dir_reads}


def run(code: Path, corpus: str, run_dir: Path, steps: int, trace: Path) -> None:
    overrides = [f"hydra.run.dir={run_dir}", f"paths.run_dir={run_dir}", f"train.steps={steps}",
                 f"data.paths=['{corpus}/*/en_head.json.gz']", "data.num_shards=4", "data.num_workers=1",
                 "train.log_every=1", "train.eval_every=1", "train.eval_batches=1",
                 # Older checkouts refuse a run shorter than the warmup (issue #13 §6).
                 "optimizer.warmup_steps=1",
                 "logger.wandb.mode=disabled", "logger.progress_bar=false"]
    cmd = ["strace", "-f", "-qq", "-e", "trace=%file", "-o", str(trace),
           sys.executable, str(code / "train.py"), *overrides]
    env = {**os.environ, "PYTHONPATH": str(code), "JAX_PLATFORMS": "cpu"}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=run_dir.parent, timeout=1800)
    if res.returncode:
        sys.exit(f"train.py failed:\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}")


def main() -> None:
    from model.runtime.distributed import quiet_cpu_start

    quiet_cpu_start()   # no libtpu warnings on a machine without a TPU (JAX_PLATFORMS, if set, wins)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("corpus", help="directory of */en_head.json.gz files")
    ap.add_argument("--out", required=True, help="scratch directory (run dir, traces); emptied first")
    ap.add_argument("--code", default=str(ROOT), help="checkout whose train.py runs (default: this one)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--no-resume", action="store_true", help="skip the resumed run")
    args = ap.parse_args()
    if not shutil.which("strace"):
        sys.exit("strace is not installed (apt-get install strace)")
    corpus = os.path.abspath(args.corpus)
    out = Path(args.out).resolve()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    n_files = sum(1 for _ in Path(corpus).glob("*/en_head.json.gz"))
    figures = {"corpus_files": n_files, "code": os.path.abspath(args.code)}
    runs = [("new_run", args.steps)] + ([] if args.no_resume else [("resumed_run", args.steps + 1)])
    for name, steps in runs:
        trace = out / f"{name}.strace"
        run(Path(args.code), corpus, out / "run", steps, trace)
        figures[name] = count(trace, corpus, n_files)
        trace.unlink()
        f = figures[name]
        print(f"{name}: {n_files} corpus files, {f['metadata_calls']} metadata calls on them "
              f"({f['metadata_per_file']:.2f} per file, at most {f['max_metadata_one_file']} on one), "
              f"{f['opens']} opens ({f['opens_per_file']:.2f} per file), {f['directory_reads']} directory reads",
              flush=True)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()

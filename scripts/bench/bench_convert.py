#!/usr/bin/env python3
"""The conversion on Apache Beam against the in-process converter (#56 item 8): the same input and
selection through `scripts/prepare_data.py` with --runner local and with --runner DirectRunner on
2 worker processes, on the same cores; documents/s and tokens/s of each, and their ratio.

    python ../shared/bench/make_corpus.py /tmp/rpconv --shards 4 --docs 3000
    python scripts/bench/bench_convert.py --corpus /tmp/rpconv          # needs the [beam] extra

The corpus's companion files are written first when missing (scripts/make_sample_companions.py).
Each figure is a whole command's wall time, start-up included (Python, the tokenizer, Beam's job
service and its worker processes, fuzzy dedup's bands), best of --repeats, the two runners
alternating; each run writes a fresh --out, and every run's parts are checked byte-identical.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def _parts(out: str) -> dict[str, bytes]:
    return {n: open(os.path.join(out, n), "rb").read() for n in sorted(os.listdir(out)) if n.endswith(".array_record")}


def run(files_glob: str, tokenizer: str, out: str, select: list[str], runner: list[str]) -> float:
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, os.path.join(REPO, "scripts", "prepare_data.py"), "--paths", files_glob,
           "--tokenizer", tokenizer, "--out", out, "--no-progress", *select, *runner]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    dt = time.perf_counter() - t0
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{r.stderr[-3000:]}")
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", required=True, help="make_corpus.py's output: DIR/NNNN/en_head.json.gz")
    ap.add_argument("--tokenizer", default=os.path.join(REPO, "data", "sample", "tokenizer.json"))
    ap.add_argument("--workers", type=int, default=2, help="DirectRunner's worker processes")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--select", default="--quality gopher --dedup exact,fuzzy",
                    help="the selection both runs convert with ('' for none)")
    args = ap.parse_args()

    sys.path.insert(0, HERE)
    from bench_quality import corpus_with_companions  # the same corpus preparation as the stream's bench

    files = corpus_with_companions(args.corpus)

    pattern = os.path.join(args.corpus, "*", "en_head.json.gz")
    select = args.select.split()
    runners = {"local": [], "DirectRunner": ["--runner", "DirectRunner", "--",
                                             f"--direct_num_workers={args.workers}",
                                             "--direct_running_mode=multi_processing"]}
    tmp = tempfile.mkdtemp(prefix="bench_convert-")
    best: dict[str, float] = {}
    first: dict[str, bytes] | None = None
    try:
        for rep in range(args.repeats):
            for name, extra in runners.items():
                out = os.path.join(tmp, name)
                dt = run(pattern, args.tokenizer, out, select, extra)
                best[name] = min(best.get(name, dt), dt)
                parts = _parts(out)
                first = parts if first is None else first
                assert parts == first, f"{name}'s parts differ from the first run's"
                m = json.load(open(os.path.join(out, "manifest.json")))
                print(f"run {rep} {name:12s} {dt:6.1f} s", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    docs, toks = m["documents"], m["tokens"]
    print(f"{len(files)} files, {docs:,} documents kept, {toks:,} tokens; selection {args.select!r}; "
          f"dropped {m.get('dropped', {})}")
    for name, dt in best.items():
        print(f"{name:12s} {dt:6.1f} s  {docs / dt:8,.0f} documents/s  {toks / dt:11,.0f} tokens/s")
    print(f"ratio DirectRunner ({args.workers} workers) / local: {best['local'] / best['DirectRunner']:.2f} "
          f"(parts byte-identical)")


if __name__ == "__main__":
    main()

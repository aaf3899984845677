"""The input formats against .json.gz lines, on the same documents. The LAST line is one JSON object.

  python ../shared/bench/make_corpus.py /tmp/fmt/src --shards 2 --docs 12000
  python scripts/bench/bench_formats.py --src '/tmp/fmt/src/*/en_head.json.gz' --work /tmp/fmt \
      --tokenizer ../shared/bench/llama_style_tokenizer.json

The source files' documents are written once more as JSON arrays (.json, .json.gz, pretty-printed
as dumps often are) and as Parquet (row groups of --row-group rows), file for file. Then, paired in
one run (each format measured in rounds, in alternating order, so a drift of the machine's speed
falls on all of them):
  stream_tok_s         per format: tokens/s of the whole host pipeline (in-process, one shard per
                       file), --batches batches after the first
  stream_vs_json_gz    per format: the median over rounds of its rate / the .json.gz lines' rate
                       in the same round
  restore_s            per format: restore -> first batch (pipeline built, first window read and
                       tokenized; best of --reps) at the second document and 1000 documents before the
                       end of each file (a window-start state there, as a saved state would be)
  end_vs_start         per format: restore_s at the end / at the start
  peak_rss_mb          per format: peak RSS of a fresh process streaming --batches batches, counted
                       from after its imports (VmHWM reset)
  rss_vs_json_gz_mb    per format: peak_rss_mb - that of the .json.gz lines
"""
from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import statistics
import subprocess
import sys
import time

from train import PROJECT_ROOT  # the repo root (the project is installed editable)

REPO = str(PROJECT_ROOT)
sys.path.insert(0, REPO)

KINDS = {"json.gz lines": "en_head.json.gz", "json array": "part.json",
         "json.gz array": "part.json.gz", "parquet": "part.parquet"}


def write_formats(src: list[str], work: str, row_group: int) -> dict:
    """{kind: glob} with the documents of `src`, file for file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from data.readers.formats import open_records
    out = {"json.gz lines": None}
    for i, path in enumerate(src):
        d = os.path.join(work, f"{i:04d}")
        os.makedirs(d, exist_ok=True)
        if not os.path.exists(os.path.join(d, "part.parquet")):
            rec = open_records(path, "raw_content")
            docs = []
            while True:
                raw, n = rec.next()
                if n == 0:
                    break
                docs.append(json.loads(raw))
            rec.close()
            text = json.dumps(docs, indent=1).encode()
            with open(os.path.join(d, "part.json"), "wb") as f:
                f.write(text)
            with gzip.open(os.path.join(d, "part.json.gz"), "wb", compresslevel=6) as f:
                f.write(text)
            pq.write_table(pa.Table.from_pylist(docs), os.path.join(d, "part.parquet"),
                           row_group_size=row_group)
        os.makedirs(os.path.join(work, "lines", f"{i:04d}"), exist_ok=True)
        link = os.path.join(work, "lines", f"{i:04d}", "en_head.json.gz")
        if not os.path.exists(link):
            os.symlink(os.path.abspath(path), link)
    for kind, name in KINDS.items():
        out[kind] = os.path.join(work, "lines" if kind == "json.gz lines" else "", "*", name)
    return out


def config(pattern: str, args, n_files: int):
    import data
    return data.DataConfig(paths=(pattern,), tokenizer=args.tokenizer, seq_len=args.seq_len,
                           global_batch_size=n_files * args.rows_per_shard, num_workers=0,
                           num_shards=n_files, files_per_stream=1, shuffle_window=0)


def stream_rate(cfg, batches: int) -> float:
    import data
    it = data.make_host_iterator(cfg, 0, 1)
    next(it)
    t0 = time.perf_counter()
    tokens = 0
    for _ in range(batches):
        b = next(it)
        tokens += int(b["inputs"].size)
    dt = time.perf_counter() - t0
    it.close()
    return tokens / dt


def states_at(files: list[str], record: int | None) -> dict:
    """A window-start state of every shard (shard v = file v) at `record` (None: 1000 before the
    end, beyond the first window's read-ahead), positions found by reading the file with its
    reader (preparation, not timed)."""
    from data.readers import formats, gzseek
    from data.streams.shard import initial_shard_state
    out = {}
    for v, path in enumerate(files):
        rec = formats.open_records(path, "raw_content")
        offs, off = [], 0
        while True:
            offs.append(off)
            raw, n = rec.next()
            if n == 0:
                break
            off += n
        rec.close()
        k = record if record is not None else len(offs) - 1000
        point = None
        if path.endswith(".gz"):
            finder = gzseek.PointFinder(path)
            point = finder.point_before(offs[k])
            finder.close()
        st = initial_shard_state()
        st["start"]["reader"] = {"epoch": 0, "next": 1, "rr": 0, "edocs": 0,
                                 "slots": [[0, k, 0, offs[k], point, rec.fmt]]}
        out[str(v)] = st
    return json.loads(json.dumps(out))


def restore_s(cfg, states: dict, reps: int) -> float:
    import data
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        it = data.make_host_iterator(cfg, 0, 1, shard_states=states)
        next(it)
        best = min(best, time.perf_counter() - t0)
        it.close()
    return best


def _rss_child(pattern: str, args: dict) -> None:
    """In a fresh process: the peak RSS of streaming, from after the imports (VmHWM reset through
    /proc/self/clear_refs, so the imports' own peak does not hide the reader's), printed in MB."""
    import argparse

    import data  # noqa: F401 - the imports' memory is not the reader's
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    a = argparse.Namespace(**args)
    stream_rate(config(pattern, a, len(glob.glob(pattern))), a.batches)
    with open("/proc/self/status") as f:
        hwm = next(int(ln.split()[1]) for ln in f if ln.startswith("VmHWM:"))
    print(hwm / 1024)


def peak_rss_mb(pattern: str, args) -> float:
    code = (f"import sys; sys.path.insert(0, {REPO!r}); from scripts.bench.bench_formats import _rss_child; "
            f"_rss_child({pattern!r}, {vars(args)!r})")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main():
    from model.runtime.distributed import quiet_cpu_start

    quiet_cpu_start()   # no libtpu warnings on a machine without a TPU (JAX_PLATFORMS, if set, wins)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", required=True, help="glob of .json.gz JSON-lines files (raw_content)")
    ap.add_argument("--work", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--rows-per-shard", type=int, default=4)
    ap.add_argument("--batches", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--row-group", type=int, default=1000)
    args = ap.parse_args()
    src = sorted(glob.glob(args.src))
    pats = write_formats(src, args.work, args.row_group)
    n = len(src)
    cfgs = {k: config(p, args, n) for k, p in pats.items()}
    rates = {k: [] for k in pats}
    order = list(pats)
    for r in range(args.rounds):
        for k in (order if r % 2 == 0 else order[::-1]):
            rates[k].append(stream_rate(cfgs[k], args.batches))
            print(f"round {r} {k}: {rates[k][-1]:,.0f} tokens/s", flush=True)
    rate = {k: sum(v) / len(v) for k, v in rates.items()}
    # per round, each format against the .json.gz run of the same round; the median over rounds
    ratio = {k: statistics.median(a / b for a, b in zip(v, rates["json.gz lines"], strict=True))
             for k, v in rates.items()}
    res = {"stream_tok_s": {k: round(v) for k, v in rate.items()},
           "stream_vs_json_gz": {k: round(v, 3) for k, v in ratio.items()},
           "restore_s": {}, "end_vs_start": {}, "peak_rss_mb": {}}
    for k, p in pats.items():
        files = sorted(glob.glob(p))
        start, end = states_at(files, 1), states_at(files, None)
        s0, s1 = restore_s(cfgs[k], start, args.reps), restore_s(cfgs[k], end, args.reps)
        res["restore_s"][k] = [round(s0, 3), round(s1, 3)]
        res["end_vs_start"][k] = round(s1 / s0, 3)
        print(f"{k}: restore start {s0:.3f} s, end {s1:.3f} s", flush=True)
    for k, p in pats.items():
        res["peak_rss_mb"][k] = round(peak_rss_mb(p, args), 1)
    res["rss_vs_json_gz_mb"] = {k: round(v - res["peak_rss_mb"]["json.gz lines"], 1)
                                for k, v in res["peak_rss_mb"].items()}
    res["text_mb_per_file"] = round(os.path.getsize(glob.glob(pats["json array"])[0]) / 1e6, 1)
    print(json.dumps(res))


if __name__ == "__main__":
    main()

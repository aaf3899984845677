"""The same input pipeline on local files and through gs:// (a local GCS emulator with --latency-ms
added per request, standing in for a bucket). The LAST line is one JSON object.

  python ../shared/bench/make_corpus.py /tmp/objstore/src --shards 4 --docs 2000
  python scripts/bench/bench_objstore.py --src /tmp/objstore/src \\
      --tokenizer ../shared/bench/llama_style_tokenizer.json

Figures, paired in one run (rounds alternate local and gs://, so a drift of the machine's speed
falls on both):
  local_tok_s / gs_tok_s   tokens/s of the host pipeline (in-process, one virtual shard per file),
                           --batches batches after the first, median over rounds
  gs_vs_local              the median over rounds of gs_tok_s / local_tok_s of the same round
  startup_requests         at the emulator, for listing the files: list requests, per-object
                           metadata requests, directories (patterns) listed, files found
  resume_requests          list requests (and per-object metadata requests: one per file opened,
                           gcsfs's size lookup on open) while a pipeline is built from the saved file list and
                           restored from a saved state (what a resume does)
The emulator runs in this process (threads): its work competes with the pipeline for the GIL, so
gs_vs_local is, if anything, low.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from train import PROJECT_ROOT  # the repo root (the project is installed editable)

REPO = str(PROJECT_ROOT)
sys.path.insert(0, REPO)


def config(pattern: str, args):
    import data
    return data.DataConfig(paths=(pattern,), tokenizer=args.tokenizer, seq_len=args.seq_len,
                           global_batch_size=args.shards * args.rows_per_shard, num_workers=0,
                           num_shards=args.shards, files_per_stream=1, shuffle_window=0)


def stream_rate(cfg, files, batches: int) -> float:
    import data
    it = data.make_host_iterator(cfg, 0, 1, files=files)
    next(it)
    t0 = time.perf_counter()
    tokens = 0
    for _ in range(batches):
        tokens += int(next(it)["inputs"].size)
    dt = time.perf_counter() - t0
    it.close()
    return tokens / dt


def main():
    from model.runtime.distributed import quiet_cpu_start

    quiet_cpu_start()   # no libtpu warnings on a machine without a TPU (JAX_PLATFORMS, if set, wins)
    ap = argparse.ArgumentParser()
    ap.add_argument("--src", required=True, help="a directory of NNNN/en_head.json.gz (make_corpus.py)")
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--latency-ms", type=float, default=20.0)
    ap.add_argument("--batches", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--block-mb", type=float, default=None,
                    help="bytes per object-store request (default: data/readers/objstore.py BLOCK, 8 MB); smaller "
                         "blocks make the files span several requests")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--rows-per-shard", type=int, default=4)
    args = ap.parse_args()

    from data.readers import objstore
    from tests.gcs_emulator import BUCKET, Emulator
    if args.block_mb:
        objstore.BLOCK = int(args.block_mb * (1 << 20))
    em = Emulator()
    fs = em.connect()
    fs.put(args.src.rstrip("/"), f"{BUCKET}/src", recursive=True)
    local_pat = os.path.join(args.src, "*", "en_head.json.gz")
    gs_pat = f"gs://{BUCKET}/src/*/en_head.json.gz"

    import data
    local_files = data.list_files(config(local_pat, argparse.Namespace(**{**vars(args), "shards": 1})))
    args.shards = len(local_files)
    local_cfg, gs_cfg = config(local_pat, args), config(gs_pat, args)
    em.latency_s = args.latency_ms / 1000
    fs.clear_instance_cache()
    n_list, n_obj = len(em.lists()), len(em.per_object())
    gs_files = data.list_files(gs_cfg)
    startup = {"list_requests": len(em.lists()) - n_list,
               "per_object_metadata_requests": len(em.per_object()) - n_obj,
               "patterns_listed": 1, "files": len(gs_files)}

    # resume: from the saved list and a saved state, as train.py does
    it = data.make_host_iterator(gs_cfg, 0, 1, files=gs_files)
    for _ in range(3):
        next(it)
    state = json.loads(json.dumps(it.get_state()))
    it.close()
    n_list, n_obj = len(em.lists()), len(em.per_object())
    r = data.make_host_iterator(gs_cfg, 0, 1, files=gs_files)
    r.set_state(state)
    next(r)
    r.close()
    # per-object metadata: gcsfs asks an object's size once when the reader opens it
    resume = {"list_requests": len(em.lists()) - n_list,
              "per_object_metadata_requests_on_open": len(em.per_object()) - n_obj}

    local, gs, ratio = [], [], []
    for k in range(args.rounds):
        order = [("local", local_cfg, local_files), ("gs", gs_cfg, gs_files)]
        if k % 2:
            order.reverse()
        got = {name: stream_rate(c, f, args.batches) for name, c, f in order}
        local.append(got["local"])
        gs.append(got["gs"])
        ratio.append(got["gs"] / got["local"])
        print(f"round {k}: local {got['local']:,.0f} tok/s, gs:// {got['gs']:,.0f} tok/s, "
              f"ratio {ratio[-1]:.3f}", flush=True)
    em.stop()
    out = {"latency_ms": args.latency_ms, "block_bytes": objstore.BLOCK, "files": len(local_files),
           "batches": args.batches,
           "rounds": args.rounds, "local_tok_s": round(statistics.median(local)),
           "gs_tok_s": round(statistics.median(gs)), "gs_vs_local": round(statistics.median(ratio), 3),
           "startup_requests": startup, "resume_requests": resume}
    print(json.dumps(out))


if __name__ == "__main__":
    main()

"""Mixture benchmark: a two-source mixture against the same files read as one source.
The LAST printed line is one JSON object.

  python scripts/bench/bench_mixture.py --a 'CORPUS/000[0-3]/en_head.json.gz' \
      --b 'CORPUS/000[4-7]/en_head.json.gz' --tokenizer TOK.json --weights 0.7,0.3

Figures:
  mix_vs_single     per round: mixture tokens/s / single-source tokens/s, the two runs of a
                    round back to back (order alternating between rounds), each in a fresh
                    process, in-process pipeline (no workers), steady state after the first
                    batch. On a shared machine absolute rates drift; the paired ratio is the
                    figure.
  cpu_mix_vs_single per round: the same ratio in tokens per CPU-second of the process (all its
                    threads): the work per token, nearly independent of the machine's load.
  peak_rss_mb       per kind: peak RSS of the process that ran it (windows of 2 sources per
                    shard instead of 1).
  shares            per packing: realized token and row share of each source over every window
                    of --share-window consecutive batches (min and max over the windows), from
                    the per-source counters of the saved state after every batch.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time


def make_cfg(args, mixture: bool, packing: str):
    import data
    base = dict(tokenizer=args.tokenizer, seq_len=args.seq_len, global_batch_size=args.batch_size,
                num_shards=args.num_shards, num_workers=0, packing=packing,
                shuffle_window=args.shuffle_window)
    if not mixture:
        return data.DataConfig(paths=(args.a, args.b), **base)
    wa, wb = (float(w) for w in args.weights.split(","))
    return data.DataConfig(paths=(), sources=(
        data.SourceConfig("a", (args.a,), wa), data.SourceConfig("b", (args.b,), wb)), **base)


def timed_run(args, mixture: bool, out) -> None:
    """In a fresh process: steady-state non-padding tokens/s and this process's peak RSS."""
    import resource

    import numpy as np

    import data
    it = data.make_host_iterator(make_cfg(args, mixture, "concat"), 0, 1)
    next(it)
    t0, cpu0, tokens = time.perf_counter(), time.process_time(), 0
    for _ in range(args.batches):
        b = next(it)
        tokens += int((np.asarray(b["segment_ids"]) > 0).sum())
    dt, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    it.close()
    out.put({"tok_s": tokens / dt, "tok_per_cpu_s": tokens / cpu,
             "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024})


def run_in_process(args, mixture: bool) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=timed_run, args=(args, mixture, q))
    p.start()
    r = q.get()
    p.join()
    return r


def shares(args, packing: str) -> dict:
    """Min/max over windows of the per-source token and row shares."""
    import numpy as np

    import data
    from data.host import find_shard_states
    from data.streams.mixture import source_counters
    it = data.make_host_iterator(make_cfg(args, True, packing), 0, 1)
    cum = []   # per batch: [[tokens, rows] per source], cumulative
    for _ in range(args.share_batches):
        next(it)
        per = source_counters(find_shard_states(it.get_state()))
        cum.append([[per[n]["tokens"], per[n]["rows"]] for n in ("a", "b")])
    it.close()
    cum = np.array([[[0, 0], [0, 0]]] + cum, dtype=np.float64)   # [batches + 1, sources, 2]
    w = args.share_window
    win = cum[w:] - cum[:-w]                                      # [windows, sources, 2]
    share = win / win.sum(1, keepdims=True)
    out = {}
    for i, name in enumerate(("a", "b")):
        out[name] = {"token_share": [round(float(share[:, i, 0].min()), 5), round(float(share[:, i, 0].max()), 5)],
                     "row_share": [round(float(share[:, i, 1].min()), 5), round(float(share[:, i, 1].max()), 5)]}
    return out


def main():
    from model.runtime.distributed import quiet_cpu_start

    quiet_cpu_start()   # no libtpu warnings on a machine without a TPU (JAX_PLATFORMS, if set, wins)
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", required=True, help="glob of source a's files")
    ap.add_argument("--b", required=True, help="glob of source b's files")
    ap.add_argument("--weights", default="0.7,0.3")
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--num-shards", type=int, default=4)
    ap.add_argument("--shuffle-window", type=int, default=64)
    ap.add_argument("--batches", type=int, default=100, help="timed batches per run")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--share-batches", type=int, default=400)
    ap.add_argument("--share-window", type=int, default=100)
    args = ap.parse_args()

    runs = {"single": [], "mixture": []}
    ratios, cpu_ratios = [], []
    for rnd in range(args.rounds):
        order = ("single", "mixture") if rnd % 2 == 0 else ("mixture", "single")
        r = {kind: run_in_process(args, kind == "mixture") for kind in order}
        for kind in order:
            runs[kind].append(r[kind])
        ratios.append(r["mixture"]["tok_s"] / r["single"]["tok_s"])
        cpu_ratios.append(r["mixture"]["tok_per_cpu_s"] / r["single"]["tok_per_cpu_s"])
        print(f"round {rnd + 1}: single {r['single']['tok_s'] / 1e6:.3f} M tok/s, mixture "
              f"{r['mixture']['tok_s'] / 1e6:.3f} M tok/s, ratio {ratios[-1]:.3f} (per CPU-second "
              f"{cpu_ratios[-1]:.3f}); peak RSS "
              f"{r['single']['peak_rss_mb']:.0f} / {r['mixture']['peak_rss_mb']:.0f} MB", flush=True)
    share = {p: shares(args, p) for p in ("concat", "first_fit")}
    for p, s in share.items():
        print(f"{p}: shares over every {args.share_window}-batch window of {args.share_batches}: "
              + json.dumps(s), flush=True)
    print(json.dumps({
        "mix_vs_single": [round(x, 3) for x in ratios],
        "cpu_mix_vs_single": [round(x, 3) for x in cpu_ratios],
        "tok_s": {k: [round(r["tok_s"]) for r in v] for k, v in runs.items()},
        "peak_rss_mb": {k: round(max(r["peak_rss_mb"] for r in v), 1) for k, v in runs.items()},
        "weights": args.weights, "shares": share,
    }))


if __name__ == "__main__":
    main()

"""Resuming a changed mixture (data.mixture_change=continue): what a re-weighted, dropped or
re-added source costs at restore. The LAST printed line is one JSON object.

  python scripts/bench/bench_mixture_change.py --a 'CORPUS/000[0-3]/en_head.json.gz' \
      --b 'CORPUS/000[4-7]/en_head.json.gz' --tokenizer TOK.json

A two-source mixture (a 0.7, b 0.3) runs --warm batches; its saved state is then restored as:
  same        the same mixture (the reference: an ordinary resume)
  reweighted  a 0.3, b 0.7
  dropped     a alone (b's position parked in the state)
  readded     a and b again, from the state of `dropped` after --warm more batches (b
              continues from its parked position)
Figures, per kind and round (each restore in a fresh process, kinds in a rotating order):
  first_batch_s   restore_host_iterator -> first batch (in-process pipeline: every listed
                  source rebuilds its current window in each shard, as after any resume)
  cpu_s           CPU seconds of that process over the same span
  state_kb        the host state's JSON size after the first batch
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time

KINDS = ("same", "reweighted", "dropped", "readded")


def make_cfg(args, weights: dict):
    import data
    paths = {"a": args.a, "b": args.b}
    return data.DataConfig(paths=(), tokenizer=args.tokenizer, seq_len=args.seq_len,
                           global_batch_size=args.batch_size, num_shards=args.num_shards, num_workers=0,
                           shuffle_window=args.shuffle_window, mixture_change="continue",
                           sources=tuple(data.SourceConfig(n, (paths[n],), w) for n, w in weights.items()))


def run_for(args, weights, state, n) -> dict:
    import data
    it = data.restore_host_iterator(make_cfg(args, weights), 0, 1, [state] if state else None)
    for _ in range(n):
        next(it)
    st = json.loads(json.dumps(it.get_state()))
    it.close()
    return st


def timed_restore(args, weights, state, out) -> None:
    """In a fresh process: restore -> first batch, wall and CPU seconds, state size."""
    import data
    t0, cpu0 = time.perf_counter(), time.process_time()
    it = data.restore_host_iterator(make_cfg(args, weights), 0, 1, [state])
    next(it)
    dt, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    size = len(json.dumps(it.get_state()))
    it.close()
    out.put({"first_batch_s": dt, "cpu_s": cpu, "state_kb": size / 1024})


def main() -> None:
    from model.runtime.distributed import quiet_cpu_start

    quiet_cpu_start()   # no libtpu warnings on a machine without a TPU (JAX_PLATFORMS, if set, wins)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", required=True)
    ap.add_argument("--b", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--num-shards", type=int, default=4)
    ap.add_argument("--shuffle-window", type=int, default=64)
    ap.add_argument("--warm", type=int, default=30, help="batches before each save")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    mix = {"a": 0.7, "b": 0.3}
    saved = run_for(args, mix, None, args.warm)
    dropped_state = run_for(args, {"a": 1.0}, saved, args.warm)
    plans = {"same": (mix, saved), "reweighted": ({"a": 0.3, "b": 0.7}, saved),
             "dropped": ({"a": 1.0}, saved), "readded": (mix, dropped_state)}
    ctx = mp.get_context("spawn")
    results = {k: [] for k in KINDS}
    for r in range(args.rounds):
        order = KINDS[r % len(KINDS):] + KINDS[:r % len(KINDS)]
        for kind in order:
            q = ctx.Queue()
            p = ctx.Process(target=timed_restore, args=(args, *plans[kind], q))
            p.start()
            results[kind].append(q.get())
            p.join()
            print(f"round {r + 1} {kind:10s} " + " ".join(f"{k}={v:.3f}" for k, v in results[kind][-1].items()),
                  flush=True)
    summary = {kind: {key: [round(x[key], 3) for x in rs] for key in rs[0]} for kind, rs in results.items()}
    for kind, figs in summary.items():
        print(f"{kind:10s} median first_batch_s={statistics.median(figs['first_batch_s']):.3f} "
              f"cpu_s={statistics.median(figs['cpu_s']):.3f} state_kb={figs['state_kb'][0]:.1f}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

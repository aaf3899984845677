"""data.num_workers=auto's switch of the worker count, timed: the loop's wait over the steps after
the switch, with the handover (data/feed.py Handover: the old pipeline serves until the new one has
caught up) against the switch as it was before (the old pipeline closed, the loop waiting for the
new one's first batches). Real pipelines with real worker processes; the step is a sleep.

    python scripts/bench/bench_switch.py --paths '/tmp/c/*/en_head.json.gz' --tokenizer TOK.json \
        --from-workers 2 --to-workers 1 --step-ms 50 --rounds 2

Prints a line per round and method, then one JSON object (the LAST line).
"""
from __future__ import annotations

import argparse
import json
import time


def run(cfg, sharding, to_workers: int, step_s: float, before: int, after: int, handover: bool) -> dict:
    import dataclasses

    from data.feed import Handover
    from data.host import find_shard_states
    from data.pipeline import DevicePrefetcher, make_host_iterator

    old = DevicePrefetcher(make_host_iterator(cfg, 0, 1), sharding, prefetch=2)
    for _ in range(before):                       # the provisional count's steps
        next(old)
        time.sleep(step_s)
    new_cfg = dataclasses.replace(cfg, num_workers=to_workers)
    t0 = time.perf_counter()
    new = DevicePrefetcher(make_host_iterator(new_cfg, 0, 1, find_shard_states(old.consumed_state())),
                           sharding, prefetch=cfg.prefetch, follows=old)
    h = Handover(old, new) if handover else None
    if not handover:
        old.close(background=True)
    wait, from_old = 0.0, 0
    for _ in range(after):
        w0 = time.perf_counter()
        if h is not None:
            batch, over = h.next()
            if over:
                h = None
                batch = next(new)
            else:
                from_old += 1
        else:
            batch = next(new)
        wait += time.perf_counter() - w0
        del batch
        time.sleep(step_s)
    wall = time.perf_counter() - t0
    new.close()
    old.close()
    return {"wait_s": round(wait, 3), "wait_frac": round(wait / wall, 4), "from_old": from_old,
            "steps": after, "wall_s": round(wall, 2)}


def main() -> int:
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from data.config import DataConfig
    from model.runtime.distributed import quiet_cpu_start

    quiet_cpu_start()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--paths", nargs="+", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--num-shards", type=int, default=16)
    ap.add_argument("--from-workers", type=int, default=2)
    ap.add_argument("--to-workers", type=int, default=1)
    ap.add_argument("--step-ms", type=float, default=50.0)
    ap.add_argument("--before", type=int, default=20, help="steps before the switch")
    ap.add_argument("--after", type=int, default=40, help="steps after it, timed")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()

    cfg = DataConfig(paths=tuple(args.paths), tokenizer=args.tokenizer, seq_len=args.seq_len,
                     global_batch_size=args.batch_size, num_shards=args.num_shards,
                     num_workers=args.from_workers, worker_nice=0)
    sharding = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("data",)), P("data"))
    out = {"closed_then_new": [], "handover": []}
    for r in range(args.rounds):
        for name, handover in (("closed_then_new", False), ("handover", True)):
            res = run(cfg, sharding, args.to_workers, args.step_ms / 1e3, args.before, args.after, handover)
            out[name].append(res)
            print(f"round {r + 1} {name:<16} wait {res['wait_s']:.3f} s over {res['steps']} steps "
                  f"({res['wait_frac']:.2%} of {res['wall_s']} s), {res['from_old']} batches from the old pipeline",
                  flush=True)
    print(json.dumps({"from_workers": args.from_workers, "to_workers": args.to_workers, "step_ms": args.step_ms,
                      **out}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

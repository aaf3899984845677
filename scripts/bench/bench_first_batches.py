"""The way to steady input with workers (#38): seconds from the iterator's creation (fresh) or
restore (a state deep inside the shards) to each of its first batches, for each way of making the
first batch (data.head_batch), and "carried": the restore of a checkpoint that carried its next
batch (data.carry_next_batch, data/carried.py; the same deep state):

  race   made in this process on every core while the workers start; the first done is used
  first  made in this process before the workers start
  off    the workers' own

  python scripts/bench/bench_first_batches.py --paths 'CORPUS/*/en_head.json.gz' --tokenizer TOK.json \\
      --seq-len 2048 --batch-size 56 --num-shards 56 --workers 8

The first batch alone does not tell the modes apart: "first" can hand it out earlier and the
second later (the workers start after it). Printed per mode and start: the seconds to batches
1, 2, 3, 5 and --batches; the modes alternate, so a slow spell of a shared host does not land on
one mode only. The LAST printed line is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def time_batches(make, n):
    """Seconds from make() to each of the first n batches of the iterator it returns."""
    t0 = time.perf_counter()
    it = make()
    out = []
    for _ in range(n):
        next(it)
        out.append(time.perf_counter() - t0)
    it.close()
    return out


def main():
    from model.runtime.distributed import quiet_cpu_start

    quiet_cpu_start()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--paths", nargs="+", required=True, help="glob(s) of corpus files")
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=16, help="host batch rows")
    ap.add_argument("--num-shards", type=int, default=8)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--worker-nice", type=int, default=10)
    ap.add_argument("--shuffle-window", type=int, default=64)
    ap.add_argument("--text-key", default="raw_content")
    ap.add_argument("--modes", default="race,first,off")
    ap.add_argument("--starts", default="fresh,deep", help="fresh, deep, carried (comma-separated)")
    ap.add_argument("--batches", type=int, default=10, help="batches timed per run")
    ap.add_argument("--deep-batches", type=int, default=60, help="batches before the state restored from")
    ap.add_argument("--reps", type=int, default=1, help="rounds over the modes")
    ap.add_argument("--switch-interval", type=float, default=None,
                    help="sys.setswitchinterval for this process (the head batch's threads hand the GIL "
                         "over at most this often when several want it; Python's default 0.005 s)")
    args = ap.parse_args()
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)

    import data
    from data import carried
    from data.feed import host_digest, restore_carried

    def cfg(mode):
        return data.DataConfig(paths=tuple(args.paths), tokenizer=args.tokenizer, seq_len=args.seq_len,
                               global_batch_size=args.batch_size, num_shards=args.num_shards,
                               shuffle_window=args.shuffle_window, text_key=args.text_key,
                               num_workers=args.workers, worker_nice=args.worker_nice, head_batch=mode)
    modes = args.modes.split(",")
    starts = args.starts.split(",")
    data.validate(cfg(modes[0]), 1, 1)
    deep = carried_deep = None
    # The tokenizer is loaded before the clock starts, as train.py loads it before its feed
    # starts (its vocabulary size is checked against the model's first); ~80 ms for this 32k one.
    tok = data.load_tokenizer(args.tokenizer)
    if "deep" in starts or "carried" in starts:
        it = data.make_host_iterator(cfg("race"), 0, 1)
        for _ in range(args.deep_batches):
            next(it)
        deep = json.loads(json.dumps(it.get_state()))
        # what a checkpoint saved there carries (data/carried.py): the next batch, the states after it
        digest = host_digest(cfg("race"), 0, 1, debug=False, tokenizer=tok)
        saved = carried.with_next(deep, digest, next(it), json.loads(json.dumps(it.get_state())))
        state, arrays = carried.split_arrays(saved)
        carried_deep = carried.attach_arrays(json.loads(json.dumps(state)), lambda: arrays)
        it.close()

    def restore_with_carried(c):
        return restore_carried(c, 0, 1, [carried_deep], digest, tokenizer=tok)[0]

    makers = {"fresh": lambda c: (lambda: data.make_host_iterator(c, 0, 1, tokenizer=tok)),
              "deep": lambda c: (lambda: data.restore_host_iterator(c, 0, 1, [deep], tokenizer=tok)),
              "carried": lambda c: (lambda: restore_with_carried(c))}
    marks = sorted({1, 2, 3, 5, args.batches} & set(range(1, args.batches + 1)))
    res = {}
    for rep in range(args.reps):
        for start in starts:
            for mode in modes:
                ts = time_batches(makers[start](cfg(mode)), args.batches)
                key = f"{mode}_{start}"
                prev = res.get(key)
                if prev is None or ts[-1] < prev[-1]:
                    res[key] = ts
                print(f"round {rep + 1} {start:5s} {mode:5s}: "
                      + ", ".join(f"batch {k} {ts[k - 1]:.2f} s" for k in marks)
                      + f" (load {os.getloadavg()[0]:.1f})", flush=True)
    print(json.dumps({"batches_s": {k: [round(t, 3) for t in v] for k, v in res.items()},
                      "workers": args.workers, "worker_nice": args.worker_nice, "seq_len": args.seq_len,
                      "switch_interval": sys.getswitchinterval(),
                      "batch_size": args.batch_size, "num_shards": args.num_shards,
                      "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()}))


if __name__ == "__main__":
    main()

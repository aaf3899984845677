"""The input workers' head batch alone (#38): the first batch (fresh shards) and the one after a
restore (shards deep in their files), made in this process as WorkerMergeIterator makes it while
its workers start. The LAST printed line is one JSON object.

  python scripts/bench/bench_head.py --paths 'CORPUS/*/en_head.json.gz' --tokenizer TOK.json \
      --seq-len 2048 --batch-size 16 --num-shards 16 --workers 2

Modes (--modes):
  all    data/workers.py head_slab: a tokenizer pool of one thread per core, with the
         tokenizer variables this process started with (as the trainer's; serial calls when
         TOKENIZERS_PARALLELISM is unset, as a worker iterator sets it).
  share  HostIterator with a worker's share of the cores (data/tokenizer.py encode_threads):
         the head batch before #38.
Per mode and start: wall seconds, CPU seconds of this process (nothing else runs in it), tokens
tokenized (whole chunks, more than the batch holds: every shard's first window) and the
tokenizer.json parse alone (which the trainer's head batch no longer pays: its encoder uses the
tokenizer already loaded), so that a host with more cores can be projected: tokens / (cores x one
thread's rate).
"""
from __future__ import annotations

import argparse
import json
import os
import threading
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--paths", nargs="+", required=True, help="glob(s) of corpus files")
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=16, help="host batch rows")
    ap.add_argument("--num-shards", type=int, default=8)
    ap.add_argument("--workers", type=int, default=2, help="data.num_workers (sets the share)")
    ap.add_argument("--shuffle-window", type=int, default=64)
    ap.add_argument("--text-key", default="raw_content")
    ap.add_argument("--deep-batches", type=int, default=60,
                    help="batches the restore's shards are past their start")
    ap.add_argument("--modes", default="share,all")
    ap.add_argument("--reps", type=int, default=2, help="runs per mode and start; the fastest is kept")
    args = ap.parse_args()

    import data
    from data.config import list_files
    from data.host import HostIterator, initial_stream_state
    from data.pipeline import host_shards, stream_spec
    from data.tokenizer import BatchEncoder, available_cores, load_tokenizer, serial_calls_unless_set

    cfg = data.DataConfig(paths=tuple(args.paths), tokenizer=args.tokenizer, seq_len=args.seq_len,
                          global_batch_size=args.batch_size, num_shards=args.num_shards,
                          shuffle_window=args.shuffle_window, text_key=args.text_key,
                          num_workers=args.workers)
    spec = stream_spec(cfg, 0, 1, list_files(cfg), load_tokenizer(cfg.tokenizer))
    ids = host_shards(cfg.num_shards, 0, 1)

    # tokens tokenized: counted at the encoder, from its pool's threads
    counted = {"tokens": 0}
    lock = threading.Lock()
    encode = BatchEncoder.encode

    def counting(self, texts):
        flat, lens = encode(self, texts)
        with lock:
            counted["tokens"] += len(flat)
        return flat, lens
    BatchEncoder.encode = counting

    # The trainer's tokenizer variables as this process started: the head batch leaves them as
    # they are, while every HostIterator built here with a worker's share sets them (serial calls)
    trainer_env = {k: os.environ.get(k) for k in ("RAYON_NUM_THREADS", "RAYON_RS_NUM_CPUS",
                                                  "TOKENIZERS_PARALLELISM")}

    def as_trainer():
        for k, v in trainer_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        serial_calls_unless_set()   # as a worker iterator sets it before the trainer's head batch

    # The parse alone, timed for the projection: the trainer's own head batch no longer parses
    # (its encoder uses the tokenizer stream_spec remembered: data/tokenizer.py parsed_tokenizer).
    import tokenizers
    t0 = time.perf_counter()
    tokenizers.Tokenizer.from_str(spec.tokenizer_json)
    parse_s = time.perf_counter() - t0

    # the deep state on every core (the rows do not depend on the pool's size): on a worker's
    # share it took minutes of a 16-core host's time
    it = HostIterator(spec, ids, {}, tokenizer_threads=available_cores())
    for _ in range(args.deep_batches):
        next(it)
    deep = json.loads(json.dumps(it.get_state()["shards"]))
    it.close()
    time.sleep(1.0)   # its read-ahead calls already running finish (close cancels only the queued)
    starts = {"fresh": {str(v): initial_stream_state(spec) for v in ids}, "deep": deep}

    def share(shards):
        h = HostIterator(spec, [int(v) for v in shards], shards)
        try:
            return next(h)
        finally:
            h.close()

    def all_cores(shards):
        from data.workers import head_slab
        as_trainer()
        return head_slab(spec, shards)

    fns = {"share": share, "all": all_cores}
    out = {}
    for mode in args.modes.split(","):
        for start, shards in starts.items():
            best = None
            for _ in range(args.reps):
                counted["tokens"] = 0
                t0, c0 = time.perf_counter(), time.process_time()
                slab = fns[mode](shards)
                r = {"wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0,
                     "tokens": counted["tokens"], "rows": int(slab["rows"].shape[1])}
                best = r if best is None or r["wall_s"] < best["wall_s"] else best
            out[f"{mode}_{start}"] = {k: round(v, 3) if isinstance(v, float) else v for k, v in best.items()}
            b = out[f"{mode}_{start}"]
            print(f"{mode:5s} {start:5s}: {b['wall_s']:.2f} s wall, {b['cpu_s']:.2f} s CPU, "
                  f"{b['tokens'] / 1e6:.2f} M tokens tokenized", flush=True)
    print(json.dumps({"parse_s": round(parse_s, 3), "cores": available_cores(), **out,
                      "seq_len": args.seq_len, "batch_size": args.batch_size,
                      "num_shards": args.num_shards, "workers": args.workers}))


if __name__ == "__main__":
    main()

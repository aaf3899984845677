"""Input-pipeline benchmark. The LAST printed line is one JSON object.

  python scripts/bench_input.py --paths 'CORPUS/*/en_head.json.gz' --tokenizer TOK.json \
      --seq-len 1024 --batch-size 16 --workers 0,1,2

Figures:
  tokenizer_tok_s   tokenizer alone (encode_batch_fast, all cores) on the corpus documents:
                    the floor of what the pipeline can reach on these cores.
  pipeline_tok_s    per worker count: steady-state non-padding tokens/s out of the host
                    iterator (after the first batch), over one epoch or --max-batches.
  first_batch_s     per worker count: iterator creation -> first batch.
  restore_s         restore a state saved deep inside the shards -> next batch (max workers).
  peak_rss_mb       peak RSS of the whole process tree (main + Grain workers) while the
                    pipelines ran.
  sim_wait_frac     a training loop whose step is a sleep sized to 80% of the measured
                    steady-state pipeline rate (max workers), through DevicePrefetcher, after a
                    2 s pause standing in for the first step's compile: fraction of wall time
                    blocked on data.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class RssSampler:
    """Peak RSS of this process and its children, sampled every 50 ms."""

    def __init__(self):
        import psutil
        self.proc = psutil.Process()
        self.peak = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> int:
        import psutil
        total = 0
        procs = [self.proc]
        try:
            procs += self.proc.children(recursive=True)
        except psutil.Error:
            pass
        for p in procs:
            try:
                total += p.memory_info().rss
            except psutil.Error:
                pass
        return total

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.sample())
            time.sleep(0.05)

    def start(self):
        self._t.start()
        return self

    def stop(self):
        self._stop.set()
        self._t.join()


def tokenizer_alone(files, tok_path, text_key, max_chars, batch_docs=256):
    """Streams the corpus documents, timing only the encode calls (all cores)."""
    from data.sources import open_lines, parse_line
    from data.tokenizer import available_cores, set_thread_env
    set_thread_env(available_cores())
    from data.tokenizer import BatchEncoder, load_tokenizer
    enc = BatchEncoder(load_tokenizer(tok_path).to_str())
    fn = enc._fast or enc.tok.encode_batch
    n_tok = n_chars = 0
    spent = cpu = 0.0
    batch = []

    def run(batch):
        nonlocal n_tok, spent, cpu
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn(batch, add_special_tokens=False)
        spent += time.perf_counter() - t0
        cpu += time.process_time() - c0
        n_tok += sum(len(e.ids) + 1 for e in out)   # + EOS, as the pipeline counts

    for f in files:
        with open_lines(f) as fh:
            for line in fh:
                text, bad = parse_line(line, text_key)
                if bad:
                    continue
                batch.append(text)
                n_chars += len(text)
                if len(batch) == batch_docs:
                    run(batch)
                    batch = []
                if n_chars >= max_chars:
                    break
        if n_chars >= max_chars:
            break
    if batch:
        run(batch)
    return n_tok / spent, n_tok, n_chars, n_tok / cpu


def tree_cpu_s(main_only: bool = False) -> float:
    """CPU seconds (user + system) of this process and (unless main_only) its live children."""
    import psutil
    me = psutil.Process()
    total = 0.0
    for p in [me] + ([] if main_only else me.children(recursive=True)):
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def run_pipeline(cfg, max_tokens, max_batches):
    import data
    t0 = time.perf_counter()
    it = data.make_host_iterator(cfg, 0, 1)
    b = next(it)
    first = time.perf_counter() - t0
    per_batch = int((b["segment_ids"] > 0).sum())
    from data.pipeline import state_counters
    tok0 = state_counters(it.get_state())["tokens"]   # non-padding tokens of rows (L + 1)
    t1, c1, m1 = time.perf_counter(), tree_cpu_s(), tree_cpu_s(main_only=True)
    n_tok, n = 0, 0
    while n_tok < max_tokens and n < max_batches:
        next(it)
        n += 1
        if n % 16 == 0:
            n_tok = state_counters(it.get_state())["tokens"] - tok0
    dt = time.perf_counter() - t1
    cpu = tree_cpu_s() - c1
    cpu_main = tree_cpu_s(main_only=True) - m1
    state = it.get_state()
    n_tok = state_counters(state)["tokens"] - tok0
    if hasattr(it, "close"):
        it.close()
    return {"tok_s": n_tok / dt, "tok_per_cpu_s": n_tok / cpu, "first_batch_s": first,
            "cores_main": cpu_main / dt, "cores_workers": (cpu - cpu_main) / dt,
            "batches": n, "seconds": dt,
            "state": json.loads(json.dumps(state)), "tokens_per_batch": per_batch}


def measure_restore(cfg, state, reps=2):
    import data
    best = None
    for _ in range(reps):
        t0 = time.perf_counter()
        it = data.make_host_iterator(cfg, 0, 1)
        it.set_state(state)
        next(it)
        dt = time.perf_counter() - t0
        if hasattr(it, "close"):
            it.close()
        best = dt if best is None else min(best, dt)
    return best


def simulate_training(cfg, steps, tok_s, frac=0.8, compile_s=2.0):
    """A loop whose accelerator step is a sleep sized so that it consumes `frac` of the
    pipeline's steady-state rate `tok_s` (measured over a whole run above, not over the first
    batches, which come out of already-filled buffers). The first step is followed by a
    `compile_s` pause, as a real first step compiles while the input pipeline fills up."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import data
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    sh = NamedSharding(mesh, P("data"))
    pf = data.DevicePrefetcher(data.make_host_iterator(cfg, 0, 1), sh, prefetch=cfg.prefetch)
    b = next(pf)
    jax.block_until_ready(b["inputs"])
    time.sleep(compile_s)
    step_s = float((np.asarray(b["segment_ids"]) > 0).sum()) / (frac * tok_s)
    w0 = pf.stats()["wait_s"]
    t0 = time.perf_counter()
    for _ in range(steps):
        b = next(pf)
        time.sleep(step_s)            # the accelerator step
    wall = time.perf_counter() - t0
    wait = pf.stats()["wait_s"] - w0
    stats = pf.stats()
    pf.close()
    return wait / wall, step_s, stats


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--paths", nargs="+", required=True, help="glob(s) of corpus files")
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=16, help="host batch rows")
    ap.add_argument("--workers", default="0,1,2")
    ap.add_argument("--num-shards", type=int, default=8)
    ap.add_argument("--packing", default="concat")
    ap.add_argument("--shuffle-window", type=int, default=64)
    ap.add_argument("--files-per-stream", type=int, default=2)
    ap.add_argument("--text-key", default="raw_content")
    ap.add_argument("--max-batches", type=int, default=100000)
    ap.add_argument("--max-chars", type=float, default=80e6,
                    help="corpus characters for the tokenizer-alone figure")
    ap.add_argument("--sim-steps", type=int, default=600)
    ap.add_argument("--paired", type=int, default=1,
                    help="re-measure the tokenizer alone before each pipeline run (1/0)")
    ap.add_argument("--pair-chars", type=float, default=30e6)
    args = ap.parse_args()

    import data
    workers = [int(w) for w in args.workers.split(",")]
    files = sorted({f for p in args.paths for f in glob.glob(os.path.expanduser(p))})
    base = dict(paths=tuple(args.paths), tokenizer=args.tokenizer, seq_len=args.seq_len,
                global_batch_size=args.batch_size, num_shards=args.num_shards,
                packing=args.packing, shuffle_window=args.shuffle_window,
                files_per_stream=args.files_per_stream, text_key=args.text_key)
    data.validate(data.DataConfig(**base, num_workers=max(workers)), 1, 1)

    tok_s, corpus_tokens, corpus_chars, tok_cpu = tokenizer_alone(
        files, args.tokenizer, args.text_key, args.max_chars)
    print(f"tokenizer alone: {tok_s / 1e6:.3f} M tok/s over {corpus_tokens / 1e6:.1f} M tokens "
          f"({corpus_chars / 1e6:.1f} M chars)", flush=True)

    rss = RssSampler().start()
    res = {}
    paired = {}
    for n in workers:
        # The machine may be shared: the tokenizer-alone rate is measured again right before
        # each pipeline run, on the same documents, and the ratio is taken per pair.
        if args.paired:
            paired[n] = tokenizer_alone(files, args.tokenizer, args.text_key,
                                        min(args.max_chars, args.pair_chars))[0]
        else:
            paired[n] = tok_s
        cfg = data.DataConfig(**base, num_workers=n)
        r = run_pipeline(cfg, min(corpus_tokens, args.max_chars / 3.0), args.max_batches)
        res[n] = r
        print(f"workers={n}: {r['tok_s'] / 1e6:.3f} M tok/s ({r['tok_s'] / paired[n]:.2f} x "
              f"tokenizer alone measured just before: {paired[n] / 1e6:.3f} M tok/s), first "
              f"batch {r['first_batch_s']:.2f} s, {r['batches']} batches in "
              f"{r['seconds']:.1f} s", flush=True)
    nmax = max(workers)
    cfg = data.DataConfig(**base, num_workers=nmax)
    restore_s = measure_restore(cfg, res[nmax]["state"])
    print(f"restore (deep state, {nmax} workers) -> next batch: {restore_s:.2f} s", flush=True)
    wait_frac, step_s, stats = simulate_training(cfg, args.sim_steps, res[nmax]["tok_s"])
    print(f"simulated loop: step {step_s * 1e3:.1f} ms, wait fraction {wait_frac:.4f}; "
          f"stats {json.dumps({k: v for k, v in stats.items() if k != 'bad_examples'})}",
          flush=True)
    rss.stop()
    tok_s_after, _, _, _ = tokenizer_alone(files, args.tokenizer, args.text_key,
                                        min(args.max_chars, 20e6))
    print(f"tokenizer alone again (load check): {tok_s_after / 1e6:.3f} M tok/s", flush=True)
    best = max(res.values(), key=lambda r: r["tok_s"])
    out = {
        "tokenizer_tok_s": round(tok_s),
        "pipeline_tok_s": {str(n): round(r["tok_s"]) for n, r in res.items()},
        "pipeline_vs_tokenizer": {str(n): round(r["tok_s"] / paired[n], 3)
                                  for n, r in res.items()},
        "tokenizer_tok_s_paired": {str(n): round(v) for n, v in paired.items()},
        "best_pipeline_tok_s": round(best["tok_s"]),
        # cores busy in the host process and in the Grain workers while the pipeline ran
        "cores_main": {str(n): round(r["cores_main"], 2) for n, r in res.items()},
        "cores_workers": {str(n): round(r["cores_workers"], 2) for n, r in res.items()},
        # load-independent: tokens per CPU-second of the whole process tree, relative to
        # the tokenizer alone (1.0 = no overhead beyond tokenization)
        "cpu_efficiency": {str(n): round(r["tok_per_cpu_s"] / tok_cpu, 3)
                           for n, r in res.items()},
        "first_batch_s": {str(n): round(r["first_batch_s"], 3) for n, r in res.items()},
        "restore_s": round(restore_s, 3),
        "peak_rss_mb": round(rss.peak / 2**20, 1),
        "sim_wait_frac": round(wait_frac, 5),
        "tokenizer_tok_s_after": round(tok_s_after),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "seq_len": args.seq_len, "batch_size": args.batch_size, "workers": workers,
        "num_shards": args.num_shards, "files": len(files), "cores": os.cpu_count(),
    }
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()

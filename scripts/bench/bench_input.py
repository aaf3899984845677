"""Input-pipeline benchmark. The LAST printed line is one JSON object.

  python scripts/bench/bench_input.py --paths 'CORPUS/*/en_head.json.gz' --tokenizer TOK.json \
      --seq-len 1024 --batch-size 16 --workers 0,1,2

Figures:
  tokenizer_tok_s   tokenizer alone (encode_batch_fast on all cores, the faster of one parallel
                    call at a time or one serial call per core; documents already in memory,
                    only the encode calls timed): the floor of what the pipeline can reach.
  pipeline_vs_tokenizer  per worker count: pipeline rate / tokenizer alone measured around
                    the same runs (interleaved rounds: the machine's speed drifts).
  cpu_efficiency_paired  per worker count: the pipeline's tokens per CPU-second (whole process
                    tree) / the tokenizer alone's, paired the same way: readable on a host
                    whose other jobs make the wall-clock rates swing.
  pipeline_tok_s    per worker count: steady-state non-padding tokens/s out of the host
                    iterator (after the second batch), over one epoch or --max-batches.
  first_batch_s     per worker count: iterator creation -> first batch.
  second_batch_s    per worker count: first batch -> second: the workers' start when the first
                    batch was made in this process (data.head_batch), left out of the rate.
  restore_s         restore a state saved deep inside the shards -> next batch (max workers).
  peak_rss_mb       peak RSS of the whole process tree (main + Grain workers) while the
                    pipelines ran.
  sim_wait_frac     a training loop whose step is a sleep sized to 80% of the measured
                    steady-state pipeline rate (max workers), through DevicePrefetcher, after a
                    2 s pause standing in for the first step's compile: fraction of wall time
                    blocked on data.
  stage_s / bound   per worker count (last round, after the first batch): seconds per input
                    stage (data/timing.py), and the stage bounding the pipeline; printed as a
                    table at the end, with the simulated loop's (which adds host -> device).
  timer_overhead_frac  the timers' cost from their counts (timed lines + chunks + batches x the
                    cost of one timer measured here) over the pipeline's CPU seconds.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import threading
import time


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


def load_texts(files, text_key, max_chars):
    """The corpus documents in file order, up to max_chars characters."""
    from data.readers.formats import open_records
    texts, n_chars = [], 0
    for f in files:
        rec = open_records(f, text_key)
        try:
            while True:
                raw, n = rec.next()
                if n == 0:
                    break
                text, bad = rec.parse(raw)
                if text is None:
                    continue
                texts.append(text)
                n_chars += len(text)
                if n_chars >= max_chars:
                    return texts
        finally:
            rec.close()
    return texts


def tokenizer_alone(texts, tok_path, method):
    """The tokenizer alone on all cores, timing only the encode calls; two ways to use the
    cores, the faster of which is the floor:
      rayon    one call of 256 documents at a time, parallel inside the tokenizer;
      threads  one serial call of 32 documents per core at a time, on a thread per core.
    -> (tokens/s, tokens incl. one EOS per document, tokens per CPU-second)."""
    from concurrent.futures import ThreadPoolExecutor

    import tokenizers

    from data.tokenizer import available_cores, set_thread_env
    cores = available_cores()
    set_thread_env(cores if method == "rayon" else 1)
    tok = tokenizers.Tokenizer.from_file(tok_path)
    batch = 256 if method == "rayon" else 32
    chunks = [texts[i:i + batch] for i in range(0, len(texts), batch)]

    def run(chunk):
        return sum(len(e.ids) + 1 for e in tok.encode_batch_fast(chunk, add_special_tokens=False))

    run(chunks[0][:8])   # warm up (thread pool start)
    t0, c0 = time.perf_counter(), time.process_time()
    if method == "rayon":
        n_tok = sum(run(c) for c in chunks)
    else:
        with ThreadPoolExecutor(cores) as ex:
            n_tok = sum(ex.map(run, chunks))
    spent, cpu = time.perf_counter() - t0, time.process_time() - c0
    return n_tok / spent, n_tok, n_tok / cpu


def best_tokenizer_alone(texts, tok_path):
    runs = {m: tokenizer_alone(texts, tok_path, m) for m in ("rayon", "threads")}
    best = max(runs, key=lambda m: runs[m][0])
    return runs[best], best, runs


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


def timer_cost_s(n=200_000):
    """(seconds per timed line, per timed chunk or batch): the very statements the reader runs per
    line (three perf_counter calls, two dict adds) and the others per chunk or batch (two calls,
    one add), minus the bare loop."""
    from data.timing import zero_times
    t, pc = zero_times(), time.perf_counter
    t0 = pc()
    for _ in range(n):
        pass
    bare = pc() - t0
    t0 = pc()
    for _ in range(n):
        a = pc()
        b = pc()
        t["read"] += b - a
        t["parse"] += pc() - b
    line = pc() - t0 - bare
    t0 = pc()
    for _ in range(n):
        a = pc()
        t["pack"] += pc() - a
    other = pc() - t0 - bare
    return max(line, 0.0) / n, max(other, 0.0) / n


def run_pipeline(cfg, max_tokens, max_batches, warmup_s=0.0):
    """The host iterator's first batch, the wait for the second, and the rate after it.

    The rate starts at the second batch: the first is made in this process before the worker
    processes start (data.head_batch, data/workers.py), so the second waits for their spawn,
    imports and tokenizer parse, which the workers' own first batch held before the head batch
    (the rate then started after their start). Counted from the first batch, 300 batches of
    16 x 1024 on the shared 2 cores with 2 workers held 1.5-2.1 s of that start (~2 CPU-s): 0.85-1.09
    M tok/s against 1.17-1.73 over batches 150-450 of the same runs, where the rate is the one
    before the head batch (0.85-1.23 x in alternated pairs). `warmup_s`: batches drawn for that
    long after the second are left out of the rate too."""
    import data
    from data.timing import sub_times
    tok = data.load_tokenizer(cfg.tokenizer)   # train.py's, loaded before its feed starts
    t0 = time.perf_counter()
    it = data.make_host_iterator(cfg, 0, 1, tokenizer=tok)
    b = next(it)
    first = time.perf_counter() - t0
    next(it)
    second = time.perf_counter() - t0 - first
    while time.perf_counter() - t0 - first - second < warmup_s:
        next(it)
    per_batch = int((b["segment_ids"] > 0).sum())
    from data.pipeline import state_counters
    c0 = state_counters(it.get_state())
    tok0 = c0["tokens"]   # non-padding tokens of rows (L + 1)
    times0 = it.stage_times()
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
    c = state_counters(state)
    n_tok = c["tokens"] - tok0
    times = sub_times(it.stage_times(), times0)
    if hasattr(it, "close"):
        it.close()
    if n_tok <= 0 or cpu <= 0:
        raise SystemExit(f"bench_input: no tokens counted after the {warmup_s:g} s warm-up ({n} batches): "
                         "a corpus too small for the run; raise --max-batches or lower --warmup-s")
    return {"tok_s": n_tok / dt, "tok_per_cpu_s": n_tok / cpu, "first_batch_s": first, "second_batch_s": second,
            "cores_main": cpu_main / dt, "cores_workers": (cpu - cpu_main) / dt,
            "batches": n, "seconds": dt, "cpu_s": cpu,
            "lines": c["docs"] - c0["docs"] + sum(c["bad"].values()) - sum(c0["bad"].values()),
            "stage_s": times,
            "state": json.loads(json.dumps(state)), "tokens_per_batch": per_batch}


def measure_restore(cfg, state, reps=2):
    """As train.py resumes: restore_host_iterator from the saved host states -> next batch."""
    import data
    best = None
    tok = data.load_tokenizer(cfg.tokenizer)   # train.py's, loaded before its feed starts
    for _ in range(reps):
        t0 = time.perf_counter()
        it = data.restore_host_iterator(cfg, 0, 1, [state], tokenizer=tok)
        next(it)
        dt = time.perf_counter() - t0
        if hasattr(it, "close"):
            it.close()
        best = dt if best is None else min(best, dt)
    return best


def simulate_training(cfg, steps, tok_s, frac=0.8, compile_s=2.0, calib_batches=300,
                      step_s=None):
    """A loop whose accelerator step is a sleep sized so that it consumes `frac` of the rate
    the input pipeline feeds a training loop at. That rate is the lower of `tok_s` (the host
    iterator's steady-state rate, measured over a whole run, not over the first batches,
    which come out of already-filled buffers) and what the DevicePrefetcher delivers when
    nothing throttles it: host -> device costs the prefetch thread ~0.3 ms a batch on CPU,
    negligible beside tokenizing but 40% of the time of a converted corpus's ~0.5 ms batch.
    The first step is followed by a `compile_s` pause, as a real first step compiles while the
    input pipeline fills up; then `calib_batches` unthrottled batches (after the buffers'
    worth) measure the prefetcher's rate, and another `compile_s` pause refills the buffers.
    `step_s`: a fixed step instead (no calibration).
    -> (wait fraction, step seconds, stats, life)."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import data
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    sh = NamedSharding(mesh, P("data"))
    t_start = time.perf_counter()
    pf = data.DevicePrefetcher(data.make_host_iterator(cfg, 0, 1), sh, prefetch=cfg.prefetch)
    b = next(pf)
    jax.block_until_ready(b["inputs"])
    time.sleep(compile_s)
    tokens = float((np.asarray(b["segment_ids"]) > 0).sum())
    per_batch = tokens / tok_s
    if calib_batches and step_s is None:
        for _ in range(cfg.prefetch + 64):   # drain what the pause let pile up
            next(pf)
        t0 = time.perf_counter()
        for _ in range(calib_batches):
            next(pf)
        per_batch = max(per_batch, (time.perf_counter() - t0) / calib_batches)
        # The calibration emptied every buffer, which a training loop never sees: it starts after
        # its compile with them full, and at 80% of the rate they stay full. Refill them as the
        # compile would, so the loop below measures the steady state, not a catch-up.
        time.sleep(compile_s)
    step_s = step_s or per_batch / frac
    w0 = pf.stats()["wait_s"]
    ready_waits, empty_wait = [], 0.0   # next() with a batch buffered (no starvation) or not
    t0 = time.perf_counter()
    for _ in range(steps):
        ready = pf.buffered() > 0
        a = time.perf_counter()
        b = next(pf)
        if ready:
            ready_waits.append(time.perf_counter() - a)
        else:
            empty_wait += time.perf_counter() - a
        time.sleep(step_s)            # the accelerator step
    wall = time.perf_counter() - t0
    wait = pf.stats()["wait_s"] - w0
    stats = pf.stats()
    # Where the wait comes from: the loop's thread getting the GIL and a core on a ready batch
    # (per step, percentiles in us), or an empty buffer (the pipeline behind; share of wall).
    if ready_waits:
        stats["ready_next_us"] = [round(float(np.percentile(ready_waits, p)) * 1e6) for p in (50, 99, 100)]
        stats["ready_wait_frac"] = sum(ready_waits) / wall
    stats["empty_wait_frac"] = empty_wait / wall
    # the stage seconds cover the prefetcher's life: from its start, not from t0
    life = time.perf_counter() - t_start
    pf.close()
    return wait / wall, step_s, stats, life


def main():
    from model.runtime.distributed import quiet_cpu_start

    quiet_cpu_start()   # no libtpu warnings on a machine without a TPU (JAX_PLATFORMS, if set, wins)
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
    ap.add_argument("--rounds", type=int, default=2,
                    help="pipeline runs per worker count, interleaved with tokenizer-alone runs")
    ap.add_argument("--pair-chars", type=float, default=30e6,
                    help="corpus characters for each tokenizer-alone run between pipeline runs")
    ap.add_argument("--warmup-s", type=float, default=0.0,
                    help="seconds of batches after the first left out of each run's rate: the workers' "
                    "start (imports, the tokenizer parsed: ~1 s quiet, several under load) is not "
                    "the steady state a long run sees")
    ap.add_argument("--worker-nice", type=int, default=None,
                    help="data.worker_nice (default: the config's, 10). On a host shared with other "
                    "jobs, niced workers yield to them while the tokenizer alone does not: 0 compares "
                    "the two at the same priority")
    args = ap.parse_args()

    import data
    workers = [int(w) for w in args.workers.split(",")]
    files = sorted({f for p in args.paths for f in glob.glob(os.path.expanduser(p))})
    base = dict(paths=tuple(args.paths), tokenizer=args.tokenizer, seq_len=args.seq_len,
                global_batch_size=args.batch_size, num_shards=args.num_shards,
                packing=args.packing, shuffle_window=args.shuffle_window,
                files_per_stream=args.files_per_stream, text_key=args.text_key)
    if args.worker_nice is not None:
        base["worker_nice"] = args.worker_nice
    load_start = os.getloadavg()[0]
    data.validate(data.DataConfig(**base, num_workers=max(workers)), 1, 1)

    texts = load_texts(files, args.text_key, args.max_chars)
    corpus_chars = sum(len(t) for t in texts)
    (tok_s, corpus_tokens, tok_cpu), method, by_method = best_tokenizer_alone(
        texts, args.tokenizer)
    print(f"tokenizer alone: {tok_s / 1e6:.3f} M tok/s over {corpus_tokens / 1e6:.1f} M tokens "
          f"({corpus_chars / 1e6:.1f} M chars; "
          + ", ".join(f"{m} {r[0] / 1e6:.3f}" for m, r in by_method.items()) + ")", flush=True)
    # the tokenizer-alone runs between pipeline runs use the faster way, on fewer documents
    pair_texts, n = [], 0
    for t in texts:
        if n >= args.pair_chars:
            break
        pair_texts.append(t)
        n += len(t)
    del texts

    rss = RssSampler().start()
    # The machine may be shared and its speed drifts: the tokenizer alone is measured between
    # every two pipeline runs (on the same documents), each pipeline run is paired with the
    # mean of the measurements just before and after it, and the rounds go over all worker
    # counts in turn, so a slow spell does not land on one worker count only.
    # The same pairing in CPU time (tokens per CPU-second of the pipeline's process tree over the
    # tokenizer alone's): what the pipeline spends beyond tokenizing, which a host whose other
    # jobs take the cores in bursts leaves readable when the wall-clock rates are not.
    runs = {n: [] for n in workers}
    pair = {n: [] for n in workers}
    pair_cpu = {n: [] for n in workers}

    def tok_now():
        rate, _, per_cpu = tokenizer_alone(pair_texts, args.tokenizer, method)
        return rate, per_cpu
    before, before_cpu = tok_now()
    for rnd in range(args.rounds):
        for n in workers:
            cfg = data.DataConfig(**base, num_workers=n)
            r = run_pipeline(cfg, min(corpus_tokens, args.max_chars / 3.0), args.max_batches,
                             warmup_s=args.warmup_s)
            after, after_cpu = tok_now()
            runs[n].append(r)
            pair[n].append((before + after) / 2)
            pair_cpu[n].append((before_cpu + after_cpu) / 2)
            print(f"round {rnd + 1}, workers={n}: {r['tok_s'] / 1e6:.3f} M tok/s "
                  f"({r['tok_s'] / pair[n][-1]:.2f} x tokenizer alone around it: "
                  f"{before / 1e6:.3f} / {after / 1e6:.3f} M tok/s; per CPU-second "
                  f"{r['tok_per_cpu_s'] / pair_cpu[n][-1]:.2f} x), first batch "
                  f"{r['first_batch_s']:.2f} s, second {r['second_batch_s']:.2f} s later, "
                  f"{r['batches']} batches in {r['seconds']:.1f} s, "
                  f"load {os.getloadavg()[0]:.1f}", flush=True)
            before, before_cpu = after, after_cpu

    def mean(xs):
        return sum(xs) / len(xs)
    res = {n: {k: mean([r[k] for r in rs]) for k in
               ("tok_s", "tok_per_cpu_s", "cores_main", "cores_workers")}
           for n, rs in runs.items()}
    for n in workers:
        res[n]["first_batch_s"] = min(r["first_batch_s"] for r in runs[n])
        res[n]["second_batch_s"] = min(r["second_batch_s"] for r in runs[n])
        res[n]["state"] = runs[n][-1]["state"]
    paired = {n: mean(v) for n, v in pair.items()}
    nmax = max(workers)
    cfg = data.DataConfig(**base, num_workers=nmax)
    restore_s = measure_restore(cfg, res[nmax]["state"])
    print(f"restore (deep state, {nmax} workers) -> next batch: {restore_s:.2f} s", flush=True)
    wait_frac, step_s, stats, sim_wall = simulate_training(cfg, args.sim_steps, res[nmax]["tok_s"])
    print(f"simulated loop: step {step_s * 1e3:.1f} ms, wait fraction {wait_frac:.4f}; "
          f"stats {json.dumps({k: v for k, v in stats.items() if k not in ('bad_examples', 'stage_s')})}",
          flush=True)
    rss.stop()
    tok_s_after = tok_now()[0]
    print(f"tokenizer alone again (load check): {tok_s_after / 1e6:.3f} M tok/s", flush=True)

    # Where the input time goes: each worker count's last run, then the simulated loop (which
    # adds host -> device). Times are wall seconds summed over threads and processes.
    from data.streams.shard import CHUNK_CHARS, CHUNK_CHARS_PER_TOKEN
    from data.timing import format_table, summarize
    per_line, per_other = timer_cost_s()
    tables, overhead = {}, {}
    for n in workers:
        r = runs[n][-1]
        summ = tables[n] = summarize(r["stage_s"], r["seconds"])
        print(f"\ninput stages, workers={n}: {r['batches']} batches in {r['seconds']:.1f} s "
              f"after the first batch", flush=True)
        print(format_table(summ, r["batches"]), flush=True)
        # per chunk: tokenize + tokenize_wait + pack; per batch: merge, ipc, pack (flush)
        chunks = r["batches"] * r["tokens_per_batch"] * CHUNK_CHARS_PER_TOKEN / CHUNK_CHARS
        cost = r["lines"] * per_line + (3 * chunks + 3 * r["batches"]) * per_other
        overhead[n] = cost / r["cpu_s"]
    print(f"timers: {per_line * 1e9:.0f} ns per timed line, {per_other * 1e9:.0f} ns per other "
          "timer; overhead from the counts: "
          + ", ".join(f"workers={n} {100 * v:.3f}% of the CPU time" for n, v in overhead.items()),
          flush=True)
    sim_table = summarize(stats["stage_s"], sim_wall)
    print(f"\ninput stages, simulated training loop ({nmax} workers, through DevicePrefetcher):",
          flush=True)
    print(format_table(sim_table, stats["batches"]), flush=True)
    best = max(res.values(), key=lambda r: r["tok_s"])
    out = {
        "tokenizer_tok_s": round(tok_s),
        "tokenizer_method": method,
        "tokenizer_tok_s_by_method": {m: round(r[0]) for m, r in by_method.items()},
        "pipeline_tok_s": {str(n): round(r["tok_s"]) for n, r in res.items()},
        "pipeline_vs_tokenizer": {str(n): round(r["tok_s"] / paired[n], 3)
                                  for n, r in res.items()},
        # the tokenizer alone measured around each worker count's runs (mean)
        "tokenizer_tok_s_paired": {str(n): round(v) for n, v in paired.items()},
        "pipeline_tok_s_runs": {str(n): [round(r["tok_s"]) for r in rs]
                                for n, rs in runs.items()},
        "best_pipeline_tok_s": round(best["tok_s"]),
        # cores busy in the host process and in the Grain workers while the pipeline ran
        "cores_main": {str(n): round(r["cores_main"], 2) for n, r in res.items()},
        "cores_workers": {str(n): round(r["cores_workers"], 2) for n, r in res.items()},
        # load-independent: tokens per CPU-second of the whole process tree, relative to
        # the tokenizer alone (1.0 = no overhead beyond tokenization)
        "cpu_efficiency": {str(n): round(r["tok_per_cpu_s"] / tok_cpu, 3)
                           for n, r in res.items()},
        # the same, paired with the tokenizer-alone runs around each pipeline run (per run, then mean)
        "cpu_efficiency_paired": {str(n): round(mean([r["tok_per_cpu_s"] / c for r, c in
                                                      zip(runs[n], pair_cpu[n], strict=True)]), 3)
                                  for n in workers},
        "first_batch_s": {str(n): round(r["first_batch_s"], 3) for n, r in res.items()},
        "second_batch_s": {str(n): round(r["second_batch_s"], 3) for n, r in res.items()},
        "restore_s": round(restore_s, 3),
        "peak_rss_mb": round(rss.peak / 2**20, 1),
        "sim_wait_frac": round(wait_frac, 5),
        "stage_s": {str(n): {k: round(v, 3) for k, v in t["seconds"].items()}
                    for n, t in tables.items()},
        "stage_share": {str(n): {k: round(v, 4) for k, v in t["share"].items()}
                        for n, t in tables.items()},
        "busy": {str(n): {k: round(v, 3) for k, v in t["busy"].items()} for n, t in tables.items()},
        "bound": {str(n): t["bound"] for n, t in tables.items()},
        "sim_stage_s": {k: round(v, 3) for k, v in sim_table["seconds"].items()},
        "sim_bound": sim_table["bound"],
        "timer_ns": {"line": round(per_line * 1e9), "other": round(per_other * 1e9)},
        "timer_overhead_frac": {str(n): round(v, 6) for n, v in overhead.items()},
        "tokenizer_tok_s_after": round(tok_s_after),
        "load_avg_1m": round(os.getloadavg()[0], 2), "load_avg_1m_start": round(load_start, 2),
        "worker_nice": cfg.worker_nice, "warmup_s": args.warmup_s,
        "seq_len": args.seq_len, "batch_size": args.batch_size, "workers": workers,
        "num_shards": args.num_shards, "files": len(files), "cores": os.cpu_count(),
    }
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()

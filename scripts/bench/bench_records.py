"""Converted-corpus benchmark: the converter and the ArrayRecord source. The LAST printed line
is one JSON object.

  python scripts/bench/bench_records.py --paths '/tmp/records/bench/*/en_head.json.gz' \
      --tokenizer TOK.json --work /tmp/records/work [--big-paths '/tmp/records/bench10/*/...']

Figures:
  converter_vs_tokenizer  converter rate / tokenizer alone on the same cores (tokens incl. one
                    EOS per document, like bench_input's tokenizer figure), the tokenizer
                    alone measured just before and just after the conversion (mean).
  records_tok_s     non-padding tokens/s out of the host iterator over the converted corpus
                    (in-process, no input workers: there is nothing to tokenize).
  records_vs_stream records_tok_s / the streaming path's rate on the same text corpus, the
                    streaming runs (its fastest worker count) before and after the records run.
  first_batch_s     iterator creation -> first batch (converted corpus).
  restore_start_s / restore_end_s  restore_host_iterator from a state saved one batch into
                    the first epoch / one batch before a shard's epoch ends -> next batch.
  sim_wait_frac     bench_input's simulated training loop on the converted corpus (step = 80%
                    of what the prefetcher delivers), in-process and (_1_worker) with one
                    input worker process.
  latency_tok_s     records_tok_s with --latency-ms added to every record read call (a
                    stand-in for a bucket).
  peak_rss_mb       peak RSS of a process reading --rss-batches batches of the converted
                    corpus; with --big-paths the same for the (10x) larger corpus.
  bytes_per_token   bytes on disk of the ArrayRecord parts / tokens.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import bench_input  # beside this file  (the tokenizer-alone floor, pipeline runs, RSS sampling)

from train import PROJECT_ROOT  # the project is installed editable


def convert(paths, tokenizer, out):
    """Runs the converter as a user does (its own process: the tokenizer's thread settings are
    made before its first encode) -> ({tokens, docs, seconds of its conversion loop, cpu_s of
    the whole process}, manifest)."""
    import re
    import resource

    from data.streams import records
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    res = subprocess.run([sys.executable, str(PROJECT_ROOT / "scripts" / "prepare_data.py"), "--paths",
                          *paths, "--tokenizer", tokenizer, "--out", out, "--no-progress"],
                         check=True, capture_output=True, text=True)
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    got = re.search(r"in ([\d.]+) s: ([\d,]+) documents, ([\d,]+) tokens", res.stdout)
    seconds, docs, tokens = (float(got[1]), int(got[2].replace(",", "")),
                             int(got[3].replace(",", "")))
    cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    return ({"tokens": tokens, "docs": docs, "seconds": seconds, "cpu_s": cpu},
            records.load_manifest(out))


def cfg_for(paths, args, **kw):
    import data
    base = dict(paths=tuple(paths), tokenizer=args.tokenizer, seq_len=args.seq_len,
                global_batch_size=args.batch_size, num_shards=args.num_shards, num_workers=0)
    base.update(kw)
    return data.DataConfig(**base)


def state_near_epoch_end(cfg, max_batches=200000):
    """The host state one batch before the first shard starts its second epoch."""
    import data
    it = data.make_host_iterator(cfg, 0, 1)
    prev = json.loads(json.dumps(it.get_state()))
    for _ in range(max_batches):
        next(it)
        st = json.loads(json.dumps(it.get_state()))
        if any(s["start"]["epoch"] > 0 for s in st["shards"].values()):
            it.close()
            return prev
        prev = st
    raise RuntimeError("no epoch boundary within max_batches")


def rss_child(out, args) -> float:
    """Peak RSS (MB) of a fresh process reading rss_batches batches of `out`."""
    cmd = [sys.executable, os.path.abspath(__file__), "--rss-child", out, "--tokenizer",
           args.tokenizer, "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size),
           "--num-shards", str(args.num_shards), "--rss-batches", str(args.rss_batches),
           "--paths", "unused"]
    res = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(res.stdout.strip().splitlines()[-1])["peak_rss_mb"]


def main():
    from model.runtime.distributed import quiet_cpu_start

    quiet_cpu_start()   # no libtpu warnings on a machine without a TPU (JAX_PLATFORMS, if set, wins)
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--paths", nargs="+", required=True, help="text corpus globs")
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--work", default="/tmp/records/work", help="converted corpora go here")
    ap.add_argument("--big-paths", nargs="+", help="a larger text corpus (RSS flatness)")
    ap.add_argument("--convert-rounds", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--num-shards", type=int, default=8)
    ap.add_argument("--stream-workers", type=int, default=2)
    ap.add_argument("--stream-tokens", type=float, default=4e6)
    ap.add_argument("--records-tokens", type=float, default=60e6)
    ap.add_argument("--latency-ms", type=float, default=20.0)
    ap.add_argument("--sim-steps", type=int, default=2000)
    ap.add_argument("--sim-step-ms", type=float, default=20.0,
                    help="a second simulated loop with this fixed step")
    ap.add_argument("--rss-batches", type=int, default=3000)
    ap.add_argument("--rss-child", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.rss_child:
        import data
        rss = bench_input.RssSampler().start()
        it = data.make_host_iterator(cfg_for([args.rss_child], args), 0, 1)
        for _ in range(args.rss_batches):
            next(it)
        it.close()
        rss.stop()
        print(json.dumps({"peak_rss_mb": rss.peak / 2**20}))
        return

    import shutil

    from data.listing import list_paths
    from data.streams import records
    from data.streams.records import RecordStore
    from data.tokenizer import load_tokenizer, tokenizer_hash
    out = os.path.join(args.work, "small")
    shutil.rmtree(out, ignore_errors=True)

    # ---- converter vs the tokenizer alone, paired
    # Rounds: tokenizer alone, convert, tokenizer alone, convert, ... (this host's speed
    # drifts by tens of % within a minute); each conversion is paired with the mean of the
    # runs just before and after it. Tokens per CPU-second (the whole process, all threads)
    # is the load-independent view of the same ratio.
    files = list_paths(args.paths).files
    texts = bench_input.load_texts(files, "raw_content", 1e12)
    (before, _, tok_cpu), method, _ = bench_input.best_tokenizer_alone(texts, args.tokenizer)
    tok_runs, conv_runs, ratios, cpu_ratios = [before], [], [], []
    for rnd in range(args.convert_rounds):
        shutil.rmtree(out, ignore_errors=True)
        stats, m = convert(args.paths, args.tokenizer, out)
        conv_cpu = stats["cpu_s"]   # includes the process' start and imports: conservative
        after, _, after_cpu = bench_input.tokenizer_alone(texts, args.tokenizer, method)
        tok_runs.append(after)
        conv_tok_s = (stats["tokens"] + stats["docs"]) / stats["seconds"]
        conv_runs.append(conv_tok_s)
        ratios.append(conv_tok_s / ((tok_runs[-2] + after) / 2))
        cpu_ratios.append((stats["tokens"] + stats["docs"]) / conv_cpu / ((tok_cpu + after_cpu) / 2))
        tok_cpu = after_cpu
        print(f"round {rnd + 1}: converter {conv_tok_s / 1e6:.3f} M tok/s = {ratios[-1]:.3f} x "
              f"the tokenizer alone ({method}: {tok_runs[-2] / 1e6:.3f} before, "
              f"{after / 1e6:.3f} after); per CPU-second {cpu_ratios[-1]:.3f} x", flush=True)
    del texts
    conv_tok_s = sum(conv_runs) / len(conv_runs)
    conv_ratio = sum(ratios) / len(ratios)
    conv_cpu_ratio = sum(cpu_ratios) / len(cpu_ratios)
    bytes_per_token = sum(p["bytes"] for p in m["files"]) / m["tokens"]
    print(f"converter: {conv_ratio:.3f} x the tokenizer alone (mean of {len(ratios)} paired "
          f"runs; per CPU-second {conv_cpu_ratio:.3f} x); {m['documents']} documents, "
          f"{m['tokens'] / 1e6:.1f} M tokens, {bytes_per_token:.3f} bytes/token on disk",
          flush=True)
    assert m["tokenizer"] == tokenizer_hash(load_tokenizer(args.tokenizer))

    # ---- reading: records vs streaming, paired (stream, records, stream)
    rec_cfg = cfg_for([out], args)
    stream_cfg = cfg_for(args.paths, args, num_workers=args.stream_workers)
    s1 = bench_input.run_pipeline(stream_cfg, args.stream_tokens, 10**9)
    r = bench_input.run_pipeline(rec_cfg, args.records_tokens, 10**9)
    s2 = bench_input.run_pipeline(stream_cfg, args.stream_tokens, 10**9)
    stream_tok_s = (s1["tok_s"] + s2["tok_s"]) / 2
    print(f"records: {r['tok_s'] / 1e6:.2f} M tok/s, streaming ({args.stream_workers} workers): "
          f"{s1['tok_s'] / 1e6:.3f} / {s2['tok_s'] / 1e6:.3f} M tok/s -> "
          f"{r['tok_s'] / stream_tok_s:.1f} x; first batch {r['first_batch_s']:.3f} s", flush=True)

    # ---- restore at the start and near the end of an epoch
    import data
    it = data.make_host_iterator(rec_cfg, 0, 1)
    next(it)
    st_start = json.loads(json.dumps(it.get_state()))
    it.close()
    st_end = state_near_epoch_end(rec_cfg)
    restore_start = bench_input.measure_restore(rec_cfg, st_start, reps=3)
    restore_end = bench_input.measure_restore(rec_cfg, st_end, reps=3)
    print(f"restore -> next batch: {restore_start:.3f} s at the start, {restore_end:.3f} s at "
          f"the end of an epoch; state {len(json.dumps(st_end))} bytes", flush=True)

    # ---- simulated training loop: in-process, and with one input worker, which takes the
    # reading and packing (~0.5 ms of Python a batch) off the training process's GIL
    sim = {}
    for n in (0, 1):
        c = cfg_for([out], args, num_workers=n)
        sim[n] = bench_input.simulate_training(c, args.sim_steps, r["tok_s"])[:2]
        print(f"simulated loop, {n} workers: step {sim[n][1] * 1e3:.2f} ms (80% of what the "
              f"prefetcher delivers), wait fraction {sim[n][0]:.5f}", flush=True)
    wait_frac, step_s = sim[0]
    # The same loop with a fixed step, still far shorter than any real step over this batch
    wait_fixed = bench_input.simulate_training(
        rec_cfg, max(50, int(args.sim_steps * 1.0 / args.sim_step_ms)), r["tok_s"],
        step_s=args.sim_step_ms / 1e3)[0]
    print(f"simulated loop, step {args.sim_step_ms:.0f} ms: wait fraction {wait_fixed:.5f}",
          flush=True)

    # ---- added latency per read call
    RecordStore.read_latency_s = args.latency_ms / 1e3
    lat = bench_input.run_pipeline(rec_cfg, min(args.records_tokens, 20e6), 10**9)
    RecordStore.read_latency_s = 0.0
    print(f"with {args.latency_ms:.0f} ms per read call: {lat['tok_s'] / 1e6:.2f} M tok/s, first "
          f"batch {lat['first_batch_s']:.3f} s", flush=True)

    # ---- peak RSS, small and (optionally) 10x corpus
    rss_small = rss_child(out, args)
    rss_big = None
    big_docs = None
    if args.big_paths:
        big = os.path.join(args.work, "big")
        if not os.path.exists(os.path.join(big, records.MANIFEST)):
            shutil.rmtree(big, ignore_errors=True)
            convert(args.big_paths, args.tokenizer, big)
        big_docs = records.load_manifest(big)["documents"]
        rss_big = rss_child(big, args)
    print(f"peak RSS reading {args.rss_batches} batches: {rss_small:.0f} MB ({m['documents']} "
          f"documents)" + (f", {rss_big:.0f} MB ({big_docs} documents)" if rss_big else ""),
          flush=True)

    print(json.dumps({
        "converter_tok_s": round(conv_tok_s), "tokenizer_tok_s_runs": [round(t) for t in tok_runs],
        "tokenizer_method": method, "converter_vs_tokenizer": round(conv_ratio, 3),
        "converter_vs_tokenizer_runs": [round(x, 3) for x in ratios],
        "converter_vs_tokenizer_per_cpu_s": round(conv_cpu_ratio, 3),
        "bytes_per_token": round(bytes_per_token, 3),
        "records_tok_s": round(r["tok_s"]), "stream_tok_s": [round(s1["tok_s"]),
                                                             round(s2["tok_s"])],
        "records_vs_stream": round(r["tok_s"] / stream_tok_s, 2),
        "first_batch_s": round(r["first_batch_s"], 3),
        "restore_start_s": round(restore_start, 3), "restore_end_s": round(restore_end, 3),
        "sim_wait_frac": round(wait_frac, 5), "sim_step_ms": round(step_s * 1e3, 3),
        "sim_wait_frac_1_worker": round(sim[1][0], 5), "sim_step_ms_1_worker": round(sim[1][1] * 1e3, 3),
        "sim_wait_frac_fixed_step": round(wait_fixed, 5), "sim_fixed_step_ms": args.sim_step_ms,
        "latency_ms": args.latency_ms, "latency_tok_s": round(lat["tok_s"]),
        "peak_rss_mb": round(rss_small, 1),
        "peak_rss_mb_big": round(rss_big, 1) if rss_big else None,
        "documents": m["documents"], "documents_big": big_docs,
        "seq_len": args.seq_len, "batch_size": args.batch_size, "num_shards": args.num_shards,
        "cores": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2),
    }), flush=True)


if __name__ == "__main__":
    main()

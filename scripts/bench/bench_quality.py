#!/usr/bin/env python3
"""RedPajama-v2's quality signals in the stream (#56 item 8): what reading and judging the
signals costs per document, and the stream's kept tokens/s with gopher + exact dedup against the
tokenizer alone on the kept documents.

    python ../shared/bench/make_corpus.py /tmp/rpq20 --shards 4 --docs 20000 --median-chars 480
    python scripts/bench/bench_quality.py --corpus /tmp/rpq20 --workers 2 --max-tokens 6000000

The corpus's companion files are written first when missing (scripts/make_sample_companions.py:
our signals, exact duplicates, minhash bands); short documents make gopher drop about 30%. Files
of 20,000 documents, as RPv2's hold tens of thousands: with 1,500 the stream wrapped ~7 epochs in
6 M tokens, opening every file and reading its duplicates file again each time (~3 us a record).
  select_us_per_doc   the reader's `select` stage (the signals line read, parsed and judged, the
                      duplicates lookup) per record, one thread, files in the page cache
  read_us_per_doc     the reader without a selection, per record (read + JSON parse + the seek
                      points of its state, taken every 32 records)
  kept_tok_s          the host iterator with data.quality=gopher data.dedup=exact and --workers
                      input workers: tokens of the kept documents per second, after --warmup-s
                      (the workers' buffers filling: counted from the start, their extra rows go
                      uncounted, ~4% at 12 M tokens)
  tokenizer_tok_s     the tokenizer alone on all cores over the kept documents' texts (an even
                      sample of --reference-docs of them)
  cpu_ratio           the same two per CPU-second (the stream's every process against the tokenizer
                      alone's): what a host's other tenants do not move, where the rates' ratio moves
                      with the cores they leave
and the same two without a selection (every document), the stream's baseline on this corpus.

--rounds N: the stream and the tokenizer alone alternate, N stream runs each between two runs of the
tokenizer alone (its faster way, `rayon` or `threads`, chosen by the first): a round's ratio is its
stream's rate over the mean of the two around it, and the median of the rounds is the figure. On
the shared 2-core machine the tokenizer alone moved 2.6-3.0 M tok/s between runs minutes apart,
as much as the gap to the goal: one pair of runs decides nothing.
"""
from __future__ import annotations

import argparse
import glob
import gzip
import importlib.util
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def _module(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def corpus_with_companions(corpus: str) -> list[str]:
    """The corpus's documents files (make_corpus.py's layout), with RPv2 companion files written
    beside them by scripts/make_sample_companions.py where they are not there yet."""
    from data.readers import companions

    files = sorted(glob.glob(os.path.join(corpus, "*", "en_head.json.gz")))
    if not files:
        sys.exit(f"no {corpus}/*/en_head.json.gz")
    if not os.path.exists(companions.companion_path(files[-1], "minhash")):
        t0 = time.perf_counter()
        _module(os.path.join(REPO, "scripts", "make_sample_companions.py"), "companions_writer").write_companions(files)
        print(f"companions written in {time.perf_counter() - t0:.1f} s", flush=True)
    return files


def read_cost(files: list[str], select) -> tuple[float, int, float]:
    """-> (seconds per record read, records, select-stage seconds) over one epoch of every file,
    the reader's state taken every 32 records as the stream takes it a chunk (its seek points
    found: data/readers/gzpoints.py)."""
    from data.readers.sources import BadRecords, ShardReader
    bad = BadRecords(False)
    r = ShardReader(files, list(range(len(files))), len(files), 0, 0, 1, "raw_content", bad, select=select)
    t0 = time.perf_counter()
    n = 0
    while True:
        _, did, _, last = r.next_piece()
        if did >> 24 >= len(files):   # epoch 1
            break
        n += last
        if n % 32 == 0:
            r.get_state()
    dt = time.perf_counter() - t0
    records = n + sum(bad.counts.values())
    r.close()
    return dt / records, records, r.times["select"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", required=True, help="make_corpus.py's output: DIR/NNNN/en_head.json.gz")
    ap.add_argument("--tokenizer", default=os.path.join(REPO, "data", "sample", "tokenizer.json"))
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=3_000_000)
    ap.add_argument("--warmup-s", type=float, default=3.0,
                    help="batches drawn this long after the second are left out of the stream's rate")
    ap.add_argument("--reference-docs", type=int, default=20_000,
                    help="the tokenizer alone runs on an even sample of this many documents (0: all)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="stream runs per selection, each between two runs of the tokenizer alone")
    ap.add_argument("--stream-only", type=int, default=0, metavar="N",
                    help="only N runs of the stream with gopher + exact, each's rate and rate per CPU-s "
                         "printed: two checkouts compared by alternating this command in each")
    args = ap.parse_args()

    import data
    from data.readers import companions, quality
    files = corpus_with_companions(args.corpus)
    if args.stream_only:
        bench_input = _module(os.path.join(HERE, "bench_input.py"), "bench_input")
        cfg = data.DataConfig(paths=tuple(files), tokenizer=args.tokenizer, seq_len=args.seq_len,
                              global_batch_size=args.batch, num_workers=args.workers, num_shards=len(files),
                              quality="gopher", dedup="exact")
        for _ in range(args.stream_only):
            r = bench_input.run_pipeline(cfg, args.max_tokens, 10_000, args.warmup_s)
            print(f"stream {r['tok_s'] / 1e6:.3f} M tok/s, {r['tok_per_cpu_s'] / 1e6:.3f} M per CPU-s "
                  f"({r['batches']} batches, {r['lines']} records)", flush=True)
        return

    # the reader's costs first, on this process's fresh heap: measured after the texts below were
    # loaded and a sample kept (the rest freed, leaving the heap in holes), the same reads took 4x
    # as long (49-53 against 12 us a record; user time, the page faults the same): the allocator's
    # work, not the reader's
    plain, n, _ = read_cost(files, None)
    sel = companions.Selection(quality.parse("gopher"), "exact")
    with_sel, _, select_s = read_cost(files, sel)
    print(f"read_us_per_doc {plain * 1e6:.1f}  with gopher+exact {with_sel * 1e6:.1f}  "
          f"select_us_per_doc {select_s / n * 1e6:.1f} (over {n} records, one thread)", flush=True)

    # an even sample of the documents for the tokenizer alone: its rate, not the corpus's length
    step = max(1, n // args.reference_docs) if args.reference_docs > 0 else 1
    rules = quality.Rules(quality.parse("gopher"))
    kept_texts, all_texts, sig_bytes, total, kept = [], [], 0, 0, 0
    for f in files:
        dups = companions.duplicate_rows(companions.companion_path(f, "duplicates"))
        with gzip.open(f) as d, gzip.open(companions.companion_path(f, "signals")) as s:
            for row, (doc, sig) in enumerate(zip(d, s, strict=True)):
                total += 1
                sig_bytes += len(sig)
                keep = row not in dups and rules.first_failed(json.loads(sig)["quality_signals"]) is None
                kept += keep
                if total % step == 0:
                    text = json.loads(doc)["raw_content"]
                    all_texts.append(text)
                    if keep:
                        kept_texts.append(text)
    print(f"{total} documents, {kept} kept by gopher + exact ({kept / total:.1%}); signals {sig_bytes / total:.0f} "
          f"bytes per document; the tokenizer alone on every {step}th ({len(kept_texts)} kept)", flush=True)

    bench_input = _module(os.path.join(HERE, "bench_input.py"), "bench_input")
    cfg = data.DataConfig(paths=tuple(files), tokenizer=args.tokenizer, seq_len=args.seq_len,
                          global_batch_size=args.batch, num_workers=args.workers, num_shards=len(files),
                          quality="gopher", dedup="exact")
    import dataclasses
    for name, c, texts in (("gopher + exact", cfg, kept_texts),
                           ("without a selection", dataclasses.replace(cfg, quality=None, dedup=None), all_texts)):
        rounds(name, c, texts, args, bench_input)


def rounds(name: str, cfg, texts: list[str], args, bench_input) -> None:
    """--rounds stream runs of `cfg`, each between two runs of the tokenizer alone on `texts`:
    prints each round and the medians of the ratios (wall and per CPU-second)."""
    (ref, method, _) = bench_input.best_tokenizer_alone(texts, args.tokenizer)
    alone = [ref]
    ratios, cpu_ratios = [], []
    for i in range(args.rounds):
        r = bench_input.run_pipeline(cfg, args.max_tokens, 10_000, args.warmup_s)
        alone.append(bench_input.tokenizer_alone(texts, args.tokenizer, method))
        (a0, _, c0), (a1, _, c1) = alone[-2], alone[-1]
        ratios.append(r["tok_s"] / ((a0 + a1) / 2))
        cpu_ratios.append(r["tok_per_cpu_s"] / ((c0 + c1) / 2))
        print(f"{name}, round {i + 1}: stream {r['tok_s'] / 1e6:.3f} M/s ({args.workers} workers, {r['batches']} "
              f"batches of {args.batch} x {args.seq_len}; {r['tok_per_cpu_s'] / 1e6:.3f} M per CPU-s); the tokenizer "
              f"alone ({method}) {a0 / 1e6:.3f} before, {a1 / 1e6:.3f} after ({c0 / 1e6:.3f} / {c1 / 1e6:.3f} M per "
              f"CPU-s); ratio {ratios[-1]:.2f}, cpu_ratio {cpu_ratios[-1]:.2f}", flush=True)
    print(f"{name}: kept_tok_s ratio median {statistics.median(ratios):.2f} over {len(ratios)} rounds "
          f"({', '.join(f'{x:.2f}' for x in ratios)}); cpu_ratio median {statistics.median(cpu_ratios):.2f}",
          flush=True)

if __name__ == "__main__":
    main()

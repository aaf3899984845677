"""What a length bucket (data.min_doc_tokens / data.max_doc_tokens) costs the input. The LAST
printed line is one JSON object.

  python scripts/bench/bench_buckets.py --paths 'data/sample/000[0-6]/en_head.json.gz' \
      --tokenizer data/sample/tokenizer.json --seq-len 1024 --rounds 3

A bucket is judged after tokenization, so a bucketed stream tokenizes every document and emits
the kept ones: its output rate is the kept share of the tokens times its read rate. Runs
bench_input.py's run_pipeline (one in-process pipeline, data.num_workers=0) without a bucket and
with each bucket, interleaved round by round (the machine's speed drifts); each run reads about
--epoch-share of one pass over the corpus (its output stops at that share of its kept tokens), so
the documents read are about the same whatever the bucket. Per bucket:
  kept_token_share   the corpus's tokens in documents inside the bucket (tokenized here once)
  out_vs_none        output tokens per CPU-second (the process's) / the unbucketed run's
  read_vs_none       (output tokens per CPU-second / kept_token_share) / the unbucketed run's: the
                     filter's own cost on reading and tokenizing documents (1.0 = free); per
                     CPU-second because a shared machine's wall-clock rates swing (the wall-clock
                     figures are printed too)
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_input import load_texts, run_pipeline  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--paths", nargs="+", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--num-shards", type=int, default=4)
    ap.add_argument("--text-key", default="raw_content")
    ap.add_argument("--buckets", default="0:4096,1024:0", help="MIN:MAX pairs (0: no bound)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--epoch-share", type=float, default=0.9, help="of one pass over the corpus, per run")
    args = ap.parse_args()

    import numpy as np

    import data
    files = sorted({f for p in args.paths for f in glob.glob(os.path.expanduser(p))})
    texts = load_texts(files, args.text_key, 1e12)
    tok = data.load_tokenizer(args.tokenizer)
    lens = np.array([len(e.ids) for e in tok.encode_batch(texts, add_special_tokens=False)])
    buckets = [tuple(int(x) for x in b.split(":")) for b in args.buckets.split(",")]
    share = {b: float(lens[(lens >= b[0]) & ((lens <= b[1]) if b[1] else True)].sum() / lens.sum())
             for b in buckets}
    base = dict(paths=tuple(args.paths), tokenizer=args.tokenizer, seq_len=args.seq_len,
                global_batch_size=args.batch_size, num_shards=args.num_shards, text_key=args.text_key,
                num_workers=0)
    runs: dict = {None: [], **{b: [] for b in buckets}}
    for rnd in range(args.rounds):
        for b in runs:
            kw = {} if b is None else dict(min_doc_tokens=b[0], max_doc_tokens=b[1])
            kept = lens.sum() * (1.0 if b is None else share[b])
            r = run_pipeline(data.DataConfig(**base, **kw), args.epoch_share * kept, 100_000)
            runs[b].append((r["tok_per_cpu_s"], r["tok_s"]))
            print(f"round {rnd + 1}, bucket {b or 'none'}: {r['tok_per_cpu_s'] / 1e6:.3f} M tok per CPU-s out, "
                  f"{r['tok_s'] / 1e6:.3f} M tok/s wall, {r['batches']} batches", flush=True)
    none_cpu, none_wall = (float(np.mean([r[i] for r in runs[None]])) for i in (0, 1))
    out = {"corpus_tokens": int(lens.sum()), "documents": len(lens), "none_tok_per_cpu_s": none_cpu,
           "none_tok_s": none_wall, "buckets": {}}
    for b in buckets:
        cpu, wall = (float(np.mean([r[i] for r in runs[b]])) for i in (0, 1))
        out["buckets"][f"{b[0]}:{b[1]}"] = {
            "kept_token_share": share[b], "out_tok_per_cpu_s": cpu, "out_vs_none": cpu / none_cpu,
            "read_vs_none": cpu / share[b] / none_cpu, "wall_out_vs_none": wall / none_wall}
    print(json.dumps(out))


if __name__ == "__main__":
    main()

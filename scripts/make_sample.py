#!/usr/bin/env python3
"""Write the bundled sample corpus: RedPajama-v2-shaped shards of real English text.

    python scripts/make_sample.py --pool ../shared/bench/pool_en.txt.gz --out data/sample

Layout and schema follow RedPajama-v2's document files, so the sample exercises the same code
path as the real corpus: OUT/NNNN/en_head.json.gz, one JSON object per line with the text under
`raw_content` plus `doc_id` and `meta` (a JSON string, as in RPv2).

The pool is a gzip text file of paragraphs separated by a line holding only \\x1e (the record
separator). The one used for the committed sample holds public-domain English: Webster's 1913
dictionary, the Jargon File and fortune cookies. Documents are runs of consecutive paragraphs
whose lengths are drawn from a log-normal law (web documents are heavy-tailed: many short pages,
a few very long ones), so packing sees realistic lengths.
"""
import argparse
import gzip
import json
import math
import os
import random


def read_paragraphs(pool_path: str) -> list[str]:
    with gzip.open(pool_path, "rt", encoding="utf-8") as f:
        return [p.strip() for p in f.read().split("\n\x1e\n") if p.strip()]


def draw_document(rng: random.Random, paragraphs: list[str], median_chars: int, max_chars: int) -> str:
    want = min(max_chars, max(200, int(rng.lognormvariate(math.log(median_chars), 1.0))))
    start = rng.randrange(len(paragraphs))
    pieces, size = [], 0
    while size < want:
        piece = paragraphs[(start + len(pieces)) % len(paragraphs)]
        pieces.append(piece)
        size += len(piece) + 2
    return "\n\n".join(pieces)[:want]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pool", required=True, help="gzip text of paragraphs separated by \\x1e lines")
    ap.add_argument("--out", default="data/sample")
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--docs-per-shard", type=int, default=120)
    ap.add_argument("--median-chars", type=int, default=2000)
    ap.add_argument("--max-chars", type=int, default=40_000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    paragraphs = read_paragraphs(args.pool)
    n_chars = 0
    for shard in range(args.shards):
        rng = random.Random(f"sample:{args.seed}:{shard}")
        shard_dir = os.path.join(args.out, f"{shard:04d}")
        os.makedirs(shard_dir, exist_ok=True)
        path = os.path.join(shard_dir, "en_head.json.gz")
        # mtime=0 keeps the gzip bytes reproducible, so regenerating does not dirty git.
        with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=9, mtime=0) as gz:
            for k in range(args.docs_per_shard):
                text = draw_document(rng, paragraphs, args.median_chars, args.max_chars)
                n_chars += len(text)
                meta = {"url": f"https://sample.invalid/{shard}/{k}", "language": "en"}
                record = {"raw_content": text, "doc_id": f"sample/{shard:04d}/{k}", "meta": json.dumps(meta)}
                gz.write((json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8"))
    print(f"wrote {args.shards} shards x {args.docs_per_shard} documents, "
          f"{n_chars / 1e6:.2f} M characters to {args.out}")


if __name__ == "__main__":
    main()

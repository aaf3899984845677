#!/usr/bin/env python3
"""Write the bundled second sample source: this project's own Python code as documents.

    python scripts/make_sample_code.py --out data/sample_code

The mixture example (configs/data/sample_mix.yaml) mixes it with the English sample: a
"code" source with its own text key (`text`, as in The Stack / StarCoder data), small enough
that it runs through several epochs in a short run. OUT/NNNN/code.jsonl.gz, one JSON object
per line: {"text": file contents, "path": path in the repository}; files dealt round-robin
over --files shards (a mixture needs at least data.num_shards files per source).
"""
import argparse
import gzip
import json
import os

from train import PROJECT_ROOT as ROOT  # the repo root (the project is installed)

PACKAGES = ("train.py", "model", "data", "scripts")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "data" / "sample_code"))
    ap.add_argument("--files", type=int, default=4)
    args = ap.parse_args()
    sources = []
    for entry in PACKAGES:
        p = ROOT / entry
        sources += [p] if p.is_file() else sorted(p.rglob("*.py"))
    shards = [[] for _ in range(args.files)]
    for i, path in enumerate(sources):
        rel = path.relative_to(ROOT).as_posix()
        shards[i % args.files].append(json.dumps({"text": path.read_text(), "path": rel}))
    for j, lines in enumerate(shards):
        d = os.path.join(args.out, f"{j:04d}")
        os.makedirs(d, exist_ok=True)
        # mtime=0: the same code gives the same bytes
        with open(os.path.join(d, "code.jsonl.gz"), "wb") as raw, \
                gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as f:
            f.write(("\n".join(lines) + "\n").encode())
    print(f"{len(sources)} documents in {args.files} files under {args.out}")


if __name__ == "__main__":
    main()

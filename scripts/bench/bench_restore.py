"""Restore cost versus the position in the files. The LAST printed line is one JSON object.

  python ../shared/bench/make_corpus.py /tmp/seek/big --shards 4 --docs 36000
  python scripts/bench/bench_restore.py --paths '/tmp/seek/big/*/en_head.json.gz' \
      --tokenizer ../shared/bench/llama_style_tokenizer.json

One virtual shard per file (one file open per shard), in-process. For each line in --lines,
every shard's state is placed at the start of a window at that line, as a saved state there
would be (line, byte offset and, for .gz, the seek point the reader would have saved), and
the host iterator is restored -> first batch. Paired in one run (the machine's speed drifts):
  restore_s          per line: restore -> first batch (best of --reps)
  read_mb_per_file   per line: bytes this process read during that restore (/proc/self/io
                     rchar: the tokenizer file included), per open file
  deep_vs_shallow    restore_s at the deepest line / at the shallowest
  no_point_s         the deepest line restored without a seek point (a re-read from the
                     file's start, as before seek points): what they save
Decompression of one file (MB/s of text, paired):
  isal_mb_s          isal.igzip, lines, whole file (the streaming reader)
  finder_mb_s        gzseek.PointFinder walked over the whole file as the reader refreshes
                     its point (every SPACING / 2): the extra work of keeping seek points
  resumed_mb_s       zlib inflate from a seek point to the end (a restored reader)
  tokenize_mb_s      the tokenizer alone (encode_batch, all cores) on the file's first
                     ~8 MB of text, measured in the same run
  finder_vs_tokenize the finder's time per MB of text / the tokenizer's: the share of the
                     input work that keeping seek points adds
"""
from __future__ import annotations

import argparse
import json
import time


def rchar() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar")).split()[1])


def line_offset(path: str, line: int) -> int:
    """Byte offset of 0-based `line` (reads the file from its start: preparation only)."""
    from data.readers.formats import open_bytes
    off = 0
    with open_bytes(path) as fh:
        for _ in range(line):
            off += len(fh.readline())
    return off


def shard_states_at(files: list[str], line: int, with_point: bool = True) -> dict:
    """A window-start state of every shard (shard v = file v) at `line`."""
    from data.readers import gzseek
    from data.streams.shard import initial_shard_state
    out = {}
    for v, path in enumerate(files):
        off = line_offset(path, line)
        point = None
        if with_point and path.endswith(".gz"):
            finder = gzseek.PointFinder(path)
            point = finder.point_before(off)
            finder.close()
        st = initial_shard_state()
        st["start"]["reader"] = {"epoch": 0, "next": 1, "slots": [[0, line, 0, off, point]],
                                 "rr": 0, "edocs": 0}
        out[str(v)] = st
    return json.loads(json.dumps(out))


def restore_once(cfg, states: dict) -> tuple[float, int]:
    import data
    r0 = rchar()
    t0 = time.perf_counter()
    it = data.make_host_iterator(cfg, 0, 1, shard_states=states)
    next(it)
    dt = time.perf_counter() - t0
    it.close()
    return dt, rchar() - r0


def tokenize_rate(path: str, tokenizer: str, chars: float = 8e6) -> float:
    """MB of text per second through the tokenizer alone (all cores)."""
    import orjson
    from isal import igzip
    from tokenizers import Tokenizer
    texts, n = [], 0
    with igzip.open(path, "rb") as fh:
        for line in fh:
            texts.append(orjson.loads(line)["raw_content"])
            n += len(texts[-1])
            if n >= chars:
                break
    tok = Tokenizer.from_file(tokenizer)
    t0 = time.perf_counter()
    tok.encode_batch(texts, add_special_tokens=False)
    return sum(len(t.encode()) for t in texts) / 1e6 / (time.perf_counter() - t0)


def decompression(path: str, tokenizer: str) -> dict:
    from isal import igzip

    from data.readers import gzseek
    tok_mb_s = tokenize_rate(path, tokenizer)
    t0 = time.perf_counter()
    n = 0
    with igzip.open(path, "rb") as fh:
        for line in fh:
            n += len(line)
    isal_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    finder = gzseek.PointFinder(path)
    first = None
    for off in range(0, n, gzseek.SPACING // 2):
        pt = finder.point_before(off)
        first = first or pt
    finder.close()
    finder_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    fh = gzseek.open_gz_at(path, first, first[3])
    m = 0
    for line in fh:
        m += len(line)
    fh.close()
    resumed_s = time.perf_counter() - t0
    mb = n / 1e6
    return {"text_mb": round(mb, 1), "isal_mb_s": round(mb / isal_s, 1),
            "finder_mb_s": round(mb / finder_s, 1),
            "resumed_mb_s": round(m / 1e6 / resumed_s, 1),
            "tokenize_mb_s": round(tok_mb_s, 2),
            "finder_vs_tokenize": round(tok_mb_s / (mb / finder_s), 4),
            "point_json_bytes": len(json.dumps(first))}


def main():
    from model.runtime.distributed import quiet_cpu_start

    quiet_cpu_start()   # no libtpu warnings on a machine without a TPU (JAX_PLATFORMS, if set, wins)
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--paths", nargs="+", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--rows-per-shard", type=int, default=4)
    ap.add_argument("--lines", default="100,35000")
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()

    import data
    files = data.list_files(data.DataConfig(paths=tuple(args.paths), tokenizer=args.tokenizer,
                                            seq_len=args.seq_len, global_batch_size=1))
    V = len(files)
    cfg = data.DataConfig(paths=tuple(args.paths), tokenizer=args.tokenizer,
                          seq_len=args.seq_len, global_batch_size=V * args.rows_per_shard,
                          num_workers=0, num_shards=V, files_per_stream=1)
    lines = [int(x) for x in args.lines.split(",")]
    states = {ln: shard_states_at(files, ln) for ln in lines}
    no_point = shard_states_at(files, lines[-1], with_point=False)
    res = {ln: [] for ln in lines}
    res["no_point"] = []
    for _ in range(args.reps):   # interleaved rounds: pairs see the same machine
        for ln in lines:
            res[ln].append(restore_once(cfg, states[ln]))
        res["no_point"].append(restore_once(cfg, no_point))
    out = {"files": V, "lines": lines, "restore_s": {}, "read_mb_per_file": {}}
    for ln in lines:
        out["restore_s"][ln] = round(min(t for t, _ in res[ln]), 3)
        out["read_mb_per_file"][ln] = round(min(b for _, b in res[ln]) / V / 1e6, 2)
        print(f"line {ln}: restore -> first batch {out['restore_s'][ln]:.2f} s, "
              f"read {out['read_mb_per_file'][ln]:.1f} MB per open file", flush=True)
    out["no_point_s"] = round(min(t for t, _ in res["no_point"]), 3)
    out["no_point_read_mb_per_file"] = round(min(b for _, b in res["no_point"]) / V / 1e6, 2)
    out["deep_vs_shallow"] = round(out["restore_s"][lines[-1]] / out["restore_s"][lines[0]], 3)
    print(f"line {lines[-1]} without a seek point (re-read from the start): "
          f"{out['no_point_s']:.2f} s, {out['no_point_read_mb_per_file']:.1f} MB per file")
    print(f"deep / shallow restore: {out['deep_vs_shallow']:.2f}x", flush=True)
    if files[0].endswith(".gz"):
        out["decompression"] = decompression(files[0], args.tokenizer)
        print("decompression of one file (MB/s of text):", out["decompression"], flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()

"""Where a traced step's device time goes: the JAX profiler's trace, summed by kernel.

    python scripts/bench/bench_step.py --preset 1b --seq 2048 --batch 16 --attention cudnn --profile /tmp/p
    python scripts/bench/profile_top.py /tmp/p --steps 3

Reads the newest `plugins/profile/*/*.trace.json.gz` under DIR (JAX writes it beside the xplane).
For each device process of the trace (a GPU's `/device:GPU:0`, ...): the traced span, the time its
streams were busy (the union of the kernels' intervals; the rest is the device idling on the host:
launch gaps, syncs), and the kernels summed by name and by kind (matmul, attention, collective,
copy, other fused elementwise/reduction work), each as a share of the busy time. With --steps N
the figures are also given per step. Prints a table; --json writes the same figures as one object.
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys

# Kernel names by what they do. Matched in this order on the lower-cased name.
KINDS = [
    ("attention", re.compile(r"fmha|flash|cudnn|attention|sdpa")),
    ("matmul", re.compile(r"gemm|cublas|cutlass|xmma|nvjet|matmul|dot|wgmma|sm90_|sm80_")),
    ("collective", re.compile(r"nccl|all-reduce|all-gather|reduce-scatter|allreduce|allgather")),
    ("copy", re.compile(r"memcpy|memset|copy")),
]


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, pattern in KINDS:
        if pattern.search(low):
            return kind
    return "other (fusions)"


def newest_trace(root: str) -> str:
    found = glob.glob(os.path.join(root, "plugins", "profile", "*", "*.trace.json.gz"))
    if not found:
        raise SystemExit(f"profile_top: no plugins/profile/*/*.trace.json.gz under {root}")
    return max(found, key=os.path.getmtime)


def union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, None
    start = None
    for a, b in sorted(intervals):
        if end is None or a > end:
            if end is not None:
                total += end - start
            start, end = a, b
        else:
            end = max(end, b)
    if end is not None:
        total += end - start
    return total


def summarize(path: str, top: int = 15, steps: int = 1, device_prefix: str = "/device:GPU") -> dict:
    with gzip.open(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    proc_names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    thread_names = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
                    if e.get("ph") == "M" and e.get("name") == "thread_name"}
    devices = {pid: name for pid, name in proc_names.items() if name.startswith(device_prefix)}
    if not devices:
        raise SystemExit(f"profile_top: no process named {device_prefix}* in {path}; "
                         f"processes: {sorted(set(proc_names.values()))}")
    out = {"trace": path, "steps": steps, "devices": {}}
    for pid, pname in sorted(devices.items()):
        # Kernels run on the stream threads; the XLA Ops / Modules lines (where present) repeat them.
        kernels = [e for e in events if e.get("ph") == "X" and e.get("pid") == pid
                   and not re.search(r"XLA (Ops|Modules)|Steps|TraceMe", thread_names.get((pid, e.get("tid")), ""))]
        if not kernels:
            continue
        spans = [(e["ts"], e["ts"] + e.get("dur", 0.0)) for e in kernels]
        span = max(b for _, b in spans) - min(a for a, _ in spans)
        busy = union_length(spans)
        by_name = collections.Counter()
        count = collections.Counter()
        for e in kernels:
            by_name[e["name"]] += e.get("dur", 0.0)
            count[e["name"]] += 1
        by_kind = collections.Counter()
        for name, dur in by_name.items():
            by_kind[kind_of(name)] += dur
        summed = sum(by_name.values())
        out["devices"][pname] = {
            "span_ms": round(span / 1e3, 3), "busy_ms": round(busy / 1e3, 3),
            "busy_frac": round(busy / span, 4) if span else None,
            "kernels": len(kernels), "kernel_ms_summed": round(summed / 1e3, 3),
            "by_kind": {k: {"ms_per_step": round(v / 1e3 / steps, 3), "frac": round(v / summed, 4)}
                        for k, v in by_kind.most_common()},
            "top": [{"name": n[:120], "kind": kind_of(n), "ms_per_step": round(v / 1e3 / steps, 3),
                     "calls_per_step": round(count[n] / steps, 1), "frac": round(v / summed, 4)}
                    for n, v in by_name.most_common(top)],
        }
    return out


def print_table(s: dict) -> None:
    print(f"trace: {s['trace']} ({s['steps']} step(s))")
    for dev, d in s["devices"].items():
        per = s["steps"]
        print(f"{dev}: span {d['span_ms'] / per:.2f} ms/step, busy {d['busy_ms'] / per:.2f} ms/step "
              f"({d['busy_frac']:.1%} of the span; the rest the device waited), {d['kernels'] // per} kernels/step")
        for kind, v in d["by_kind"].items():
            print(f"  {kind:<16} {v['ms_per_step']:>9.2f} ms/step  {v['frac']:6.1%}")
        print("  top kernels:")
        for t in d["top"]:
            print(f"    {t['ms_per_step']:>9.2f} ms  {t['frac']:6.1%}  x{t['calls_per_step']:<6g} "
                  f"{t['kind']:<12} {t['name']}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", help="the profile directory (bench_step.py --profile DIR, or a run's profile/)")
    p.add_argument("--steps", type=int, default=1, help="steps in the trace (figures per step)")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--device-prefix", default="/device:GPU", help="processes to read (e.g. /device:TPU, /host:CPU)")
    p.add_argument("--json", type=str, default=None, help="also write the figures here")
    args = p.parse_args(argv)
    s = summarize(newest_trace(args.dir), args.top, args.steps, args.device_prefix)
    print_table(s)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(s, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

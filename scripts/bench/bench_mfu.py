"""A sweep of train-step settings for MFU (issue #25 Part 2), one `bench_step.py` process per try.

    python scripts/bench/bench_mfu.py --plan gpu --out mfu.jsonl        # on a GPU host: ~10 min
    python scripts/bench/bench_mfu.py --plan gpu --only 1b_s2048        # the tries whose name holds it
    python scripts/bench/bench_mfu.py --plan gpu --only _fp8            # model.fp8's tries (Hopper+)
    python scripts/bench/bench_mfu.py --plan cpu                        # the driver itself, tiny, on CPU

Each try is a fresh process (XLA flags are read when the backend starts, and a try that runs out of
memory must not take the others with it) with its own time limit. A try that fails is a row with its
reason ("out of memory" for the allocator's RESOURCE_EXHAUSTED), not the end of the sweep. Prints a
table as the tries finish and appends every try's bench_step JSON (plus "name", "status", "error")
to --out, the figures BENCHMARKS.md records, kept and rejected alike.

MFU columns: `mfu` counts attention as the full square (PaLM, model/flops.py), `mfu_causal` only
its lower triangle (the count torchtitan quotes), `vs_probe` the causal count against the bf16
matmul rate the same device reached in the same process (--matmul-probe), beside the datasheet's.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

BENCH_STEP = Path(__file__).resolve().parent / "bench_step.py"
sys.path.insert(0, str(BENCH_STEP.parent))
import profile_top  # noqa: E402 - beside this script

# Whose kernels a try's profile sums: the GPU's (the CPU plan reads the host's XLA threads).
DEVICE_PREFIX = os.environ.get("BENCH_MFU_DEVICE_PREFIX", "/device:GPU")

# XLA's GPU flags worth a try for a dense transformer step (XLA_FLAGS of the try's process).
LHS = "--xla_gpu_enable_latency_hiding_scheduler=true"
NO_TRITON_GEMM = "--xla_gpu_enable_triton_gemm=false"
TRITON_GEMM_ANY = "--xla_gpu_triton_gemm_any=true"


def _try(name, args, xla_flags=""):
    return {"name": name, "args": args, "xla_flags": xla_flags}


def _gpu_args(preset, seq, batch, attention, remat, *extra, steps=8):
    # A try's name says whether it runs cuDNN's packed layout ("packed<M>"); the others run the
    # segment mask as a bias, as they did when measured (the presets now default to the packed).
    packed = [] if "--packed-segments" in extra else ["--packed-segments", "0"]
    return ["--preset", preset, "--seq", str(seq), "--batch", str(batch), "--attention", attention,
            "--remat", remat, "--steps", str(steps), "--warmup", "2", "--matmul-probe", "8192", *packed, *extra]


def gpu_plan() -> list[dict]:
    """One GPU (H100 80 GB / H200 141 GB), in the order that answers the issue first: the 1b at seq
    2048 (the goal: >= 50% MFU) without and with remat, cuDNN vs XLA attention, the Llama-3-shaped
    1b (128k vocabulary), then seq 1024 and the 125m; then the second round's variants of the 1b
    (bigger batches, the flags, the chunked loss), worth running once the first round says which
    remat and batch fit."""
    a = _gpu_args
    return [
        _try("1b_s2048_cudnn_none_b16", a("1b", 2048, 16, "cudnn", "none")),
        _try("1b_s2048_cudnn_dots_b16", a("1b", 2048, 16, "cudnn", "dots")),
        _try("1b_s2048_xla_dots_b16", a("1b", 2048, 16, "xla", "dots")),
        _try("llama3_2_1b_s2048_cudnn_none_b8", a("llama3_2_1b", 2048, 8, "cudnn", "none")),
        _try("1b_s1024_cudnn_none_b32", a("1b", 1024, 32, "cudnn", "none")),
        _try("125m_s2048_cudnn_none_b32", a("125m", 2048, 32, "cudnn", "none")),
        _try("125m_s1024_cudnn_none_b64", a("125m", 1024, 64, "cudnn", "none")),
        # second round, after the first on an H100 (BENCHMARKS.md): remat none ran out of memory at
        # 16 rows of 2048; dots fit at 47 GB, its profile showed cuDNN's attention forward run twice
        # and the vocabulary projection's backward in fp32: "dots_attention" and project_to_vocab.
        _try("1b_s2048_cudnn_dotsattn_b16", a("1b", 2048, 16, "cudnn", "dots_attention")),
        _try("1b_s2048_cudnn_dots_b16_bf16head", a("1b", 2048, 16, "cudnn", "dots")),
        _try("llama3_2_1b_s2048_cudnn_none_b8_bf16head", a("llama3_2_1b", 2048, 8, "cudnn", "none")),
        _try("1b_s2048_cudnn_dotsattn_b16_notriton", a("1b", 2048, 16, "cudnn", "dots_attention"), NO_TRITON_GEMM),
        _try("1b_s1024_cudnn_dotsattn_b32", a("1b", 1024, 32, "cudnn", "dots_attention")),
        _try("1b_s2048_cudnn_dotsattn_b24", a("1b", 2048, 24, "cudnn", "dots_attention")),
        _try("1b_s2048_cudnn_none_b8", a("1b", 2048, 8, "cudnn", "none")),
        _try("1b_s2048_cudnn_dotsattn_b16_lhs", a("1b", 2048, 16, "cudnn", "dots_attention"), LHS),
        _try("1b_s2048_cudnn_dotsattn_b32_chunk512",
             a("1b", 2048, 32, "cudnn", "dots_attention", "--loss-chunk", "512")),
        # third round, after the second (BENCHMARKS.md): cuDNN attention was 23% of the step at ~195
        # TFLOP/s, reading the segment mask as a bias; the packed layout reads none.
        _try("1b_s2048_cudnn_dotsattn_b16_packed8",
             a("1b", 2048, 16, "cudnn", "dots_attention", "--packed-segments", "8")),
        _try("1b_s2048_cudnn_dotsattn_b16_packed16",
             a("1b", 2048, 16, "cudnn", "dots_attention", "--packed-segments", "16")),
        _try("1b_s2048_cudnn_dotsattn_b24_packed16",
             a("1b", 2048, 24, "cudnn", "dots_attention", "--packed-segments", "16")),
        _try("llama3_2_1b_s2048_cudnn_none_b8_packed16",
             a("llama3_2_1b", 2048, 8, "cudnn", "none", "--packed-segments", "16")),
        # fourth: the packed layout at 8 documents a row (the faster of 8 and 16 on the H100)
        _try("1b_s2048_cudnn_dotsattn_b24_packed8",
             a("1b", 2048, 24, "cudnn", "dots_attention", "--packed-segments", "8")),
        _try("llama3_2_1b_s2048_cudnn_none_b8_packed8",
             a("llama3_2_1b", 2048, 8, "cudnn", "none", "--packed-segments", "8")),
        _try("1b_s1024_cudnn_dotsattn_b32_packed8",
             a("1b", 1024, 32, "cudnn", "dots_attention", "--packed-segments", "8")),
        # fifth, for the next lent GPU: the packed step spends 24% in elementwise fusions, part of
        # them remat's recompute; fewer rows without remat (16 rows ran out of memory unpacked)
        _try("1b_s2048_cudnn_none_b12_packed8", a("1b", 2048, 12, "cudnn", "none", "--packed-segments", "8")),
        _try("1b_s2048_cudnn_none_b8_packed8", a("1b", 2048, 8, "cudnn", "none", "--packed-segments", "8")),
        _try("1b_s1024_cudnn_dotsattn_b32_packed16",
             a("1b", 1024, 32, "cudnn", "dots_attention", "--packed-segments", "16")),
        # sixth: model.fp8 (the q/k/v/o and MLP matmuls in FP8, docs/gpus.md), each beside its bf16
        # try above in the same session (gpu_session.sh ROUND=5): tokens/s is the comparison.
        _try("1b_s2048_cudnn_dotsattn_b16_packed8_fp8",
             a("1b", 2048, 16, "cudnn", "dots_attention", "--packed-segments", "8", "--fp8")),
        _try("llama3_2_1b_s2048_cudnn_none_b8_packed8_fp8",
             a("llama3_2_1b", 2048, 8, "cudnn", "none", "--packed-segments", "8", "--fp8")),
    ]


def cpu_plan() -> list[dict]:
    """The driver on CPU with the tiny model: a try that runs, one with a flag, one that fails."""
    common = ["--preset", "tiny", "--seq", "64", "--steps", "2", "--warmup", "1", "--peak-flops", "1e11"]
    return [
        _try("tiny_b16", [*common, "--batch", "16", "--matmul-probe", "256"]),
        _try("tiny_b16_mb2_chunk32", [*common, "--batch", "16", "--microbatches", "2", "--loss-chunk", "32"],
             "--xla_cpu_enable_fast_math=false"),
        _try("tiny_b15_mb2_fails", [*common, "--batch", "15", "--microbatches", "2"]),
        _try("tiny_b16_fp8", [*common, "--batch", "16", "--fp8", "--matmul-probe", "256"]),
    ]


PLANS = {"gpu": gpu_plan, "cpu": cpu_plan}


def error_line(stderr: str) -> str:
    """The reason a try failed, in one line: out of memory, else the last exception line."""
    if "RESOURCE_EXHAUSTED" in stderr or "out of memory" in stderr.lower():
        return "out of memory"
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error" in line]
    return (errors or lines or ["no output"])[-1].strip()[:300]


def run_try(t: dict, timeout_s: float) -> dict:
    # JAX preallocates 75% of a GPU by default; a plan that needs more would read as out of memory.
    env = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9", **os.environ}
    if t["xla_flags"]:
        env["XLA_FLAGS"] = " ".join(f for f in (env.get("XLA_FLAGS", ""), t["xla_flags"]) if f)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, str(BENCH_STEP), *t["args"]], capture_output=True, text=True,
                              env=env, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"name": t["name"], "status": "timeout", "error": f"over {timeout_s:.0f} s", "args": t["args"]}
    wall = round(time.perf_counter() - t0, 1)
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    if proc.returncode == 0 and last.startswith("{"):
        return {"name": t["name"], "status": "ok", "wall_s": wall, "args": t["args"], **json.loads(last)}
    return {"name": t["name"], "status": "failed", "error": error_line(proc.stderr), "wall_s": wall,
            "args": t["args"]}


def profile_of(path: Path, name: str) -> dict | None:
    """The try's traced steps summed by kernel (profile_top.py), printed and returned for its row."""
    try:
        summary = profile_top.summarize(profile_top.newest_trace(str(path)), top=12, steps=3,
                                        device_prefix=DEVICE_PREFIX)
    except SystemExit as e:   # no trace, or no device process in it: the row says so
        return {"error": str(e)}
    print(f"--- profile of {name}", flush=True)
    profile_top.print_table(summary)
    return summary


def table_row(r: dict) -> str:
    if r["status"] != "ok":
        return f"{r['name']:<36} {r['status']}: {r['error']}"

    def pct(v):
        return "-" if v is None else f"{v:.1%}"

    peak = r.get("peak_bytes_in_use")
    return (f"{r['name']:<36} step {r['step_s_median']:.4f} s  tok/s {r['tokens_per_s']:>12,.0f}  "
            f"mfu {pct(r['mfu'])}  causal {pct(r['mfu_causal'])}  vs_probe {pct(r['mfu_causal_vs_probe'])}  "
            f"peak {'-' if peak is None else f'{peak / 2**30:.1f} GiB'}  ({r['wall_s']:.0f} s)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plan", choices=sorted(PLANS), default="gpu")
    p.add_argument("--only", default="", help="run only the tries whose name contains this")
    p.add_argument("--names", default="", help="run only these tries (comma-separated full names, in this order)")
    p.add_argument("--profile-dir", type=Path, default=None,
                   help="trace 3 steps of each try after its timed ones into DIR/<name> and add where the "
                        "device time went (scripts/bench/profile_top.py) to its row")
    p.add_argument("--out", type=Path, help="append each try's JSON here (one line a try)")
    p.add_argument("--timeout-s", type=float, default=240.0, help="per try (compile included)")
    args = p.parse_args(argv)

    tries = [t for t in PLANS[args.plan]() if args.only in t["name"]]
    if args.names:
        by_name = {t["name"]: t for t in tries}
        unknown = [n for n in args.names.split(",") if n not in by_name]
        if unknown:
            raise SystemExit(f"bench_mfu: plan {args.plan!r} has no try named {', '.join(unknown)}")
        tries = [by_name[n] for n in args.names.split(",")]
    if not tries:
        raise SystemExit(f"bench_mfu: no try of plan {args.plan!r} matches --only {args.only!r}")
    results = []
    for t in tries:
        if args.profile_dir:
            t = {**t, "args": [*t["args"], "--profile", str(args.profile_dir / t["name"])]}
        r = run_try(t, args.timeout_s)
        if args.profile_dir and r["status"] == "ok":
            r["profile"] = profile_of(args.profile_dir / t["name"], t["name"])
        results.append(r)
        print(table_row(r), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(r) + "\n")
    return 0 if any(r["status"] == "ok" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

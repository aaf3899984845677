"""Benchmark the train step: step time, tokens/s and MFU for a model preset on a mesh.

Random tokens (packed into a few documents per row), AdamW, the real sharded init and the
real jitted train step from model/step.py. Prints progress, then one JSON line at the end.

    python scripts/bench/bench_step.py --preset tiny --batch 16 --seq 256              # CPU default
    python scripts/bench/bench_step.py --preset 1b --mesh fsdp --batch 512 --seq 1024 --attention splash
    python scripts/bench/bench_step.py --preset 1b --seq 2048 --batch 16 --attention cudnn --fp8    # Hopper+
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python scripts/bench/bench_step.py --mesh fsdp_tp
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import yaml  # noqa: E402

from model import flops, sharding, step  # noqa: E402
from model.llama import FP8_FORWARD, LlamaConfig  # noqa: E402
from train import PROJECT_ROOT  # noqa: E402 - the repo root (the project is installed editable)

# scripts/bench/ -> the repository root
CONFIGS = str(PROJECT_ROOT / "configs")


def load_yaml(group: str, name: str) -> dict:
    with open(os.path.join(CONFIGS, group, f"{name}.yaml")) as f:
        return yaml.safe_load(f)


def random_batch(rng, batch: int, seq: int, vocab: int, docs_per_row: int) -> dict:
    """Rows of `docs_per_row` packed documents with positions restarting per document."""
    tokens = rng.integers(0, vocab, (batch, seq + 1), dtype=np.int32)
    bounds = np.sort(rng.choice(np.arange(1, seq), docs_per_row - 1, replace=False)) if docs_per_row > 1 else []
    seg = np.zeros(seq, np.int32)
    for b0 in bounds:
        seg[b0:] += 1
    seg += 1
    starts = np.r_[0, bounds].astype(np.int32)
    pos = np.arange(seq, dtype=np.int32) - starts[seg - 1]
    tile = lambda a: np.broadcast_to(a, (batch, seq)).copy()  # noqa: E731
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": tile(seg),
            "positions": tile(pos), "loss_mask": np.ones((batch, seq), np.int32)}


def matmul_rate(n: int, dtype: str, repeats: int = 10, fp8: bool = False) -> float:
    """FLOP/s one device reaches on an n x n x n matmul in `dtype` (median of `repeats`, after a
    compile): the achievable ceiling to set MFU against, beside the datasheet peak. fp8: e4m3
    operands, the output in `dtype` (model.fp8's GEMM)."""
    a = jnp.ones((n, n), FP8_FORWARD if fp8 else dtype)
    mm = jax.jit(lambda x, y: jnp.matmul(x, y, preferred_element_type=jnp.dtype(dtype)))
    mm(a, a).block_until_ready()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mm(a, a).block_until_ready()
        times.append(time.perf_counter() - t0)
    return 2 * n ** 3 / float(np.median(times))


def timed_steps(train_step, state, batch, steps: int):
    """(state, last metrics, seconds of each step): `steps` steps, each timed to its results."""
    times, metrics = [], None
    for _ in range(steps):
        t0 = time.perf_counter()
        state, metrics = train_step(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t0)
    return state, metrics, times


def peak_bytes_in_use() -> int | None:
    """The most device memory the run held (GPU/TPU allocators report it; CPU: None)."""
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def main(argv=None):
    from model.runtime.distributed import quiet_cpu_start

    quiet_cpu_start()   # no libtpu warnings on a machine without a TPU (JAX_PLATFORMS, if set, wins)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny", help="configs/model/<preset>.yaml")
    p.add_argument("--mesh", default="default", help="configs/mesh/<mesh>.yaml")
    p.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--dtype", default=None, help="compute dtype override (bfloat16, float32)")
    p.add_argument("--remat", default=None, help="none | full | dots | dots_attention | dots_all")
    p.add_argument("--attention", default=None, help="xla | cudnn | splash")
    p.add_argument("--packed-segments", type=int, default=None,
                   help="model.cudnn_packed_segments (cuDNN's packed layout for rows of up to this many documents)")
    p.add_argument("--fp8", action="store_true", help="model.fp8=true: the q/k/v/o and MLP matmuls in FP8")
    p.add_argument("--steps", type=int, default=10, help="timed steps (after warmup)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps (compile + first runs)")
    p.add_argument("--docs-per-row", type=int, default=4)
    p.add_argument("--peak-flops", type=float, default=None, help="override the per-device peak")
    p.add_argument("--microbatches", type=int, default=1, help="gradient accumulation slices (train.microbatches)")
    p.add_argument("--loss-chunk", type=int, default=0, help="chunked cross-entropy positions (train.loss_chunk)")
    p.add_argument("--matmul-probe", type=int, default=0, metavar="N",
                   help="also time an N x N x N matmul in the model's dtype on one device (e.g. 8192 on a GPU): "
                        "MFU against the rate this device reaches, beside the datasheet's")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="after the timed steps, trace 3 more with the JAX profiler into DIR "
                        "(scripts/bench/profile_top.py DIR names where the step's time goes)")
    args = p.parse_args(argv)

    overrides = {k: v for k, v in dict(dtype=args.dtype, remat=args.remat, attention=args.attention,
                                       cudnn_packed_segments=args.packed_segments, fp8=args.fp8 or None).items()
                 if v is not None}
    cfg = dataclasses.replace(LlamaConfig.from_mapping(load_yaml("model", args.preset)), **overrides)
    mesh_cfg = load_yaml("mesh", args.mesh)
    mesh = sharding.make_mesh(mesh_cfg)
    rules = sharding.rules_from_cfg(mesh_cfg)
    print(f"preset={args.preset} params={cfg.num_params():,} mesh: {sharding.describe(mesh)} "
          f"device={jax.devices()[0].device_kind}", file=sys.stderr)

    tx = optax.adamw(1e-4)
    t0 = time.perf_counter()
    state, shardings = step.init_train_state(cfg, tx, mesh, rules, seed=0)
    jax.block_until_ready(state)
    init_s = time.perf_counter() - t0
    train_step = step.make_train_step(cfg, tx, mesh, rules, shardings, microbatches=args.microbatches,
                                      loss_chunk=args.loss_chunk)
    b_sh = step.batch_sharding(mesh, rules)
    rng = np.random.default_rng(0)
    batch = {k: jax.device_put(jnp.asarray(v), b_sh)
             for k, v in random_batch(rng, args.batch, args.seq, cfg.vocab_size, args.docs_per_row).items()}

    t0 = time.perf_counter()
    for _ in range(args.warmup):
        state, metrics = train_step(state, batch)
    jax.block_until_ready(metrics)
    warmup_s = time.perf_counter() - t0

    state, metrics, times = timed_steps(train_step, state, batch, args.steps)
    step_s = float(np.median(times))
    if args.profile:
        # Outside the timed steps: tracing slows the host side, and its write takes seconds.
        with jax.profiler.trace(args.profile):
            for _ in range(3):
                state, metrics = train_step(state, batch)
            jax.block_until_ready(metrics)
    tokens_per_s = args.batch * args.seq / step_s
    fpt = flops.flops_per_token(cfg, args.seq)
    fpt_causal = flops.flops_per_token(cfg, args.seq, causal=True)
    peak = flops.peak_flops(jax.devices()[0].device_kind, args.peak_flops)
    measured = matmul_rate(args.matmul_probe, cfg.dtype) if args.matmul_probe else None
    measured_fp8 = matmul_rate(args.matmul_probe, cfg.dtype, fp8=True) if args.matmul_probe and cfg.fp8 else None
    result = {
        "preset": args.preset, "params": cfg.num_params(), "mesh": dict(mesh.shape),
        "device_kind": jax.devices()[0].device_kind, "n_devices": mesh.size,
        "batch": args.batch, "seq": args.seq, "dtype": cfg.dtype, "remat": cfg.remat,
        "attention": cfg.attention, "packed_segments": cfg.cudnn_packed_segments, "fp8": cfg.fp8,
        "init_s": round(init_s, 3), "compile_and_warmup_s": round(warmup_s, 3),
        "step_s_median": round(step_s, 4), "step_s_min": round(min(times), 4),
        "tokens_per_s": round(tokens_per_s, 1), "flops_per_token": fpt,
        "model_tflops_per_s": round(tokens_per_s * fpt / 1e12, 4),
        "microbatches": args.microbatches, "loss_chunk": args.loss_chunk,
        "recompute_factor": round(flops.recompute_factor(cfg, args.seq, args.loss_chunk), 4),
        "mfu": None if peak is None else round(flops.mfu(tokens_per_s, fpt, mesh.size, peak), 4),
        "mfu_causal": None if peak is None else round(flops.mfu(tokens_per_s, fpt_causal, mesh.size, peak), 4),
        "matmul_probe_tflops_per_device": None if measured is None else round(measured / 1e12, 2),
        "mfu_causal_vs_probe": None if measured is None else round(
            flops.mfu(tokens_per_s, fpt_causal, mesh.size, measured), 4),
        # fp8: the e4m3 GEMM rate (the MFU columns stay against the bf16 peak and probe, so fp8 and
        # bf16 rows compare; the speed-up is tokens_per_s)
        "matmul_probe_fp8_tflops_per_device": None if measured_fp8 is None else round(measured_fp8 / 1e12, 2),
        "peak_bytes_in_use": peak_bytes_in_use(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "loss": round(float(metrics["loss"]), 4),
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

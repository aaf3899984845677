"""Attention alone, forward and backward, at one layer's shapes: the kernels model.attention can run,
timed on packed rows, each checked against the masked cuDNN kernel (the one the model ran before the
packed layout) and the XLA reference. Prints one JSON line per variant.

    python scripts/bench/bench_attention.py                       # a GPU: the 1b's layer at seq 2048
    python scripts/bench/bench_attention.py --batch 2 --seq 128 --heads 4 --kv-heads 2 --variants xla

Variants: xla (the reference), cudnn_masked (jax.nn.dot_product_attention with the segment mask,
which jax hands to cuDNN as a bias), cudnn_packed<M> (model.cudnn_packed_segments=M: each document
its own sequence, rows of up to M documents), cudnn_causal (causality alone, no documents: the
kernel's floor on these shapes, not a correct attention for packed rows).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from model import llama  # noqa: E402


def packed_rows(rng, b: int, t: int, docs_per_row: float) -> np.ndarray:
    """Segment ids of rows holding 1 + Poisson(docs_per_row - 1) documents at random cuts."""
    seg = np.zeros((b, t), np.int32)
    for i in range(b):
        n = min(1 + rng.poisson(max(docs_per_row - 1, 0)), t // 8)
        cuts = np.sort(rng.choice(np.arange(1, t), n - 1, replace=False))
        seg[i] = np.digitize(np.arange(t), cuts) + 1
    return seg


def variant_fn(name: str):
    if name == "xla":
        return lambda q, k, v, seg: llama.attention_xla(q, k, v, seg)
    if name == "cudnn_masked":
        return lambda q, k, v, seg: llama.attention_dpa(q, k, v, seg, "cudnn")
    if name == "cudnn_causal":
        return lambda q, k, v, seg: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    if name.startswith("cudnn_packed"):
        m = int(name.removeprefix("cudnn_packed"))
        return lambda q, k, v, seg: llama.attention_cudnn_packed(q, k, v, seg, m)
    raise ValueError(f"unknown variant {name!r}")


def jax_fixes() -> dict:
    """Which of jax's cuDNN-attention fixes this jax has (read from its source)."""
    import inspect

    from jax._src.cudnn import fused_attention_stablehlo as fa
    try:
        src = inspect.getsource(fa.dot_product_attention)
    except (OSError, TypeError):
        src = ""
    return {"jax": jax.__version__, "bool_mask_skips_dbias": "bias_is_differentiable" in src,
            "packed_kv_offsets_gqa": llama._packed_kv_offsets_scale_by_kv_heads()}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--docs-per-row", type=float, default=2.6,
                   help="mean documents per row (2.6: RedPajama-v2-shaped text at seq 2048, concat packing)")
    p.add_argument("--variants", default="cudnn_masked,cudnn_packed8,cudnn_packed16,cudnn_packed32,"
                                          "cudnn_causal,xla")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args(argv)

    print(json.dumps({"fixes": jax_fixes(), "device": str(jax.devices()[0].device_kind)}), flush=True)
    rng = np.random.default_rng(0)
    b, t, n, k, h = args.batch, args.seq, args.heads, args.kv_heads, args.head_dim
    seg = jnp.asarray(packed_rows(rng, b, t, args.docs_per_row))
    runs = int((1 + np.sum(np.diff(np.asarray(seg), axis=1) != 0, axis=1)).max())
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (b, t, n, h), args.dtype)
    kk = jax.random.normal(keys[1], (b, t, k, h), args.dtype)
    v = jax.random.normal(keys[2], (b, t, k, h), args.dtype)
    do = jax.random.normal(keys[3], (b, t, n, h), args.dtype)
    # Causal attention's useful work: the lower triangle, 2 matmuls forward, 5 backward (with the
    # recomputed scores), 2 flops a multiply-add.
    causal_flops = 2 * b * n * h * t * (t + 1) / 2 * 2 * 3.5

    reference = None
    for name in args.variants.split(","):
        row = {"variant": name, "batch": b, "seq": t, "heads": n, "kv_heads": k, "head_dim": h, "max_runs": runs}
        try:
            fn = variant_fn(name)

            @jax.jit
            def fwd_bwd(q, kk, v, seg, fn=fn):
                out, vjp = jax.vjp(lambda q, kk, v: fn(q, kk, v, seg), q, kk, v)
                return (out, *vjp(do))

            t0 = time.perf_counter()
            got = jax.block_until_ready(fwd_bwd(q, kk, v, seg))
            row["compile_s"] = round(time.perf_counter() - t0, 2)
            times = []
            for _ in range(args.iters):
                t0 = time.perf_counter()
                jax.block_until_ready(fwd_bwd(q, kk, v, seg))
                times.append(time.perf_counter() - t0)
            ms = 1e3 * float(np.median(times))
            row.update(status="ok", fwd_bwd_ms=round(ms, 3), causal_tflops=round(causal_flops / ms / 1e9, 1))
            if name == "cudnn_masked" or (reference is None and name == "xla"):
                reference = (name, [np.asarray(x, np.float32) for x in got])
            elif reference is not None and name != "cudnn_causal":
                # relative error of the output and each gradient against the reference variant
                row["vs"] = reference[0]
                row["rel_err"] = [round(float(np.linalg.norm(np.asarray(a, np.float32) - r) /
                                              max(np.linalg.norm(r), 1e-12)), 5)
                                  for a, r in zip(got, reference[1], strict=True)]
        except Exception as e:  # noqa: BLE001 - a variant this machine refuses is a result too
            row.update(status="failed", error=str(e).strip().splitlines()[0][:300] if str(e).strip() else repr(e))
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

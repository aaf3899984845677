"""Context parallelism figures (BENCHMARKS.md, "Context parallelism"): two parts.

balance: the causal attention work per chip (model/context.py attention_work) of real packed
rows, max / mean over a row's `context` chips, for each token order (contiguous = none, zigzag,
striped = what the step uses), at each row length and context size; and of single-document rows.
Rows: a RedPajama-v2-shaped corpus tokenized and concatenated into rows as `packing: concat` does
(documents end with EOS, cut across rows, positions restarting at each row's start).

step: the train step's time at mesh.context 1, 2, 4 at one shape (same model, batch and sequence
length) on this machine's devices, measured in one process, and each ratio to context 1.

    python ../shared/bench/make_corpus.py /tmp/corpus --shards 4 --docs 2000   # the shared bench tools
    python scripts/bench/bench_context.py balance --corpus /tmp/corpus \
        --tokenizer ../shared/bench/llama_style_tokenizer.json --seq-lens 32768 131072 --contexts 2 4 8
    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \
        python scripts/bench/bench_context.py step --seq-len 1024 --contexts 1 2 4
"""
from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def corpus_rows(corpus: str, tokenizer: str, seq_len: int) -> np.ndarray:
    """[rows, seq_len] segment ids of the corpus's documents concatenated into rows (EOS after each)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer)
    lengths = []
    for path in sorted(glob.glob(os.path.join(corpus, "*", "*.json.gz"))):
        with gzip.open(path, "rt", encoding="utf-8") as f:
            texts = [json.loads(line)["raw_content"] for line in f]
        lengths += [len(e.ids) + 1 for e in tok.encode_batch(texts, add_special_tokens=False)]  # + EOS
    doc_of_token = np.repeat(np.arange(len(lengths)), lengths)
    rows = len(doc_of_token) // seq_len
    doc_rt = doc_of_token[: rows * seq_len].reshape(rows, seq_len)
    starts = np.concatenate([np.ones((rows, 1), bool), doc_rt[:, 1:] != doc_rt[:, :-1]], axis=1)
    return np.cumsum(starts, axis=1).astype(np.int32), np.asarray(lengths)


def balance(args) -> None:
    from model import context as ctx

    for seq_len in args.seq_lens:
        seg_rt, lengths = corpus_rows(args.corpus, args.tokenizer, seq_len)
        docs = (seg_rt[:, -1]).mean()
        print(f"\n## rows of {seq_len} tokens: {len(seg_rt)} rows, {docs:.1f} documents a row (document tokens: "
              f"median {int(np.median(lengths))}, p99 {int(np.percentile(lengths, 99))}, max {lengths.max()})")
        print("| context | order | packed rows: mean | packed rows: worst | single document |")
        print("|---|---|---|---|---|")
        work_rt = ctx.attention_work(seg_rt)
        one_doc = ctx.attention_work(np.ones((1, seq_len), np.int32))
        for c in args.contexts:
            for layout in ctx.LAYOUTS:
                per_row = np.array([ctx.imbalance(w) for w in ctx.chip_work(work_rt, c, layout)[:, None]])
                single = float(ctx.imbalance(ctx.chip_work(one_doc, c, layout)))
                print(f"| {c} | {layout} | {per_row.mean():.3f} | {per_row.max():.3f} | {single:.3f} |")


def step_time(args) -> None:
    import jax
    import jax.numpy as jnp
    import optax
    import yaml

    from model import sharding as shd
    from model import step
    from model.llama import LlamaConfig

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_step import timed_steps  # the timing loop bench_step uses

    cfg = LlamaConfig(vocab_size=1024, d_model=args.d_model, n_layers=args.layers, n_heads=8, n_kv_heads=4,
                      d_ff=4 * args.d_model, dtype="float32", remat="full", max_seq_len=args.seq_len)
    with open(os.path.join(os.path.dirname(__file__), "..", "..", "configs", "mesh", "context.yaml")) as f:
        mesh_base = yaml.safe_load(f)
    rng = np.random.default_rng(0)
    b, t = args.batch, args.seq_len
    seg = np.cumsum(rng.random((b, t)) < 1 / 900, axis=1).astype(np.int32) + 1   # ~900-token documents
    pos = np.zeros_like(seg)
    for r in range(b):
        starts = np.flatnonzero(np.r_[True, seg[r, 1:] != seg[r, :-1]])
        pos[r] = np.arange(t) - np.repeat(starts, np.diff(np.r_[starts, t]))
    host_batch = {"inputs": rng.integers(0, 1024, (b, t)), "targets": rng.integers(0, 1024, (b, t)),
                  "segment_ids": seg, "positions": pos, "loss_mask": np.ones((b, t))}
    n = jax.device_count()
    print(f"{n} {jax.devices()[0].platform} devices; model d={args.d_model} layers={args.layers}, batch {b} x {t}, "
          f"fp32, {args.steps} timed steps after 2 warm-up steps")
    print("| mesh | step time (median) | ratio to context 1 | context_imbalance |")
    print("|---|---|---|---|")
    base = None
    for c in args.contexts:
        m = dict(mesh_base, data=1, fsdp=n // c, context=c, tensor=1)
        mesh, rules = shd.make_mesh(m), shd.rules_from_cfg(m)
        tx = optax.adamw(1e-4)
        state, shardings = step.init_train_state(cfg, tx, mesh, rules, seed=0)
        train_step = step.make_train_step(cfg, tx, mesh, rules, shardings)
        batch = {k: jax.device_put(jnp.asarray(v, jnp.int32), step.batch_sharding(mesh, rules))
                 for k, v in host_batch.items()}
        for _ in range(2):
            state, metrics = train_step(state, batch)
        jax.block_until_ready(metrics)
        state, metrics, times = timed_steps(train_step, state, batch, args.steps)
        med = float(np.median(times))
        base = base or med
        imb = float(metrics.get("context_imbalance", 1.0))
        print(f"| fsdp={n // c} context={c} | {med * 1e3:.0f} ms | {med / base:.2f} | {imb:.3f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="part", required=True)
    b = sub.add_parser("balance")
    b.add_argument("--corpus", required=True)
    b.add_argument("--tokenizer", required=True)
    b.add_argument("--seq-lens", type=int, nargs="+", default=[32768, 131072])
    b.add_argument("--contexts", type=int, nargs="+", default=[2, 4, 8])
    s = sub.add_parser("step")
    s.add_argument("--seq-len", type=int, default=1024)
    s.add_argument("--batch", type=int, default=8)
    s.add_argument("--d-model", type=int, default=256)
    s.add_argument("--layers", type=int, default=4)
    s.add_argument("--steps", type=int, default=5)
    s.add_argument("--contexts", type=int, nargs="+", default=[1, 2, 4])
    args = ap.parse_args()
    balance(args) if args.part == "balance" else step_time(args)


if __name__ == "__main__":
    main()

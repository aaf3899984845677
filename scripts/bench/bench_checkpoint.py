#!/usr/bin/env python3
"""How long an asynchronous checkpoint blocks the training loop, against a synchronous save.

    python scripts/bench/bench_checkpoint.py                       # ~350M-param train state (~4.2 GB)
    python scripts/bench/bench_checkpoint.py --d-model 512 --layers 4 --repeats 2   # a quick look

Builds the real train state (params + AdamW moments + step) of a Llama config with
model/step.py's sharded init, then saves it through model/runtime/checkpoint.py's Checkpointer, the
exact code train.py runs:
  sync_s     Checkpointer(async=false).save() — the loop is stopped for the whole write.
  blocked_s  Checkpointer(async=true).save() returning — what the loop waits for (device to
             host copy, this process's data state, Orbax's bookkeeping); the files are then
             written by background threads while training goes on.
  total_s    blocked_s plus the wait for the background write (the save's latency).
Reported figure: blocked_s / sync_s (target <= 0.1). Medians over --repeats saves, each into a
fresh step. On a CPU "device" the device-to-host copy is a host memcpy; on TPU/GPU it is a
DMA over PCIe, so the ratio there depends on the host link as well as the disk.

With --local-dir (e.g. /dev/shm/bench) also the local tier (model/runtime/local_tier.py, the code
train.py runs for checkpoint.local_dir): its blocked time (this host's shards copied off the
devices) and total time per save, against the durable async save's, and the restore time of
the same state from each tier (Checkpointer.restore_state against LocalTier.restore).
Prints one JSON line at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

from train import PROJECT_ROOT  # the repo root (the project is installed editable)


def main() -> None:
    from model.runtime.distributed import quiet_cpu_start

    quiet_cpu_start()   # no libtpu warnings on a machine without a TPU (JAX_PLATFORMS, if set, wins)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--d-ff", type=int, default=2816)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir; gs:// works)")
    ap.add_argument("--local-dir", default=None, help="also time the local tier there (e.g. /dev/shm/bench)")
    args = ap.parse_args()

    import jax

    from model import sharding as shd
    from model import step as step_lib
    from model.llama import LlamaConfig
    from model.optimizer import make_optimizer
    from model.runtime.checkpoint import Checkpointer

    cfg = LlamaConfig(vocab_size=args.vocab, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads,
                      n_kv_heads=args.kv_heads, d_ff=args.d_ff, tie_embeddings=False, dtype="float32",
                      param_dtype="float32", remat="none")
    opt_cfg = {"lr": 1e-3, "min_lr_ratio": 0.1, "warmup_steps": 10, "decay_steps": None, "b1": 0.9,
               "b2": 0.95, "eps": 1e-8, "weight_decay": 0.1, "clip_norm": 1.0}
    tx, _ = make_optimizer(opt_cfg, 1000)
    from omegaconf import OmegaConf

    mesh_cfg = OmegaConf.load(PROJECT_ROOT / "configs/mesh/default.yaml")
    mesh = shd.make_mesh(mesh_cfg)
    rules = shd.rules_from_cfg(mesh_cfg)
    t0 = time.perf_counter()
    state, _ = step_lib.init_train_state(cfg, tx, mesh, rules, seed=0)
    jax.block_until_ready(state)
    init_s = time.perf_counter() - t0
    leaves = jax.tree.leaves(state)
    n_bytes = sum(x.nbytes for x in leaves)
    data_state = {"shards": {str(v): {"epoch": 0, "file": 3, "line": 12345, "carry": list(range(200))}
                             for v in range(64)}}
    meta = {"fingerprint": {"model": {"d_model": args.d_model}}, "wandb_id": None, "process_count": 1}

    root = args.dir or tempfile.mkdtemp(prefix="bench_ckpt_")

    def run(is_async: bool) -> tuple[list[float], list[float]]:
        directory = f"{root.rstrip('/')}/{'async' if is_async else 'sync'}"
        ckpt = Checkpointer({"dir": directory, "keep": 1, "async": is_async, "every": 1,
                             "resume_from": None, "init_from": None})
        blocked, total = [], []
        for i in range(args.repeats + 1):          # the first save warms up (directories, threads)
            t = time.perf_counter()
            ckpt.save(i + 1, state, data_state, meta)
            b = time.perf_counter() - t
            ckpt.wait()
            done = time.perf_counter() - t
            if i:
                blocked.append(b)
                total.append(done)
            print(f"{'async' if is_async else 'sync '} save {i + 1}: blocked {b:.3f} s, complete {done:.3f} s",
                  file=sys.stderr, flush=True)
        ckpt.close()
        return blocked, total

    sync_blocked, sync_total = run(is_async=False)
    async_blocked, async_total = run(is_async=True)
    tiers = {}
    if args.local_dir:
        from model.runtime.checkpoint import ResumePoint
        from model.runtime.local_tier import LocalTier

        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
        tier = LocalTier(args.local_dir, every=1, keep=1, process_index=0)
        blocked, total = [], []
        for i in range(args.repeats + 1):
            t = time.perf_counter()
            tier.save(i + 1, state, data_state, meta)
            b = time.perf_counter() - t
            tier.wait()
            if i:
                blocked.append(b)
                total.append(time.perf_counter() - t)
            print(f"local save {i + 1}: blocked {b:.3f} s, complete {time.perf_counter() - t:.3f} s",
                  file=sys.stderr, flush=True)
        last = args.repeats + 1
        restore = {}
        for name, load in (("durable", lambda: Checkpointer(
                {"dir": f"{root.rstrip('/')}/async", "keep": 1, "async": True, "every": 1, "resume_from": None,
                 "init_from": None}).restore_state(ResumePoint(f"{root.rstrip('/')}/async", last, "latest"), abstract)),
                           ("local", lambda: tier.restore(last, abstract))):
            times = []
            for _ in range(args.repeats):
                t = time.perf_counter()
                jax.block_until_ready(load())
                times.append(time.perf_counter() - t)
            restore[name] = round(statistics.median(times), 3)
        tiers = {"local_blocked_s": round(statistics.median(blocked), 3),
                 "local_total_s": round(statistics.median(total), 3),
                 "local_over_durable_blocked": round(statistics.median(blocked) / statistics.median(async_blocked), 3),
                 "restore_durable_s": restore["durable"], "restore_local_s": restore["local"]}
        shutil.rmtree(args.local_dir, ignore_errors=True)
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)

    sync_s = statistics.median(sync_total)
    blocked_s = statistics.median(async_blocked)
    result = {
        "bench": "checkpoint_async_block",
        "params": int(sum(x.size for x in jax.tree.leaves(state["params"]))),
        "state_bytes": int(n_bytes),
        "devices": jax.device_count(),
        "backend": jax.default_backend(),
        "init_s": round(init_s, 2),
        "sync_save_s": round(sync_s, 3),
        "async_blocked_s": round(blocked_s, 3),
        "async_total_s": round(statistics.median(async_total), 3),
        "blocked_over_sync": round(blocked_s / sync_s, 4),
        "target": 0.1,
        "repeats": args.repeats,
        "write_GBps_sync": round(n_bytes / sync_s / 1e9, 3),
        "cpu_count": os.cpu_count(),
        **tiers,
    }
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

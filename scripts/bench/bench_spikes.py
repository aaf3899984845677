"""What loss-spike skipping (train.spikes) costs per step: the same train step with and without
it, timed in alternating pairs in one process (so machine load hits both alike).

The decision is a few scalar ops on a window of losses; the cost is the select that keeps the
old parameters and optimizer state on a skipped step (one read of each and a write, fused by
XLA into the update where it can). Prints one JSON line.

    python scripts/bench/bench_spikes.py                       # tiny model, CPU
    python scripts/bench/bench_spikes.py --preset 125m --batch 8 --seq 512
"""
from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from bench_step import load_yaml, random_batch

from model import step
from model.llama import LlamaConfig


def main(argv=None):
    from model.runtime.distributed import quiet_cpu_start

    quiet_cpu_start()   # no libtpu warnings on a machine without a TPU (JAX_PLATFORMS, if set, wins)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--mesh", default="default")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--pairs", type=int, default=20, help="timed (with, without) pairs after the warmup")
    args = p.parse_args(argv)

    cfg = LlamaConfig.from_mapping(load_yaml("model", args.preset))
    mesh_cfg = load_yaml("mesh", args.mesh)
    tx = optax.adamw(1e-4)
    spikes = step.SpikeConfig(window=128, k=6.0, min_steps=32)
    programs = {name: step.build_program(cfg, tx, mesh_cfg, global_batch=args.batch, z_loss=0.0, microbatches=1,
                                         spikes=sp) for name, sp in (("with", spikes), ("without", None))}
    rng = np.random.default_rng(0)
    host = random_batch(rng, args.batch, args.seq, cfg.vocab_size, 4)
    states, batches = {}, {}
    for name, prog in programs.items():
        states[name] = prog.init_state(0)
        batches[name] = {k: jax.device_put(jnp.asarray(v), prog.batch_sharding) for k, v in host.items()}
        for _ in range(2):          # compile + a first run
            states[name], m = prog.train_step(states[name], batches[name])
        jax.block_until_ready(m)
    times = {"with": [], "without": []}
    for i in range(args.pairs):
        order = ("with", "without") if i % 2 == 0 else ("without", "with")
        for name in order:
            t0 = time.perf_counter()
            states[name], m = programs[name].train_step(states[name], batches[name])
            jax.block_until_ready(m)
            times[name].append(time.perf_counter() - t0)
    med = {k: float(np.median(v)) for k, v in times.items()}
    print(json.dumps({"preset": args.preset, "params": cfg.num_params(), "batch": args.batch, "seq": args.seq,
                      "device_kind": jax.devices()[0].device_kind, "n_devices": len(jax.devices()),
                      "step_s_median_with": round(med["with"], 5), "step_s_median_without": round(med["without"], 5),
                      "overhead_per_step_s": round(med["with"] - med["without"], 5),
                      "ratio": round(med["with"] / med["without"], 4), "pairs": args.pairs}))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Compiled plans of an experiment over 1, 2, 4, ... slices: per-chip memory, the bytes each step
sends over the data-center network (DCN) and their time at a stated bandwidth per host.

    python scripts/bench/bench_multislice.py experiment=v4_32_llama_1b --slices 1 2 4 --quick
    python scripts/bench/bench_multislice.py experiment=v5e_16_llama_1b --slices 1 2 4 --dcn-gbps 100

Each plan is scripts/compile_tpu.py's compile_plan (libtpu on this machine, no TPU): the run's own
program for `tpu.slices=N`, data parallel across the slices (mesh.dcn_data=-1) unless overridden.
Prints one row per slice count and one JSON line per plan.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load_compile_tpu():
    spec = importlib.util.spec_from_file_location("compile_tpu", ROOT / "scripts" / "compile_tpu.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["compile_tpu"] = mod
    spec.loader.exec_module(mod)
    return mod


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slices", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--quick", action="store_true", help="compile_tpu's --quick (memory within a few per cent)")
    parser.add_argument("--dcn-gbps", type=float, default=None, help="DCN bandwidth per host, Gbit/s")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args()
    ct = load_compile_tpu()
    gbps = args.dcn_gbps or ct.DEFAULT_DCN_GBPS
    rows = []
    for n in args.slices:
        cfg = ct.compose([*args.overrides, f"tpu.slices={n}"])
        tpu = ct.parse_slice(cfg.tpu.topology)
        ct.libtpu_env(tpu)
        plan = ct.compile_plan(cfg, tpu, quick=args.quick, dcn_gbps=gbps)
        rows.append(plan)
        print(json.dumps({k: plan[k] for k in ("topology", "slices", "chips", "mesh", "compute_s_at_peak",
                                               "train_step", "eval_step")}), flush=True)
    print(f"\n{'slices':>6} {'chips':>5} {'train GiB/chip':>14} {'eval GiB/chip':>13} {'DCN MiB/chip':>12} "
          f"{'MiB/host':>9} {'DCN s':>7} {'compute s':>9}  (DCN at {gbps:g} Gbit/s per host; compute at peak)")
    for p in rows:
        t, e = p["train_step"], p["eval_step"]
        d = t.get("dcn", {"payload_bytes": 0, "sent_bytes_per_host": 0, "seconds_at_dcn_gbps": 0.0})
        print(f"{p['slices']:>6} {p['chips']:>5} {t.get('total_gib', float('nan')):>14.2f} "
              f"{e.get('total_gib', float('nan')):>13.2f} {d['payload_bytes'] / 2**20:>12.1f} "
              f"{d['sent_bytes_per_host'] / 2**20:>9.1f} {d['seconds_at_dcn_gbps']:>7.3f} "
              f"{p['compute_s_at_peak'] or float('nan'):>9.3f}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, str(ROOT))
    sys.exit(main())

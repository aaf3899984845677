#!/usr/bin/env python3
"""Max |logit difference| between our Llama and transformers, per open-checkpoint family, fp32.

    python scripts/bench/bench_hf_parity.py            # every variant of tests/hf_helpers.py
    python scripts/bench/bench_hf_parity.py mistral qwen3
    python scripts/bench/bench_hf_parity.py --yarn      # the YaRN variants only

For each variant, the tests' own procedure (tests/hf_helpers.py `logit_gap`): a tiny random model built
with transformers' class (Llama 2 and 3.x with both RoPE spellings, a decoupled head_dim, Qwen2,
Qwen3, Mistral with a window of 8, SmolLM2- and TinyLlama-shaped; YaRN on Llama, Qwen2 and Qwen3,
factor 4 over an original context of 32), saved with save_pretrained and read by model/hf.py;
logits over a packed row of three documents (two longer than the window, each run alone through
transformers) and over two 48-token rows (128 for YaRN: 4x past its original context). Prints one
row per variant, with the RoPE spelling its config.json holds, and one JSON line.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load_variants():
    spec = importlib.util.spec_from_file_location("hf_helpers", ROOT / "tests" / "hf_helpers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("variants", nargs="*", help="names from tests/hf_helpers.py VARIANTS (default: all)")
    ap.add_argument("--yarn", action="store_true", help="the YaRN variants only")
    args = ap.parse_args(argv)
    module = load_variants()
    names = args.variants or [n for n in module.VARIANTS if "yarn" in n or not args.yarn]
    rows = {}
    print(f"{'variant':<26}{'class':<20}{'RoPE spelling':<34}{'max |diff|':>12}{'max |logit|':>13}")
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            gap, scale = module.logit_gap(name, Path(tmp) / name)
            key = module.HUB_SPELLING.get(name)
            spelling = f"rope_scaling ({key}) + theta" if key else "rope_parameters"
            rows[name] = {"max_abs_diff": gap, "max_abs_logit": scale, "spelling": spelling}
            print(f"{name:<26}{module.VARIANTS[name][0]:<20}{spelling:<34}{gap:>12.2e}{scale:>13.2f}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""model/predict.py against a step time someone else measured (#57 item 2): MaxText's published
Trillium run of Llama-3.1-8B on a v6e-16, predicted from MaxText's own compiled program.

    python scripts/bench/bench_predict.py

MaxText's program is not compiled here (33 min on 2 cores, in its own environment): its figures
below were read from its compile of 2026-11-28 (BENCHMARKS.md "Calibration: MaxText's published
v6e-16 Llama-3.1-8B run", the command there) and are priced with this checkout's model/predict.py,
so a change to the model's constants or terms shows here. Prints each term, the predicted range,
and the published step's place in it.
"""
from __future__ import annotations

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

GIB = 2**30

# MaxText e591f30, `train_compile compile_topology=v6e-16 model_name=llama3.1-8b per_device_batch_size=3
# max_target_length=8192 ici_fsdp_parallelism=-1 remat_policy=custom decoder_layer_input=offload
# out_proj=offload query_proj=offload key_proj=offload value_proj=offload attention=flash ...`, its
# recipe's LIBTPU_INIT_ARGS; memory from the compiled program, ICI bytes by model/ici.py over its HLO.
MAXTEXT_V6E_16_8B = {
    "slice": "v6e", "chips": 16, "seq_len": 8192, "rows_per_chip": 3,
    "hbm_gib": 24.8, "host_temporaries_gib": 21.0,     # the offloaded activations, per chip
    "ici_gib_by_axes": {"fsdp": 53.0}, "links": {"fsdp": 2},   # FSDP over the 4x4's 16 chips: 2 links
    "recompute": 1.0,             # offloaded, not recomputed
    # published: MaxText's Trillium recipe page (Llama3.1-8B, v6e-16)
    "published_step_s": 3.393, "published_tok_s_chip": 7243,
}


def calibration(m: dict = MAXTEXT_V6E_16_8B) -> dict:
    """-> the prediction of `m` with and without its host transfers, and its shapes."""
    from omegaconf import OmegaConf

    from model.flops import flops_per_token
    from model.llama import LlamaConfig
    from model.predict import CHIPS, host_bytes, predict

    model = LlamaConfig.from_mapping(OmegaConf.load(os.path.join(REPO, "configs", "model", "llama3_1_8b.yaml")))
    tokens = m["chips"] * m["rows_per_chip"] * m["seq_len"]
    useful = flops_per_token(model, m["seq_len"], causal=True) * tokens
    chip = CHIPS[m["slice"]]
    host = host_bytes(m["host_temporaries_gib"] * GIB, 0.0)
    ici = {a: g * GIB for a, g in m["ici_gib_by_axes"].items()}
    terms = dict(useful_flops=useful, executed_flops=useful * m["recompute"], chips=m["chips"], chip=chip,
                 ici_bytes_by_axes=ici, links=m["links"])
    return {"with_host": predict(**terms, host_bytes=host), "without_host": predict(**terms),
            "tokens": tokens, "useful": useful, "host_bytes": host, "chip": chip}


def main() -> None:
    m = MAXTEXT_V6E_16_8B
    c = calibration(m)
    p, without, tokens, useful, host_bytes, chip = (c[k] for k in ("with_host", "without_host", "tokens", "useful",
                                                                    "host_bytes", "chip"))
    pub = m["published_step_s"]
    print(f"MaxText Llama-3.1-8B on v6e-16, {tokens:,} tokens per step; useful FLOPs {useful:.3g}")
    print(f"  compute {p['compute_s']:.3f} s at peak; ici {p['ici_s']:.3f} s; host (PCIe, "
          f"{host_bytes / GIB:.1f} GiB at {chip.pcie_bps:.2g} B/s) {p['host_s']:.3f} s")
    print(f"  predicted step {p['step_s']:.3f} s (every transfer under compute, {p['bound']}-bound) to "
          f"{p['step_s_upper']:.3f} s (none); published {pub:.3f} s")
    for name, s in (("lower", p["step_s"]), ("upper", p["step_s_upper"])):
        print(f"  {name}: {s / pub - 1:+.1%} against the published step; tokens/s per chip "
              f"{tokens / m['chips'] / s:,.0f} (published {m['published_tok_s_chip']:,})")
    print(f"  without the host term: {without['step_s']:.3f} - {without['step_s_upper']:.3f} s "
          f"({without['step_s_upper'] / pub - 1:+.1%} at the upper end)")


if __name__ == "__main__":
    main()

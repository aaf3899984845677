#!/usr/bin/env python3
"""model/predict.py against step times someone else measured (#57 item 2): MaxText's published
Trillium run of Llama-3.1-8B on a v6e-16 and its published v5e-256 16B run, each predicted from
MaxText's own compiled program; and the v5e run's shapes compiled as our program.

    python scripts/bench/bench_predict.py

MaxText's programs are not compiled here (its own environment; 33 min for the v6e-16 one on a
loaded machine, 84 s for the v5e-256 one): their figures below were read from its compiles
(BENCHMARKS.md "Calibration: MaxText's published v6e-16 Llama-3.1-8B run" and "... v5e-256 16B
run", the commands there) and are priced with this checkout's model/predict.py, so a change to the
model's constants or terms shows here. Prints each term, the predicted range, and the published
step's place in it.
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

# MaxText's configs/v5e/16b.sh: global_parameter_scale=16 over base.yml (embed 4,096, 64 heads of
# 128, MLP 28,672, 32 layers, vocab 32,000: 15.8B parameters), per_device_batch_size=6 at 2,048,
# remat full, flash attention, FSDP over the v5e-256 (16x16, wrapped: 4 links). Published (its
# configs/v5e/README.md): 120 TFLOP/s per chip, 61.10% MFU on 1x v5e-256, by MaxText's count
# (attention's full square). Both programs below are compiled at this recipe's shapes.
V5E_256_16B_RECIPE = {
    "slice": "v5e", "chips": 256, "seq_len": 2048, "rows_per_chip": 6,
    "model": {"vocab_size": 32000, "d_model": 4096, "n_layers": 32, "n_heads": 64, "n_kv_heads": 64,
              "head_dim": 128, "d_ff": 28672, "tie_embeddings": False, "remat": "full"},
    "host_temporaries_gib": 0.0, "links": {"fsdp": 4},
    "recompute": 1.331,           # remat full: each layer's forward run again (compile_tpu's factor)
    "published_tflops_chip": 120.0,
}

# Our program at those shapes (2026-11-29, libtpu 0.0.42.1, full compile, 88 s):
#   python scripts/compile_tpu.py experiment=v5e_16_llama_1b --topology v5e-256 mesh.data=1 \
#       model.d_model=4096 model.n_layers=32 model.n_heads=64 model.n_kv_heads=64 model.head_dim=128 \
#       model.d_ff=28672 model.remat=full train.microbatches=1 data.seq_len=2048 \
#       data.global_batch_size=1536 data.num_shards=256 data.num_workers=1
# train step 13.11 GiB per chip (83%), fsdp 117 GiB per chip per step.
OURS_AT_MAXTEXT_V5E_256_16B = {**V5E_256_16B_RECIPE, "hbm_gib": 13.11, "ici_gib_by_axes": {"fsdp": 117.0}}

# MaxText e591f30's own program for that recipe: `train_compile maxtext/configs/base.yml
# per_device_batch_size=6 remat_policy=full global_parameter_scale=16 max_target_length=2048
# use_iota_embed=true reuse_example_batch=1 dataset_type=synthetic attention=flash
# enable_checkpointing=false compile_topology=v5e-256 compile_topology_num_slices=1`, 16b.sh's
# LIBTPU_INIT_ARGS (2026-11-29, 84 s): 0.69 GiB arguments + 12.19 temporaries + 0.04 code per chip
# (compile_tpu's sum); model/ici.py over its HLO: 117.0 GiB per chip per step, all fsdp (the
# weights gathered twice, forward and remat, and their gradients all-reduced, in the 32-layer loop:
# 57.8 + 57.8; the rest 1.5).
MAXTEXT_V5E_256_16B = {**V5E_256_16B_RECIPE, "hbm_gib": 12.93, "ici_gib_by_axes": {"fsdp": 117.0}}


def published_step_s(m: dict) -> float:
    """The published step: given, or from the published TFLOP/s per chip by MaxText's count
    (6 N per token and attention's full square: model/flops.py flops_per_token, causal=False)."""
    if "published_step_s" in m:
        return m["published_step_s"]
    from model.flops import flops_per_token
    from model.llama import LlamaConfig

    model = LlamaConfig.from_mapping(m["model"])
    tokens_per_chip = m["rows_per_chip"] * m["seq_len"]
    return flops_per_token(model, m["seq_len"]) * tokens_per_chip / (m["published_tflops_chip"] * 1e12)


def calibration(m: dict = MAXTEXT_V6E_16_8B) -> dict:
    """-> the prediction of `m` with and without its host transfers, and its shapes."""
    from omegaconf import OmegaConf

    from model.flops import flops_per_token
    from model.llama import LlamaConfig
    from model.predict import CHIPS, host_bytes, predict

    model = LlamaConfig.from_mapping(m["model"]) if "model" in m else \
        LlamaConfig.from_mapping(OmegaConf.load(os.path.join(REPO, "configs", "model", "llama3_1_8b.yaml")))
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
    report(MAXTEXT_V6E_16_8B, "MaxText's program, Llama-3.1-8B on v6e-16")
    report(MAXTEXT_V5E_256_16B, "MaxText's program, its 16B on v5e-256")
    report(OURS_AT_MAXTEXT_V5E_256_16B, "ours at MaxText's v5e-256 16B recipe")


def report(m: dict, name: str) -> None:
    c = calibration(m)
    p, without, tokens, useful, host_bytes, chip = (c[k] for k in ("with_host", "without_host", "tokens", "useful",
                                                                    "host_bytes", "chip"))
    pub = published_step_s(m)
    print(f"{name}, {tokens:,} tokens per step; useful FLOPs {useful:.3g}")
    print(f"  compute {p['compute_s']:.3f} s at peak; ici {p['ici_s']:.3f} s; host (PCIe, "
          f"{host_bytes / GIB:.1f} GiB at {chip.pcie_bps:.2g} B/s) {p['host_s']:.3f} s")
    print(f"  predicted step {p['step_s']:.3f} s (every transfer under compute, {p['bound']}-bound) to "
          f"{p['step_s_upper']:.3f} s (none); published {pub:.3f} s")
    for end, s in (("lower", p["step_s"]), ("upper", p["step_s_upper"])):
        print(f"  {end}: {s / pub - 1:+.1%} against the published step; tokens/s per chip "
              f"{tokens / m['chips'] / s:,.0f} (published {tokens / m['chips'] / pub:,.0f})")
    print(f"  without the host term: {without['step_s']:.3f} - {without['step_s_upper']:.3f} s "
          f"({without['step_s_upper'] / pub - 1:+.1%} at the upper end)")


if __name__ == "__main__":
    main()

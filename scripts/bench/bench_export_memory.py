#!/usr/bin/env python3
"""Peak memory of scripts/import_hf.py and scripts/export_hf.py at a real model's size.

    python scripts/bench/bench_export_memory.py                       # Qwen2.5-0.5B shapes
    python scripts/bench/bench_export_memory.py --model configs/model/llama3_2_3b.yaml --tmp /big/disk
    PYTHONPATH=/other/checkout python scripts/bench/bench_export_memory.py --repo /other/checkout

Builds a Hugging Face directory of configs/model/qwen2_5_0_5b.yaml's shapes with random bf16
weights (one model.safetensors, as the hub ships that model), then runs, each in its own
process: import_hf.py (HF directory -> checkpoint) and export_hf.py (checkpoint -> HF
directory). Prints each one's peak resident memory (the child's ru_maxrss, from os.wait4) and
seconds, the checkpoint's bytes (the parameters in fp32, as stored) and the largest tensor's
bytes in fp32. --repo: whose scripts run (another checkout: a before/after comparison).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[2]


def build_hf_dir(out: Path, model_yaml: Path, seed: int = 0) -> tuple[int, int]:
    """config.json + model.safetensors (bf16, random); returns (fp32 bytes of all parameters,
    fp32 bytes of the largest one)."""
    import ml_dtypes
    from safetensors.numpy import save_file

    from model.hf import abstract_params, to_hf_config
    from model.llama import LlamaConfig

    cfg = LlamaConfig.from_mapping(yaml.safe_load(model_yaml.read_text()))
    out.mkdir(parents=True)
    hf_cfg = to_hf_config(cfg, bos_token_id=None, eos_token_id=0)
    hf_cfg["torch_dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(hf_cfg, indent=2))
    leaves = [np.prod(a.shape) * 4 for a in _leaves(abstract_params(cfg))]
    rng = np.random.default_rng(seed)
    d, n, k, h, f = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, d), "model.norm.weight": (d,)}
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                       p + "self_attn.q_proj.weight": (n * h, d), p + "self_attn.k_proj.weight": (k * h, d),
                       p + "self_attn.v_proj.weight": (k * h, d), p + "self_attn.o_proj.weight": (d, n * h),
                       p + "mlp.gate_proj.weight": (f, d),
                       p + "mlp.up_proj.weight": (f, d), p + "mlp.down_proj.weight": (d, f)})
        if cfg.qkv_bias:        # Qwen2
            shapes.update({p + "self_attn.q_proj.bias": (n * h,), p + "self_attn.k_proj.bias": (k * h,),
                           p + "self_attn.v_proj.bias": (k * h,)})
        if cfg.qk_norm:         # Qwen3
            shapes.update({p + "self_attn.q_norm.weight": (h,), p + "self_attn.k_norm.weight": (h,)})
    if not cfg.tie_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, d)
    sd = {name: (rng.standard_normal(shape, np.float32) * 0.02).astype(ml_dtypes.bfloat16)
          for name, shape in shapes.items()}
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    return int(sum(leaves)), int(max(leaves))


def _leaves(tree):
    if isinstance(tree, dict):
        for v in tree.values():
            yield from _leaves(v)
    else:
        yield tree


def run_measured(cmd: list[str], env: dict) -> tuple[float, float]:
    """(peak RSS in GiB, seconds) of one child process (its own ru_maxrss: os.wait4 on its pid)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{out.decode()[-3000:]}")
    return usage.ru_maxrss * 1024 / 2**30, seconds      # ru_maxrss: KiB on Linux


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(ROOT / "configs" / "model" / "qwen2_5_0_5b.yaml"))
    ap.add_argument("--repo", default=str(ROOT), help="checkout whose scripts/import_hf.py and export_hf.py run")
    ap.add_argument("--tmp", default=None, help="working directory (default: a temporary one, removed)")
    ap.add_argument("--export-args", default="", help="extra arguments for export_hf.py (e.g. '--dtype float32')")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        tmp = Path(tmp)
        total, largest = build_hf_dir(tmp / "hf", Path(args.model))
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        repo = Path(args.repo)
        imp = run_measured([sys.executable, str(repo / "scripts" / "import_hf.py"), str(tmp / "hf"),
                            str(tmp / "ckpt")], env)
        on_disk = sum(p.stat().st_size for p in (tmp / "ckpt").rglob("*") if p.is_file())
        exp = run_measured([sys.executable, str(repo / "scripts" / "export_hf.py"), str(tmp / "ckpt"),
                            str(tmp / "out"), *args.export_args.split()], env)
        written = sorted(p.name for p in (tmp / "out").glob("*.safetensors"))
        out_bytes = sum((tmp / "out" / n).stat().st_size for n in written)

    gib = 2**30
    print(f"model {Path(args.model).name}; scripts of {repo}")
    print(f"checkpoint (fp32 parameters): {total / gib:.2f} GiB ({on_disk / gib:.2f} GiB on disk); "
          f"largest tensor (fp32): {largest / gib:.3f} GiB")
    print(f"goal, 1 GiB + 2 x largest: {(gib + 2 * largest) / gib:.2f} GiB")
    print(f"import_hf.py peak RSS {imp[0]:.2f} GiB ({imp[0] * gib / total:.2f} x checkpoint), {imp[1]:.0f} s")
    print(f"export_hf.py peak RSS {exp[0]:.2f} GiB ({exp[0] * gib / total:.2f} x checkpoint), {exp[1]:.0f} s; "
          f"wrote {len(written)} safetensors file(s), {out_bytes / gib:.2f} GiB")


if __name__ == "__main__":
    main()

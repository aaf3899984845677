"""Import a Hugging Face Llama, Mistral, Qwen2/2.5 or Qwen3 directory as a parameters-only checkpoint to train from.

    python scripts/import_hf.py /models/TinyLlama-1.1B ckpt/tinyllama
    python train.py model=1b checkpoint.init_from=ckpt/tinyllama tokenizer.path=/models/TinyLlama-1.1B

HF_DIR holds config.json and model.safetensors, or shards listed in
model.safetensors.index.json (any dtype; stored here as fp32 masters). OUT_CKPT_DIR becomes an
Orbax checkpoint directory with one step (0) whose "state" item is {"params": ...} and whose
"meta" item records the model config, so `checkpoint.init_from` reads it and
`scripts/generate.py --checkpoint OUT_CKPT_DIR` samples from it. The model config to train
with is printed (as configs/model/*.yaml text and as overrides); shape settings must match it.
"""
from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path


def import_hf(hf_dir: str, out_dir: str, **runtime) -> tuple:
    """(LlamaConfig, checkpoint directory). `runtime`: dtype, remat, attention, ... for the
    model config recorded in the meta and printed (LlamaConfig defaults otherwise)."""
    import dataclasses

    from model.hf import from_hf_config, from_hf_state_dict, read_safetensors
    from model.runtime.checkpoint import save_params

    hf = Path(hf_dir).resolve()
    config_file = hf / "config.json"
    if not config_file.is_file():
        raise SystemExit(f"{hf}: no config.json")
    cfg = from_hf_config(json.loads(config_file.read_text()), **runtime)
    params = from_hf_state_dict(read_safetensors(hf), cfg)
    config = {"model": dataclasses.asdict(cfg)}
    if (hf / "tokenizer.json").is_file():
        config["tokenizer"] = {"path": str(hf / "tokenizer.json")}
    meta = {"config": config, "source": {"hf_dir": str(hf)}}
    return cfg, save_params(out_dir, params, meta)


def model_overrides(cfg) -> list[str]:
    """`model.<field>=<value>` for every field of `cfg`, as Hydra reads them (YAML scalars)."""
    from model.hf import model_yaml

    return [f"model.{line.replace(': ', '=', 1)}" for line in model_yaml(cfg).splitlines()]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("hf_dir", help="Hugging Face directory (config.json + safetensors) of model_type llama, "
                                   "mistral, qwen2 or qwen3")
    ap.add_argument("out_ckpt_dir", help="new checkpoint directory")
    ap.add_argument("--dtype", default="bfloat16", help="compute dtype recorded in the model config")
    ap.add_argument("--remat", default="full", help="remat policy recorded in the model config")
    args = ap.parse_args(argv)
    from model.runtime.distributed import quiet_cpu_start

    quiet_cpu_start()       # before JAX starts: no libtpu warnings where no TPU can be
    logging.getLogger("absl").setLevel(logging.ERROR)

    from model.hf import model_yaml

    cfg, directory = import_hf(args.hf_dir, args.out_ckpt_dir, dtype=args.dtype, remat=args.remat)
    text = model_yaml(cfg)
    overrides = " ".join(model_overrides(cfg))
    tokenizer = Path(args.hf_dir).resolve() / "tokenizer.json"
    tok_arg = f" tokenizer.path={tokenizer}" if tokenizer.is_file() else ""
    print(f"imported {cfg.num_params():,} parameters from {args.hf_dir} to {directory} (step 0)\n")
    print("# model config (save as configs/model/<name>.yaml and train with model=<name>):")
    print(text)
    print("# or as overrides:")
    print(f"python train.py checkpoint.init_from={directory}{tok_arg} {overrides}")


if __name__ == "__main__":
    main()

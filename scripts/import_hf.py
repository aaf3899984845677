"""Import a Hugging Face Llama, Mistral, Qwen2/2.5 or Qwen3 directory as a parameters-only checkpoint to train from.

    python scripts/import_hf.py /models/TinyLlama-1.1B ckpt/tinyllama
    python train.py model=1b checkpoint.init_from=ckpt/tinyllama tokenizer.path=/models/TinyLlama-1.1B
    python scripts/import_hf.py /models/Llama-3.1-8B gs://BUCKET/jaxpt/imports/llama3_1_8b

HF_DIR holds config.json and model.safetensors, or shards listed in
model.safetensors.index.json (any dtype; stored here as fp32 masters). OUT_CKPT_DIR (a local
path or a gs:// URL) becomes an Orbax checkpoint directory with one step (0) whose "state" item
is {"params": ...} and whose "meta" item records the model config, so `checkpoint.init_from`
reads it and `scripts/generate.py --checkpoint OUT_CKPT_DIR` samples from it. The model config
to train with is printed (as configs/model/*.yaml text and as overrides); shape settings must
match it.

Memory: the weights are read one tensor at a time (safetensors' lazy safe_open) and each of our
parameters is made just before Orbax writes it and freed after (a stacked [layers, ...] one is
filled layer by layer), so the peak is about one parameter in fp32 twice over, not the model: an
8B imports on a workstation, on the CPU alone.
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

    from model.hf import LazySafetensors, check_hf_names, from_hf_config, leaf_makers, set_path
    from model.runtime.checkpoint import LazyLeaf, save_params

    hf = Path(hf_dir).resolve()
    config_file = hf / "config.json"
    if not config_file.is_file():
        raise SystemExit(f"{hf}: no config.json")
    cfg = from_hf_config(json.loads(config_file.read_text()), **runtime)
    weights = LazySafetensors(hf)
    check_hf_names(weights.names(), cfg, weights.shape)     # before anything is written
    params: dict = {}
    for path, shape, make in leaf_makers(cfg, weights.get):
        set_path(params, path, LazyLeaf(shape, "float32", make))
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
    ap.add_argument("out_ckpt_dir", help="new checkpoint directory: a local path or gs://BUCKET/...")
    ap.add_argument("--dtype", default="bfloat16", help="compute dtype recorded in the model config")
    ap.add_argument("--remat", default="full", help="remat policy recorded in the model config")
    args = ap.parse_args(argv)
    from model.runtime.distributed import quiet_cpu_start

    quiet_cpu_start()       # before JAX starts: no libtpu warnings where no TPU can be
    logging.getLogger("absl").setLevel(logging.ERROR)

    from model.hf import model_yaml

    try:
        cfg, directory = import_hf(args.hf_dir, args.out_ckpt_dir, dtype=args.dtype, remat=args.remat)
    except (ValueError, FileExistsError, FileNotFoundError) as e:    # one line naming the key, weight or path
        raise SystemExit(f"import_hf: {e}") from None
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

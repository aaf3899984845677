"""Export a checkpoint as a Hugging Face Llama directory (transformers, vLLM, llama.cpp converters).

    python scripts/export_hf.py runs/tiny_sample hf/tiny_sample
    python -c "import transformers as t; m = t.LlamaForCausalLM.from_pretrained('hf/tiny_sample'); \
               tok = t.AutoTokenizer.from_pretrained('hf/tiny_sample')"
    python scripts/export_hf.py gs://BUCKET/jaxpt/v4_32_llama3_1_8b hf/llama3_1_8b_continued

PATH: a run directory (its latest checkpoint), a checkpoint directory or one step directory,
local or gs://. Writes config.json, generation_config.json, the weights as the hub ships them
(HF names and layouts: model/hf.py; bf16 unless --dtype float32; files of at most
--max-shard-size, default 5GB, as `model-00001-of-0000N.safetensors` with
model.safetensors.index.json, or one model.safetensors when they fit in one) and the run's
tokenizer: tokenizer.json, tokenizer_config.json and special_tokens_map.json, all loadable
offline. Only the parameters are read.

Memory: the parameters are read one at a time into host memory (never onto an accelerator) and
each HF tensor is converted and streamed into its file, so the peak is about the largest
parameter twice over, not the model: an 8B exports on a workstation or a TPU VM's host.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path


def export_tokenizer(tok_path: str, out_dir: Path, *, add_bos: bool, max_len: int) -> dict:
    """tokenizer.json (+ a BOS template when training added one) and the two small JSON files
    `AutoTokenizer` reads; returns {"bos_token_id", "eos_token_id"}."""
    from tokenizers.processors import TemplateProcessing

    from data.tokenizer import load_tokenizer, special_ids

    tok = load_tokenizer(tok_path)
    eos_id, bos_id = special_ids(tok)
    specials = {"eos_token": tok.id_to_token(eos_id)}
    if bos_id is not None:
        specials["bos_token"] = tok.id_to_token(bos_id)
    if tok.token_to_id("<unk>") is not None:
        specials["unk_token"] = "<unk>"
    if add_bos and bos_id is not None:
        # Training put BOS before every document (data.add_bos): encode prompts the same way.
        bos = specials["bos_token"]
        tok.post_processor = TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                special_tokens=[(bos, bos_id)])
    tok.save(str(out_dir / "tokenizer.json"))
    # PreTrainedTokenizerFast, not LlamaTokenizerFast: the latter assumes SentencePiece
    # conventions (a Metaspace pre-tokenizer, BOS added) that a byte-level BPE does not share.
    tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_len,
               "clean_up_tokenization_spaces": False, **specials}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    (out_dir / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n")
    return {"bos_token_id": bos_id, "eos_token_id": eos_id}


def export(path: str, out_dir: str, *, dtype: str = "bfloat16", max_shard_size: str | int = "5GB") -> Path:
    """The HF directory `out_dir` from the checkpoint at `path` (module docstring)."""
    from model.hf import parse_size
    from model.runtime.checkpoint import HostParams

    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"{out} is not empty; choose a new directory")
    max_bytes = parse_size(max_shard_size)
    with HostParams(path) as ckpt:
        return _export(ckpt, path, out, dtype, max_bytes)


def _export(ckpt, path: str, out: Path, dtype: str, max_bytes: int) -> Path:
    from model.hf import ShardedSafetensorsWriter, hf_shapes, hf_tensors_of_leaf, leaf_maps, to_hf_config

    cfg, meta = ckpt.cfg, ckpt.meta
    run_cfg = meta.get("config") or {}
    shapes = hf_shapes(cfg)
    maps = leaf_maps(cfg)
    # Checked before anything is written: a bad --dtype or a family the config cannot express.
    writer = ShardedSafetensorsWriter(out, [(name, shapes[name]) for m in maps for name in m.names], dtype,
                                      max_bytes)
    hf_config = to_hf_config(cfg, dtype=dtype)
    out.mkdir(parents=True, exist_ok=True)

    tok_path = (run_cfg.get("tokenizer") or {}).get("path")
    ids = {"bos_token_id": None, "eos_token_id": None}
    if tok_path:
        ids = export_tokenizer(tok_path, out, add_bos=bool((run_cfg.get("data") or {}).get("add_bos")),
                               max_len=cfg.max_seq_len)
    else:
        print(f"warning: {path} names no tokenizer.path; exporting the model without a tokenizer", file=sys.stderr)
    hf_config.update(ids)
    (out / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({k: v for k, v in ids.items() if v is not None}) + "\n")
    for m in maps:                      # one of our parameters at a time, each HF tensor streamed out
        leaf = ckpt.read(m.path)
        for name, tensor in hf_tensors_of_leaf(m, leaf):
            writer.write(name, tensor)
            del tensor
        del leaf
    writer.close()
    files = writer.files[0] if len(writer.files) == 1 else f"{len(writer.files)} files + model.safetensors.index.json"
    print(f"exported {meta['directory']}/{meta['step']} ({cfg.num_params():,} parameters, {dtype}, {files}) to {out}")
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("path", help="run dir, checkpoint dir, or step dir")
    ap.add_argument("out_dir", help="new Hugging Face model directory")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"],
                    help="the weights' dtype in the safetensors files (default bfloat16, as the hub's)")
    ap.add_argument("--max-shard-size", default="5GB",
                    help="largest safetensors file, e.g. 5GB (10^9 bytes, the hub's default), 2GiB or bytes")
    args = ap.parse_args(argv)
    from model.runtime.distributed import quiet_cpu_start

    quiet_cpu_start()       # before JAX starts: no libtpu warnings where no TPU can be
    logging.getLogger("absl").setLevel(logging.ERROR)  # Orbax's read-only notices
    try:
        export(args.path, args.out_dir, dtype=args.dtype, max_shard_size=args.max_shard_size)
    except (ValueError, FileNotFoundError) as e:     # a bad size, a path that holds no checkpoint
        raise SystemExit(f"export_hf: {e}") from None


if __name__ == "__main__":
    main()

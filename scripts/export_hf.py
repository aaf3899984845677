"""Export a checkpoint as a Hugging Face Llama directory (transformers, vLLM, llama.cpp converters).

    python scripts/export_hf.py runs/tiny_sample hf/tiny_sample
    python -c "import transformers as t; m = t.LlamaForCausalLM.from_pretrained('hf/tiny_sample'); \
               tok = t.AutoTokenizer.from_pretrained('hf/tiny_sample')"

PATH: a run directory (its latest checkpoint), a checkpoint directory or one step directory.
Writes config.json, generation_config.json, model.safetensors (fp32, HF names and layouts:
model/hf.py) and the run's tokenizer: tokenizer.json, tokenizer_config.json and
special_tokens_map.json, all loadable offline. Only the parameters are read.
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


def export(path: str, out_dir: str) -> Path:
    from safetensors.numpy import save_file

    from model.hf import to_hf_config, to_hf_state_dict
    from model.runtime.checkpoint import load_params

    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"{out} is not empty; choose a new directory")
    cfg, params, meta = load_params(path)
    run_cfg = meta.get("config") or {}
    out.mkdir(parents=True, exist_ok=True)

    tok_path = (run_cfg.get("tokenizer") or {}).get("path")
    ids = {"bos_token_id": None, "eos_token_id": None}
    if tok_path:
        ids = export_tokenizer(tok_path, out, add_bos=bool((run_cfg.get("data") or {}).get("add_bos")),
                               max_len=cfg.max_seq_len)
    else:
        print(f"warning: {path} names no tokenizer.path; exporting the model without a tokenizer", file=sys.stderr)
    (out / "config.json").write_text(json.dumps(to_hf_config(cfg, **ids), indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({k: v for k, v in ids.items() if v is not None}) + "\n")
    save_file(to_hf_state_dict(params, cfg), str(out / "model.safetensors"), metadata={"format": "pt"})
    print(f"exported {meta['directory']}/{meta['step']} ({cfg.num_params():,} parameters) to {out}")
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("path", help="run dir, checkpoint dir, or step dir")
    ap.add_argument("out_dir", help="new Hugging Face model directory")
    args = ap.parse_args(argv)
    from model.runtime.distributed import quiet_cpu_start

    quiet_cpu_start()       # before JAX starts: no libtpu warnings where no TPU can be
    logging.getLogger("absl").setLevel(logging.ERROR)  # Orbax's read-only notices
    export(args.path, args.out_dir)


if __name__ == "__main__":
    main()

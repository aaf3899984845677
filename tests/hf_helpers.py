"""Tiny open-checkpoint models for the tests and scripts/bench/bench_hf_parity.py: one per family
(Llama 2 and 3.x, Qwen2, Qwen3, Mistral, SmolLM2- and TinyLlama-shaped; YaRN on Llama, Qwen2 and
Qwen3 in both RoPE spellings), built with transformers' own classes, saved with save_pretrained and
read back by model/hf.py; logits against transformers on packed documents and on long rows (past
YaRN's original context). Import after pytest.importorskip("torch") / ("transformers").
"""
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import torch
import transformers

# Tiny random models built with transformers' own classes, saved with save_pretrained and read
# back by model/hf.py (the import path of scripts/import_hf.py without the Orbax save). Each
# variant's shapes keep its family's peculiarity: a decoupled head_dim, GQA ratio, tied head,
# RoPE scaling with every band populated (original_max_position_embeddings 64, so wavelengths
# fall below, between and above 64/4 and 64/1), a window shorter than the rows.
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
# YaRN as Qwen2.5/Qwen3's long-context configs spell it (there: factor 4 over 32768), over a tiny
# original context, so the 128-token rows run 4x past it and every band of the ramp is populated.
YARN_ROPE = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 32}
# ... and with the optional keys away from transformers' defaults, each moving the logits: the ramp
# (pairs turning 2 to 1/4 times in the 32 positions: pairs 1.6 to 5.2 of 16), unrounded, and the
# attention factor from the two mscales.
YARN_ROPE_ALL = {**YARN_ROPE, "beta_fast": 2.0, "beta_slow": 0.25, "truncate": False, "mscale": 1.0,
                 "mscale_all_dim": 0.5}
SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, initializer_range=0.2)
VARIANTS = {
    # name: (transformers class, config kwargs over SHAPE)
    "llama2": ("LlamaForCausalLM", {}),
    "llama3": ("LlamaForCausalLM", {"rope_parameters": LLAMA3_ROPE, "tie_word_embeddings": True}),
    # the hub's spelling of the same (rope_scaling + a top-level rope_theta), written into config.json
    "llama3_hub_spelling": ("LlamaForCausalLM", {"rope_parameters": LLAMA3_ROPE, "tie_word_embeddings": True}),
    "llama_head_dim": ("LlamaForCausalLM", {"head_dim": 32}),
    "qwen2": ("Qwen2ForCausalLM", {"tie_word_embeddings": True, "rope_parameters": {"rope_theta": 1e6}}),
    "qwen3": ("Qwen3ForCausalLM", {"head_dim": 32, "rope_parameters": {"rope_theta": 1e6}}),
    "mistral": ("MistralForCausalLM", {"sliding_window": 8}),
    # YaRN: transformers 5's rope_parameters, and the hub's rope_scaling + top-level rope_theta
    # (Qwen2.5's config.json with its old "type" key); Qwen3 also with every optional key.
    "llama_yarn": ("LlamaForCausalLM", {"rope_parameters": YARN_ROPE}),
    "llama_yarn_hub_spelling": ("LlamaForCausalLM", {"rope_parameters": {**YARN_ROPE, "attention_factor": 1.25}}),
    "qwen2_yarn": ("Qwen2ForCausalLM", {"rope_parameters": {**YARN_ROPE, "rope_theta": 1e6}}),
    "qwen2_yarn_hub_spelling": ("Qwen2ForCausalLM", {"rope_parameters": {**YARN_ROPE, "rope_theta": 1e6}}),
    "qwen3_yarn": ("Qwen3ForCausalLM", {"head_dim": 32, "rope_parameters": YARN_ROPE_ALL}),
    "qwen3_yarn_hub_spelling": ("Qwen3ForCausalLM", {"head_dim": 32, "rope_parameters": YARN_ROPE}),
    # SmolLM2-135M: 9 heads over 3 kv heads, tied, theta 1e5 (here head_dim 8); TinyLlama-1.1B:
    # 32 heads over 4, untied (here head_dim 4). Both plain Llama.
    "smollm2": ("LlamaForCausalLM", {"hidden_size": 72, "num_attention_heads": 9, "num_key_value_heads": 3,
                                     "tie_word_embeddings": True, "rope_parameters": {"rope_theta": 1e5}}),
    "tinyllama": ("LlamaForCausalLM", {"hidden_size": 128, "num_attention_heads": 32, "num_key_value_heads": 4}),
}
# Three packed documents, the first two longer than the Mistral window.
DOC_LENGTHS = (21, 13, 6)
# The variants written in the hub's spelling: rope_scaling + a top-level rope_theta, the type under
# this key ("type": Qwen2.5's config.json).
HUB_SPELLING = {"llama3_hub_spelling": "rope_type", "llama_yarn_hub_spelling": "rope_type",
                "qwen2_yarn_hub_spelling": "type", "qwen3_yarn_hub_spelling": "rope_type"}
# The length of logit_gap's long rows: 48, and for YaRN 128 (4x its original context of 32).
LONG_ROWS = {name: 128 if "yarn" in name else 48 for name in VARIANTS}


def save_variant(name: str, directory, **shape) -> "torch.nn.Module":
    """transformers' model for `name`, random, with norm scales and biases away from their
    init (a missing or transposed one shows), saved to `directory`; returns it (eval mode).
    `shape`: config keys over SHAPE and the variant's (a tokenizer's vocab_size, say)."""
    cls_name, kwargs = VARIANTS[name]
    cls = getattr(transformers, cls_name)
    config = cls.config_class(**{**SHAPE, **kwargs, **shape}, attn_implementation="eager")
    torch.manual_seed(0)
    model = cls(config).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif pname.endswith(".bias"):
                p.copy_(0.5 * torch.randn_like(p))
    model.save_pretrained(str(directory))
    if name in HUB_SPELLING:
        path = Path(directory) / "config.json"
        hf_cfg = json.loads(path.read_text())
        rope = hf_cfg.pop("rope_parameters")
        hf_cfg["rope_theta"] = rope.pop("rope_theta")
        rope[HUB_SPELLING[name]] = rope.pop("rope_type")
        hf_cfg["rope_scaling"] = rope
        path.write_text(json.dumps(hf_cfg))
        model = cls.from_pretrained(str(directory), attn_implementation="eager").eval()
    return model


def import_variant(directory, **runtime):
    """(our config, our Llama) from a transformers directory, as scripts/import_hf.py reads it."""
    from model import hf
    from model.step import model_from_params

    cfg = hf.from_hf_config(json.loads((Path(directory) / "config.json").read_text()),
                            dtype="float32", remat="none", **runtime)
    return cfg, model_from_params(cfg, hf.from_hf_state_dict(hf.read_safetensors(directory), cfg))


def packed_row(vocab: int, lengths=DOC_LENGTHS):
    """(tokens, positions, segment ids) of one row packing `lengths`-token documents, and the
    documents apart."""
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, vocab, n) for n in lengths]
    tokens = np.concatenate(docs)[None]
    positions = np.concatenate([np.arange(n) for n in lengths])[None]
    segments = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)])[None]
    return tokens, positions, segments, docs


def logit_gap(name: str, directory) -> tuple[float, float]:
    """(max |our logits - transformers'| over a packed row and over one long document, max |logit|)."""
    hf_model = save_variant(name, directory)
    cfg, ours = import_variant(directory)
    tokens, positions, segments, docs = packed_row(cfg.vocab_size)
    with torch.no_grad():  # transformers sees each document alone: ours must not let them mix
        want = np.concatenate([hf_model(torch.from_numpy(d[None])).logits.numpy() for d in docs], axis=1)
        long_doc = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, LONG_ROWS[name]))
        want_long = hf_model(torch.from_numpy(long_doc)).logits.numpy()
    got = np.asarray(ours(jnp.asarray(tokens, jnp.int32), jnp.asarray(positions, jnp.int32),
                          jnp.asarray(segments, jnp.int32)))
    b, t = long_doc.shape
    got_long = np.asarray(ours(jnp.asarray(long_doc, jnp.int32), jnp.broadcast_to(jnp.arange(t), (b, t)),
                               jnp.ones((b, t), jnp.int32)))
    gap = max(np.abs(got - want).max(), np.abs(got_long - want_long).max())
    return float(gap), float(max(np.abs(want).max(), np.abs(want_long).max()))

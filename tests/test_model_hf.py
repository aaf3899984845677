"""Golden logits: our Llama vs Hugging Face `LlamaForCausalLM`, same random weights, fp32.

Skips without torch/transformers. CPU torch:
    pip install torch --index-url https://download.pytorch.org/whl/cpu && pip install -e ".[hf]"
Run: pytest tests/test_model_hf.py -q
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from model.llama import Llama, LlamaConfig  # noqa: E402


def to_our_params(hf_model, cfg: LlamaConfig) -> dict:
    """HF state dict -> our params dict (scanned layers stacked on axis 0).

    HF Linear weights are [out, in]; ours are [in, ...] with heads split out: q_proj.weight
    [n*h, d] -> wq_dnh = W.T reshaped to [d, n, h]. HF checkpoints are already permuted for
    "rotate half" RoPE, which is the layout model/llama.py uses.
    """
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in hf_model.state_dict().items()}
    d, n, k, h = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim

    def layer(i):
        p = f"model.layers.{i}."
        return {
            "attn_norm": {"scale_d": sd[p + "input_layernorm.weight"]},
            "mlp_norm": {"scale_d": sd[p + "post_attention_layernorm.weight"]},
            "wq_dnh": sd[p + "self_attn.q_proj.weight"].T.reshape(d, n, h),
            "wk_dkh": sd[p + "self_attn.k_proj.weight"].T.reshape(d, k, h),
            "wv_dkh": sd[p + "self_attn.v_proj.weight"].T.reshape(d, k, h),
            "wo_nhd": sd[p + "self_attn.o_proj.weight"].T.reshape(n, h, d),
            "w_gate_df": sd[p + "mlp.gate_proj.weight"].T,
            "w_up_df": sd[p + "mlp.up_proj.weight"].T,
            "w_down_fd": sd[p + "mlp.down_proj.weight"].T,
        }

    layers = [layer(i) for i in range(cfg.n_layers)]
    stacked = {key: (np.stack([l[key] for l in layers]) if not isinstance(layers[0][key], dict)
                     else {"scale_d": np.stack([l[key]["scale_d"] for l in layers])})
               for key in layers[0]}
    params = {"embed_vd": sd["model.embed_tokens.weight"], "layers": stacked,
              "final_norm": {"scale_d": sd["model.norm.weight"]}}
    if not cfg.tie_embeddings:
        params["lm_head_dv"] = sd["lm_head.weight"].T
    return params


@pytest.mark.parametrize("tie", [False, True])
def test_logits_match_hf_llama(tie):
    cfg = LlamaConfig(vocab_size=256, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=160,
                      rope_theta=10000.0, norm_eps=1e-5, max_seq_len=64, tie_embeddings=tie,
                      dtype="float32", param_dtype="float32", remat="none")
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads, rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta,
        max_position_embeddings=cfg.max_seq_len, tie_word_embeddings=tie, attention_bias=False,
        mlp_bias=False, initializer_range=0.2, attn_implementation="eager")
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    with torch.no_grad():  # non-trivial norm scales, so a missing/transposed one shows
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))

    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 40)).astype(np.int64)
    with torch.no_grad():
        want = hf(torch.from_numpy(tokens)).logits.numpy()

    graphdef, _ = nnx.split(nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0))), nnx.Param)
    model = nnx.merge(graphdef, to_our_params(hf, cfg))
    b, t = tokens.shape
    got = model(jnp.asarray(tokens, jnp.int32), jnp.broadcast_to(jnp.arange(t), (b, t)), jnp.ones((b, t), jnp.int32))
    got = np.asarray(got)
    assert got.dtype == np.float32 and got.shape == want.shape
    assert np.abs(want).max() > 1.0  # the check is not vacuous
    assert np.abs(got - want).max() <= 1e-4, np.abs(got - want).max()


# ---------------------------------------------------------------- the open-checkpoint families
# Tiny random models built with transformers' own classes, saved with save_pretrained and read
# back by model/hf.py (the import path of scripts/import_hf.py without the Orbax save). Each
# variant's shapes keep its family's peculiarity: a decoupled head_dim, GQA ratio, tied head,
# RoPE scaling with every band populated (original_max_position_embeddings 64, so wavelengths
# fall below, between and above 64/4 and 64/1), a window shorter than the rows.
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
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
    # SmolLM2-135M: 9 heads over 3 kv heads, tied, theta 1e5 (here head_dim 8); TinyLlama-1.1B:
    # 32 heads over 4, untied (here head_dim 4). Both plain Llama.
    "smollm2": ("LlamaForCausalLM", {"hidden_size": 72, "num_attention_heads": 9, "num_key_value_heads": 3,
                                     "tie_word_embeddings": True, "rope_parameters": {"rope_theta": 1e5}}),
    "tinyllama": ("LlamaForCausalLM", {"hidden_size": 128, "num_attention_heads": 32, "num_key_value_heads": 4}),
}
# Three packed documents, the first two longer than the Mistral window.
DOC_LENGTHS = (21, 13, 6)


def save_variant(name: str, directory, **shape) -> "torch.nn.Module":
    """transformers' model for `name`, random, with norm scales and biases away from their
    init (a missing or transposed one shows), saved to `directory`; returns it (eval mode).
    `shape`: config keys over SHAPE and the variant's (a tokenizer's vocab_size, say)."""
    import json
    from pathlib import Path

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
    if name == "llama3_hub_spelling":
        path = Path(directory) / "config.json"
        hf_cfg = json.loads(path.read_text())
        rope = hf_cfg.pop("rope_parameters")
        hf_cfg["rope_theta"] = rope.pop("rope_theta")
        hf_cfg["rope_scaling"] = rope
        path.write_text(json.dumps(hf_cfg))
        model = cls.from_pretrained(str(directory), attn_implementation="eager").eval()
    return model


def import_variant(directory, **runtime):
    """(our config, our Llama) from a transformers directory, as scripts/import_hf.py reads it."""
    import json
    from pathlib import Path

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
        long_doc = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 48))
        want_long = hf_model(torch.from_numpy(long_doc)).logits.numpy()
    got = np.asarray(ours(jnp.asarray(tokens, jnp.int32), jnp.asarray(positions, jnp.int32),
                          jnp.asarray(segments, jnp.int32)))
    b, t = long_doc.shape
    got_long = np.asarray(ours(jnp.asarray(long_doc, jnp.int32), jnp.broadcast_to(jnp.arange(t), (b, t)),
                               jnp.ones((b, t), jnp.int32)))
    gap = max(np.abs(got - want).max(), np.abs(got_long - want_long).max())
    return float(gap), float(max(np.abs(want).max(), np.abs(want_long).max()))


@pytest.mark.parametrize("name", list(VARIANTS))
def test_family_logits_match_transformers(name, tmp_path):
    gap, scale = logit_gap(name, tmp_path / name)
    assert scale > 1.0  # not vacuous
    assert gap <= 1e-4, gap


def test_variant_features_are_read_and_matter(tmp_path):
    """Each variant's field is read, and leaving it out would change the logits (so the parity
    above checks it): RoPE scaling, the window, biases and q/k norms."""
    import dataclasses

    from model import hf
    from model.step import model_from_params

    expected = {"llama3": dict(rope_type="llama3", rope_factor=32.0, rope_low_freq_factor=1.0,
                               rope_high_freq_factor=4.0, rope_original_max_len=64, rope_theta=500000.0,
                               tie_embeddings=True),
                "llama3_hub_spelling": dict(rope_type="llama3", rope_factor=32.0, rope_original_max_len=64,
                                            rope_theta=500000.0),
                "mistral": dict(sliding_window=8, hf_model_type="mistral"),
                "qwen2": dict(qkv_bias=True, hf_model_type="qwen2", tie_embeddings=True),
                "qwen3": dict(qk_norm=True, head_dim=32, hf_model_type="qwen3")}
    without = {"llama3": dict(rope_type="default", rope_factor=None, rope_low_freq_factor=None,
                              rope_high_freq_factor=None, rope_original_max_len=None),
               "mistral": dict(sliding_window=None)}
    long_doc = np.random.default_rng(1).integers(0, 256, (1, 48))
    pos, seg = jnp.arange(48)[None], jnp.ones((1, 48), jnp.int32)
    for name, fields in expected.items():
        save_variant(name, tmp_path / name)
        cfg, ours = import_variant(tmp_path / name)
        assert {k: getattr(cfg, k) for k in fields} == fields, name
        if name in without:
            params = hf.from_hf_state_dict(hf.read_safetensors(tmp_path / name), cfg)
            other = model_from_params(dataclasses.replace(cfg, **without[name]), params)
            gap = np.abs(np.asarray(ours(jnp.asarray(long_doc), pos, seg)) -
                         np.asarray(other(jnp.asarray(long_doc), pos, seg))).max()
            assert gap > 1e-2, (name, gap)

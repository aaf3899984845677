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
from hf_helpers import VARIANTS, import_variant, logit_gap, save_variant  # noqa: E402

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
# One tiny random model per family, built by transformers' own class (tests/hf_helpers.py).


# One family in the fast tier; the rest with the slow tests (~4 s each)
@pytest.mark.parametrize("name", [n if n == "llama3" else pytest.param(n, marks=pytest.mark.slow) for n in VARIANTS])
def test_family_logits_match_transformers(name, tmp_path):
    gap, scale = logit_gap(name, tmp_path / name)
    assert scale > 1.0  # not vacuous
    assert gap <= 1e-4, gap


@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.parametrize("name, fields", [
    # Qwen2.5's spelling: rope_scaling {"type": "yarn", ...} and a top-level rope_theta
    ("qwen2_yarn_hub_spelling", dict(rope_type="yarn", rope_theta=1e6, rope_factor=4.0, rope_original_max_len=32,
                                     rope_beta_fast=None, rope_beta_slow=None, rope_attention_factor=None,
                                     rope_mscale=None, rope_mscale_all_dim=None, rope_truncate=None)),
    # transformers 5's rope_parameters with every optional key
    ("qwen3_yarn", dict(rope_type="yarn", rope_theta=1e4, rope_factor=4.0, rope_original_max_len=32,
                        rope_beta_fast=2.0, rope_beta_slow=0.25, rope_attention_factor=None, rope_mscale=1.0,
                        rope_mscale_all_dim=0.5, rope_truncate=False)),
    ("llama_yarn_hub_spelling", dict(rope_type="yarn", rope_attention_factor=1.25)),
])
def test_yarn_fields_are_read_and_matter(name, fields, tmp_path):
    """YaRN's keys are read, and each one read matters past the original context (so the parity
    above checks it): YaRN against plain RoPE, the attention factor (cos and sin scaled) against
    none, and every optional key against transformers' default for it."""
    import dataclasses

    from model import hf
    from model.llama import YARN_ROPE_FIELDS
    from model.step import model_from_params

    save_variant(name, tmp_path)
    cfg, ours = import_variant(tmp_path)
    assert {k: getattr(cfg, k) for k in fields} == fields
    assert hf.from_hf_config(hf.to_hf_config(cfg), dtype="float32", remat="none") == cfg
    params = hf.from_hf_state_dict(hf.read_safetensors(tmp_path), cfg)
    doc = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (1, 128)))
    pos, seg = jnp.arange(128)[None], jnp.ones((1, 128), jnp.int32)
    want = np.asarray(ours(doc, pos, seg))
    changes = {"plain RoPE": dict(rope_type="default", **dict.fromkeys(YARN_ROPE_FIELDS)),
               "no attention factor": dict(rope_attention_factor=1.0, rope_mscale=None, rope_mscale_all_dim=None)}
    changes.update({k: {k: None} for k in YARN_ROPE_FIELDS[2:] if getattr(cfg, k) is not None})
    for what, change in changes.items():
        other = model_from_params(dataclasses.replace(cfg, **change), params)
        gap = np.abs(want - np.asarray(other(doc, pos, seg))).max()
        assert gap > 1e-2, (what, gap)

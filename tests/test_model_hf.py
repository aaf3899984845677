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

"""Hugging Face Llama-family checkpoints <-> our Llama: config, weight names and layouts, safetensors.

Used by scripts/export_hf.py, scripts/import_hf.py and scripts/generate.py; train.py never
imports it. The numerical reference is tests/test_model_hf.py (HF logits to 1e-4 in fp32).

Weight layouts. HF `nn.Linear` weights are [out, in]; ours are [in, ...] with the heads split
out, and the layers stacked on a leading axis when `scan_layers` (see model/llama.py):
    q_proj.weight [n*h, d]  <->  wq_dnh [d, n, h]        (k, v: [k*h, d] <-> [d, k, h])
    o_proj.weight [d, n*h]  <->  wo_nhd [n, h, d]
    gate/up_proj  [f, d]    <->  w_gate_df / w_up_df [d, f];  down_proj [d, f] <-> w_down_fd [f, d]
    lm_head.weight [v, d]   <->  lm_head_dv [d, v]   (absent when the embeddings are tied)
    q/k/v_proj.bias [n*h]   <->  bq_nh [n, h] / bk_kh, bv_kh [k, h]    (Qwen2)
    q/k_norm.weight [h]     <->  q_norm / k_norm scale_d [h]          (Qwen3)
Both use the "rotate half" RoPE layout, so no q/k permutation is needed either way.
Families (config.json model_type): llama, mistral, qwen2, qwen3 (HF_FAMILIES); the model config
records which (hf_model_type), so an export writes the family it was imported from.

Reading and writing parameter-only checkpoints is model/runtime/checkpoint.py's (load_params, save_params).
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Callable, Mapping

import jax
import numpy as np

from model.llama import Llama, LlamaConfig

# ----------------------------------------------------------------------------- config
# The Hugging Face families that are this network: model_type -> (architecture class, the
# defaults its config class gives keys a config.json may omit).
HF_FAMILIES = {
    "llama": ("LlamaForCausalLM", {"max_position_embeddings": 2048, "num_key_value_heads": None, "head_dim": None}),
    "mistral": ("MistralForCausalLM", {"max_position_embeddings": 4096 * 32, "num_key_value_heads": 8,
                                       "head_dim": None, "sliding_window": 4096}),
    "qwen2": ("Qwen2ForCausalLM", {"max_position_embeddings": 32768, "num_key_value_heads": 32, "head_dim": None}),
    "qwen3": ("Qwen3ForCausalLM", {"max_position_embeddings": 32768, "num_key_value_heads": 32, "head_dim": 128}),
}
# Keys of other families (or of ours, set otherwise) that would change the network and that no
# field here represents, with the value that leaves it unchanged (None: must be absent or null).
_REFUSED_KEYS = {
    "hidden_act": "silu", "mlp_bias": False, "pretraining_tp": 1, "partial_rotary_factor": 1.0,
    "rotary_pct": 1.0, "use_sliding_window": False, "attn_logit_softcapping": None,
    "final_logit_softcapping": None, "logits_scaling": 1.0, "embedding_multiplier": 1.0,
    "residual_multiplier": 1.0, "attention_multiplier": None, "query_pre_attn_scalar": None,
    "num_experts": None, "num_local_experts": None, "n_routed_experts": None, "num_experts_per_tok": None,
    "moe_intermediate_size": None, "decoder_sparse_step": None, "shared_expert_intermediate_size": None,
    "use_qk_norm": None, "qk_layernorm": None, "no_rope_layers": None,
}
_LLAMA3_KEYS = {"rope_factor": "factor", "rope_low_freq_factor": "low_freq_factor",
                "rope_high_freq_factor": "high_freq_factor",
                "rope_original_max_len": "original_max_position_embeddings"}


def _refuse(key: str, value, why: str):
    raise ValueError(f"config.json {key}={value!r}: {why}")


def _rope_from_hf(hf: Mapping[str, Any]) -> dict:
    """Our rope fields from either spelling: `rope_scaling` (+ top-level `rope_theta`, the hub's
    config.json files) or `rope_parameters` (transformers 5, rope_theta inside)."""
    scaling, params = hf.get("rope_scaling"), hf.get("rope_parameters")
    if scaling and params:
        for key in sorted(set(scaling) | set(params)):
            if key != "rope_theta" and key in scaling and scaling.get(key) != params.get(key):
                _refuse(f"rope_scaling.{key}", scaling.get(key), f"rope_parameters.{key}={params.get(key)!r} disagrees")
    rope = dict(params or {}, **(scaling or {}))  # transformers: rope_scaling wins
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    theta = rope.get("rope_theta") or hf.get("rope_theta") or 10000.0
    where = "rope_scaling" if scaling else "rope_parameters"
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        _refuse(f"{where}.partial_rotary_factor", rope["partial_rotary_factor"], "model/llama.py rotates whole heads")
    out = {"rope_theta": float(theta), "rope_type": rope_type}
    if rope_type == "default":
        return out
    if rope_type != "llama3":
        _refuse(f"{where}.rope_type", rope_type, "model/llama.py has RoPE types 'default' and 'llama3' only")
    for ours, theirs in _LLAMA3_KEYS.items():
        if rope.get(theirs) is None:
            _refuse(f"{where}.{theirs}", None, "rope_type 'llama3' needs it")
        out[ours] = int(rope[theirs]) if ours == "rope_original_max_len" else float(rope[theirs])
    return out


def from_hf_config(hf: Mapping[str, Any], **runtime) -> LlamaConfig:
    """Our config from a config.json; `runtime` sets dtype, remat, attention, ... (defaults otherwise).

    Reads Llama 2/3.x (rope_type llama3, tied embeddings, a decoupled head_dim), Mistral
    (sliding_window), Qwen2/2.5 (q/k/v biases) and Qwen3 (per-head q/k RMSNorm). Raises a
    one-line ValueError naming the key and value for anything else that would change the network
    (another model_type or RoPE type, other biases or activations, MoE keys, ...), rather than
    converting it into a different network.
    """
    model_type = hf.get("model_type", "llama")
    if model_type not in HF_FAMILIES:
        _refuse("model_type", model_type, f"supported: {', '.join(HF_FAMILIES)}")
    defaults = HF_FAMILIES[model_type][1]
    for key, neutral in _REFUSED_KEYS.items():
        value = hf.get(key)
        if value is not None and value != neutral:
            _refuse(key, value, "model/llama.py has no such part (absent or null only)" if neutral is None
                    else f"model/llama.py needs {neutral!r}")
    kinds = set(hf.get("layer_types") or []) - {"full_attention"}
    if kinds:
        _refuse("layer_types", sorted(kinds), "per-layer attention kinds are not supported")
    # Qwen2's projections always carry q/k/v biases; Llama's and Qwen3's attention_bias also puts
    # one on o_proj, which this network lacks; Mistral has none.
    if model_type in ("llama", "qwen3") and hf.get("attention_bias"):
        _refuse("attention_bias", hf["attention_bias"], "an o_proj bias model/llama.py lacks")
    d, n = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or defaults["head_dim"] or d // n
    n_kv = hf.get("num_key_value_heads", defaults["num_key_value_heads"]) or n
    window = hf.get("sliding_window", defaults.get("sliding_window")) if model_type == "mistral" else None
    return LlamaConfig(
        vocab_size=hf["vocab_size"], d_model=d, n_layers=hf["num_hidden_layers"], n_heads=n,
        n_kv_heads=n_kv, d_ff=hf["intermediate_size"], norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_seq_len=int(hf.get("max_position_embeddings", defaults["max_position_embeddings"])),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), head_dim=head_dim,
        qkv_bias=model_type == "qwen2", qk_norm=model_type == "qwen3", sliding_window=window,
        hf_model_type=model_type, **_rope_from_hf(hf), **runtime)


def to_hf_config(cfg: LlamaConfig, bos_token_id: int | None = None, eos_token_id: int | None = None) -> dict:
    """config.json of the transformers class `cfg.hf_model_type` names, with our shapes (weights
    stored fp32). RoPE is written in both spellings, equal: `rope_theta` + `rope_scaling` (what
    transformers 4.x, vLLM and llama.cpp's converter read) and `rope_parameters` (transformers 5).
    A network the family cannot express (e.g. q/k norms in a llama config) is a ValueError."""
    family = cfg.hf_model_type
    wanted = {"qkv_bias": family == "qwen2", "qk_norm": family == "qwen3"}
    for field, want in wanted.items():
        if getattr(cfg, field) != want:
            raise ValueError(f"model.{field}={getattr(cfg, field)} does not fit model.hf_model_type={family!r} "
                             f"(Qwen2 has q/k/v biases, Qwen3 q/k norms, the others neither)")
    if cfg.sliding_window is not None and family != "mistral":
        raise ValueError(f"model.sliding_window={cfg.sliding_window}: a {family!r} config.json has no "
                         "sliding window (model.hf_model_type=mistral has)")
    rope = {"rope_type": cfg.rope_type}
    if cfg.rope_type == "llama3":
        rope.update({theirs: getattr(cfg, ours) for ours, theirs in _LLAMA3_KEYS.items()})
    config = {
        "architectures": [HF_FAMILIES[family][0]],
        "model_type": family,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "hidden_act": "silu",
        "rope_theta": cfg.rope_theta,
        "rope_scaling": dict(rope) if cfg.rope_type != "default" else None,
        "rope_parameters": {**rope, "rope_theta": cfg.rope_theta},
        "rms_norm_eps": cfg.norm_eps,
        "max_position_embeddings": cfg.max_seq_len,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "torch_dtype": "float32",
    }
    config["head_dim"] = cfg.head_dim  # every family's attention reads it when present
    if family in ("llama", "qwen3"):
        config["attention_bias"] = False
    if family == "llama":
        config.update({"mlp_bias": False, "pretraining_tp": 1})
    if family == "mistral":
        config["sliding_window"] = cfg.sliding_window
    if family in ("qwen2", "qwen3"):
        config.update({"use_sliding_window": False, "sliding_window": None, "max_window_layers": cfg.n_layers})
    return config


def model_yaml(cfg: LlamaConfig) -> str:
    """The configs/model/*.yaml text for `cfg` (every field, in declaration order)."""
    import yaml

    # safe_dump writes 1e-5 as 1.0e-05, which YAML 1.1 loaders read back as a float.
    return yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False)


# ----------------------------------------------------------------------------- weights

def _layer_table(cfg: LlamaConfig) -> list[tuple[tuple[str, ...], str, Callable, Callable]]:
    """One row per weight of a layer: (our path in the layer, HF name after "model.layers.{i}.",
    ours -> HF, HF -> ours). Both directions sit side by side, so they cannot drift apart."""
    d, n, k, h = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    same = lambda w: w  # noqa: E731
    T = lambda w: w.T  # noqa: E731
    table = [
        (("attn_norm", "scale_d"), "input_layernorm.weight", same, same),
        (("wq_dnh",), "self_attn.q_proj.weight", lambda w: w.reshape(d, n * h).T, lambda w: w.T.reshape(d, n, h)),
        (("wk_dkh",), "self_attn.k_proj.weight", lambda w: w.reshape(d, k * h).T, lambda w: w.T.reshape(d, k, h)),
        (("wv_dkh",), "self_attn.v_proj.weight", lambda w: w.reshape(d, k * h).T, lambda w: w.T.reshape(d, k, h)),
        (("wo_nhd",), "self_attn.o_proj.weight", lambda w: w.reshape(n * h, d).T, lambda w: w.T.reshape(n, h, d)),
        (("mlp_norm", "scale_d"), "post_attention_layernorm.weight", same, same),
        (("w_gate_df",), "mlp.gate_proj.weight", T, T),
        (("w_up_df",), "mlp.up_proj.weight", T, T),
        (("w_down_fd",), "mlp.down_proj.weight", T, T),
    ]
    if cfg.qkv_bias:  # Qwen2: q_proj.bias [n*h] <-> bq_nh [n, h]
        table += [(("bq_nh",), "self_attn.q_proj.bias", lambda w: w.reshape(n * h), lambda w: w.reshape(n, h)),
                  (("bk_kh",), "self_attn.k_proj.bias", lambda w: w.reshape(k * h), lambda w: w.reshape(k, h)),
                  (("bv_kh",), "self_attn.v_proj.bias", lambda w: w.reshape(k * h), lambda w: w.reshape(k, h))]
    if cfg.qk_norm:  # Qwen3: one [h] scale each, shared by the heads
        table += [(("q_norm", "scale_d"), "self_attn.q_norm.weight", same, same),
                  (("k_norm", "scale_d"), "self_attn.k_norm.weight", same, same)]
    return table


def _get(tree, path):
    for key in path:
        tree = tree[key]
    return tree


def _set(tree: dict, path, value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def to_hf_state_dict(params: Mapping, cfg: LlamaConfig) -> dict[str, np.ndarray]:
    """Our params (plain nested dict) -> {HF name: contiguous fp32 numpy array}."""
    p = jax.tree.map(lambda x: np.asarray(x, np.float32), dict(params))
    out = {"model.embed_tokens.weight": p["embed_vd"], "model.norm.weight": p["final_norm"]["scale_d"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = p["lm_head_dv"].T
    for i in range(cfg.n_layers):
        layer = jax.tree.map(lambda x, i=i: x[i], p["layers"]) if cfg.scan_layers else p["layers"][i]
        for path, name, to_hf, _ in _layer_table(cfg):
            out[f"model.layers.{i}.{name}"] = to_hf(_get(layer, path))
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def from_hf_state_dict(sd: Mapping[str, np.ndarray], cfg: LlamaConfig) -> dict:
    """{HF name: array} -> our params (fp32 numpy), checked against the shapes `cfg` implies.

    Names HF does not need for inference (rotary inv_freq buffers) and a tied checkpoint's
    redundant lm_head are ignored; a missing or misshapen weight is a ValueError, and so is a
    weight this network has no place for (an o_proj bias, say): it would be dropped silently.
    """
    used = {name for name in sd if name.endswith("rotary_emb.inv_freq")}
    if cfg.tie_embeddings:
        used.add("lm_head.weight")

    def take(name):
        if name not in sd:
            raise ValueError(f"weight {name!r} missing from the safetensors files")
        used.add(name)
        return np.asarray(sd[name], np.float32)

    table = _layer_table(cfg)
    layers = []
    for i in range(cfg.n_layers):
        layer: dict = {}
        for path, name, _, from_hf in table:
            _set(layer, path, from_hf(take(f"model.layers.{i}.{name}")))
        layers.append(layer)
    params = {"embed_vd": take("model.embed_tokens.weight"),
              "final_norm": {"scale_d": take("model.norm.weight")},
              "layers": (jax.tree.map(lambda *xs: np.stack(xs), *layers) if cfg.scan_layers
                         else dict(enumerate(layers)))}
    if not cfg.tie_embeddings:
        params["lm_head_dv"] = take("lm_head.weight").T
    unused = sorted(set(sd) - used)
    if unused:
        raise ValueError(f"weight {unused[0]!r} (and {len(unused) - 1} more) in the safetensors files has no "
                         "place in model/llama.py for this config.json")
    _check_shapes(params, cfg)
    return params


def abstract_params(cfg: LlamaConfig) -> dict:
    from flax import nnx

    model = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def _check_shapes(params, cfg: LlamaConfig) -> None:
    want = jax.tree_util.tree_flatten_with_path(abstract_params(cfg))[0]
    got = dict(jax.tree_util.tree_flatten_with_path(params)[0])
    for path, abstract in want:
        shape = tuple(np.shape(got[path]))
        if shape != tuple(abstract.shape):
            raise ValueError(f"{jax.tree_util.keystr(path)}: shape {shape}, config.json implies {abstract.shape}")


def read_safetensors(hf_dir: str | os.PathLike) -> dict[str, np.ndarray]:
    """model.safetensors, or the shards listed by model.safetensors.index.json; any dtype
    (bf16 included: read through JAX, which has it) -> numpy arrays in their stored dtype."""
    from safetensors import safe_open

    hf_dir = Path(hf_dir)
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (hf_dir / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{hf_dir}: no model.safetensors or model.safetensors.index.json "
                                "(PyTorch .bin checkpoints are not read; convert them to safetensors)")
    sd = {}
    for name in files:
        with safe_open(str(hf_dir / name), framework="flax") as f:
            for key in f.keys():
                sd[key] = np.asarray(f.get_tensor(key))
    return sd

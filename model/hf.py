"""Hugging Face Llama <-> our Llama: config, weight names and layouts, safetensors.

Used by scripts/export_hf.py, scripts/import_hf.py and scripts/generate.py; train.py never
imports it. The numerical reference is tests/test_model_hf.py (HF logits to 1e-4 in fp32).

Weight layouts. HF `nn.Linear` weights are [out, in]; ours are [in, ...] with the heads split
out, and the layers stacked on a leading axis when `scan_layers` (see model/llama.py):
    q_proj.weight [n*h, d]  <->  wq_dnh [d, n, h]        (k, v: [k*h, d] <-> [d, k, h])
    o_proj.weight [d, n*h]  <->  wo_nhd [n, h, d]
    gate/up_proj  [f, d]    <->  w_gate_df / w_up_df [d, f];  down_proj [d, f] <-> w_down_fd [f, d]
    lm_head.weight [v, d]   <->  lm_head_dv [d, v]   (absent when the embeddings are tied)
Both use the "rotate half" RoPE layout, so no q/k permutation is needed either way.

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


def to_hf_config(cfg: LlamaConfig, bos_token_id: int | None = None, eos_token_id: int | None = None) -> dict:
    """config.json of a `transformers.LlamaForCausalLM` with our shapes (weights stored fp32)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "rms_norm_eps": cfg.norm_eps,
        "max_position_embeddings": cfg.max_seq_len,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "torch_dtype": "float32",
    }


def from_hf_config(hf: Mapping[str, Any], **runtime) -> LlamaConfig:
    """Our config from a config.json; `runtime` sets dtype, remat, attention, ... (defaults otherwise).

    Raises ValueError for HF variants this model cannot represent (biases, RoPE scaling, other
    activations or head sizes), rather than converting them into a different network.
    """
    if hf.get("model_type", "llama") != "llama":
        raise ValueError(f"model_type={hf.get('model_type')!r}: only Llama checkpoints convert")
    d, n = hf["hidden_size"], hf["num_attention_heads"]
    unsupported = {
        "hidden_act": (hf.get("hidden_act", "silu"), "silu"),
        "attention_bias": (bool(hf.get("attention_bias", False)), False),
        "mlp_bias": (bool(hf.get("mlp_bias", False)), False),
        "rope_scaling": (hf.get("rope_scaling"), None),
        "head_dim": (hf.get("head_dim") or d // n, d // n),
        "pretraining_tp": (hf.get("pretraining_tp", 1), 1),
    }
    for key, (got, want) in unsupported.items():
        if got != want:
            raise ValueError(f"config.json {key}={got!r} is not supported (model/llama.py needs {want!r})")
    rope_theta = hf.get("rope_theta")
    if rope_theta is None:  # newer transformers keep it under rope_parameters
        rope_theta = (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    return LlamaConfig(
        vocab_size=hf["vocab_size"], d_model=d, n_layers=hf["num_hidden_layers"], n_heads=n,
        n_kv_heads=hf.get("num_key_value_heads") or n, d_ff=hf["intermediate_size"],
        rope_theta=float(rope_theta), norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_seq_len=int(hf.get("max_position_embeddings", 2048)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), **runtime)


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
    return [
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
    redundant lm_head are ignored; a missing or misshapen weight is a ValueError.
    """
    def take(name):
        if name not in sd:
            raise ValueError(f"weight {name!r} missing from the safetensors files")
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

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

Reading and writing parameter-only checkpoints is model/runtime/checkpoint.py's (HostParams, load_params,
save_params, LazyLeaf).
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import jax
import numpy as np

from model.llama import ROPE_TYPES, Llama, LlamaConfig

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
# rope_type yarn: the two keys it needs, then the ones transformers fills in when absent (our None).
_YARN_KEYS = {"rope_factor": "factor", "rope_original_max_len": "original_max_position_embeddings",
              "rope_beta_fast": "beta_fast", "rope_beta_slow": "beta_slow", "rope_attention_factor": "attention_factor",
              "rope_mscale": "mscale", "rope_mscale_all_dim": "mscale_all_dim", "rope_truncate": "truncate"}
_ROPE_KEYS = {"llama3": _LLAMA3_KEYS, "yarn": _YARN_KEYS}


def _refuse(key: str, value, why: str):
    raise ValueError(f"config.json {key}={value!r}: {why}")


def _rope_from_hf(hf: Mapping[str, Any]) -> dict:
    """Our rope fields from either spelling: `rope_scaling` (+ top-level `rope_theta`, the hub's
    config.json files; the type as `rope_type` or the older `type`, Qwen2.5's) or `rope_parameters`
    (transformers 5, rope_theta inside)."""
    scaling, params = hf.get("rope_scaling"), hf.get("rope_parameters")
    if scaling and params:
        for key in sorted(set(scaling) | set(params)):
            if key != "rope_theta" and key in scaling and scaling.get(key) != params.get(key):
                _refuse(f"rope_scaling.{key}", scaling.get(key), f"rope_parameters.{key}={params.get(key)!r} disagrees")
    rope = dict(params or {}, **(scaling or {}))  # transformers: rope_scaling wins
    where = "rope_scaling" if scaling else "rope_parameters"
    if "type" in rope and "rope_type" in rope and rope["type"] != rope["rope_type"]:
        _refuse(f"{where}.type", rope["type"], f"{where}.rope_type={rope['rope_type']!r} disagrees")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    theta = rope.get("rope_theta") or hf.get("rope_theta") or 10000.0
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        _refuse(f"{where}.partial_rotary_factor", rope["partial_rotary_factor"], "model/llama.py rotates whole heads")
    out = {"rope_theta": float(theta), "rope_type": rope_type}
    if rope_type == "default":
        return out
    if rope_type not in ROPE_TYPES:
        _refuse(f"{where}.rope_type", rope_type, f"model/llama.py has RoPE types {list(ROPE_TYPES)} only")
    # transformers (5.x) reads a top-level original_max_position_embeddings over the RoPE dict's (Phi-3's spelling)
    top = hf.get("original_max_position_embeddings")
    if top is not None and rope.get("original_max_position_embeddings", top) != top:
        _refuse("original_max_position_embeddings", top,
                f"{where}.original_max_position_embeddings={rope['original_max_position_embeddings']!r} disagrees")
    rope.setdefault("original_max_position_embeddings", top)
    keys = _ROPE_KEYS[rope_type]
    needed = list(keys.values())[:2] if rope_type == "yarn" else list(keys.values())
    for ours, theirs in keys.items():
        value = rope.get(theirs)
        if value is None and theirs in needed:
            _refuse(f"{where}.{theirs}", None, f"rope_type {rope_type!r} needs it")
        if value is None and theirs == "truncate" and theirs in rope:
            _refuse(f"{where}.truncate", None, "write true or false (transformers reads null as false)")
        if value is not None:
            cast = {"rope_original_max_len": int, "rope_truncate": bool}.get(ours, float)
            out[ours] = cast(value)
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


def to_hf_config(cfg: LlamaConfig, bos_token_id: int | None = None, eos_token_id: int | None = None,
                 dtype: str = "float32") -> dict:
    """config.json of the transformers class `cfg.hf_model_type` names, with our shapes (weights
    stored in `dtype`). RoPE is written in both spellings, equal: `rope_theta` + `rope_scaling` (what
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
    for ours, theirs in _ROPE_KEYS.get(cfg.rope_type, {}).items():
        if getattr(cfg, ours) is not None:  # yarn's optional keys: absent, as transformers' defaults
            rope[theirs] = getattr(cfg, ours)
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
        "torch_dtype": dtype,
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


@dataclasses.dataclass(frozen=True)
class LeafMap:
    """One leaf of our params and the HF tensors it holds: `names[0]` for a plain leaf, `names[i]`
    for layer i of a stacked one (scan_layers). `to_hf` / `from_hf` convert one layer's slice."""
    path: tuple
    names: tuple[str, ...]
    stacked: bool
    to_hf: Callable
    from_hf: Callable


def leaf_maps(cfg: LlamaConfig) -> list[LeafMap]:
    """Every leaf of our params with its HF names, in the order export writes them (embeddings,
    the layers' weights, final norm, lm_head): what lets export and import move one tensor at a
    time instead of a whole state dict."""
    same = lambda w: w  # noqa: E731
    T = lambda w: w.T  # noqa: E731
    maps = [LeafMap(("embed_vd",), ("model.embed_tokens.weight",), False, same, same)]
    table = _layer_table(cfg)
    if cfg.scan_layers:
        maps += [LeafMap(("layers", *path), tuple(f"model.layers.{i}.{name}" for i in range(cfg.n_layers)), True,
                         to_hf, from_hf) for path, name, to_hf, from_hf in table]
    else:
        maps += [LeafMap(("layers", i, *path), (f"model.layers.{i}.{name}",), False, to_hf, from_hf)
                 for i in range(cfg.n_layers) for path, name, to_hf, from_hf in table]
    maps.append(LeafMap(("final_norm", "scale_d"), ("model.norm.weight",), False, same, same))
    if not cfg.tie_embeddings:
        maps.append(LeafMap(("lm_head_dv",), ("lm_head.weight",), False, T, T))
    return maps


def hf_tensors_of_leaf(m: LeafMap, leaf) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, array) for each tensor of one of our leaves, one at a time. The arrays may be
    views (a transpose): the writer makes each contiguous in its own dtype, one copy."""
    if m.stacked:
        for i, name in enumerate(m.names):
            yield name, m.to_hf(leaf[i])
    else:
        yield m.names[0], m.to_hf(leaf)


def hf_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """{HF name: shape} this config implies (no arrays made)."""
    abstract = abstract_params(cfg)
    shapes = {}
    for m in leaf_maps(cfg):
        leaf = _get(abstract, m.path)
        one = jax.ShapeDtypeStruct(leaf.shape[1:] if m.stacked else leaf.shape, leaf.dtype)
        shape = tuple(jax.eval_shape(m.to_hf, one).shape)
        shapes.update({name: shape for name in m.names})
    return shapes


def to_hf_state_dict(params: Mapping, cfg: LlamaConfig) -> dict[str, np.ndarray]:
    """Our params (plain nested dict) -> {HF name: contiguous fp32 numpy array}."""
    out = {}
    for m in leaf_maps(cfg):
        out.update((name, np.ascontiguousarray(w))
                   for name, w in hf_tensors_of_leaf(m, np.asarray(_get(params, m.path), np.float32)))
    return out


def leaf_from_hf(m: LeafMap, take: Callable[[str], np.ndarray], shape) -> np.ndarray:
    """One of our leaves (fp32) from its HF tensors, `take(name)` reading one at a time: a stacked
    leaf is filled layer by layer, so only it and one HF tensor are ever in memory."""
    if not m.stacked:
        return np.ascontiguousarray(m.from_hf(np.asarray(take(m.names[0]), np.float32)))
    out = np.empty(shape, np.float32)
    for i, name in enumerate(m.names):
        out[i] = m.from_hf(np.asarray(take(name), np.float32))
    return out


def check_hf_names(names, cfg: LlamaConfig, shape_of: Callable[[str], tuple] | None = None) -> None:
    """A weight this config needs that is missing or misshapen, or one it has no place for (an
    o_proj bias, say: it would be dropped silently), is a one-line ValueError. Rotary inv_freq
    buffers and a tied checkpoint's redundant lm_head are ignored."""
    want = hf_shapes(cfg)
    names = set(names)
    for name, shape in want.items():
        if name not in names:
            raise ValueError(f"weight {name!r} missing from the safetensors files")
        if shape_of is not None and tuple(shape_of(name)) != shape:
            raise ValueError(f"weight {name!r}: shape {tuple(shape_of(name))}, config.json implies {shape}")
    ignored = {n for n in names if n.endswith("rotary_emb.inv_freq")}
    if cfg.tie_embeddings:
        ignored.add("lm_head.weight")
    unused = sorted(names - set(want) - ignored)
    if unused:
        raise ValueError(f"weight {unused[0]!r} (and {len(unused) - 1} more) in the safetensors files has no "
                         "place in model/llama.py for this config.json")


def from_hf_state_dict(sd: Mapping[str, np.ndarray], cfg: LlamaConfig) -> dict:
    """{HF name: array} -> our params (fp32 numpy), checked against the shapes `cfg` implies
    (check_hf_names)."""
    check_hf_names(sd, cfg, lambda name: np.shape(sd[name]))
    params: dict = {}
    for path, _, make in leaf_makers(cfg, sd.__getitem__):
        set_path(params, path, make())
    _check_shapes(params, cfg)
    return params


def leaf_makers(cfg: LlamaConfig, take: Callable[[str], np.ndarray]) -> list[tuple[tuple, tuple, Callable]]:
    """(path in our params, shape, make) for every leaf, `make()` building that leaf (fp32) from
    `take(name)`'s HF tensors when called: the import makes and writes one leaf at a time."""
    abstract = abstract_params(cfg)
    out = []
    for m in leaf_maps(cfg):
        shape = tuple(_get(abstract, m.path).shape)
        out.append((m.path, shape, lambda m=m, shape=shape: leaf_from_hf(m, take, shape)))
    return out


def set_path(tree: dict, path, value) -> None:
    """tree[path[0]][path[1]]... = value, making the dicts on the way."""
    _set(tree, path, value)


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


def safetensors_files(hf_dir: str | os.PathLike) -> list[str]:
    """The weight files of an HF directory: the shards model.safetensors.index.json lists, else
    model.safetensors."""
    hf_dir = Path(hf_dir)
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    if (hf_dir / "model.safetensors").is_file():
        return ["model.safetensors"]
    raise FileNotFoundError(f"{hf_dir}: no model.safetensors or model.safetensors.index.json "
                            "(PyTorch .bin checkpoints are not read; convert them to safetensors)")


class LazySafetensors:
    """An HF directory's tensors read one at a time (safetensors' `safe_open`: the header is
    parsed, a tensor is read only when asked for), in their stored dtype (bf16 included, as
    ml_dtypes.bfloat16). `names()`, `shape(name)`, `get(name)`."""

    def __init__(self, hf_dir: str | os.PathLike):
        from safetensors import safe_open

        self.dir = Path(hf_dir)
        self._where: dict[str, str] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        for fname in safetensors_files(self.dir):
            with safe_open(str(self.dir / fname), framework="numpy") as f:
                for key in f.keys():
                    self._where[key] = fname
                    self._shapes[key] = tuple(f.get_slice(key).get_shape())

    def names(self) -> list[str]:
        return list(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def get(self, name: str) -> np.ndarray:
        from safetensors import safe_open

        with safe_open(str(self.dir / self._where[name]), framework="numpy") as f:
            return f.get_tensor(name)


def read_safetensors(hf_dir: str | os.PathLike) -> dict[str, np.ndarray]:
    """Every tensor of model.safetensors, or of the shards listed by model.safetensors.index.json,
    as numpy arrays in their stored dtype (bf16 as ml_dtypes.bfloat16). For tests and small
    models: the import reads one tensor at a time (LazySafetensors)."""
    lazy = LazySafetensors(hf_dir)
    return {name: lazy.get(name) for name in lazy.names()}


# ----------------------------------------------------------------------------- sharded safetensors
_ST_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
_SIZE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str | int) -> int:
    """Bytes of "5GB" (10^9, as the hub's max_shard_size), "500MiB" (2^20) or a plain integer."""
    if isinstance(text, int):
        return text
    t = str(text).strip().upper().replace(" ", "")
    digits = t.rstrip("KMGTIB")
    unit = t[len(digits):] or "B"
    try:
        value = float(digits)
    except ValueError:
        value = -1.0
    if unit not in _SIZE_UNITS or value <= 0:
        raise ValueError(f"--max-shard-size={text!r}: expected a size such as 5GB, 500MB, 2GiB or a byte count")
    return int(value * _SIZE_UNITS[unit])


class ShardedSafetensorsWriter:
    """Writes an HF model's tensors as the hub does: `model-00001-of-0000N.safetensors` files of at
    most `max_shard_bytes` each (a tensor larger than that gets a file of its own) plus
    model.safetensors.index.json ({"metadata": {"total_size"}, "weight_map"}), or one
    model.safetensors when everything fits in one file.

    Every tensor's name, shape and dtype are known before any is made (`plan`: (name, shape) in
    the order they will come), so each file's header is written first and each tensor streamed
    into its file as it arrives (`write`): no shard is ever assembled in memory."""

    def __init__(self, out_dir: str | os.PathLike, plan: list[tuple[str, tuple[int, ...]]], dtype: str,
                 max_shard_bytes: int):
        if dtype not in _ST_DTYPES:
            raise ValueError(f"--dtype={dtype!r}: expected one of {', '.join(_ST_DTYPES)}")
        self.out, self.dtype = Path(out_dir), np.dtype(_np_dtype(dtype))
        self._st_dtype = _ST_DTYPES[dtype]
        shards: list[list[tuple[str, tuple[int, ...], int]]] = [[]]
        size = 0
        for name, shape in plan:
            nbytes = int(np.prod(shape, dtype=np.int64)) * self.dtype.itemsize
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append((name, tuple(shape), nbytes))
            size += nbytes
        n = len(shards)
        self.files = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors"
                                                            for i in range(n)]
        self._shards = shards
        self._order = [(fi, name, shape) for fi, shard in enumerate(shards) for name, shape, _ in shard]
        self._next = 0
        self._fh = None
        self.total_size = sum(nb for shard in shards for _, _, nb in shard)

    def _open(self, fi: int):
        if self._fh is not None:
            self._fh.close()
        header, offset = {}, 0
        for name, shape, nbytes in self._shards[fi]:
            header[name] = {"dtype": self._st_dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        header["__metadata__"] = {"format": "pt"}
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)         # the data starts 8-byte aligned, as safetensors writes
        self._fh = open(self.out / self.files[fi], "wb")
        self._fh.write(len(text).to_bytes(8, "little"))
        self._fh.write(text)

    def write(self, name: str, array: np.ndarray) -> None:
        """The next tensor of the plan, cast to the writer's dtype."""
        fi, want, shape = self._order[self._next]
        if name != want or tuple(array.shape) != shape:
            raise ValueError(f"{name} {tuple(array.shape)} written where the plan has {want} {shape}")
        if self._next == 0 or self._order[self._next - 1][0] != fi:
            self._open(fi)
        self._fh.write(np.ascontiguousarray(array, self.dtype).reshape(-1).view(np.uint8))
        self._next += 1

    def close(self) -> None:
        """Closes the last file and writes the index (several files); every planned tensor must
        have been written."""
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        if self._next != len(self._order):
            raise ValueError(f"{len(self._order) - self._next} planned tensors were not written "
                             f"(next: {self._order[self._next][1]})")
        if len(self.files) > 1:
            index = {"metadata": {"total_size": self.total_size},
                     "weight_map": {name: self.files[fi] for fi, name, _ in self._order}}
            (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _np_dtype(name: str):
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(name)

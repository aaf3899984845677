"""Llama in Flax NNX: the one model file.

References: Llama 2 (Touvron et al. 2023) for the block (pre-RMSNorm, RoPE, GQA, SwiGLU);
Hugging Face `LlamaForCausalLM` is the numerical reference (tests/test_model_hf.py checks
logits to 1e-4 in fp32), so RoPE uses its "rotate half" layout. The open checkpoints built on
this block are config fields, off by default: Llama 3.1's RoPE scaling (rope_type llama3), YaRN
(rope_type yarn, Qwen2.5/Qwen3's long contexts; Peng et al. 2023, arXiv 2309.00071), a head_dim
apart from d_model / n_heads, Qwen2's q/k/v biases, Qwen3's per-head q/k RMSNorm and Mistral's
sliding window (model/hf.py maps their config.json files; the same test covers each).

Conventions (the models we learn from: big_vision, flax gemma, nanoGPT, torchtitan):
- Names carry shapes: b batch, t query length, s key length, d model width, n query heads,
  k kv heads, g query heads per kv head, h head dim, f MLP width, v vocab, l layers.
- Parameters are fp32 (`param_dtype`) and are cast to `dtype` (bf16) at use, so the optimizer
  updates full-precision masters while matmuls run at bf16 speed.
- Parameters and activations name *logical* axes only; `model/sharding.py` maps them to mesh
  axes through the rules table in `configs/mesh/*.yaml`. The model never sees the mesh,
  except the splash kernel, which must run under `shard_map` (it is a per-device kernel).
- Layers are stacked on a leading "layers" axis and run with `jax.lax.scan`, so the compile
  time does not grow with depth; each layer body is rematerialised per `remat`.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import sys
from typing import Any, Mapping

import jax
import jax.numpy as jnp
from flax import nnx
from jax._src.cudnn import fused_attention_stablehlo as _cudnn_fa  # private: the packed layout (below)
from jax.ad_checkpoint import checkpoint_name

from model import context as ctx
from model import sharding as shd

ATTENTION_IMPLS = ("xla", "cudnn", "splash")
ROPE_TYPES = ("default", "llama3", "yarn")
# The Hugging Face families this network is (model/hf.py): the config.json model_type an export writes.
HF_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# The fields rope_type "llama3" reads (Llama 3.1+: longer contexts by slowing the low frequencies).
LLAMA3_ROPE_FIELDS = ("rope_factor", "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_len")
# The fields rope_type "yarn" reads (YaRN: interpolate the low frequencies, keep the high, and scale
# q and k): the first two it needs; the others None take transformers' defaults (LlamaConfig).
YARN_ROPE_FIELDS = ("rope_factor", "rope_original_max_len", "rope_beta_fast", "rope_beta_slow",
                    "rope_attention_factor", "rope_mscale", "rope_mscale_all_dim", "rope_truncate")
# The RoPE fields: how positions are encoded, never a parameter's shape (tests/test_model.py checks), so
# a run may change them when it resumes (a context extension: a larger rope_theta, or rope_type yarn
# with its factor), with max_seq_len, the longest position the run then reaches.
ROPE_FIELDS = ("rope_theta", "rope_type", *dict.fromkeys(LLAMA3_ROPE_FIELDS + YARN_ROPE_FIELDS), "max_seq_len")
# The fused attention kernels' forward primitives (cuDNN's, through jax.nn.dot_product_attention):
# their outputs (the attention output and its softmax statistics) are all the backward kernel reads.
FUSED_ATTENTION_FWD = frozenset({"dot_product_attention_fwd_wrapper", "dot_product_attention_fwd"})


def _fused_attention_saveable(prim, *_, **__) -> bool:
    return prim.name in FUSED_ATTENTION_FWD


# The activations remat "offload" keeps on the host, named in Block (jax.ad_checkpoint.checkpoint_name).
OFFLOADED_ACTIVATIONS = ("layer_input", "q_proj", "k_proj", "v_proj", "out_proj")

# What a rematerialised layer keeps for the backward pass instead of recomputing it.
REMAT_POLICIES = {
    "none": None,  # no remat at all: fastest, most memory
    "full": jax.checkpoint_policies.nothing_saveable,  # keep only each layer's input
    # keep the weight matmuls (no batch dims), recompute attention and elementwise ops
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    # dots, and the fused attention kernel's output and softmax statistics (cuDNN): the backward
    # pass then runs no second attention forward (measured on an H100, 1b at seq 2048: the
    # forward kernel was 11% of the step, run twice under dots). ~4 KB per token per layer more
    # than dots (bf16 [t, d] plus fp32 [heads, t]); with the XLA reference attention it is dots.
    "dots_attention": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable, _fused_attention_saveable),
    "dots_all": jax.checkpoint_policies.dots_saveable,  # also keep attention matmuls
    # Keep each layer's input and its attention's q, k, v and output projections in host memory
    # (written to the host in the forward pass, read back in the backward) and recompute the rest:
    # norms, RoPE, attention and the MLP. Device memory then holds no layer's activations between
    # the passes, so longer rows or more rows fit in one pass without re-gathering FSDP weights per
    # microbatch; the price is their bytes over PCIe (model/predict.py's host term). The tensors are
    # MaxText's offloading recipe's (decoder_layer_input, query/key/value_proj, out_proj), so the
    # two programs compare at equal plans. On CPU the host is the device: nothing moves.
    "offload": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=list(OFFLOADED_ACTIVATIONS),
        offload_src="device", offload_dst="pinned_host"),
}


@jax.custom_vjp
def project_to_vocab(x_btd, head_dv):
    """[b, t, d] x [d, v] -> [b, t, v] logits with fp32 accumulation and output (the loss is a
    log-softmax over the vocab), in the operands' dtype (bf16 in training).

    The backward pass takes the logits' fp32 gradient down to the operands' dtype before its two
    matmuls, as mixed-precision training does for every other layer: left to autodiff, an fp32
    cotangent promotes both to fp32 (tf32) GEMMs at half the bf16 rate, which on an H100 were 5%
    of the 1b's step and 16% of a 128k-vocabulary Llama 3's. Accumulation stays fp32."""
    return jnp.einsum("btd,dv->btv", x_btd, head_dv, preferred_element_type=jnp.float32)


def _project_to_vocab_fwd(x_btd, head_dv):
    return project_to_vocab(x_btd, head_dv), (x_btd, head_dv)


def _project_to_vocab_bwd(res, g_btv):
    x_btd, head_dv = res
    g_btv = g_btv.astype(x_btd.dtype)
    dx_btd = jnp.einsum("btv,dv->btd", g_btv, head_dv, preferred_element_type=jnp.float32)
    dhead_dv = jnp.einsum("btd,btv->dv", x_btd, g_btv, preferred_element_type=jnp.float32)
    return dx_btd.astype(x_btd.dtype), dhead_dv.astype(head_dv.dtype)


project_to_vocab.defvjp(_project_to_vocab_fwd, _project_to_vocab_bwd)


# FP8 matmuls (LlamaConfig.fp8): the formats of the forward operands and of the backward's gradients.
FP8_FORWARD, FP8_BACKWARD = jnp.float8_e4m3fn, jnp.float8_e5m2


def fp8_quantize(x, f8):
    """(x times a power of two, rounded to the fp8 dtype `f8`, and that power's inverse): current
    scaling, per tensor. The power of two is the largest that keeps this tensor's amax within f8's
    finite range, so the scaling itself rounds nothing and x is about x_f8 * inverse. An inf or a NaN in
    x stays non-finite (e4m3fn, which has no inf, makes it NaN): loud, as without fp8."""
    x32 = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x32))
    _, e = jnp.frexp(jnp.finfo(f8).max.astype(jnp.float32) / amax)  # max / amax = m 2^e, m in [0.5, 1)
    scale = jnp.where(amax > 0, jnp.ldexp(jnp.float32(1), e - 1), jnp.float32(1))
    return (x32 * scale).astype(f8), 1 / scale


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def fp8_einsum(spec: str, x, w):
    """jnp.einsum(spec, x, w) for x and w in one dtype (the compute dtype), computed in FP8: both
    operands e4m3 (fp8_quantize), the gradient of the output e5m2 in the backward pass, where each
    of the two matmuls takes it with the forward's e4m3 operand. Accumulation in fp32 (the GEMM's),
    output in x's dtype, times the operands' exact power-of-two scales. `spec` names every index of
    x in w or in the output, and of w in x or the output (a projection: "btd,dnh->btnh")."""
    return _fp8_einsum_fwd(spec, x, w)[0]


def _fp8_einsum_fwd(spec, x, w):
    x_f8, x_inv = fp8_quantize(x, FP8_FORWARD)
    w_f8, w_inv = fp8_quantize(w, FP8_FORWARD)
    out = jnp.einsum(spec, x_f8, w_f8, preferred_element_type=x.dtype)
    # Residuals in fp8: half the bytes of the bf16 operands autodiff would keep.
    return out * (x_inv * w_inv).astype(x.dtype), (x_f8, x_inv, w_f8, w_inv)


def _fp8_einsum_bwd(spec, res, g):
    x_f8, x_inv, w_f8, w_inv = res
    x_idx, w_idx = spec.split("->")[0].split(",")
    out_idx = spec.split("->")[1]
    g_f8, g_inv = fp8_quantize(g, FP8_BACKWARD)
    # HIGHEST: on a GPU, cuBLASLt's exact fp32 accumulation for the gradients (DEFAULT, the forward's,
    # lets it take the faster, coarser one), as Transformer Engine and flax's fp8_ops do.
    highest = jax.lax.Precision.HIGHEST
    dx = jnp.einsum(f"{out_idx},{w_idx}->{x_idx}", g_f8, w_f8, preferred_element_type=g.dtype, precision=highest)
    dw = jnp.einsum(f"{x_idx},{out_idx}->{w_idx}", x_f8, g_f8, preferred_element_type=g.dtype, precision=highest)
    return dx * (g_inv * w_inv).astype(g.dtype), dw * (x_inv * g_inv).astype(g.dtype)


fp8_einsum.defvjp(_fp8_einsum_fwd, _fp8_einsum_bwd)


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Shapes and numerics of one Llama. Presets: configs/model/*.yaml (keys = field names)."""

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    # The open-checkpoint variants (model/hf.py reads them from config.json). The defaults are
    # the Llama 2 block: leaving them alone leaves the network, its parameters and its numbers as
    # they were.
    head_dim: int | None = None  # None: d_model // n_heads (Qwen3 sets it apart from the width)
    qkv_bias: bool = False  # biases on the q, k, v projections (Qwen2/2.5)
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3)
    sliding_window: int | None = None  # a query sees itself and the window-1 keys before it (Mistral)
    rope_type: str = "default"  # one of ROPE_TYPES
    rope_factor: float | None = None  # rope_type llama3 (all four of LLAMA3_ROPE_FIELDS) and yarn
    rope_low_freq_factor: float | None = None
    rope_high_freq_factor: float | None = None
    rope_original_max_len: int | None = None  # llama3 and yarn: the context the checkpoint trained at
    # rope_type yarn only, each the HF key without "rope_"; None does what transformers does when the
    # key is absent (and an export leaves it absent). Pair j turns original_max_len / wavelength_j times:
    rope_beta_fast: float | None = None  # pairs turning more often than this keep their frequency (None: 32)
    rope_beta_slow: float | None = None  # pairs turning less often are slowed by rope_factor, a ramp between (None: 1)
    rope_attention_factor: float | None = None  # cos and sin times this, q.k logits times its square (None: below)
    rope_mscale: float | None = None  # both set: g(mscale) / g(mscale_all_dim), g(m) = 0.1 m ln(rope_factor) + 1;
    rope_mscale_all_dim: float | None = None  # else g(1) (g = 1 when rope_factor <= 1). DeepSeek's keys
    rope_truncate: bool | None = None  # the ramp's ends rounded out to whole pairs (None: True)
    hf_model_type: str = "llama"  # one of HF_MODEL_TYPES: not the network, the family export names
    dtype: str = "bfloat16"  # compute dtype (activations, matmul inputs)
    param_dtype: str = "float32"  # storage dtype of the parameters (optimizer masters)
    # The q, k, v, o and MLP matmuls in FP8 (fp8_einsum: e4m3 operands, e5m2 gradients, current
    # scaling, no state); the vocab head, attention and the rest stay in `dtype`. Not a parameter:
    # a run may switch it when it resumes (model/runtime/checkpoint.py MODEL_RUNTIME_KEYS).
    fp8: bool = False
    remat: str = "full"  # one of REMAT_POLICIES
    scan_layers: bool = True
    attention: str = "xla"  # one of ATTENTION_IMPLS
    # attention=cudnn on Hopper+: rows of up to this many documents run cuDNN's packed layout (each
    # document its own sequence: no mask to read, cross-document blocks skipped); a batch with a
    # fuller row runs the masked kernel. 0: always the masked kernel. See attention_cudnn_packed.
    # 8 (H100, 1b at seq 2048): attention 120 -> 54 ms of a 0.517 -> 0.464 s step; 16 and 32 cost
    # more (the kernel's grid and softmax statistics grow with it). RedPajama-v2-shaped rows of 2048
    # hold 2.6 documents on average and at most 8-9 in a batch of 16 (BENCHMARKS.md).
    cudnn_packed_segments: int = 8

    def __post_init__(self):
        if self.head_dim is None:
            if self.d_model % self.n_heads:
                raise ValueError(f"model.d_model={self.d_model} not divisible by model.n_heads={self.n_heads}")
            # Resolved here so every user (and the saved config) sees one number.
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"model.n_heads={self.n_heads} not divisible by model.n_kv_heads={self.n_kv_heads}")
        if self.fp8 not in (True, False):
            raise ValueError(f"model.fp8={self.fp8!r}: expected true or false")
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"model.remat={self.remat!r}; expected one of {list(REMAT_POLICIES)}")
        if self.attention not in ATTENTION_IMPLS:
            raise ValueError(f"model.attention={self.attention!r}; expected one of {list(ATTENTION_IMPLS)}")
        if self.cudnn_packed_segments < 0 or self.cudnn_packed_segments == 1:
            raise ValueError(f"model.cudnn_packed_segments={self.cudnn_packed_segments}; expected 0 (off) or >= 2")
        if self.head_dim < 2 or self.head_dim % 2:
            raise ValueError(f"model.head_dim={self.head_dim} must be even (and positive) for RoPE")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"model.sliding_window={self.sliding_window}; expected a positive int or null")
        if self.hf_model_type not in HF_MODEL_TYPES:
            raise ValueError(f"model.hf_model_type={self.hf_model_type!r}; expected one of {list(HF_MODEL_TYPES)}")
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"model.rope_type={self.rope_type!r}; expected one of {list(ROPE_TYPES)}")
        needs = {"llama3": LLAMA3_ROPE_FIELDS, "yarn": YARN_ROPE_FIELDS[:2]}.get(self.rope_type, ())
        reads = YARN_ROPE_FIELDS if self.rope_type == "yarn" else needs
        for name in dict.fromkeys(LLAMA3_ROPE_FIELDS + YARN_ROPE_FIELDS):
            value = getattr(self, name)
            if (value is None and name in needs) or (value is not None and name not in reads):
                need = "needs it" if value is None else "does not use it"
                raise ValueError(f"model.{name}={value!r}: model.rope_type={self.rope_type!r} {need}")
        for name in YARN_ROPE_FIELDS[:5]:
            value = getattr(self, name)
            if value is not None and not value > 0:  # transformers reads a beta of 0 as its default
                raise ValueError(f"model.{name}={value!r}: expected a positive number")
        if self.rope_truncate not in (None, True, False):
            raise ValueError(f"model.rope_truncate={self.rope_truncate!r}: expected true, false or null")
        if self.rope_type == "llama3" and self.rope_high_freq_factor <= self.rope_low_freq_factor:
            raise ValueError(f"model.rope_high_freq_factor={self.rope_high_freq_factor} must exceed "
                             f"model.rope_low_freq_factor={self.rope_low_freq_factor}")

    @property
    def rope_llama3(self) -> tuple | None:
        """(factor, low_freq_factor, high_freq_factor, original_max_len) for rope_type llama3."""
        return tuple(getattr(self, name) for name in LLAMA3_ROPE_FIELDS) if self.rope_type == "llama3" else None

    @property
    def rope_yarn(self) -> tuple | None:
        """(factor, original_max_len, beta_fast, beta_slow, truncate) for rope_type yarn, the
        defaults filled in as transformers fills them."""
        if self.rope_type != "yarn":
            return None
        return (self.rope_factor, self.rope_original_max_len, self.rope_beta_fast or 32.0, self.rope_beta_slow or 1.0,
                self.rope_truncate is not False)

    @property
    def rope_scale(self) -> float:
        """What RoPE multiplies cos and sin by (so q.k logits by its square): YaRN's attention factor,
        given or computed from rope_factor and the mscales as transformers' `_compute_yarn_parameters`
        does; 1.0 for the other types."""
        if self.rope_type != "yarn":
            return 1.0
        if self.rope_attention_factor is not None:
            return float(self.rope_attention_factor)

        def mscale(m: float) -> float:  # YaRN's 0.1 ln(s) + 1 temperature, none when not stretched
            return 1.0 if self.rope_factor <= 1 else 0.1 * m * math.log(self.rope_factor) + 1.0

        if self.rope_mscale and self.rope_mscale_all_dim:  # DeepSeek-V2/V3's spelling
            return mscale(self.rope_mscale) / mscale(self.rope_mscale_all_dim)
        return mscale(1.0)

    @classmethod
    def from_mapping(cls, m: Mapping[str, Any]) -> "LlamaConfig":
        """Build from a dict or Hydra DictConfig; unknown keys are errors, not silently ignored."""
        m = dict(m.items())
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(m) - names)
        if unknown:
            raise ValueError(f"unknown model config keys {unknown}; known: {sorted(names)}")
        return cls(**m)

    def layer_params(self) -> int:
        d, h = self.d_model, self.head_dim
        attn = d * self.n_heads * h + 2 * d * self.n_kv_heads * h + self.n_heads * h * d
        attn += (self.n_heads + 2 * self.n_kv_heads) * h if self.qkv_bias else 0
        attn += 2 * h if self.qk_norm else 0  # the per-head q and k norm scales
        mlp = 3 * d * self.d_ff
        return attn + mlp + 2 * d  # + two RMSNorm scales

    def num_params(self, embeddings: bool = True) -> int:
        """Exact parameter count. embeddings=False drops the input embedding table (not a matmul)."""
        n = self.n_layers * self.layer_params() + self.d_model  # + final norm
        n += 0 if self.tie_embeddings else self.d_model * self.vocab_size  # output head
        if embeddings:
            n += self.vocab_size * self.d_model
        return n


# ----------------------------------------------------------------------------- init


def _param(rngs: nnx.Rngs, shape, names, std, dtype) -> nnx.Param:
    """A Param initialised N(0, std) (or ones when std is None) carrying logical axis names.

    eager_sharding=False: shardings are applied by `jax.jit(init, out_shardings=...)` in
    model/step.py from these names and the rules table, not at Variable creation.
    """
    if std is None:
        value = jnp.ones(shape, dtype)
    else:
        value = std * jax.random.normal(rngs.params(), shape, dtype)
    return nnx.Param(value, out_sharding=names, eager_sharding=False)


def _zeros(shape, names, dtype) -> nnx.Param:
    """A Param of zeros (biases), drawing nothing from the rngs: the other Params' values do not
    depend on whether a variant has biases."""
    return nnx.Param(jnp.zeros(shape, dtype), out_sharding=names, eager_sharding=False)


# ----------------------------------------------------------------------------- layers


class RMSNorm(nnx.Module):
    def __init__(self, d: int, eps: float, param_dtype, *, rngs: nnx.Rngs):
        self.scale_d = _param(rngs, (d,), ("norm",), None, param_dtype)
        self.eps = eps

    def __call__(self, x_btd):
        # Statistics in fp32 whatever the compute dtype: bf16 mean-of-squares loses ~3 digits.
        x32 = x_btd.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * self.scale_d[...].astype(jnp.float32)).astype(x_btd.dtype)


def rope_inv_freq(h: int, theta: float, llama3: tuple | None = None, yarn: tuple | None = None):
    """[h/2] fp32 rotation frequencies. llama3 = (factor, low_freq_factor, high_freq_factor,
    original_max_len) (Llama 3.1+, HF rope_type "llama3"): wavelengths longer than
    original_max_len / low_freq_factor are slowed by `factor`, those shorter than
    original_max_len / high_freq_factor kept, and those between interpolated smoothly.
    yarn = LlamaConfig.rope_yarn (HF rope_type "yarn"): see _yarn_inv_freq."""
    if yarn is not None:
        return _yarn_inv_freq(h, theta, *yarn)
    inv_freq_j = 1.0 / (theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h))
    if llama3 is None:
        return inv_freq_j
    factor, low, high, original = llama3
    wavelen_j = 2 * math.pi / inv_freq_j
    slowed_j = jnp.where(wavelen_j > original / low, inv_freq_j / factor, inv_freq_j)
    smooth_j = (original / wavelen_j - low) / (high - low)
    between_j = (wavelen_j >= original / high) & (wavelen_j <= original / low)
    return jnp.where(between_j, (1 - smooth_j) * slowed_j / factor + smooth_j * slowed_j, slowed_j)


def _yarn_inv_freq(h: int, theta: float, factor: float, original: int, beta_fast: float, beta_slow: float,
                   truncate: bool):
    """YaRN's "NTK-by-parts" frequencies (Peng et al. 2023, section 3.2; transformers'
    `_compute_yarn_parameters` is the reference the tests hold us to). Pair j turns
    original / (2 pi theta^(2j/h)) times over the original context: pairs turning more than beta_fast
    times keep their frequency, those turning fewer than beta_slow times are slowed by `factor`
    (position interpolation), and between them a linear ramp in j mixes the two."""
    def pair_turning(turns: float) -> float:  # the (fractional) pair j that turns `turns` times
        return h * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))

    first, last = pair_turning(beta_fast), pair_turning(beta_slow)
    if truncate:
        first, last = math.floor(first), math.ceil(last)
    first, last = max(first, 0), min(last, h - 1)
    if first == last:
        last += 0.001  # a step, not a division by zero
    slowed_j = jnp.clip((jnp.arange(h // 2, dtype=jnp.float32) - first) / (last - first), 0, 1)
    wavelen_scale_j = theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h)
    kept_j = 1.0 / wavelen_scale_j
    interpolated_j = 1.0 / (factor * wavelen_scale_j)
    keep_j = 1 - slowed_j  # (1 - keep_j rather than slowed_j: transformers' rounding, bit for bit)
    return interpolated_j * (1 - keep_j) + kept_j * keep_j


def rope(x_btnh, positions_bt, inv_freq_j, scale: float = 1.0):
    """Rotary embedding, HF "rotate half" layout (first half / second half of each head).
    `scale` multiplies cos and sin (YaRN's attention factor, LlamaConfig.rope_scale), as transformers
    applies it: q and k are each scaled, so their dot products by scale**2."""
    angle_btj = positions_bt.astype(jnp.float32)[..., None] * inv_freq_j
    cos, sin = jnp.cos(angle_btj)[:, :, None, :], jnp.sin(angle_btj)[:, :, None, :]
    if scale != 1.0:  # python-level: the other RoPE types' programs are unchanged
        cos, sin = cos * scale, sin * scale
    x1, x2 = jnp.split(x_btnh.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_btnh.dtype)


def attention_mask(segment_ids_bt, branch_ids_bt=None, window: int | None = None, positions_bt=None):
    """[b, t, s] bool: causal and same document. Packed documents never see each other.

    branch_ids_bt (scoring only, model/evals/evaluate.py): a document is a shared prefix (branch 0)
    followed by branches 1, 2, ... that each see the prefix and themselves but not each other,
    so several continuations of one context are scored in one pass over the context.
    window (sliding-window attention): a query also sees only keys fewer than `window` positions
    back (HF: key > query - window). Distances are in positions when given (a branch's tokens sit
    after the earlier branches in the row but follow the prefix in position), else in row slots,
    which within one training document are the same.

    Causality too is read from positions when given, not from row slots: within a document they
    rise with the slot, so the mask is the same, and it stays right when the row's tokens are
    reordered (context parallelism, model/context.py). Padding (segment 0, all at position 0) then
    sees all of its padding: no loss reads it and no document sees it."""
    t = segment_ids_bt.shape[1]
    pos_bt = jnp.broadcast_to(jnp.arange(t), segment_ids_bt.shape) if positions_bt is None else positions_bt
    mask_bts = document_mask(segment_ids_bt, pos_bt, segment_ids_bt, pos_bt, window)
    if branch_ids_bt is not None:
        key_b1s = branch_ids_bt[:, None, :]
        mask_bts &= (key_b1s == 0) | (key_b1s == branch_ids_bt[:, :, None])
    return mask_bts


def document_mask(q_segment_ids_bt, q_positions_bt, kv_segment_ids_bs, kv_positions_bs, window: int | None = None):
    """[b, t, s] bool: key s is in query t's document, at or before it (and fewer than `window`
    positions back). Queries and keys in any order and any number: under context parallelism a
    chip's t/C queries against the row's s keys (attention_dpa_context)."""
    distance_bts = q_positions_bt[:, :, None] - kv_positions_bs[:, None, :]  # query position - key position
    mask_bts = (distance_bts >= 0) & (q_segment_ids_bt[:, :, None] == kv_segment_ids_bs[:, None, :])
    return mask_bts if window is None else mask_bts & (distance_bts < window)


def attention_xla(q_btnh, k_bskh, v_bskh, segment_ids_bt, branch_ids_bt=None, window=None, positions_bt=None):
    """Reference attention: plain einsums, softmax in fp32. Runs on every backend."""
    mask_bts = attention_mask(segment_ids_bt, branch_ids_bt, window, positions_bt)
    return _gqa_attention(q_btnh, k_bskh, v_bskh, mask_bts[:, None, None])


def _gqa_attention(q_btnh, k_bskh, v_bskh, mask):
    """Masked softmax attention; `mask` broadcasts to [b, k, g, t, s].

    GQA without repeating K/V: query heads are grouped [k, g] against their shared kv head.
    """
    b, t, n, h = q_btnh.shape
    k = k_bskh.shape[2]
    q_btkgh = q_btnh.reshape(b, t, k, n // k, h)
    logits_bkgts = jnp.einsum("btkgh,bskh->bkgts", q_btkgh, k_bskh, preferred_element_type=jnp.float32)
    logits_bkgts = logits_bkgts / math.sqrt(h)
    # Queries stay split as the activations' length is (context parallelism); keys span the row.
    logits_bkgts = shd.constrain(logits_bkgts, ("act_batch", "act_kv_heads", None, "act_len", None))
    # Finite fill (not -inf): the diagonal is always allowed, so no row is fully masked.
    logits_bkgts = jnp.where(mask, logits_bkgts, jnp.finfo(jnp.float32).min)
    probs_bkgts = jax.nn.softmax(logits_bkgts, axis=-1).astype(v_bskh.dtype)
    out_btkgh = jnp.einsum("bkgts,bskh->btkgh", probs_bkgts, v_bskh)
    return out_btkgh.reshape(b, t, n, h)


def attention_dpa(q_btnh, k_bskh, v_bskh, segment_ids_bt, implementation: str, window: int | None = None):
    """`jax.nn.dot_product_attention`: "cudnn" (flash attention on NVIDIA GPUs) or "xla".

    The segment mask is passed as a boolean mask and causality as is_causal, so cuDNN can
    skip the upper triangle (jax hands the mask to cuDNN as an additive bias). The "xla" variant
    exists so CPU tests exercise this code path; `attention` decides where "cudnn" may run.
    A sliding window is jax's local_window_size (window-1 keys back, none ahead), which cuDNN
    runs as its own sliding-window length.
    """
    mask_b1ts = (segment_ids_bt[:, :, None] == segment_ids_bt[:, None, :])[:, None]
    return jax.nn.dot_product_attention(
        q_btnh, k_bskh, v_bskh, mask=mask_b1ts, is_causal=True, implementation=implementation,
        local_window_size=None if window is None else (window - 1, 0),
    )


def attention_dpa_context(q_btnh, k_bskh, v_bskh, segment_ids_bt, positions_bt, implementation: str,
                          window: int | None = None):
    """attention_dpa under context parallelism: per chip (shard_map over the batch, heads and the
    `act_len` axes), its t/C queries against the row's t keys with the mask read from positions and
    segment ids (document_mask) as an explicit mask, which cuDNN takes as a bias: exact in the striped
    order, where its causal and window masks (slot-based) are not. No masked block is skipped.
    "xla" is the same code path on any backend (the CPU tests); `attention` picks "cudnn"."""
    mesh, rules = shd.current()
    len_axes, _ = _context_axes()
    P = jax.sharding.PartitionSpec
    batch_axes = shd.mesh_axes_for("act_batch", rules) or None
    head_axes = shd.mesh_axes_for("act_heads", rules)
    k_bskh, v_bskh = kv_heads_for_shards(k_bskh, v_bskh, q_btnh.shape[2], mesh, head_axes)

    def local(q, k, v, seg_q, pos_q, seg_kv, pos_kv):  # q [b, t/C, n, h]; k, v [b, t, k, h]; seg_kv, pos_kv [b, t]
        mask_b1ts = document_mask(seg_q, pos_q, seg_kv, pos_kv, window)[:, None]
        return jax.nn.dot_product_attention(q, k, v, mask=mask_b1ts, implementation=implementation)

    spec_btn, spec_bsn = P(batch_axes, len_axes or None, head_axes or None), P(batch_axes, None, head_axes or None)
    spec_bt, spec_bs = P(batch_axes, len_axes or None), P(batch_axes)
    return jax.shard_map(local, mesh=mesh, in_specs=(spec_btn, spec_bsn, spec_bsn, spec_bt, spec_bt, spec_bs, spec_bs),
                         out_specs=spec_btn, check_vma=False)(
        q_btnh, k_bskh, v_bskh, segment_ids_bt, positions_bt, segment_ids_bt, positions_bt)


def packed_layout(segment_ids_bt, max_segments: int):
    """Each row's documents (runs of equal segment ids, padding included) in cuDNN's packed layout:
    offsets_bm1 [b, M+1] where each run starts and seqlen_bm [b, M] its length, -1 past a row's last
    run (the layout jax's fused attention takes, M = max_segments), and whether every row has at most
    M runs (when not, the arrays hold the first M runs only and must not be used)."""
    b, t = segment_ids_bt.shape
    m = max_segments
    starts_bt = jnp.concatenate(
        [jnp.ones((b, 1), bool), segment_ids_bt[:, 1:] != segment_ids_bt[:, :-1]], axis=1)
    fits = jnp.all(jnp.sum(starts_bt, axis=1) <= m)
    first = jax.vmap(lambda row: jnp.nonzero(row, size=m + 1, fill_value=-1)[0])(starts_bt).astype(jnp.int32)
    begin_bm = first[:, :m]
    end_bm = jnp.where(first[:, 1:] >= 0, first[:, 1:], t)
    seqlen_bm = jnp.where(begin_bm >= 0, end_bm - begin_bm, -1).astype(jnp.int32)
    offsets_bm1 = jnp.concatenate([begin_bm, jnp.full((b, 1), -1, jnp.int32)], axis=1)
    return offsets_bm1, seqlen_bm, fits


@functools.cache
def _packed_kv_offsets_scale_by_kv_heads() -> bool:
    """Whether this jax strides the packed layout's key/value offsets by the key/value heads. Before
    jax PR #39521 (merged 2026-07-31) it used the query heads, which reads the wrong rows under GQA;
    there the kernel gets key/value repeated to the query heads. Read from the source: the only
    trace of the fix jax leaves, and the kernel cannot be run to find out on a machine without one."""
    import inspect
    try:
        return "N_kv" in inspect.getsource(_cudnn_fa._fix_seqlen_offsets)
    except (AttributeError, OSError, TypeError):
        return False


def attention_cudnn_packed(q_btnh, k_bskh, v_bskh, segment_ids_bt, max_segments: int):
    """cuDNN flash attention with each packed document as its own sequence (the packed, "THD",
    layout): causal within a document, no [t, s] mask for the kernel to read and no dbias for it to
    write, and the blocks between documents skipped, not masked. A batch with a row of more than
    `max_segments` documents runs the masked kernel instead (lax.cond: both are compiled, one runs).
    Hopper or later (jax refuses the layout elsewhere); jax's private cuDNN entry point, as
    jax.nn.dot_product_attention offers no packed layout."""
    offsets_bm1, seqlen_bm, fits = packed_layout(segment_ids_bt, max_segments)

    def packed(q, k, v):
        if k.shape[2] != q.shape[2] and not _packed_kv_offsets_scale_by_kv_heads():
            g = q.shape[2] // k.shape[2]
            k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
        return _cudnn_fa.dot_product_attention(
            q, k, v, q_seqlen=seqlen_bm, kv_seqlen=seqlen_bm, q_offsets=offsets_bm1, kv_offsets=offsets_bm1,
            scale=1.0 / math.sqrt(q.shape[-1]), mask_type=_cudnn_fa.MaskType.PADDING_CAUSAL, qkv_layout="BTNH")

    def masked(q, k, v):
        return attention_dpa(q, k, v, segment_ids_bt, "cudnn")

    return jax.lax.cond(fits, packed, masked, q_btnh, k_bskh, v_bskh)


def _context_axes() -> tuple[tuple[str, ...], int]:
    """The mesh axes that split a row's tokens (the rules' `act_len`) and how many chips that is: the
    context parallelism the kernels under shard_map must undo (model/context.py). ((), 1) without a mesh."""
    mesh, rules = shd.current()
    if mesh is None:
        return (), 1
    axes = tuple(shd.mesh_axes_for("act_len", rules))
    return axes, math.prod(mesh.shape[a] for a in axes)


def kv_heads_for_shards(k_bskh, v_bskh, n_heads: int, mesh, head_axes):
    """K and V for a per-chip kernel under shard_map whose n_heads query heads split over head_axes:
    the kv heads as they are where they split over those axes as the query heads do (each shard then
    holds its query heads' groups), else repeated to the query heads (fewer kv heads than shards)."""
    shards = math.prod(mesh.shape[a] for a in head_axes) if mesh is not None else 1
    if k_bskh.shape[2] % shards == 0:
        return k_bskh, v_bskh
    g = n_heads // k_bskh.shape[2]
    return jnp.repeat(k_bskh, g, axis=2), jnp.repeat(v_bskh, g, axis=2)


# Splash's tile edge. The library's default (128, marked "select better parameters" in its source)
# is its placeholder; 512 is what tuned TPU setups run. The block map splash builds on the host
# while tracing has one entry per tile pair, so at 128 a chip's 32k queries against a 128k row
# took about a minute of CPU per process before anything compiled; at 512, a sixteenth of that
# (BENCHMARKS.md "The suite's time, #55").
SPLASH_BLOCK = 512


def splash_block_sizes(t_q: int, t_kv: int):
    """Splash's BlockSizes for t_q queries against t_kv keys: SPLASH_BLOCK, or the largest power of
    two below it that divides the length (a tile must divide its axis)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    bq, bkv = math.gcd(SPLASH_BLOCK, t_q), math.gcd(SPLASH_BLOCK, t_kv)
    return splash.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkv, block_q_dkv=bq, block_kv_dkv=bkv,
                             block_kv_dkv_compute=bkv, block_q_dq=bq, block_kv_dq=bkv)


def attention_splash(q_btnh, k_bskh, v_bskh, segment_ids_bt, interpret: bool = False, window: int | None = None):
    """Pallas splash attention (TPU). A per-device kernel, so it runs under shard_map.

    Batch is split over the mesh axes the rules give "act_batch", heads over "act_heads".
    GQA without repeating K/V: the kernel maps each query head to its group's kv head (the gathered
    row's keys and values under context, and their gradients, stay at the kv heads' size: a quarter
    of the query heads' for Llama 3 8B). Only where the kv heads cannot split over the head axes as
    the query heads do (fewer kv heads than tensor shards) are they repeated. interpret=True runs the
    Pallas kernel in the interpreter (any backend, slow): how the CPU tests check this path.
    The causal mask (and a sliding window: window-1 keys back, none ahead) is computed in the kernel
    from row indices, whose fully masked blocks the kernel skips (context.StripedSplashMask).

    Context parallelism (`act_len` split over C chips, model/context.py): each chip holds t/C
    queries in the striped order (chip i: row tokens i, i + C, ...) and, from Block's gather, the
    whole row's keys, values and segment ids. The keys go back to row order and the queries carry
    their row indices (a C + i, from the chip's index), so causality and the window are counted in
    row tokens and documents by segment ids: exact. Padding sees the padding before it, not after.
    """
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    b, t, n, h = q_btnh.shape
    mesh, rules = shd.current()
    head_axes = shd.mesh_axes_for("act_heads", rules) if mesh is not None else ()
    k_bskh, v_bskh = kv_heads_for_shards(k_bskh, v_bskh, n, mesh, head_axes)
    q_bnth = jnp.swapaxes(q_btnh, 1, 2) / math.sqrt(h)  # splash does not scale
    k_bksh = jnp.swapaxes(k_bskh, 1, 2)
    v_bksh = jnp.swapaxes(v_bskh, 1, 2)
    len_axes, c = _context_axes()

    def local(q, k, v, seg_q, seg_kv):  # q [b, n, t/C, h] this chip's queries; k, v [b, k, t, h]; seg_kv [b, t]
        n_local, t_chip = q.shape[1], q.shape[2]
        k, v, seg_kv = ctx.unstripe(k, c, 2), ctx.unstripe(v, c, 2), ctx.unstripe(seg_kv, c, 1)
        mask = splash.MultiHeadMask([ctx.StripedSplashMask((t_chip, t), c, window) for _ in range(n_local)])
        kernel = splash.make_splash_mha(mask, head_shards=1, q_seq_shards=1, interpret=interpret,
                                         block_sizes=splash_block_sizes(t_chip, t))
        # This chip's query rows: the kernel computes the mask from them (its block map holds for every chip).
        rows = ctx.chip_rows(t_chip, c, jax.lax.axis_index(len_axes) if c > 1 else 0)
        infos = (kernel.fwd_mask_info, kernel.dq_mask_info, kernel.dkv_mask_info)
        kernel = type(kernel)(*(i if i is None else i._replace(q_sequence=rows) for i in infos), **kernel.kwargs)
        ids = splash.SegmentIds(q=seg_q, kv=seg_kv)
        return jax.vmap(kernel)(q, k, v, segment_ids=ids)

    if mesh is None:
        out_bnth = local(q_bnth, k_bksh, v_bksh, segment_ids_bt, segment_ids_bt)
    else:
        P = jax.sharding.PartitionSpec
        batch_axes = shd.mesh_axes_for("act_batch", rules) or None
        # kv heads split over the same axes as the query heads: each shard holds its query heads' groups
        spec_bnt, spec_bn = P(batch_axes, head_axes or None, len_axes or None), P(batch_axes, head_axes or None)
        out_bnth = jax.shard_map(
            local, mesh=mesh, in_specs=(spec_bnt, spec_bn, spec_bn, P(batch_axes, len_axes or None), P(batch_axes)),
            out_specs=spec_bnt, check_vma=False,
        )(q_bnth, k_bksh, v_bksh, segment_ids_bt, segment_ids_bt)
    return jnp.swapaxes(out_bnth, 1, 2)


# cuDNN's fused attention (jax/_src/cudnn/fused_attention_stablehlo.py, check_layout and
# check_is_flash_attention, jax 0.10): bf16/fp16 inputs, head dim a multiple of 8 up to 128
# (256 from Hopper, compute capability 9.0), and an even sequence length when a bias is trained
# (our segment mask reaches cuDNN as a bias).
CUDNN_DTYPES = ("bfloat16", "float16")


def _at_least(compute_capability: str | None, version: tuple[int, int]) -> bool:
    return compute_capability is not None and tuple(int(x) for x in compute_capability.split(".")[:2]) >= version


def cudnn_unavailable(platform: str, dtype, head_dim: int, seq_len: int,
                      compute_capability: str | None = None) -> str | None:
    """Why the cuDNN flash-attention kernel cannot run here, or None when it can.

    A pure function of what the trace knows, so the choice is testable on any machine;
    `attention` also catches what jax itself refuses at trace time (a missing cuDNN)."""
    if platform != "gpu":
        return f"the devices are {platform}, not NVIDIA GPUs"
    if jnp.dtype(dtype).name not in CUDNN_DTYPES:
        return f"model.dtype={jnp.dtype(dtype).name}: cuDNN attention takes bfloat16 or float16"
    h_max = 256 if _at_least(compute_capability, (9, 0)) else 128
    if head_dim % 8 or head_dim > h_max:
        return f"head_dim={head_dim}: cuDNN attention needs a multiple of 8 up to {h_max} on this GPU"
    if seq_len % 2:
        return f"sequence length {seq_len}: cuDNN attention with a mask needs an even length"
    return None


_NOTICES_SHOWN: set[str] = set()


def _notice_once(message: str) -> None:
    """One line on stderr per distinct message and process (process 0 only): a step function is
    traced several times (train, eval, each layer body) and each trace would repeat it."""
    if message in _NOTICES_SHOWN:
        return
    _NOTICES_SHOWN.add(message)
    if jax.process_index() == 0:
        print(message, file=sys.stderr, flush=True)


def _devices_here():
    """(platform, compute capability or None) of the devices this trace will run on: the mesh's
    when one is active (scripts/compile_tpu.py traces for devices other than the default)."""
    mesh, _ = shd.current()
    device = mesh.devices.flat[0] if mesh is not None else jax.devices()[0]
    return device.platform, getattr(device, "compute_capability", None)


def attention(q_btnh, k_bskh, v_bskh, segment_ids_bt, impl: str, branch_ids_bt=None,
              window: int | None = None, positions_bt=None, packed_segments: int = 0):
    """Causal attention within each packed document (and within `window` when set) by `impl`.
    positions_bt: the window's distances for the reference (see attention_mask). packed_segments:
    cuDNN's packed layout for rows of up to this many documents (0: off; see attention_cudnn_packed)."""
    if impl == "xla" or branch_ids_bt is not None:
        # Branched rows are scoring's (no gradient, short rows): the kernels take segment ids only.
        return attention_xla(q_btnh, k_bskh, v_bskh, segment_ids_bt, branch_ids_bt, window, positions_bt)
    if impl == "cudnn":
        platform, capability = _devices_here()
        reason = cudnn_unavailable(platform, q_btnh.dtype, q_btnh.shape[-1], q_btnh.shape[1], capability)
        _, context = _context_axes()
        if reason is None and context > 1:
            try:
                out = attention_dpa_context(q_btnh, k_bskh, v_bskh, segment_ids_bt, positions_bt, "cudnn", window)
                _notice_once(f"model.attention=cudnn: cuDNN flash attention under mesh.context={context} (the "
                             f"striped causal and document mask as a bias)")
                return out
            except (NotImplementedError, RuntimeError, ValueError) as e:  # jax's refusals at trace time
                reason = str(e).splitlines()[0]
        if reason is None and context == 1 and packed_segments and window is None and _at_least(capability, (9, 0)):
            try:
                out = attention_cudnn_packed(q_btnh, k_bskh, v_bskh, segment_ids_bt, packed_segments)
                _notice_once(f"model.attention=cudnn: cuDNN flash attention, packed layout (rows of up to "
                             f"{packed_segments} documents; fuller batches: segment mask as a bias)")
                return out
            except (NotImplementedError, RuntimeError, ValueError) as e:  # jax's refusals at trace time
                _notice_once(f"model.cudnn_packed_segments={packed_segments}: the packed layout is refused "
                             f"({str(e).splitlines()[0]}); the segment mask as a bias instead")
        if reason is None and context == 1:
            try:
                out = attention_dpa(q_btnh, k_bskh, v_bskh, segment_ids_bt, "cudnn", window)
                _notice_once("model.attention=cudnn: cuDNN flash attention (segment mask as a bias)")
                return out
            except (NotImplementedError, RuntimeError) as e:  # jax's own refusals at trace time
                reason = str(e).splitlines()[0]
        # The reference computes the same function: same numbers, but it builds the [t, s] scores
        # in memory, so a GPU plan sized for cuDNN may need more memory or microbatches.
        _notice_once(f"model.attention=cudnn unavailable ({reason}); using the XLA reference attention")
        return attention_xla(q_btnh, k_bskh, v_bskh, segment_ids_bt, window=window, positions_bt=positions_bt)
    if impl == "splash":
        return attention_splash(q_btnh, k_bskh, v_bskh, segment_ids_bt, window=window)
    raise ValueError(f"model.attention={impl!r}")


def attention_cached(q_btnh, k_bskh, v_bskh, start, window: int | None = None):
    """attention_xla against a KV cache (generation): the t queries sit at cache slots
    start .. start+t-1 and query i sees slots <= start + i, so the empty slots beyond the
    filled ones are masked too. One sequence per row (no packing): slot s holds position s.
    With a sliding window, query i also sees only slots > start + i - window.
    """
    t, s = q_btnh.shape[1], k_bskh.shape[1]
    query_t1 = start + jnp.arange(t)[:, None]
    visible_ts = jnp.arange(s)[None, :] <= query_t1
    if window is not None:
        visible_ts &= jnp.arange(s)[None, :] > query_t1 - window
    return _gqa_attention(q_btnh, k_bskh, v_bskh, visible_ts)


class Block(nnx.Module):
    """Pre-norm transformer layer: x + Attn(norm(x)), then x + SwiGLU(norm(x))."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        d, n, k, h, f = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff
        pdt = jnp.dtype(cfg.param_dtype)
        std = 0.02
        # Residual-branch outputs scaled by 1/sqrt(2 L) (GPT-2): keeps the residual stream's
        # variance independent of depth at init.
        out_std = std / math.sqrt(2 * cfg.n_layers)
        self.attn_norm = RMSNorm(d, cfg.norm_eps, pdt, rngs=rngs)
        self.wq_dnh = _param(rngs, (d, n, h), ("embed", "heads", "head_dim"), std, pdt)
        self.wk_dkh = _param(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"), std, pdt)
        self.wv_dkh = _param(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"), std, pdt)
        self.wo_nhd = _param(rngs, (n, h, d), ("heads", "head_dim", "embed"), out_std, pdt)
        # Optional parts are None when off: the default block's parameters are today's, unchanged.
        self.bq_nh = _zeros((n, h), ("heads", "head_dim"), pdt) if cfg.qkv_bias else None
        self.bk_kh = _zeros((k, h), ("kv_heads", "head_dim"), pdt) if cfg.qkv_bias else None
        self.bv_kh = _zeros((k, h), ("kv_heads", "head_dim"), pdt) if cfg.qkv_bias else None
        self.q_norm = RMSNorm(h, cfg.norm_eps, pdt, rngs=rngs) if cfg.qk_norm else None
        self.k_norm = RMSNorm(h, cfg.norm_eps, pdt, rngs=rngs) if cfg.qk_norm else None
        self.mlp_norm = RMSNorm(d, cfg.norm_eps, pdt, rngs=rngs)
        self.w_gate_df = _param(rngs, (d, f), ("embed", "mlp"), std, pdt)
        self.w_up_df = _param(rngs, (d, f), ("embed", "mlp"), std, pdt)
        self.w_down_fd = _param(rngs, (f, d), ("mlp", "embed"), out_std, pdt)
        self.rope_theta = cfg.rope_theta
        self.rope_llama3 = cfg.rope_llama3
        self.rope_yarn, self.rope_scale = cfg.rope_yarn, cfg.rope_scale
        self.sliding_window = cfg.sliding_window
        self.attention_impl = cfg.attention
        self.cudnn_packed_segments = cfg.cudnn_packed_segments
        self.dtype = jnp.dtype(cfg.dtype)
        self.einsum = fp8_einsum if cfg.fp8 else jnp.einsum  # the dense projections' matmul

    def _w(self, p):
        return p[...].astype(self.dtype)   # fp32 master -> compute dtype

    def _qkv(self, x_btd, positions_bt):
        """norm -> q, k, v projections (+ biases) -> per-head q, k norms -> RoPE on q and k."""
        y_btd = self.attn_norm(x_btd)
        q_btnh = self.einsum("btd,dnh->btnh", y_btd, self._w(self.wq_dnh))
        k_btkh = self.einsum("btd,dkh->btkh", y_btd, self._w(self.wk_dkh))
        v_btkh = self.einsum("btd,dkh->btkh", y_btd, self._w(self.wv_dkh))
        if self.bq_nh is not None:
            q_btnh = q_btnh + self._w(self.bq_nh)
            k_btkh = k_btkh + self._w(self.bk_kh)
            v_btkh = v_btkh + self._w(self.bv_kh)
        q_btnh = checkpoint_name(q_btnh, "q_proj")
        k_btkh, v_btkh = checkpoint_name(k_btkh, "k_proj"), checkpoint_name(v_btkh, "v_proj")
        q_btnh = shd.constrain(q_btnh, ("act_batch", "act_len", "act_heads", None))
        k_btkh = shd.constrain(k_btkh, ("act_batch", "act_len", "act_kv_heads", None))
        v_btkh = shd.constrain(v_btkh, ("act_batch", "act_len", "act_kv_heads", None))
        if self.q_norm is not None:
            q_btnh, k_btkh = self.q_norm(q_btnh), self.k_norm(k_btkh)
        inv_freq_j = rope_inv_freq(q_btnh.shape[-1], self.rope_theta, self.rope_llama3, self.rope_yarn)
        return (rope(q_btnh, positions_bt, inv_freq_j, self.rope_scale),
                rope(k_btkh, positions_bt, inv_freq_j, self.rope_scale), v_btkh)

    def _out_and_mlp(self, x_btd, o_btnh):
        """Attention output projection into the residual, then the SwiGLU branch."""
        o_btnh = shd.constrain(o_btnh, ("act_batch", "act_len", "act_heads", None))
        x_btd = x_btd + checkpoint_name(self.einsum("btnh,nhd->btd", o_btnh, self._w(self.wo_nhd)), "out_proj")
        x_btd = shd.constrain(x_btd, ("act_batch", "act_len", "act_embed"))

        y_btd = self.mlp_norm(x_btd)
        gate_btf = self.einsum("btd,df->btf", y_btd, self._w(self.w_gate_df))
        up_btf = self.einsum("btd,df->btf", y_btd, self._w(self.w_up_df))
        h_btf = shd.constrain(jax.nn.silu(gate_btf) * up_btf, ("act_batch", "act_len", "act_mlp"))
        x_btd = x_btd + self.einsum("btf,fd->btd", h_btf, self._w(self.w_down_fd))
        return shd.constrain(x_btd, ("act_batch", "act_len", "act_embed"))

    def __call__(self, x_btd, positions_bt, segment_ids_bt, branch_ids_bt=None):
        x_btd = checkpoint_name(x_btd, "layer_input")
        q_btnh, k_btkh, v_btkh = self._qkv(x_btd, positions_bt)
        # Every query sees every key of its document: keys and values (and the keys' segment ids
        # and positions) span the whole row, all-gathered over whatever splits `act_len`
        # (context parallelism; nothing to gather otherwise). The queries stay split.
        k_btkh = shd.constrain(k_btkh, ("act_batch", None, "act_kv_heads", None))
        v_btkh = shd.constrain(v_btkh, ("act_batch", None, "act_kv_heads", None))
        o_btnh = attention(q_btnh, k_btkh, v_btkh, segment_ids_bt, self.attention_impl, branch_ids_bt,
                           self.sliding_window, positions_bt, self.cudnn_packed_segments)
        return self._out_and_mlp(x_btd, o_btnh)

    def decode(self, x_btd, positions_bt, k_cache_bskh, v_cache_bskh, start):
        """__call__ for generation: the same weights and RoPE, one sequence per row.

        Writes this call's RoPE'd keys and values into the cache at slots start..start+t-1 and
        attends to every filled slot. Returns (x_btd, k_cache_bskh, v_cache_bskh).
        """
        q_btnh, k_btkh, v_btkh = self._qkv(x_btd, positions_bt)
        k_cache_bskh = jax.lax.dynamic_update_slice_in_dim(k_cache_bskh, k_btkh.astype(k_cache_bskh.dtype), start, 1)
        v_cache_bskh = jax.lax.dynamic_update_slice_in_dim(v_cache_bskh, v_btkh.astype(v_cache_bskh.dtype), start, 1)
        o_btnh = attention_cached(q_btnh, k_cache_bskh, v_cache_bskh, start, self.sliding_window)
        return self._out_and_mlp(x_btd, o_btnh), k_cache_bskh, v_cache_bskh


def _stacked_blocks(cfg: LlamaConfig, rngs: nnx.Rngs) -> Block:
    """n_layers Blocks with every Param stacked on a leading "layers" axis (for lax.scan)."""

    @nnx.split_rngs(splits=cfg.n_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make(rngs):
        return Block(cfg, rngs=rngs)

    return make(rngs)


class Llama(nnx.Module):
    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        pdt = jnp.dtype(cfg.param_dtype)
        d, v = cfg.d_model, cfg.vocab_size
        # std 1 for the table: RMSNorm follows, so its scale only matters when tied.
        emb_std = 0.02 if cfg.tie_embeddings else 1.0
        self.embed_vd = _param(rngs, (v, d), ("vocab", "embed"), emb_std, pdt)
        if cfg.scan_layers:
            self.layers = _stacked_blocks(cfg, rngs)
        else:
            self.layers = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.n_layers)])
        self.final_norm = RMSNorm(d, cfg.norm_eps, pdt, rngs=rngs)
        if not cfg.tie_embeddings:
            self.lm_head_dv = _param(rngs, (d, v), ("embed", "vocab"), 1.0 / math.sqrt(d), pdt)

    def __call__(self, tokens_bt, positions_bt, segment_ids_bt):
        """Logits [b, t, v] in fp32. positions restart at 0 per packed document."""
        return self.logits(self.hidden(tokens_bt, positions_bt, segment_ids_bt))

    def hidden(self, tokens_bt, positions_bt, segment_ids_bt, branch_ids_bt=None):
        """The final-normed hidden states [b, t, d] that `logits` projects onto the vocab. Apart
        so the loss can project a chunk of positions at a time (train.loss_chunk).
        branch_ids_bt: shared-prefix scoring rows (attention_mask); None in training."""
        cfg = self.cfg
        dt = jnp.dtype(cfg.dtype)
        x_btd = jnp.take(shd.table_for_lookup(self.embed_vd[...], dt), tokens_bt, axis=0).astype(dt)
        x_btd = shd.constrain(x_btd, ("act_batch", "act_len", "act_embed"))

        policy = REMAT_POLICIES[cfg.remat]

        def apply(graphdef, state, x_btd):
            return nnx.merge(graphdef, state)(x_btd, positions_bt, segment_ids_bt, branch_ids_bt)

        if cfg.remat != "none":
            # prevent_cse=False is safe (and faster) inside scan, which already blocks CSE.
            apply = jax.checkpoint(apply, policy=policy, static_argnums=(0,),
                                   prevent_cse=not cfg.scan_layers)
        if cfg.scan_layers:
            graphdef, state = nnx.split(self.layers)
            x_btd, _ = jax.lax.scan(lambda x, s: (apply(graphdef, s, x), None), x_btd, state)
        else:
            for block in self.layers:
                graphdef, state = nnx.split(block)
                x_btd = apply(graphdef, state, x_btd)

        return self.final_norm(x_btd)

    def logits(self, x_btd):
        """[b, t, d] hidden states -> [b, t, v] logits in fp32."""
        cfg = self.cfg
        logits_btv = project_to_vocab(x_btd, self.output_head().astype(jnp.dtype(cfg.dtype)))
        return shd.constrain(logits_btv, ("act_batch", "act_len", "act_vocab"))

    def output_head(self):
        """The output projection [d, v]: the embedding's transpose when tied."""
        return self.embed_vd[...].T if self.cfg.tie_embeddings else self.lm_head_dv[...]

    # ------------------------------------------------------------------------- generation
    # KV-cache decoding (scripts/generate.py): `decode` the prompt once (prefill), then one
    # token per call. The cache has a fixed size, so one jitted decode step serves every token.
    # Attention is always the masked-einsum reference whatever `cfg.attention` says: the
    # flash kernels take no cache. The training path above is untouched by any of this.

    def init_cache(self, batch: int, max_len: int) -> dict:
        """An empty cache for `batch` sequences of up to `max_len` tokens (prompt + generated).

        {"k_lbskh", "v_lbskh": [layers, batch, max_len, kv heads, head dim] in the compute
        dtype, keys stored after RoPE; "length": int32[], slots filled so far (every row alike)}.
        """
        cfg = self.cfg
        shape = (cfg.n_layers, batch, max_len, cfg.n_kv_heads, cfg.head_dim)
        # Two separate buffers (not one array twice): a jitted step may donate both.
        return {"k_lbskh": jnp.zeros(shape, jnp.dtype(cfg.dtype)), "v_lbskh": jnp.zeros(shape, jnp.dtype(cfg.dtype)),
                "length": jnp.zeros((), jnp.int32)}

    def decode(self, tokens_bt, positions_bt, cache: dict):
        """(logits [b, t, v] fp32, cache) for t new tokens following the cache's `length`.

        positions_bt is normally length + arange(t). The caller keeps length + t <= max_len:
        past the end, XLA's dynamic_update_slice would clamp and overwrite the last slots.
        """
        cfg = self.cfg
        dt = jnp.dtype(cfg.dtype)
        start = cache["length"]
        x_btd = jnp.take(shd.table_for_lookup(self.embed_vd[...], dt), tokens_bt, axis=0).astype(dt)
        if cfg.scan_layers:
            graphdef, state = nnx.split(self.layers)

            def body(x_btd, layer):
                state, k_bskh, v_bskh = layer
                x_btd, k_bskh, v_bskh = nnx.merge(graphdef, state).decode(x_btd, positions_bt, k_bskh, v_bskh, start)
                return x_btd, (k_bskh, v_bskh)

            x_btd, (k_lbskh, v_lbskh) = jax.lax.scan(body, x_btd, (state, cache["k_lbskh"], cache["v_lbskh"]))
        else:
            ks, vs = [], []
            for i, block in enumerate(self.layers):
                x_btd, k_bskh, v_bskh = block.decode(x_btd, positions_bt, cache["k_lbskh"][i],
                                                     cache["v_lbskh"][i], start)
                ks.append(k_bskh)
                vs.append(v_bskh)
            k_lbskh, v_lbskh = jnp.stack(ks), jnp.stack(vs)
        x_btd = self.final_norm(x_btd)
        logits_btv = project_to_vocab(x_btd, self.output_head().astype(dt))
        cache = {"k_lbskh": k_lbskh, "v_lbskh": v_lbskh, "length": start + tokens_bt.shape[1]}
        return logits_btv, cache

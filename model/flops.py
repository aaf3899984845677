"""Training FLOPs per token and peak FLOP/s per chip, for MFU.

Convention (PaLM, Chowdhery et al. 2022, appendix B), the one most MFU figures use:
  flops/token = 6 * N_matmul + 12 * n_layers * (n_heads * head_dim) * seq_len
- N_matmul: parameters that take part in a matmul per token: every layer's attention and
  MLP weights plus the output projection (also when tied to the embedding). The input
  embedding lookup and the norm scales do no matmul FLOPs and are left out.
- 6 = 2 (multiply-add) * 3 (forward + two backward matmuls).
- Attention scores and the weighted sum are 2 matmuls of 2*t*(n*h) FLOPs per token forward,
  times 3 for backward, with *no* causal discount (as in PaLM; XLA's reference attention does
  compute the full square). Rematerialisation is not counted: MFU counts useful FLOPs only.
  `causal=True` halves the attention term (only the lower triangle is useful work), the count
  torchtitan and the GPU MFU figures of OLMo-core use; benchmarks report both.
"""
from __future__ import annotations

from model.llama import LlamaConfig

# bf16 dense peak FLOP/s per chip (per GPU). Keys are matched against jax's
# `device.device_kind` by longest case-insensitive prefix. Override with train.peak_flops.
PEAK_FLOPS: dict[str, float] = {
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,  # v5e
    "TPU v5e": 197e12,
    "TPU v5p": 459e12,
    "TPU v5": 459e12,  # v5p reports device_kind "TPU v5"
    "TPU v6 lite": 918e12,  # v6e (Trillium)
    "TPU v6e": 918e12,
    "NVIDIA H100": 989e12,  # SXM; PCIe is ~756e12: override if you run on those
    "NVIDIA H200": 989e12,
    "NVIDIA A100": 312e12,
}


def matmul_params(cfg: LlamaConfig) -> int:
    """Parameters used in matmuls per token: layers' weights (no norms) + output projection."""
    layers = cfg.n_layers * (cfg.layer_params() - 2 * cfg.d_model)
    return layers + cfg.d_model * cfg.vocab_size


def flops_per_token(cfg: LlamaConfig, seq_len: int, causal: bool = False) -> float:
    """Training (fwd + bwd) FLOPs per token; see the module docstring for the convention."""
    attn = 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq_len
    return float(6 * matmul_params(cfg) + (attn / 2 if causal else attn))


def recompute_factor(cfg: LlamaConfig, seq_len: int, loss_chunk: int = 0) -> float:
    """FLOPs a train step executes over the useful ones (flops_per_token), counting the matmuls
    that rematerialisation and a chunked loss run again in the backward pass.

    - remat "full" re-runs each layer's forward: its weight matmuls and attention (~4/3 overall);
    - "dots"/"dots_all" keep the weight matmuls and re-run attention (a splash kernel is no dot,
      so "dots_all" keeps attention only with the XLA einsums); "dots_attention" also keeps the
      cuDNN kernel's outputs (no re-run there);
    - "offload" keeps the layer input and the q, k, v and output projections (on the host) and
      re-runs attention and the MLP's three matmuls;
    - loss_chunk > 0 re-runs the output projection.
    Elementwise work (norms, RoPE, softmax) is left out, as in flops_per_token.
    """
    layer_weights = matmul_params(cfg) - cfg.d_model * cfg.vocab_size
    attention_fwd = 4 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq_len
    extra = {"none": 0, "full": 2 * layer_weights + attention_fwd, "dots": attention_fwd,
             # the cuDNN kernel's outputs are kept; the XLA reference's attention is re-run (= dots)
             "dots_attention": 0 if cfg.attention == "cudnn" else attention_fwd,
             "dots_all": attention_fwd if cfg.attention == "splash" else 0,
             "offload": attention_fwd + 2 * 3 * cfg.n_layers * cfg.d_model * cfg.d_ff}[cfg.remat]
    if loss_chunk:
        extra += 2 * cfg.d_model * cfg.vocab_size
    return 1.0 + extra / flops_per_token(cfg, seq_len)


def peak_flops(device_kind: str, override: float | None = None) -> float | None:
    """Peak bf16 FLOP/s of one device, `override` if given, None when unknown (e.g. CPU)."""
    if override:
        return float(override)
    kind = device_kind.lower().strip()
    best = None
    for key, value in PEAK_FLOPS.items():
        if kind.startswith(key.lower()) and (best is None or len(key) > len(best[0])):
            best = (key, value)
    return best[1] if best else None


def mfu(tokens_per_s: float, flops_token: float, n_devices: int, peak: float | None) -> float | None:
    """Model FLOPs utilisation: achieved useful FLOP/s over the devices' combined peak."""
    if not peak:
        return None
    return tokens_per_s * flops_token / (n_devices * peak)

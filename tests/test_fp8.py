"""FP8 matmuls (model.fp8, model/llama.py fp8_einsum) on CPU, where XLA emulates the fp8 dots:
the switch off is today's network; on, the operands really are e4m3 (forward) and the gradient
e5m2 (backward), checked against products of explicitly quantized operands; the loss stays near
bf16's and falls in training; the compiled program keeps the fp8 types; a run resumes exactly.
Speed needs a Hopper GPU: scripts/bench/bench_mfu.py's fp8 tries.

Run: pytest tests/test_fp8.py -q -n0  (-m "not slow" for the fast tier)
"""
import dataclasses
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import nnx

from model import llama, step
from model.llama import Llama, LlamaConfig
from model.runtime import checkpoint

SMALL = LlamaConfig(vocab_size=128, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96,
                    dtype="bfloat16", remat="none")
SPECS = ["btd,dnh->btnh", "btnh,nhd->btd", "btf,fd->btd"]  # Block's projections: q/k/v, o, MLP down
SHAPES = {"b": 2, "t": 8, "d": 64, "n": 4, "h": 16, "f": 96}
# Against a product of the quantized operands, relative to its largest value: on CPU XLA computes
# the fp8 dot in fp32 (~1e-8 here); a GPU's fp8 GEMM accumulates its own way. Quantizing with the
# wrong grid (or not at all) is off by > 5e-2 here: DIFFERS is what proves it is the right one.
TOL = 1e-5 if jax.default_backend() == "cpu" else 5e-3
DIFFERS = 1e-2


def _operands(spec, seed=0):
    """x and w of `spec` in fp32: x ~ N(0, 1) with a few large values (an activation's outliers),
    w ~ N(0, 0.02)."""
    x_idx, w_idx = spec.split("->")[0].split(",")
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, tuple(SHAPES[c] for c in x_idx)).at[0, 0].multiply(20.0)
    w = 0.02 * jax.random.normal(kw, tuple(SHAPES[c] for c in w_idx))
    return x, w


def _quantized(a, f8) -> np.ndarray:
    """The reference quantizer, apart from the model's: a's values on f8's grid after scaling by
    the power of two that maps its amax into (max / 2, max] (ml_dtypes rounds), scaled back, in fp64."""
    a = np.asarray(a, np.float64)
    top = float(ml_dtypes.finfo(f8).max)
    k = np.floor(np.log2(top / np.abs(a).max()))
    return (a * 2.0 ** k).astype(f8).astype(np.float64) / 2.0 ** k


def _einsum64(spec, a, b):
    return np.einsum(spec, np.asarray(a, np.float64), np.asarray(b, np.float64))


def _batch(cfg, b=2, t=32, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, cfg.vocab_size, (b, t + 1)).astype(np.int32)
    seg = np.repeat([[1] * 20 + [2] * (t - 20)], b, axis=0).astype(np.int32)
    pos = np.where(seg == 1, np.arange(t), np.arange(t) - 20).astype(np.int32)
    return dict(inputs=tokens[:, :-1], targets=tokens[:, 1:], segment_ids=seg, positions=pos,
                loss_mask=np.ones_like(seg))


def _loss_and_grads(cfg, params=None, batch=None):
    graphdef, init = nnx.split(Llama(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    params = nnx.to_pure_dict(init) if params is None else params
    batch = _batch(cfg) if batch is None else batch
    (loss, _), grads = jax.jit(jax.value_and_grad(
        lambda p: step.loss_fn(p, graphdef, batch, 0.0), has_aux=True))(params)
    return params, loss, grads


# ---------------------------------------------------------------- the switch and its config
def test_the_switch_defaults_off_and_refuses_a_non_bool_in_one_line():
    m = {k: v for k, v in dataclasses.asdict(SMALL).items() if k != "fp8"}
    assert LlamaConfig.from_mapping(m).fp8 is False  # a preset or checkpoint without the key: off
    assert LlamaConfig.from_mapping(dict(m, fp8=True)).fp8 is True
    with pytest.raises(ValueError, match=r"^model\.fp8='e4m3': expected true or false$"):
        LlamaConfig.from_mapping(dict(m, fp8="e4m3"))
    # fp8 holds no state (current scaling): a run may switch it when it resumes, as it may the dtype
    assert checkpoint.fingerprint_diffs({"model": m}, {"model": dict(m, fp8=True)}) == []
    assert checkpoint.fingerprint_diffs({"model": m}, {"model": dict(m, d_ff=128)}) != []


def test_fp8_off_is_todays_network():
    """Off, the projections are jnp.einsum itself (the call they were before the switch) and the
    program holds no fp8 type; on, it is fp8_einsum. (Checked against main's model at e26a999 by
    hand when the switch came: the same loss and gradients, bit for bit.)"""
    off = Llama(SMALL, rngs=nnx.Rngs(0))
    assert off.layers.einsum is jnp.einsum
    assert Llama(dataclasses.replace(SMALL, fp8=True), rngs=nnx.Rngs(0)).layers.einsum is llama.fp8_einsum
    graphdef, params = nnx.split(off, nnx.Param)
    grad = jax.grad(lambda p: step.loss_fn(p, graphdef, _batch(SMALL), 0.0)[0])
    assert "f8" not in jax.jit(grad).lower(nnx.to_pure_dict(params)).as_text()


# ---------------------------------------------------------------- the quantization really happens
def test_quantize_scales_by_a_power_of_two_onto_the_fp8_grid():
    x, _ = _operands(SPECS[0])
    for f8 in (llama.FP8_FORWARD, llama.FP8_BACKWARD):
        x_f8, inv = llama.fp8_quantize(x, f8)
        assert x_f8.dtype == f8
        k = -np.log2(float(inv))
        assert k == round(k)  # the scaling itself rounds nothing
        amax = float(jnp.abs(x_f8.astype(jnp.float32)).max())
        assert float(jnp.finfo(f8).max) / 2 < amax <= float(jnp.finfo(f8).max)  # the range used
        np.testing.assert_array_equal(np.asarray(x_f8.astype(jnp.float32), np.float64) * float(inv),
                                      _quantized(x, f8))
    zeros_f8, inv = llama.fp8_quantize(jnp.zeros((4, 4)), llama.FP8_FORWARD)
    assert float(inv) == 1.0 and not np.any(np.asarray(zeros_f8, np.float32))
    inf_f8, _ = llama.fp8_quantize(jnp.array([1.0, jnp.inf]), llama.FP8_FORWARD)
    assert np.isnan(np.asarray(inf_f8, np.float32)).any()  # an overflow stays loud


@pytest.mark.parametrize("spec", SPECS)
def test_forward_is_the_product_of_e4m3_operands(spec):
    x, w = _operands(spec)
    got = np.asarray(llama.fp8_einsum(spec, x, w))
    want = _einsum64(spec, _quantized(x, ml_dtypes.float8_e4m3fn), _quantized(w, ml_dtypes.float8_e4m3fn))
    np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL * np.abs(want).max())
    exact = _einsum64(spec, x, w)
    assert np.abs(got - exact).max() > DIFFERS * np.abs(want).max()  # unquantized it is not


@pytest.mark.parametrize("spec", SPECS)
def test_backward_takes_the_gradient_in_e5m2(spec):
    """dx = g . w and dw = x . g, with g on the e5m2 grid (2 mantissa bits) and x, w on e4m3's."""
    x, w = _operands(spec)
    out, vjp = jax.vjp(lambda x, w: llama.fp8_einsum(spec, x, w), x, w)
    g = jax.random.normal(jax.random.key(7), out.shape)
    dx, dw = (np.asarray(a) for a in vjp(g))
    x_idx, w_idx = spec.split("->")[0].split(",")
    out_idx = spec.split("->")[1]
    xq, wq = _quantized(x, ml_dtypes.float8_e4m3fn), _quantized(w, ml_dtypes.float8_e4m3fn)

    def refs(g_f8):
        gq = _quantized(g, g_f8)
        return _einsum64(f"{out_idx},{w_idx}->{x_idx}", gq, wq), _einsum64(f"{x_idx},{out_idx}->{w_idx}", xq, gq)

    for got, want, wrong in zip((dx, dw), refs(ml_dtypes.float8_e5m2), refs(ml_dtypes.float8_e4m3fn), strict=True):
        np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL * np.abs(want).max())
        assert np.abs(got - wrong).max() > DIFFERS * np.abs(want).max()  # an e4m3 gradient reads otherwise


@pytest.mark.slow
def test_compiled_program_keeps_the_fp8_types():
    """The step's StableHLO has the seven projections' dots on e4m3 x e4m3 and their fourteen
    gradient dots on e5m2 x e4m3 (the scanned layer body once), the vocab head's in bf16; XLA's
    CPU program keeps the fp8 arrays and converts them at the dot (a GPU runs fp8 GEMMs)."""
    cfg = dataclasses.replace(SMALL, fp8=True)
    graphdef, params = nnx.split(Llama(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    grad = jax.jit(jax.grad(lambda p: step.loss_fn(p, graphdef, _batch(cfg), 0.0)[0]))
    lowered = grad.lower(nnx.to_pure_dict(params))
    dots = re.findall(r"stablehlo\.dot_general .*?: \((tensor<[^>]*>), (tensor<[^>]*>)\)", lowered.as_text())
    kinds = [tuple("e4m3" if "f8E4M3FN" in t else "e5m2" if "f8E5M2" in t else "wide" for t in d) for d in dots]
    assert kinds.count(("e4m3", "e4m3")) == 7, kinds
    assert sum(sorted(k) == ["e4m3", "e5m2"] for k in kinds) == 14, kinds
    head = [k for d, k in zip(dots, kinds, strict=True) if "x128x" in d[0] + d[1]]  # v = 128: the vocab head
    assert head == [("wide", "wide")] * 3, head  # its forward and two gradients stay in the compute dtype
    compiled = lowered.compile().as_text()
    for f8 in ("f8e4m3fn", "f8e5m2"):  # fp8 arrays the program computes (then converts for the CPU's dot)
        assert re.search(rf"= {f8}\[[\d,]*\]\S* convert\(", compiled), f"the compiled program holds no {f8}"


def _fp8_gpu() -> bool:
    d = jax.devices()[0]
    return d.platform == "gpu" and float(getattr(d, "compute_capability", "0")) >= 8.9


@pytest.mark.skipif(not _fp8_gpu(), reason="needs an NVIDIA GPU with fp8 tensor cores (Ada/Hopper or later)")
def test_gpu_runs_the_projections_as_fp8_gemms():
    """On Hopper, XLA's GEMM rewriter turns each fp8 dot (with its scales and output type) into a
    cuBLASLt fp8 call: the seven projections and their fourteen gradients (the layer body once)."""
    cfg = dataclasses.replace(SMALL, fp8=True)
    graphdef, params = nnx.split(Llama(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    grad = jax.jit(jax.grad(lambda p: step.loss_fn(p, graphdef, _batch(cfg), 0.0)[0]))
    compiled = grad.lower(nnx.to_pure_dict(params)).compile().as_text()
    calls = [line.strip()[:300] for line in compiled.splitlines() if "custom_call_target" in line or " dot(" in line]
    assert sum('"__cublas$lt$matmul$f8"' in c for c in calls) >= 21, "\n".join(calls)


# ---------------------------------------------------------------- the network in FP8
@pytest.mark.slow
@pytest.mark.parametrize("variant", [dict(remat="full"), dict(remat="dots"), dict(scan_layers=False)])
def test_remat_and_unscanned_layers_run_the_same_fp8_numbers(variant):
    """fp8_einsum's custom gradient under jax.checkpoint's policies and outside the scan (in fp32
    compute: bf16 rounds differently in differently fused programs, fp8 or not)."""
    fp32 = dataclasses.replace(SMALL, fp8=True, dtype="float32")
    params, ref_loss, ref_g = _loss_and_grads(fp32)
    cfg = dataclasses.replace(fp32, **variant)
    if not cfg.scan_layers:
        unstack = lambda tree: {i: jax.tree.map(lambda a, i=i: a[i], tree) for i in range(cfg.n_layers)}  # noqa: E731
        params = dict(params, layers=unstack(params["layers"]))
        ref_g = dict(ref_g, layers=unstack(ref_g["layers"]))
    _, loss, g = _loss_and_grads(cfg, params)
    loose = 1 if jax.default_backend() == "cpu" else 10  # a GPU fuses the two programs' elementwise work apart
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6 * loose)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5 * loose, atol=1e-7 * loose), g, ref_g)


@pytest.mark.slow
def test_fp8_loss_and_gradients_follow_bf16():
    params, bf16_loss, bf16_g = _loss_and_grads(SMALL)
    _, fp8_loss, fp8_g = _loss_and_grads(dataclasses.replace(SMALL, fp8=True), params)
    assert abs(float(fp8_loss) / float(bf16_loss) - 1) < 0.02, (fp8_loss, bf16_loss)
    assert float(fp8_loss) != float(bf16_loss)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(bf16_g), jax.tree.leaves(fp8_g), strict=True):
        a, b = np.ravel(a), np.ravel(b)
        cos = a @ b / (np.linalg.norm(a) * np.linalg.norm(b))
        assert cos > 0.98, (path, cos)


@pytest.mark.slow
def test_fp8_training_lowers_the_loss_as_bf16_does():
    """Twenty AdamW steps on one batch (memorising it): fp8's losses fall with bf16's."""
    batch = _batch(SMALL, b=4, t=64, seed=1)

    def losses(cfg):
        graphdef, params = nnx.split(Llama(cfg, rngs=nnx.Rngs(0)), nnx.Param)
        params, tx = nnx.to_pure_dict(params), optax.adamw(3e-3)
        opt = tx.init(params)

        @jax.jit
        def train_step(params, opt):
            (loss, _), g = jax.value_and_grad(lambda p: step.loss_fn(p, graphdef, batch, 0.0), has_aux=True)(params)
            updates, opt = tx.update(g, opt, params)
            return optax.apply_updates(params, updates), opt, loss

        out = []
        for _ in range(20):
            params, opt, loss = train_step(params, opt)
            out.append(float(loss))
        return np.array(out)

    bf16, fp8 = losses(SMALL), losses(dataclasses.replace(SMALL, fp8=True))
    assert fp8[-1] < 0.7 * fp8[0], fp8
    np.testing.assert_allclose(fp8, bf16, rtol=0.05)


# ---------------------------------------------------------------- a run resumes exactly
@pytest.mark.slow
def test_an_fp8_run_resumes_bit_identically(tmp_path):
    """train.py with model.fp8=true, killed after its step-K checkpoint and restarted: the same
    per-step losses and batches as the straight run. Current scaling keeps no state, so the
    checkpoint's arrays are those of a bf16 run."""
    import signal

    from tests.run_helpers import K, N, assert_same_run, complete_steps, run, run_until

    straight = tmp_path / "straight"
    run(straight, "model.fp8=true", "data.num_workers=0", "checkpoint.every=0")
    run_dir = tmp_path / "run"
    ckpt = run_dir / "checkpoints"
    run_until(run_dir, lambda: (ckpt / str(K)).is_dir(), signal.SIGKILL, "model.fp8=true", "data.num_workers=0",
              f"checkpoint.every={K}")
    assert complete_steps(ckpt)[-1] < N, "the kill came too late"
    run(run_dir, "model.fp8=true", "data.num_workers=0", f"checkpoint.every={K}")
    assert_same_run(run_dir, straight)

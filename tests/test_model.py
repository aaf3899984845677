"""Model invariants on CPU: config, presets by shape only, attention implementations against
the reference, packing, scan/remat and chunked-loss equivalence. (Memory plans for TPU slices are
compiled by the TPU compiler: tests/test_compile_tpu.py.)

Run: pytest tests/test_model.py -q
"""
import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from flax import nnx

from model import llama, step
from model.llama import Llama, LlamaConfig

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
SMALL = LlamaConfig(vocab_size=128, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96,
                    dtype="float32", remat="none")


def preset(name) -> LlamaConfig:
    with open(os.path.join(CONFIGS, "model", f"{name}.yaml")) as f:
        return LlamaConfig.from_mapping(yaml.safe_load(f))


def test_from_mapping_rejects_unknown_keys_and_bad_values():
    m = dataclasses.asdict(SMALL)
    assert LlamaConfig.from_mapping(m) == SMALL
    with pytest.raises(ValueError, match="n_layer"):
        LlamaConfig.from_mapping(dict(m, n_layer=3))
    with pytest.raises(ValueError, match="model.attention"):
        LlamaConfig.from_mapping(dict(m, attention="flash"))
    with pytest.raises(ValueError, match="n_kv_heads"):
        LlamaConfig.from_mapping(dict(m, n_kv_heads=3))


@pytest.mark.parametrize("name,expected", [
    ("tiny", None), ("125m", None), ("1b", 1_100_048_384), ("llama2_7b", 6_738_415_616),
    # the open checkpoints' (configs/model: their config.json shapes; the count their tensors hold,
    # a tied head once)
    ("llama3_2_1b", 1_235_814_400), ("llama3_2_3b", 3_212_749_824), ("llama3_1_8b", 8_030_261_248),
    ("qwen2_5_0_5b", 494_032_768), ("qwen3_0_6b", 596_049_920), ("mistral_7b", 7_241_732_096)])
def test_presets_build_by_shape_and_count_params(name, expected):
    cfg = preset(name)
    model = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
    counted = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert counted == cfg.num_params()
    if expected is not None:  # the published counts (Llama-2-7B, TinyLlama-1.1B, ...)
        assert cfg.num_params() == expected
    b, t = 2, 16
    out = jax.eval_shape(lambda m: m(jnp.zeros((b, t), jnp.int32), jnp.zeros((b, t), jnp.int32),
                                     jnp.ones((b, t), jnp.int32)), model)
    assert out.shape == (b, t, cfg.vocab_size) and out.dtype == jnp.float32


def test_every_param_names_its_axes():
    model = nnx.eval_shape(lambda: Llama(SMALL, rngs=nnx.Rngs(0)))
    for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        names = v.get_metadata().get("out_sharding")
        assert names is not None and len(names) == v.ndim, (path, names)
    layers = nnx.state(model, nnx.Param)["layers"]["wq_dnh"]
    assert layers.get_metadata()["out_sharding"][0] == "layers"


def _qkv(seed, b=2, t=32, n=4, k=2, h=16):
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (b, t, n, h))
    kk = jax.random.normal(ks[1], (b, t, k, h))
    v = jax.random.normal(ks[2], (b, t, k, h))
    # three documents of ~1/3, ~1/2 and the rest of the row
    seg = jnp.asarray(np.repeat([np.digitize(np.arange(t), [t // 3, 5 * t // 6]) + 1], b, axis=0), jnp.int32)
    return q, kk, v, seg


def _naive_attention(q, k, v, seg):
    """Independent check: repeat kv heads, loop-free dense softmax with explicit mask."""
    g = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    s = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])
    t = q.shape[1]
    mask = (np.tril(np.ones((t, t), bool))[None] & (seg[:, :, None] == seg[:, None, :]))[:, None]
    p = jax.nn.softmax(jnp.where(mask, s, -1e30), axis=-1)
    return jnp.einsum("bnts,bsnh->btnh", p, v)


@pytest.mark.slow
def test_reference_attention_matches_naive():
    q, k, v, seg = _qkv(0)
    np.testing.assert_allclose(llama.attention_xla(q, k, v, seg), _naive_attention(q, k, v, seg), atol=1e-5)


IMPLS = {
    # name -> (runs on this backend?, fn)
    "dpa_xla": (True, lambda *a: llama.attention_dpa(*a, implementation="xla")),
    "cudnn": (jax.default_backend() == "gpu", lambda *a: llama.attention(*a, impl="cudnn")),
    "splash": (jax.default_backend() == "tpu", lambda *a: llama.attention(*a, impl="splash")),
    # the same Pallas kernel in the interpreter: checks our splash wiring (layout, scaling,
    # GQA repeat, segment ids) on any backend
    "splash_interpret": (True, lambda *a: llama.attention_splash(*a, interpret=True)),
}


@pytest.mark.slow
@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_attention_impls_match_reference(impl, dtype):
    available, fn = IMPLS[impl]
    if not available:
        pytest.skip(f"{impl} does not run on {jax.default_backend()}")
    if impl == "splash_interpret" and dtype == "bfloat16":
        pytest.skip("interpreter: fp32 is enough to check the wiring")
    t = 128 if impl.startswith("splash") else 32  # splash wants 128-multiples
    q, k, v, seg = _qkv(1, t=t, h=128 if impl != "dpa_xla" else 16)
    seg = jnp.asarray(np.repeat([np.sort(np.random.default_rng(0).integers(1, 4, t))], 2, axis=0), jnp.int32)
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    want = llama.attention_xla(q, k, v, seg).astype(jnp.float32)
    got = fn(q, k, v, seg).astype(jnp.float32)
    tol = 1e-5 if dtype == "float32" else 3e-2
    np.testing.assert_allclose(got, want, atol=tol, rtol=tol)


def _naive_window_attention(q, k, v, seg, window):
    """_naive_attention with each query also seeing only the `window` slots ending at itself."""
    t = q.shape[1]
    g = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    s = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])
    idx = np.arange(t)
    near = (idx[:, None] >= idx[None, :]) & (idx[:, None] - idx[None, :] < window)
    mask = (near[None] & (seg[:, :, None] == seg[:, None, :]))[:, None]
    p = jax.nn.softmax(jnp.where(mask, s, -1e30), axis=-1)
    return jnp.einsum("bnts,bsnh->btnh", p, v)


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["reference", *IMPLS])
def test_sliding_window_attention_on_every_kernel(impl):
    """Mistral's window (a query sees itself and window-1 keys before it) on packed documents
    longer than the window, on each kernel model.attention can pick; the window matters."""
    if impl != "reference" and not IMPLS[impl][0]:
        pytest.skip(f"{impl} does not run on {jax.default_backend()}")
    window, t = 40, 128
    q, k, v, _ = _qkv(3, t=t, h=128 if impl in ("cudnn", "splash") else 16)
    seg = jnp.asarray(np.repeat([np.digitize(np.arange(t), [70, 110]) + 1], 2, axis=0), jnp.int32)
    want = _naive_window_attention(q, k, v, seg, window)
    if impl == "reference":
        got = llama.attention_xla(q, k, v, seg, window=window)
    elif impl == "dpa_xla":
        got = llama.attention_dpa(q, k, v, seg, "xla", window=window)
    elif impl == "splash_interpret":
        got = llama.attention_splash(q, k, v, seg, interpret=True, window=window)
    else:
        got = llama.attention(q, k, v, seg, impl, window=window)
    np.testing.assert_allclose(got, want, atol=1e-5 if impl != "cudnn" else 3e-2)
    assert np.abs(np.asarray(want) - np.asarray(_naive_attention(q, k, v, seg))).max() > 1e-2


@pytest.mark.slow
def test_splash_at_its_512_tiles_matches_reference_forward_and_backward():
    """Rows of 2,048 run splash at its 512 x 512 tiles (llama.SPLASH_BLOCK; the other tests' 128-token
    rows fit one tile): documents and a window cross the tile edges, so the block map skips some
    tiles (wholly outside the window) and masks others, and the backward kernels (dq, dkv: their own
    block maps) give the reference's gradients."""
    t, window = 2048, 600
    sizes = llama.splash_block_sizes(t, t)
    assert (sizes.block_q, sizes.block_kv, sizes.block_q_dkv, sizes.block_kv_dq) == (512,) * 4
    assert llama.splash_block_sizes(384, 640).block_q == 128 and llama.splash_block_sizes(384, 640).block_kv == 128
    q, k, v, _ = _qkv(4, b=1, t=t, h=128)
    seg = jnp.asarray(np.digitize(np.arange(t), [700, 1800])[None] + 1, jnp.int32)     # edges off the tiles

    def loss(fn):
        return jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(fn(q, k, v) ** 2), argnums=(0, 1, 2)))

    got = loss(lambda q, k, v: llama.attention_splash(q, k, v, seg, interpret=True, window=window))(q, k, v)
    want = loss(lambda q, k, v: llama.attention_xla(q, k, v, seg, window=window))(q, k, v)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, atol=2e-4, rtol=2e-4)


@pytest.mark.slow
def test_splash_under_shard_map_matches_reference():
    """Splash on a fsdp=4 x tensor=2 mesh: batch and heads split, per-device kernels."""
    import yaml as _yaml

    from model import sharding as shd
    with open(os.path.join(CONFIGS, "mesh", "fsdp_tp.yaml")) as f:
        mcfg = _yaml.safe_load(f)
    mesh, rules = shd.make_mesh(mcfg), shd.rules_from_cfg(mcfg)
    q, k, v, seg = _qkv(2, b=4, t=128, h=128)

    @jax.jit
    def f(q, k, v, seg):
        with shd.activation_sharding(mesh, rules):
            return llama.attention_splash(q, k, v, seg, interpret=True)

    np.testing.assert_allclose(f(q, k, v, seg), llama.attention_xla(q, k, v, seg), atol=1e-5)


def _packed_example(vocab=128, lengths=(9, 14, 5, 4)):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, vocab, n + 1) for n in lengths]  # +1: each doc's last target
    inputs = np.concatenate([d[:-1] for d in docs])[None].astype(np.int32)
    targets = np.concatenate([d[1:] for d in docs])[None].astype(np.int32)
    seg = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)])[None].astype(np.int32)
    pos = np.concatenate([np.arange(n) for n in lengths])[None].astype(np.int32)
    return docs, inputs, targets, seg, pos


@pytest.mark.slow
def test_packed_row_equals_documents_one_by_one():
    model = Llama(SMALL, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    fwd = jax.jit(lambda p, x, pos, seg: nnx.merge(graphdef, p)(x, pos, seg))
    model = lambda x, pos, seg: fwd(params, x, pos, seg)  # noqa: E731
    docs, inputs, targets, seg, pos = _packed_example(SMALL.vocab_size)
    packed, _ = step.token_losses(model(inputs, pos, seg), targets)
    alone = []
    for d in docs:
        x, y = d[:-1][None].astype(np.int32), d[1:][None].astype(np.int32)
        n = x.shape[1]
        ce, _ = step.token_losses(model(x, np.arange(n)[None], np.ones((1, n), np.int32)), y)
        alone.append(ce[0])
    np.testing.assert_allclose(packed[0], np.concatenate(alone), atol=1e-5, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("variant", [dict(remat="full"), dict(remat="dots"), dict(remat="dots_attention"),
                                     dict(remat="offload"), dict(scan_layers=False, remat="full")])
def test_scan_and_remat_do_not_change_loss_or_grads(variant):
    docs, inputs, targets, seg, pos = _packed_example(SMALL.vocab_size)
    batch = dict(inputs=inputs, targets=targets, segment_ids=seg, positions=pos, loss_mask=np.ones_like(seg))

    def loss_and_grad(cfg, params=None):
        graphdef, init = nnx.split(Llama(cfg, rngs=nnx.Rngs(0)), nnx.Param)
        params = nnx.to_pure_dict(init) if params is None else params
        (loss, _), g = jax.jit(jax.value_and_grad(
            lambda p: step.loss_fn(p, graphdef, batch, 0.0), has_aux=True))(params)
        return params, loss, g

    params, ref_loss, ref_g = loss_and_grad(SMALL)
    cfg = dataclasses.replace(SMALL, **variant)
    if not cfg.scan_layers:  # same weights, unstacked into a list of layers
        unstack = lambda tree: {i: jax.tree.map(lambda a, i=i: a[i], tree) for i in range(cfg.n_layers)}  # noqa: E731
        params = dict(params, layers=unstack(params["layers"]))
        ref_g = dict(ref_g, layers=unstack(ref_g["layers"]))
    _, loss, g = loss_and_grad(cfg, params)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), g, ref_g)


@pytest.mark.slow
def test_chunked_loss_equals_whole_sequence_loss_and_grads():
    # train.loss_chunk computes the same CE and z-loss (the lse path) per chunk of positions.
    rng = np.random.default_rng(0)
    inputs, targets = (rng.integers(0, SMALL.vocab_size, (2, 16)).astype(np.int32) for _ in range(2))
    seg = np.repeat(np.array([[1] * 10 + [2] * 6]), 2, axis=0).astype(np.int32)
    pos = np.where(seg == 1, np.arange(16), np.arange(16) - 10).astype(np.int32)
    mask = np.ones_like(seg)
    mask[0, -3:] = mask[1, :5] = 0   # uneven: a chunk's tokens landing at the wrong positions show
    batch = dict(inputs=inputs, targets=targets, segment_ids=seg, positions=pos, loss_mask=mask)
    model = Llama(SMALL, rngs=nnx.Rngs(0))
    for whole, chunked in zip(step.model_token_losses(model, batch), step.model_token_losses(model, batch, 4),
                              strict=True):
        np.testing.assert_allclose(chunked, whole, rtol=1e-6, atol=1e-6)
    graphdef, params = nnx.split(model, nnx.Param)
    params = nnx.to_pure_dict(params)

    def loss_and_grad(chunk):
        loss = lambda p: step.loss_fn(p, graphdef, batch, 1e-2, loss_chunk=chunk)[0]  # noqa: E731
        return jax.jit(jax.value_and_grad(loss))(params)

    ref_loss, ref_g = loss_and_grad(0)
    loss, g = loss_and_grad(4)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), g, ref_g)
    with pytest.raises(ValueError, match="train.loss_chunk=5"):
        loss_and_grad(5)


@pytest.mark.slow
def test_bf16_compute_keeps_fp32_params_and_logits():
    cfg = dataclasses.replace(SMALL, dtype="bfloat16")
    model = Llama(cfg, rngs=nnx.Rngs(0))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    _, inputs, targets, seg, pos = _packed_example(cfg.vocab_size)
    logits = model(inputs, pos, seg)
    ref = Llama(SMALL, rngs=nnx.Rngs(0))(inputs, pos, seg)
    assert logits.dtype == jnp.float32
    np.testing.assert_allclose(logits, ref, atol=0.1)




def test_the_vocab_projection_backward_runs_in_the_compute_dtype():
    """project_to_vocab: fp32 logits from bf16 operands, and a backward pass whose two matmuls take
    the logits' gradient in bf16 (autodiff alone would promote them to fp32 GEMMs). Its gradients
    equal autodiff's to bf16 rounding (to fp32 rounding in fp32, where the cast is a no-op)."""
    from model.llama import project_to_vocab

    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 16, 32)).astype(np.float32)
    w = (rng.standard_normal((32, 64)) / 6).astype(np.float32)
    g = rng.standard_normal((2, 16, 64)).astype(np.float32)

    def grads(fn, dtype):
        xd, wd = jnp.asarray(x, dtype), jnp.asarray(w, dtype)
        out, vjp = jax.vjp(fn, xd, wd)
        return out, vjp(jnp.asarray(g))

    plain = lambda a, b: jnp.einsum("btd,dv->btv", a, b, preferred_element_type=jnp.float32)  # noqa: E731
    for dtype, tol in ((jnp.float32, 1e-6), (jnp.bfloat16, 2e-2)):
        out, (dx, dw) = grads(project_to_vocab, dtype)
        ref_out, (ref_dx, ref_dw) = grads(plain, dtype)
        assert out.dtype == jnp.float32 and dx.dtype == dtype and dw.dtype == dtype
        np.testing.assert_array_equal(np.asarray(out), np.asarray(ref_out))
        for a, b in ((dx, ref_dx), (dw, ref_dw)):
            a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
            rel = np.linalg.norm(a - b) / np.linalg.norm(b)
            assert rel <= tol, (dtype, rel)
    # In bf16 the backward's matmuls read a bf16 gradient: no fp32 dot in the program.
    hlo = jax.jit(jax.grad(lambda a, b: project_to_vocab(a, b).sum(), argnums=(0, 1))).lower(
        jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)).as_text()
    operands = [line.rsplit(" : (", 1)[1].split(") ->")[0] for line in hlo.splitlines() if "dot_general" in line]
    assert len(operands) == 2 and not any("f32" in o for o in operands), operands


def test_rope_fields_leave_the_parameters_as_they_are():
    """llama.ROPE_FIELDS (what a resumed run may change: a context extension) name every rope_*
    field and max_seq_len, and changing them, each at least once here, leaves every parameter's
    shape, dtype and logical axes as they were; a field outside them (head_dim) does not."""
    fields = {f.name for f in dataclasses.fields(LlamaConfig)}
    assert set(llama.ROPE_FIELDS) == {f for f in fields if f.startswith("rope_")} | {"max_seq_len"}

    def params(cfg):
        state = nnx.state(nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0))), nnx.Param)
        return jax.tree.map(lambda p: (p.shape, p.dtype, p.out_sharding), state,
                            is_leaf=lambda x: isinstance(x, nnx.Variable))

    base = dataclasses.replace(SMALL, max_seq_len=128)
    yarn = dict(rope_type="yarn", rope_factor=4.0, rope_original_max_len=128, rope_beta_fast=16.0,
                rope_beta_slow=2.0, rope_attention_factor=1.1, rope_mscale=1.0, rope_mscale_all_dim=1.0,
                rope_truncate=False, max_seq_len=512, rope_theta=1e6)
    llama3 = dict(rope_type="llama3", rope_factor=8.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                  rope_original_max_len=128, rope_theta=5e5)
    changed = set()
    for change in (yarn, llama3, dict(rope_theta=5e5, max_seq_len=4096)):
        assert set(change) <= set(llama.ROPE_FIELDS)
        assert params(dataclasses.replace(base, **change)) == params(base), change
        changed |= set(change)
    assert changed == set(llama.ROPE_FIELDS)
    assert params(dataclasses.replace(base, head_dim=32)) != params(base)  # the check can fail


@pytest.mark.parametrize("fields, names", [
    (dict(rope_beta_fast=16.0), "model.rope_beta_fast=16.0: model.rope_type='default' does not use it"),
    (dict(rope_type="llama3", rope_factor=8.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
          rope_original_max_len=64, rope_truncate=False), "model.rope_truncate=False: model.rope_type='llama3'"),
    (dict(rope_type="yarn", rope_original_max_len=64), "model.rope_factor=None: model.rope_type='yarn' needs it"),
    (dict(rope_type="yarn", rope_factor=4.0, rope_original_max_len=64, rope_low_freq_factor=1.0),
     "model.rope_low_freq_factor=1.0: model.rope_type='yarn' does not use it"),
    (dict(rope_type="yarn", rope_factor=4.0, rope_original_max_len=64, rope_beta_slow=0.0),
     "model.rope_beta_slow=0.0: expected a positive number"),
    (dict(rope_type="dynamic"), "model.rope_type='dynamic'"),
])
def test_rope_fields_are_checked_in_one_line(fields, names):
    with pytest.raises(ValueError) as e:
        dataclasses.replace(SMALL, **fields)
    assert names in str(e.value) and "\n" not in str(e.value), str(e.value)

"""Context parallelism on 8 fake CPU devices (tests/conftest.py): each row's tokens split over
`mesh.context` chips in the striped order (model/context.py), keys and values all-gathered.

The train step at context 1, 2, 4, 8 (beside data, fsdp and tensor) gives the single device's loss,
gradients and parameters (fp32, 1e-5 relative) on packed documents of mixed lengths that cross the
chips' parts, with GQA and a sliding window shorter and longer than one chip's part; a change to
one document leaves every other document's logits alone; the balance metric; the one-line refusals;
a checkpoint saved at context 2 resumes at context 1 and 4; generate.py on a context-2 checkpoint.
The fused kernels under context: splash (Pallas interpreter) and cuDNN's masked path (its "xla"
twin) against the reference, loss and gradients, at context 2 and 4; splash's block map.

Run: pytest -n0 tests/test_context.py -q   (the fast tier: -m "not slow")
"""
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import yaml
from flax import nnx

from model import context as ctx
from model import llama, step
from model import sharding as shd
from model.llama import LlamaConfig
from tests.run_helpers import MICRO

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
T = 32  # at context 8 each chip holds 4 tokens of a row


def config(window=None, **kw):
    return LlamaConfig(vocab_size=128, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96, dtype="float32",
                       remat="full", sliding_window=window, **kw)


def mesh_cfg(name="context", **sizes):
    with open(os.path.join(CONFIGS, "mesh", f"{name}.yaml")) as f:
        m = yaml.safe_load(f)
    m.update(sizes)
    return m


def packed_batch(b=8, t=T, seed=0):
    """Rows of 2-4 documents of mixed lengths (one of them longer than a context-2 chip's part in
    most rows), some rows ending in padding; every row different."""
    rng = np.random.default_rng(seed)
    seg, pos = np.zeros((b, t), np.int32), np.zeros((b, t), np.int32)
    for r in range(b):
        end = t - (3 if r % 2 else 0)
        cuts = sorted(rng.choice(np.arange(1, end), rng.integers(1, 4), replace=False)) + [end]
        start = 0
        for i, stop in enumerate(cuts):
            seg[r, start:stop], pos[r, start:stop] = i + 1, np.arange(stop - start)
            start = stop
    return {"inputs": rng.integers(0, 128, (b, t)), "targets": rng.integers(0, 128, (b, t)),
            "segment_ids": seg, "positions": pos, "loss_mask": seg > 0}


# ----------------------------------------------------------------------------- the order


def test_layouts_are_permutations_and_striped_balances_packed_rows():
    for layout in ctx.LAYOUTS:
        assert sorted(ctx.layout_index(T, 4, layout)) == list(range(T))
    assert list(ctx.layout_index(8, 2, "striped")) == [0, 2, 4, 6, 1, 3, 5, 7]
    assert list(ctx.layout_index(8, 2, "zigzag")) == [0, 1, 6, 7, 2, 3, 4, 5]
    with pytest.raises(ValueError, match=r"data\.seq_len=30 .* mesh\.context=4"):
        ctx.layout_index(30, 4)
    # the work each query does = the keys the causal, same-document mask lets it see
    batch = packed_batch()
    mask = np.asarray(llama.attention_mask(jnp.asarray(batch["segment_ids"]), window=5,
                                           positions_bt=jnp.asarray(batch["positions"])))
    real = batch["segment_ids"] > 0
    np.testing.assert_array_equal(ctx.attention_work(batch["segment_ids"], 5)[real], mask.sum(-1)[real])
    np.testing.assert_array_equal(np.asarray(ctx.attention_work(jnp.asarray(batch["segment_ids"]), 5)),
                                  ctx.attention_work(batch["segment_ids"], 5))
    # one document of 4096 tokens, and a packed row whose long document ends mid-row, over 8 chips:
    # contiguous and zigzag leave chips idle where striped stays within 10% of the mean
    t = 4096
    one_doc = np.ones((1, t), np.int32)
    packed = np.concatenate([np.full(2600, 1), np.repeat(np.arange(2, 17), 100)[: t - 2600]])[None]
    imb = {(name, layout): float(ctx.imbalance(ctx.chip_work(ctx.attention_work(seg), 8, layout)))
           for name, seg in (("one", one_doc), ("packed", packed)) for layout in ctx.LAYOUTS}
    assert imb["one", "striped"] < 1.1 and imb["packed", "striped"] < 1.1
    assert imb["one", "zigzag"] < 1.01 and imb["packed", "zigzag"] > 1.3
    assert imb["one", "contiguous"] > 1.5
    # the metric of a batch at context 1 is 1.0; groups: the worst batch shard counts
    assert float(ctx.batch_imbalance(jnp.asarray(packed), 1, 1)) == 1.0
    two_rows = np.concatenate([packed, one_doc])
    assert float(ctx.batch_imbalance(two_rows, 8, 2, layout="zigzag")) == pytest.approx(imb["packed", "zigzag"])


def test_unstripe_undoes_the_striped_order():
    t, c = 24, 4
    idx = ctx.layout_index(t, c)
    x = jnp.arange(3 * t).reshape(3, t)[:, idx]  # [b, t] in the step's order
    np.testing.assert_array_equal(ctx.unstripe(x, c, 1), jnp.arange(3 * t).reshape(3, t))
    for chip in range(c):  # chip i's slots a hold row tokens a c + i
        np.testing.assert_array_equal(ctx.chip_rows(t // c, c, chip), idx[chip * t // c:(chip + 1) * t // c])


def _brute_row_mask(t_chip, c, chip, window):
    rows, keys = ctx.chip_rows(t_chip, c, chip)[:, None], np.arange(t_chip * c)[None]
    return np.asarray((rows >= keys) & ((rows - keys < window) if window else True))


@pytest.mark.parametrize("c,window", [(1, None), (1, 200), (4, None), (4, 100), (4, 700)])
def test_striped_splash_mask_blocks_hold_for_every_chip(c, window):
    """The block map splash builds from StripedSplashMask: a block is skipped only where every chip's
    mask is empty there, unmasked only where every chip's is full; the kernel's mask function on a
    chip's rows is that chip's causal (window) mask; the causal blocks above the diagonal are skipped."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    t, block = 2048, 128
    t_chip = t // c
    mask = ctx.StripedSplashMask((t_chip, t), c, window)
    chips = [_brute_row_mask(t_chip, c, i, window) for i in range(c)]
    for i in range(c):
        rows = ctx.chip_rows(t_chip, c, i)[:, None]
        np.testing.assert_array_equal(np.asarray(mask.mask_function(rows, jnp.arange(t)[None])), chips[i])
    computed = 0
    for a in range(0, t_chip, block):
        for k in range(0, t, block):
            summary = mask[a:a + block, k:k + block]
            parts = [m[a:a + block, k:k + block] for m in chips]
            assert bool(summary.any()) == any(p.any() for p in parts), (a, k)
            assert bool(summary.all()) == all(p.all() for p in parts), (a, k)
            computed += bool(summary.any())
    if c == 1:  # splash's own masks give the same block map
        own = splash.CausalMask((t, t)) if window is None else splash.LocalMask((t, t), (window - 1, 0), 0)
        assert all(bool(own[a:a + block, k:k + block].any()) == bool(mask[a:a + block, k:k + block].any())
                   for a in range(0, t, block) for k in range(0, t, block))
    if window is None:  # a chip's share of one device's causal blocks, and at most 2 more per query block
        one_device = (t // block) * (t // block + 1) // 2
        assert computed <= one_device / c + 2 * (t_chip // block)


def _splash_case(c, t, seed=0, b=2, n=4, k=2, h=128):
    """q, k, v, w (a cotangent) and the rows' segment ids and positions, in the step's striped order: row 0
    packs four documents of mixed lengths, row 1 one document then padding."""
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (b, t, n, h))
    kk, v = (jax.random.normal(x, (b, t, k, h)) for x in keys[1:3])
    seg, pos = np.zeros((b, t), np.int32), np.zeros((b, t), np.int32)
    for r, cuts in enumerate([[0, t // 7, t // 2 + 5, t - 9, t], [0, t - 3]]):
        for i in range(len(cuts) - 1):
            seg[r, cuts[i]:cuts[i + 1]], pos[r, cuts[i]:cuts[i + 1]] = i + 1, np.arange(cuts[i + 1] - cuts[i])
    idx = ctx.layout_index(t, c)
    w = jax.random.normal(keys[3], (b, t, n, h)) * (seg > 0)[:, :, None, None]  # padding's outputs unread
    return (q[:, idx], kk[:, idx], v[:, idx], w[:, idx]), jnp.asarray(seg[:, idx]), jnp.asarray(pos[:, idx])


def _loss_and_grads(fn, mesh, rules, q, k, v, w):
    def loss(q, k, v):
        with shd.activation_sharding(mesh, rules):
            q = shd.constrain(q, ("act_batch", "act_len", "act_heads", None))  # each chip its t/C queries
            return jnp.sum(fn(q, k, v) * w)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)


def _assert_same(got, want, tol):
    np.testing.assert_allclose(got[0], want[0], rtol=tol)
    for g, r, name in zip(got[1], want[1], "qkv", strict=True):
        np.testing.assert_allclose(g, r, rtol=tol, atol=tol, err_msg=f"d{name}")


@pytest.mark.slow
@pytest.mark.parametrize("sizes,t,window", [
    (dict(data=1, fsdp=2, context=2, tensor=2), 256, None),
    (dict(data=1, fsdp=2, context=4), 512, 50),     # window 50 < a chip's 128 tokens
    (dict(data=1, fsdp=2, context=4), 512, 300),    # window 300 > a chip's 128 tokens
    (dict(data=1, fsdp=1, context=2, tensor=4), 256, None),  # 2 kv heads over 4 tensor shards: repeated
], ids=["context2_tensor2", "context4_window50", "context4_window300", "context2_tensor4_kv_repeated"])
def test_splash_under_context_matches_reference(sizes, t, window):
    """Splash (Pallas interpreter) on each chip's striped queries against the gathered row: the loss
    and the gradients of q, k, v of the XLA reference (fp32), GQA, documents crossing the chips' parts."""
    m = mesh_cfg(**sizes)
    mesh, rules = shd.make_mesh(m), shd.rules_from_cfg(m)
    (q, k, v, w), seg, pos = _splash_case(sizes["context"], t)
    got = _loss_and_grads(lambda q, k, v: llama.attention_splash(q, k, v, seg, interpret=True, window=window),
                          mesh, rules, q, k, v, w)
    want = _loss_and_grads(lambda q, k, v: llama.attention_xla(q, k, v, seg, window=window, positions_bt=pos),
                           mesh, rules, q, k, v, w)
    _assert_same(got, want, 1e-5)


@pytest.mark.parametrize("sizes,window", [
    (dict(data=2, fsdp=2, context=2), None),
    (dict(data=1, fsdp=1, context=4, tensor=2), 3),     # window 3 < a chip's 8 tokens
    (dict(data=1, fsdp=1, context=8), 20),              # window 20 > a chip's 4 tokens
    (dict(data=1, fsdp=1, context=2, tensor=4), 5),     # 2 kv heads over 4 tensor chips: repeated
], ids=["context2", "context4_tensor2_window3", "context8_window20", "context2_tensor4_window5"])
def test_cudnn_context_mask_matches_reference(sizes, window):
    """model.attention=cudnn under context runs jax.nn.dot_product_attention per chip with the
    document mask as its bias (attention_dpa_context); its "xla" implementation, the same code path
    on CPU, gives the reference's loss and gradients, padding included."""
    m = mesh_cfg(**sizes)
    mesh, rules = shd.make_mesh(m), shd.rules_from_cfg(m)
    (q, k, v, w), seg, pos = _splash_case(sizes["context"], T, seed=1, b=4, h=16)
    got = _loss_and_grads(lambda q, k, v: llama.attention_dpa_context(q, k, v, seg, pos, "xla", window),
                          mesh, rules, q, k, v, w)
    want = _loss_and_grads(lambda q, k, v: llama.attention_xla(q, k, v, seg, window=window, positions_bt=pos),
                           mesh, rules, q, k, v, w)
    _assert_same(got, want, 1e-5)


@pytest.mark.parametrize("window", [None, 3, 20])
def test_reordered_row_gives_the_same_attention(window):
    """attention_xla is exact under any reordering of the row: its mask reads positions and
    segment ids, not slots (GQA: 4 query heads on 2 kv heads)."""
    batch = packed_batch()
    key = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(key[0], (8, T, 4, 16))
    k, v = (jax.random.normal(kk, (8, T, 2, 16)) for kk in key[1:])
    seg, pos = jnp.asarray(batch["segment_ids"]), jnp.asarray(batch["positions"])
    want = llama.attention_xla(q, k, v, seg, window=window, positions_bt=pos)
    idx = ctx.layout_index(T, 8)
    got = llama.attention_xla(q[:, idx], k[:, idx], v[:, idx], seg[:, idx], window=window, positions_bt=pos[:, idx])
    real = np.asarray(seg > 0)[:, idx]   # padding sees padding only, in either order
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[:, idx][real], rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------- the step


def _run(cfg, sizes=None, mesh_name="context", steps=2, microbatches=1, t=T, loss_chunk=0):
    """Metrics of each step and params after `steps` SGD steps (one device when sizes is None)."""
    if sizes is None:
        m = mesh_cfg("default", data=1, fsdp=1, context=1, tensor=1)
        mesh = shd.make_mesh(m, devices=jax.devices()[:1])
    else:
        m = mesh_cfg(mesh_name, **sizes)
        mesh = shd.make_mesh(m)
    rules = shd.rules_from_cfg(m)
    tx = optax.sgd(0.5)  # large lr: a wrong gradient shows in the params after a step
    state, shardings = step.init_train_state(cfg, tx, mesh, rules, seed=0)
    train_step = step.make_train_step(cfg, tx, mesh, rules, shardings, z_loss=1e-3, microbatches=microbatches,
                                      loss_chunk=loss_chunk)
    bsh = step.batch_sharding(mesh, rules)
    batch = {k: jax.device_put(jnp.asarray(v, jnp.int32), bsh) for k, v in packed_batch(t=t).items()}
    metrics = []
    for _ in range(steps):
        state, m_ = train_step(state, batch)
        metrics.append(m_)
    return jax.device_get(metrics), jax.device_get(state["params"])


_REFERENCE = {}


def reference(window):
    if window not in _REFERENCE:
        _REFERENCE[window] = _run(config(window))
    return _REFERENCE[window]


@pytest.mark.slow
@pytest.mark.parametrize("sizes,window", [
    (dict(data=2, fsdp=4, context=1), None),
    (dict(data=2, fsdp=2, context=2, chunk=8), None),  # the loss in chunks of 8: 4 positions a chip
    (dict(data=1, fsdp=2, context=4), 3),       # window 3 < a chip's 8 tokens
    (dict(data=1, fsdp=1, context=8), 20),      # window 20 > a chip's 4 tokens
    (dict(data=2, fsdp=1, context=2, tensor=2, mb=2), 20),  # window 20 > a chip's 16 tokens
], ids=["context1", "context2_chunk8", "context4_window3", "context8_window20",
        "context2_tensor2_window20_microbatch2"])
def test_train_step_at_every_context_size_matches_single_device(sizes, window):
    ref_metrics, ref_params = reference(window)
    sizes = dict(sizes)
    metrics, params = _run(config(window), sizes, microbatches=sizes.pop("mb", 1), loss_chunk=sizes.pop("chunk", 0))
    for m, r in zip(metrics, ref_metrics, strict=True):
        assert float(m["n_tokens"]) == float(r["n_tokens"]) == (packed_batch()["segment_ids"] > 0).sum()
        for k in ("loss", "z_loss", "grad_norm", "param_norm"):
            np.testing.assert_allclose(m[k], r[k], rtol=1e-5, err_msg=k)
        assert ("context_imbalance" in m) == (sizes["context"] > 1)
        if sizes["context"] > 1:
            assert 1.0 <= float(m["context_imbalance"]) < 1.5
    # params after 2 steps of SGD(0.5) = init - 0.5 * (g1 + g2): gradients agree elementwise
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), params, ref_params)


@pytest.mark.slow
def test_train_step_with_splash_at_context_2_matches_single_device(monkeypatch):
    """model.attention=splash (Pallas interpreter) through the whole step at context 2 beside fsdp and
    tensor, rows of 256 (a chip's part: splash's 128 block), window 20: the loss, grad norm and
    parameters after an SGD step of the XLA reference on one device."""
    import functools

    monkeypatch.setattr(llama, "attention_splash", functools.partial(llama.attention_splash, interpret=True))
    (ref,), ref_params = _run(config(20), steps=1, t=256)
    (got,), params = _run(config(20, attention="splash"), dict(data=1, fsdp=2, context=2, tensor=2), steps=1, t=256)
    for k in ("loss", "grad_norm"):
        np.testing.assert_allclose(got[k], ref[k], rtol=1e-5, err_msg=k)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), params, ref_params)


@pytest.mark.slow
def test_context_one_on_the_default_mesh_is_todays_step():
    """mesh.context=1 on configs/mesh/default.yaml ([act_len, context] in its rules): the loss and
    parameters of the mesh without the axis's rule, bit for bit."""
    cfg = config()
    today = mesh_cfg("default")
    today["rules"] = [r if r[0] != "act_len" else ["act_len", None] for r in today["rules"]]
    mesh = shd.make_mesh(today)
    out = []
    for m in (today, mesh_cfg("default")):
        rules = shd.rules_from_cfg(m)
        tx = optax.sgd(0.5)
        state, shardings = step.init_train_state(cfg, tx, mesh, rules, seed=0)
        train_step = step.make_train_step(cfg, tx, mesh, rules, shardings)
        batch = {k: jax.device_put(jnp.asarray(v, jnp.int32), step.batch_sharding(mesh, rules))
                 for k, v in packed_batch().items()}
        state, metrics = train_step(state, batch)
        out.append((jax.device_get(metrics), jax.device_get(state["params"])))
    for k in out[0][0]:
        np.testing.assert_array_equal(out[0][0][k], out[1][0][k], err_msg=k)
    jax.tree.map(np.testing.assert_array_equal, out[0][1], out[1][1])


@pytest.mark.slow
def test_changing_one_document_leaves_the_others_logits_unchanged():
    cfg = config(window=6)
    m = mesh_cfg(data=1, fsdp=2, context=4)
    mesh, rules = shd.make_mesh(m), shd.rules_from_cfg(m)
    state, _ = step.init_train_state(cfg, optax.sgd(0.1), mesh, rules, seed=0)
    graphdef, _ = step.abstract_model(cfg)
    idx = ctx.layout_index(T, 4)
    undo = np.argsort(idx)

    @jax.jit
    def logits(params, batch):
        with shd.activation_sharding(mesh, rules):
            b = ctx.reorder(batch, 4)
            out = nnx.merge(graphdef, params)(b["inputs"], b["positions"], b["segment_ids"])
        return out[:, undo]

    batch = {k: jnp.asarray(v, jnp.int32) for k, v in packed_batch().items()}
    seg = np.asarray(batch["segment_ids"])
    changed = dict(batch, inputs=jnp.where(batch["segment_ids"] == 2, (batch["inputs"] + 1) % 128, batch["inputs"]))
    before, after = np.asarray(logits(state["params"], batch)), np.asarray(logits(state["params"], changed))
    others = (seg != 2) & (seg > 0)
    np.testing.assert_array_equal(before[others], after[others])
    assert np.abs(before[seg == 2] - after[seg == 2]).max() > 1e-3


def test_refusals_name_the_keys():
    tx = optax.sgd(0.1)
    for impl in ("splash", "cudnn"):  # the kernels run under context
        step.build_program(config(attention=impl), tx, mesh_cfg(), global_batch=8, z_loss=0.0, microbatches=1,
                           seq_len=512)
    with pytest.raises(ValueError, match=r"model\.attention=splash .* data\.seq_len=384 / mesh\.context=2, .* 128"):
        step.build_program(config(attention="splash"), tx, mesh_cfg(), global_batch=8, z_loss=0.0, microbatches=1,
                           seq_len=384)
    no_rule = mesh_cfg()
    no_rule["rules"] = [r if r[0] != "act_len" else ["act_len", None] for r in no_rule["rules"]]
    with pytest.raises(ValueError, match=r"mesh\.context=2 but mesh\.rules maps act_len to \[\]"):
        step.build_program(config(), tx, no_rule, global_batch=8, z_loss=0.0, microbatches=1)
    with pytest.raises(ValueError, match=r"mesh\.data\*mesh\.fsdp\*mesh\.context\*mesh\.tensor = 6"):
        shd.make_mesh(mesh_cfg(data=1, fsdp=3, context=2))
    assert dict(shd.make_mesh(mesh_cfg()).shape) == {"data": 1, "fsdp": 4, "context": 2, "tensor": 1}


# Compiles the tiny model's train step at fsdp 2 x context 4 and at fsdp 8 (the mesh groups' own
# rules) and prints the bytes of its arguments per chip; XLA's warnings go to stderr.
STATE_PER_CHIP = """
import json, sys
import jax, jax.numpy as jnp, optax, yaml
from model import step, sharding as shd
from model.llama import LlamaConfig
cfg = LlamaConfig(vocab_size=1024, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=256, dtype="bfloat16",
                  remat="full")
out = {}
for name, sizes in (("context", dict(fsdp=2, context=4)), ("fsdp", dict(fsdp=8, context=1))):
    m = yaml.safe_load(open(f"configs/mesh/{name}.yaml"))
    m.update(data=1, tensor=1, **sizes)
    mesh, rules = shd.make_mesh(m), shd.rules_from_cfg(m)
    tx = optax.adamw(1e-3)
    state, shardings = step.init_train_state(cfg, tx, mesh, rules, seed=0)
    bsh = step.batch_sharding(mesh, rules)
    batch = {k: jax.device_put(jnp.zeros((8, 256), jnp.int32), bsh) for k in step.BATCH_KEYS}
    compiled = step.make_train_step(cfg, tx, mesh, rules, shardings).lower(state, batch).compile()
    out[name] = compiled.memory_analysis().argument_size_in_bytes
print(json.dumps(out))
"""


@pytest.mark.slow
def test_state_shards_over_fsdp_and_context_and_nothing_is_replicated_whole(tmp_path):
    """Parameters, gradients and Adam's moments split over fsdp x context (the `embed` rule), so context
    takes no FSDP ways: the state per chip at fsdp 2 x context 4 is fsdp 8's, not fsdp 2's (4x). And
    the compiled step copies no array whole to every chip: XLA's "Involuntary full rematerialization",
    which the embedding lookup caused before the table was gathered for it (sharding.table_for_lookup)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}  # warnings on a miss only
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", STATE_PER_CHIP], capture_output=True, text=True, timeout=600,
                       cwd=root, env={**env, "PYTHONPATH": root})
    assert r.returncode == 0, r.stderr[-3000:]
    per_chip = json.loads(r.stdout.strip().splitlines()[-1])
    assert per_chip["context"] <= 1.05 * per_chip["fsdp"], per_chip
    assert "Involuntary full rematerialization" not in r.stderr, r.stderr[-3000:]


@pytest.mark.parametrize("overrides,needle", [
    (["mesh=context", "data.seq_len=63"], "data.seq_len=63 does not split into the 2 parts mesh.context=2 needs"),
    (["mesh=context", "model.attention=splash", "data.seq_len=192"],
     "model.attention=splash needs each chip's part of a row, data.seq_len=192 / mesh.context=2, to be a multiple"),
], ids=["seq_len", "splash"])
def test_train_py_refuses_in_one_line(tmp_path, capsys, overrides, needle):
    from tests.run_helpers import main_in_process

    code, lines = main_in_process(capsys, tmp_path / "run", *overrides)
    assert code == 2 and len(lines) == 1 and lines[0].startswith("config error:") and needle in lines[0], lines


# ----------------------------------------------------------------------------- whole runs

RUN = [*MICRO, "model.dtype=float32", "data.seq_len=64",
       "data.global_batch_size=8", "data.num_workers=0", "train.log_every=1", "train.eval_every=0",
       "checkpoint.every=3", "optimizer.warmup_steps=1", "logger.wandb.mode=disabled", "mesh=context"]


def _train(run_dir, *overrides):
    import train as train_mod
    from tests.run_helpers import make_cfg

    train_mod.train(make_cfg(run_dir, *RUN, *overrides))
    with open(run_dir / "metrics.jsonl") as f:
        return {r["step"]: r for r in map(json.loads, f)}


@pytest.fixture(scope="module")
def context2_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("context2")
    return run_dir, _train(run_dir, "train.steps=6", "mesh.context=2")


@pytest.mark.slow
@pytest.mark.parametrize("context", [1, 4])
def test_checkpoint_at_context_2_resumes_at_context_1_and_4(context2_run, context, tmp_path):
    run_dir, straight = context2_run
    assert all(1.0 <= straight[s]["context_imbalance"] < 1.5 for s in straight)
    resumed = _train(tmp_path, "train.steps=6", f"mesh.context={context}",
                     f"checkpoint.resume_from={run_dir / 'checkpoints' / '3'}")
    assert sorted(resumed) == [4, 5, 6]
    for s in resumed:
        assert resumed[s]["tokens_seen"] == straight[s]["tokens_seen"]
        np.testing.assert_allclose(resumed[s]["loss"], straight[s]["loss"], rtol=1e-5)
        np.testing.assert_allclose(resumed[s]["grad_norm"], straight[s]["grad_norm"], rtol=1e-5)


@pytest.mark.slow
def test_generate_decodes_a_long_prompt_from_a_context_2_checkpoint(context2_run, capsys):
    from scripts import generate

    run_dir, _ = context2_run
    prompt = " ".join(["The river was wide and the boats were slow"] * 6)  # longer than a chip's part
    generate.main(["--checkpoint", str(run_dir), "--prompt", prompt, "--max-new-tokens", "8", "--temperature", "0"])
    captured = capsys.readouterr()
    assert captured.out.startswith(prompt)
    n_prompt, n_new = map(int, re.search(r"(\d+) prompt \+ (\d+) new tokens", captured.err).groups())
    assert n_prompt > 64 // 2 and n_new >= 1   # longer than a context-2 chip's part of a training row


def test_cpu_runs_start_their_collectives_in_one_order(monkeypatch):
    """On CPU, XLA_FLAGS gets the scheduler flag that keeps one process's devices entering their
    collectives in one order (docs/long-context.md's demo deadlocked without it), once; an
    accelerator run's flags are left alone. The demo itself runs in tests/test_docs.py."""
    from model.runtime import distributed

    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    distributed.cpu_collectives_in_order()
    distributed.cpu_collectives_in_order()
    assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=8 " + distributed.CPU_COLLECTIVES_FLAG
    monkeypatch.setenv("JAX_PLATFORMS", "tpu")
    monkeypatch.setenv("XLA_FLAGS", "")
    distributed.cpu_collectives_in_order()
    assert os.environ["XLA_FLAGS"] == ""

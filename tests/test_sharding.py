"""Sharding on 8 fake CPU devices (tests/conftest.py): mesh from config, rules, sharded init,
and the train step giving the same loss and gradients on 1 device and on 8 under
data / fsdp / fsdp+tensor meshes (fp32 compute, 1e-5 relative).

Run: pytest tests/test_sharding.py -q
"""
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import yaml

from model import sharding as shd
from model import step
from model.llama import LlamaConfig

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
CFG = LlamaConfig(vocab_size=128, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96,
                  dtype="float32", remat="full")


def mesh_cfg(name="default", **sizes):
    with open(os.path.join(CONFIGS, "mesh", f"{name}.yaml")) as f:
        m = yaml.safe_load(f)
    m.update(sizes)
    return m


def test_mesh_fill_and_errors():
    assert jax.device_count() == 8
    assert dict(shd.make_mesh(mesh_cfg("default")).shape) == {"data": 8, "fsdp": 1, "context": 1, "tensor": 1}
    assert dict(shd.make_mesh(mesh_cfg("fsdp")).shape) == {"data": 1, "fsdp": 8, "context": 1, "tensor": 1}
    assert dict(shd.make_mesh(mesh_cfg("fsdp_tp")).shape) == {"data": 1, "fsdp": 4, "context": 1, "tensor": 2}
    with pytest.raises(ValueError, match=r"mesh\.data\*mesh\.fsdp\*mesh\.context\*mesh\.tensor = 6"):
        shd.make_mesh(mesh_cfg(data=3, fsdp=2, tensor=1))
    with pytest.raises(ValueError, match=r"mesh\.fsdp=-1"):
        shd.make_mesh(mesh_cfg(data=1, fsdp=-1, tensor=3))
    with pytest.raises(ValueError, match="only one"):
        shd.make_mesh(mesh_cfg(data=-1, fsdp=-1))


class _Chip:
    """A TPU device as make_mesh's block layout reads it: an id, torus coordinates, a core."""

    def __init__(self, i: int, coords: tuple[int, ...], core: int = 0):
        self.id, self.coords, self.core_on_chip = i, coords, core

    def __repr__(self):
        return f"chip{self.coords}"


def test_block_layout_makes_each_axis_a_compact_block_of_the_torus():
    from model.predict import links_by_axes

    chips = [_Chip(i, (x, y, 0)) for i, (y, x) in enumerate(np.ndindex(4, 4))]    # a 4x4 slice, as libtpu orders it
    grid = shd.block_grid((4, 4, 1, 1), chips)
    assert sorted(d.id for d in grid.flat) == list(range(16))
    coords = np.array([d.coords for d in grid.flat]).reshape(4, 4, 1, 1, 3)
    for i in range(4):      # every fsdp group a 2x2 square, every data group one chip of each square
        fsdp = {tuple(c[:2]) for c in coords[i, :, 0, 0]}
        x0, y0 = min(fsdp)
        assert fsdp == {(x0, y0), (x0 + 1, y0), (x0, y0 + 1), (x0 + 1, y0 + 1)}, fsdp
        assert sorted({(x // 2, y // 2) for x, y, _ in coords[:, i, 0, 0]}) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    links = links_by_axes(shd.MESH_AXES, coords, (4, 4, 1), (False, False, False))
    assert links["fsdp"] == links["data"] == 2          # the torus order's line of 4: 1 link (test_predict.py)
    line = np.array([c.coords for c in chips]).reshape(4, 4, 1, 1, 3)    # data along y, fsdp along x
    assert links_by_axes(shd.MESH_AXES, line, (4, 4, 1), (False, False, False))["fsdp"] == 1
    # fsdp 8 on the 4x4: a 2x4 block, data 2 its two halves
    fsdp8 = np.array([d.coords for d in shd.block_grid((2, 8, 1, 1), chips).flat]).reshape(2, 8, 3)
    assert all(len({c[0] for c in g}) * len({c[1] for c in g}) == 8 for g in fsdp8)
    # what cannot tile: a 3-way axis; devices without torus coordinates (CPU) keep the torus order
    with pytest.raises(ValueError, match="mesh.layout=blocks: mesh.data=3"):
        shd.block_grid((3, 1, 1, 1), [_Chip(i, (i, 0, 0)) for i in range(3)])
    assert shd.block_grid((8, 1, 1, 1), jax.devices()) is None
    two_by_four = {"data": 2, "fsdp": 4, "context": 1, "tensor": 1}
    mesh = shd.make_mesh({**two_by_four, "layout": "blocks"})
    assert list(mesh.devices.flat) == list(shd.make_mesh(two_by_four).devices.flat)
    with pytest.raises(ValueError, match="mesh.layout='rows'"):
        shd.make_mesh({"data": -1, "fsdp": 1, "context": 1, "tensor": 1, "layout": "rows"})


def test_rules_parse_and_map():
    rules = shd.rules_from_cfg(mesh_cfg("fsdp_tp"))
    assert shd.mesh_axes_for("act_batch", rules) == ("data", "fsdp")
    assert shd.mesh_axes_for("head_dim", rules) == ()
    mesh = shd.make_mesh(mesh_cfg("fsdp_tp"))
    P = jax.sharding.PartitionSpec
    assert shd.logical_to_spec(("embed", "mlp"), rules, (64, 96), mesh) == P("fsdp", "tensor")
    # a mesh axis that does not divide the dim is dropped, not a compile error
    assert shd.logical_to_spec(("embed", "kv_heads"), rules, (64, 3), mesh) == P("fsdp")
    # each mesh axis used once per array
    assert shd.logical_to_spec(("mlp", "heads"), rules) == P("tensor")
    with pytest.raises(ValueError, match="unknown mesh axes"):
        shd.rules_from_cfg({"rules": [["embed", "model"]]})
    with pytest.raises(KeyError, match="no entry"):
        shd.mesh_axes_for("nope", rules)


@pytest.mark.slow
def test_init_is_sharded_and_abstract_state_matches():
    mesh, rules = shd.make_mesh(mesh_cfg("fsdp_tp")), shd.rules_from_cfg(mesh_cfg("fsdp_tp"))
    tx = optax.adamw(1e-3)
    state, shardings = step.init_train_state(CFG, tx, mesh, rules, seed=0)
    wq = state["params"]["layers"]["wq_dnh"]  # [layers, d, n, h]: d over fsdp, n over tensor
    assert wq.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor")
    assert wq.addressable_shards[0].data.shape == (2, 16, 2, 16)
    mu = state["opt_state"][0].mu["layers"]["wq_dnh"]
    assert mu.sharding == wq.sharding  # Adam moments sharded like their parameter
    abstract, shardings2 = step.abstract_train_state(CFG, tx, mesh, rules)
    assert jax.tree.structure(abstract) == jax.tree.structure(state)
    for a, s in zip(jax.tree.leaves(abstract), jax.tree.leaves(state), strict=False):
        assert a.shape == s.shape and a.dtype == s.dtype and a.sharding == s.sharding


def _batch(b=8, t=32):
    rng = np.random.default_rng(0)
    seg = np.repeat(np.r_[[1] * 12, [2] * 14, [0] * 6][None], b, axis=0)  # 2 docs + padding
    pos = np.repeat(np.r_[np.arange(12), np.arange(14), np.zeros(6)][None], b, axis=0)
    return {"inputs": rng.integers(0, CFG.vocab_size, (b, t)), "targets": rng.integers(0, CFG.vocab_size, (b, t)),
            "segment_ids": seg, "positions": pos, "loss_mask": (seg > 0)}


def _run(mesh_sizes, steps=2, microbatches=1, slices=1, loss_chunk=0):
    """Loss, grad norm and params after `steps` SGD steps on a mesh (1 device when sizes is None);
    slices > 1: the 8 devices split into that many slices of consecutive ids."""
    if mesh_sizes is None:
        mesh = shd.make_mesh(mesh_cfg(data=1, fsdp=1, tensor=1), devices=jax.devices()[:1])
    else:
        mesh = shd.make_mesh(mesh_cfg(**mesh_sizes), device_slice=lambda d: d.id * slices // 8)
    rules = shd.rules_from_cfg(mesh_cfg())
    tx = optax.sgd(0.5)  # large lr: a wrong gradient shows in the params after a step
    state, shardings = step.init_train_state(CFG, tx, mesh, rules, seed=0)
    train_step = step.make_train_step(CFG, tx, mesh, rules, shardings, z_loss=1e-3,
                                      microbatches=microbatches, loss_chunk=loss_chunk)
    bsh = step.batch_sharding(mesh, rules)
    batch = {k: jax.device_put(jnp.asarray(v, jnp.int32), bsh) for k, v in _batch().items()}
    losses = []
    for _ in range(steps):
        state, metrics = train_step(state, batch)
        losses.append(metrics)
    return jax.device_get(losses), jax.device_get(state["params"])


@pytest.fixture(scope="module")
def single_device():
    return _run(None)


@pytest.mark.slow
# chunk: train.loss_chunk against the single device's whole loss. Over data 2 x fsdp 4 each chip
# gathers the head once and reduce-scatters its gradient (model/loss.py); with a tensor axis the
# vocab is split and the partitioner's way runs.
@pytest.mark.parametrize("sizes", [dict(data=8, fsdp=1, tensor=1), dict(data=2, fsdp=4, tensor=1, chunk=8),
                                   dict(data=1, fsdp=4, tensor=2), dict(data=2, fsdp=2, tensor=2, mb=2, chunk=16)],
                         ids=["data8", "data2_fsdp4_chunk8", "fsdp4_tp2", "data2_fsdp2_tp2_microbatch2_chunk16"])
def test_train_step_matches_single_device(single_device, sizes):
    ref_metrics, ref_params = single_device
    sizes = dict(sizes)
    metrics, params = _run(sizes, microbatches=sizes.pop("mb", 1), loss_chunk=sizes.pop("chunk", 0))
    for m, r in zip(metrics, ref_metrics, strict=False):
        assert float(r["n_tokens"]) == 8 * 26
        for k in ("loss", "z_loss", "grad_norm", "param_norm"):
            np.testing.assert_allclose(m[k], r[k], rtol=1e-5, err_msg=k)
    # params after 2 steps of SGD(0.5) = init - 0.5 * (g1 + g2): gradients agree elementwise
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), params, ref_params)


def test_hybrid_mesh_over_told_slices():
    by_id = lambda d: d.id // 4   # noqa: E731  (two slices of 4 devices)
    mesh = shd.make_mesh(mesh_cfg("default"), device_slice=by_id)
    # data = 4 in each slice x 2 slices; the slices are blocks along data, so only `data` spans them
    assert dict(mesh.shape) == {"data": 8, "fsdp": 1, "context": 1, "tensor": 1}
    assert [by_id(d) for d in mesh.devices[:, 0, 0, 0]] == [0, 0, 0, 0, 1, 1, 1, 1]
    mesh = shd.make_mesh(mesh_cfg("fsdp_tp", dcn_data=1, dcn_fsdp=-1), device_slice=by_id)
    assert dict(mesh.shape) == {"data": 1, "fsdp": 4, "context": 1, "tensor": 2}
    assert {by_id(d) for d in mesh.devices[0, :2].flat} == {0} and {by_id(d) for d in mesh.devices[0, 2:].flat} == {1}
    # tensor pairs never span slices
    assert all(by_id(a) == by_id(b) for a, b in mesh.devices[0, :, 0])
    # wrong products fail in one line naming the keys, before anything compiles
    with pytest.raises(ValueError, match=r"mesh\.dcn_data\*mesh\.dcn_fsdp = 4 .* but there are 2 slices"):
        shd.make_mesh(mesh_cfg("default", dcn_data=2, dcn_fsdp=2), device_slice=by_id)
    with pytest.raises(ValueError, match=r"mesh\.data\*mesh\.fsdp\*mesh\.context\*mesh\.tensor = 8 .* 4 devices per "):
        shd.make_mesh(mesh_cfg(data=8), device_slice=by_id)
    with pytest.raises(ValueError, match="different device counts"):
        shd.make_mesh(mesh_cfg("default", dcn_data=-1), devices=jax.devices()[:6], device_slice=by_id)
    # one slice: exactly today's mesh, whatever the DCN keys say when they fill 1
    assert (shd.make_mesh(mesh_cfg("fsdp")).devices == jax.make_mesh((1, 8, 1, 1), shd.MESH_AXES).devices).all()


@pytest.mark.slow
@pytest.mark.parametrize("sizes", [dict(data=4, fsdp=1, tensor=1), dict(data=1, fsdp=2, tensor=2, dcn_data=1,
                                                                        dcn_fsdp=2)],
                         ids=["dcn_data2", "dcn_fsdp2_tp2"])
def test_train_step_over_two_slices_matches_single_device(single_device, sizes):
    ref_metrics, ref_params = single_device
    metrics, params = _run(dict(sizes), slices=2)
    for m, r in zip(metrics, ref_metrics, strict=True):
        for k in ("loss", "grad_norm", "param_norm"):
            np.testing.assert_allclose(m[k], r[k], rtol=1e-5, err_msg=k)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), params, ref_params)


@pytest.mark.slow
def test_eval_step_agrees_with_train_loss():
    mesh, rules = shd.make_mesh(mesh_cfg("fsdp")), shd.rules_from_cfg(mesh_cfg("fsdp"))
    tx = optax.sgd(0.0)
    state, shardings = step.init_train_state(CFG, tx, mesh, rules, seed=0)
    bsh = step.batch_sharding(mesh, rules)
    batch = {k: jax.device_put(jnp.asarray(v, jnp.int32), bsh) for k, v in _batch().items()}
    ev = step.make_eval_step(CFG, mesh, rules, shardings)(state["params"], batch)
    _, metrics = step.make_train_step(CFG, tx, mesh, rules, shardings)(state, batch)
    np.testing.assert_allclose(ev["loss_sum"] / ev["n_tokens"], metrics["loss"], rtol=1e-6)

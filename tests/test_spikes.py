"""Loss spikes (train.spikes): the update of a step whose loss leaves the trailing window's band
is skipped on the device, the window is checkpointed, and a run without it is unchanged.

    pytest tests/test_spikes.py -q      (~3 min on 2 loaded cores; 8 fake CPU devices; two slow tests)
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from omegaconf import OmegaConf
from run_helpers import CONFIGS

from model import step as step_lib
from model.llama import LlamaConfig
from model.optimizer import make_optimizer
from model.runtime.checkpoint import Checkpointer

MODEL = LlamaConfig.from_mapping(OmegaConf.load(CONFIGS / "model/tiny.yaml"))
OPT = OmegaConf.load(CONFIGS / "optimizer/adamw.yaml")
SPIKES = step_lib.SpikeConfig(window=4, k=2.0, min_steps=3)


def window_after(losses, spikes=SPIKES):
    w = step_lib.spike_window_init(spikes.window)
    skips = []
    for x in losses:
        skip, w = step_lib.spike_decision(w, jnp.float32(x), spikes)
        skips.append(bool(skip))
    return skips, jax.device_get(w)


def test_the_rule_skips_what_leaves_the_band_and_nothing_before_min_steps():
    # A huge first loss is not a spike: the window holds fewer than min_steps losses.
    skips, w = window_after([50.0, 5.0, 5.1, 4.9, 5.0, 9.0, 5.05, float("nan"), float("inf"), 4.95])
    assert skips == [False, False, False, False, False, True, False, True, True, False]
    assert int(w["skipped"]) == 3 and int(w["run"]) == 0 and int(w["seen"]) == 7
    # The skipped losses never entered the ring buffer (the last 4 updated steps' losses).
    assert sorted(np.asarray(w["losses"]).tolist()) == pytest.approx(sorted([4.9, 5.0, 5.05, 4.95]))
    _, w = window_after([5.0, 5.1, 4.9, float("nan"), float("nan")])
    assert int(w["run"]) == 2
    # The band follows mean + k * std of the window: 5 +- 0.1 with k=2 lets 5.15 through, not 5.25.
    assert window_after([4.9, 5.1, 4.9, 5.1, 5.15])[0][-1] is False
    assert window_after([4.9, 5.1, 4.9, 5.1, 5.25])[0][-1] is True


def test_config_is_checked_in_one_line():
    assert step_lib.SpikeConfig.from_mapping({"enabled": False, "window": 1}) is None
    assert step_lib.SpikeConfig.from_mapping(None) is None
    with pytest.raises(ValueError, match="min_steps <= window"):
        step_lib.SpikeConfig.from_mapping({"enabled": True, "window": 8, "min_steps": 9})
    with pytest.raises(ValueError, match=r"unknown keys \['sigma'\]"):
        step_lib.SpikeConfig.from_mapping({"enabled": True, "sigma": 3})


@pytest.fixture(scope="module")
def program():
    tx, _ = make_optimizer(OPT, 100)
    mcfg = OmegaConf.load(CONFIGS / "mesh/default.yaml")
    with_spikes = step_lib.build_program(MODEL, tx, mcfg, global_batch=8, z_loss=0.0, microbatches=1,
                                         spikes=SPIKES)
    without = step_lib.build_program(MODEL, tx, mcfg, global_batch=8, z_loss=0.0, microbatches=1)
    return with_spikes, without


def batch(program, tokens):
    """[8, 33] tokens -> the step's batch (inputs/targets shifted, one document per row)."""
    tokens = np.asarray(tokens, np.int32)
    b, t = tokens.shape[0], tokens.shape[1] - 1
    host = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": np.ones((b, t), np.int32),
            "positions": np.tile(np.arange(t, dtype=np.int32), (b, 1)), "loss_mask": np.ones((b, t), np.int32)}
    return {k: jax.device_put(v, program.batch_sharding) for k, v in host.items()}


def host(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


@pytest.mark.slow
def test_a_planted_spike_is_skipped_on_the_device(program):
    with_spikes, without = program
    pattern = batch(with_spikes, np.tile(np.arange(33) % 11 + 5, (8, 1)))
    # The spike: random tokens after the model has learnt the pattern (its loss jumps far up).
    noise = batch(with_spikes, np.random.default_rng(0).integers(5, 4096, (8, 33)))
    state = with_spikes.init_state(0)
    losses = []
    for _ in range(6):
        state, m = with_spikes.train_step(state, pattern)
        losses.append(float(m["loss"]))
        assert float(m["skipped"]) == 0.0
    before = host({k: state[k] for k in ("params", "opt_state")})
    state, m = with_spikes.train_step(state, noise)
    band = np.mean(losses[-4:]) + SPIKES.k * np.std(losses[-4:])
    assert float(m["loss"]) > band, (losses, float(m["loss"]))
    assert (float(m["skipped"]), int(m["skipped_total"]), int(m["skipped_in_a_row"])) == (1.0, 1, 1)
    after = host({k: state[k] for k in ("params", "opt_state")})
    jax.tree.map(np.testing.assert_array_equal, before, after)      # nothing moved
    assert int(state["step"]) == 7                                  # the batch is consumed
    state, m = with_spikes.train_step(state, pattern)
    assert float(m["skipped"]) == 0.0 and int(m["skipped_in_a_row"]) == 0
    moved = host(state["params"])
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(moved), jax.tree.leaves(after["params"]),
                                                       strict=True))

    # Without train.spikes the same steps update on the spike: the same losses (to float32's last
    # digits: the two programs fuse differently, and the tests' CPU emitters round them apart by
    # ~2e-7; a skipped or altered update moves the loss by orders more), no extra metric.
    state = without.init_state(0)
    for i in range(6):
        state, m = without.train_step(state, pattern)
        np.testing.assert_allclose(float(m["loss"]), losses[i], rtol=1e-5)
    assert "skipped" not in m and "spikes" not in state
    before = host(state["params"])
    state, _ = without.train_step(state, noise)
    assert not np.array_equal(jax.tree.leaves(host(state["params"]))[0], jax.tree.leaves(before)[0])


@pytest.mark.slow
def test_the_window_is_checkpointed_beside_the_arrays(program, tmp_path):
    with_spikes, without = program
    state = with_spikes.init_state(0)
    pattern = batch(with_spikes, np.tile(np.arange(33) % 11 + 5, (8, 1)))
    for _ in range(3):
        state, _ = with_spikes.train_step(state, pattern)
    window = host(state["spikes"])
    cfg = {"dir": str(tmp_path / "ckpt"), "every": 1, "keep": 0, "async": False, "resume_from": None,
           "init_from": None, "allow_data_change": False}
    ckpt = Checkpointer(cfg)
    ckpt.save(3, state, {"s": 3}, {"x": 1})
    ckpt.close()
    ckpt = Checkpointer(cfg)
    resume = ckpt.find_resume()
    meta, _ = ckpt.restore_meta_and_data(resume)
    assert meta["x"] == 1 and len(meta["spikes"]["losses"]) == SPIKES.window
    restored = ckpt.restore_state(resume, with_spikes.abstract_state)
    jax.tree.map(np.testing.assert_array_equal, host(restored["spikes"]), window)
    assert restored["spikes"]["losses"].sharding == with_spikes.state_shardings["spikes"]["losses"]
    # The arrays are the same with spike skipping off: such a run restores the same step.
    plain = ckpt.restore_state(resume, without.abstract_state)
    assert "spikes" not in plain
    jax.tree.map(np.testing.assert_array_equal, host(plain["params"]), host(restored["params"]))
    ckpt.close()

    # A step saved without spike skipping gives a run that turns it on an empty window.
    cfg2 = {**cfg, "dir": str(tmp_path / "plain")}
    ckpt = Checkpointer(cfg2)
    ckpt.save(3, plain, {"s": 3}, {"x": 1})
    ckpt.close()
    ckpt = Checkpointer(cfg2)
    fresh = ckpt.restore_state(ckpt.find_resume(), with_spikes.abstract_state)
    ckpt.close()
    assert int(fresh["spikes"]["seen"]) == 0 and not np.asarray(fresh["spikes"]["losses"]).any()

"""The learning-rate schedule (model/optimizer.py, configs/optimizer/adamw.yaml): linear warmup from 0
to optimizer.lr over warmup_steps, cosine decay to lr * min_lr_ratio at decay_steps (default: the
run's last step), held there after; the values the experiments' plans print.

    pytest -n0 tests/test_optimizer.py -q
"""
import math

import pytest

from model.optimizer import make_schedule, resolve_warmup

OPT = {"lr": 3e-4, "min_lr_ratio": 0.1, "warmup_steps": 2000, "decay_steps": None, "b1": 0.9, "b2": 0.95,
       "eps": 1e-8, "weight_decay": 0.1, "clip_norm": 1.0}


def test_warmup_then_cosine_to_the_floor_at_the_last_step():
    steps = 42_000
    lr = make_schedule(OPT, steps)
    assert float(lr(0)) == 0.0
    assert float(lr(1000)) == pytest.approx(1.5e-4)                 # linear: half way up
    assert float(lr(2000)) == pytest.approx(3e-4)                   # the peak at the end of warmup
    mid = 2000 + (steps - 2000) // 2                                 # cosine: half way down at the middle
    assert float(lr(mid)) == pytest.approx(3e-5 + (3e-4 - 3e-5) * 0.5 * (1 + math.cos(math.pi / 2)), rel=1e-5)
    assert float(lr(steps)) == pytest.approx(3e-5)                  # min_lr_ratio * lr at the last step
    values = [float(lr(s)) for s in range(2000, steps + 1, 1000)]
    assert all(a >= b for a, b in zip(values, values[1:], strict=False))   # never rises after the peak


def test_an_explicit_decay_ends_earlier_and_holds_the_floor():
    lr = make_schedule({**OPT, "decay_steps": 10_000}, 42_000)
    assert float(lr(10_000)) == pytest.approx(3e-5)
    assert float(lr(30_000)) == pytest.approx(3e-5)                 # held after decay_steps
    assert resolve_warmup({**OPT, "decay_steps": 10_000}, 42_000) == (2000, 10_000, None)


def test_a_run_not_longer_than_its_warmup_warms_up_over_half_of_it():
    warmup, decay, notice = resolve_warmup(OPT, 20)
    assert (warmup, decay) == (10, 20) and "optimizer.warmup_steps=2000" in notice
    with pytest.raises(ValueError, match="optimizer.warmup_steps=2000 must be below optimizer.decay_steps=1000"):
        resolve_warmup({**OPT, "decay_steps": 1000}, 42_000)


@pytest.mark.slow
def test_fresh_opt_state_keeps_the_schedule_count():
    """checkpoint.reset_optimizer (model/step.py fresh_opt_state): Adam's moments and count start
    again, the learning-rate schedule's count goes on where the run is."""
    import jax
    import jax.numpy as jnp
    import optax

    from model.step import fresh_opt_state

    tx = optax.adamw(optax.linear_schedule(0.0, 1e-3, 10))
    params = {"w": jnp.ones((3,))}
    state = tx.init(params)
    for _ in range(4):
        _, state = tx.update({"w": jnp.full((3,), 0.5)}, state, params)
    fresh = fresh_opt_state(tx, params, state)
    leaves = jax.tree.leaves(fresh, is_leaf=lambda x: isinstance(x, optax.ScaleByScheduleState))
    sched = [x for x in leaves if isinstance(x, optax.ScaleByScheduleState)]
    adam = [x for x in jax.tree.leaves(fresh, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
            if isinstance(x, optax.ScaleByAdamState)]
    assert len(sched) == 1 and int(sched[0].count) == 4
    assert len(adam) == 1 and int(adam[0].count) == 0 and float(jnp.abs(adam[0].mu["w"]).sum()) == 0.0

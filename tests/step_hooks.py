"""What tests plant around a run's train step, reached through model/runtime/seam.py (one seam:
JAXPT_TEST_HOOKS=1). `planted(...)` gives the environment a test sets for a `python train.py`
subprocess or an in-process run:

- diverge_at="3,7": after the step that draws the 3rd (7th) batch of this start, the parameters
  become NaN, as a NaN gradient leaves them (tests/test_rollback.py);
- late_first_step="40@1": process 1 starts its first step 40 s after the others, as a host that
  compiles slowly (tests/test_multihost.py; model/runtime/distributed.py compiled_together);
- pace="0.2": each step starts 0.2 s after the previous one returned, as a slower chip would: a run
  that trains until the test stops it (the simulated pod's) idles between steps instead of taking
  the machine's cores from the other tests (tests/pod_sim.py).
"""
from __future__ import annotations

import os
import time

from model.runtime.seam import TEST_HOOKS_ENV

DIVERGE_ENV = "JAXPT_TEST_DIVERGE_AT"
LATE_FIRST_STEP_ENV = "JAXPT_TEST_LATE_FIRST_STEP"
PACE_ENV = "JAXPT_TEST_STEP_PACE"


def planted(*, diverge_at: str | None = None, late_first_step: str | None = None, pace: str | None = None) -> dict:
    env = {TEST_HOOKS_ENV: "1"}
    if pace is not None:
        env[PACE_ENV] = pace
    if diverge_at is not None:
        env[DIVERGE_ENV] = diverge_at
    if late_first_step is not None:
        env[LATE_FIRST_STEP_ENV] = late_first_step
    return env


def diverge_at() -> set[int]:
    return {int(x) for x in os.environ.get(DIVERGE_ENV, "").split(",") if x.strip()}


def late_first_step_s(process_index: int) -> float:
    seconds, _, process = os.environ.get(LATE_FIRST_STEP_ENV, "").partition("@")
    return float(seconds) if seconds and (not process or int(process) == process_index) else 0.0


def nan_params(state: dict, metrics: dict) -> tuple[dict, dict]:
    import jax
    import jax.numpy as jnp

    state = dict(state, params=jax.tree.map(lambda x: x * jnp.nan, state["params"]))
    return state, dict(metrics, param_norm=jnp.float32(jnp.nan))


def wrap(train_step, process_index: int):
    plant, late_s = diverge_at(), late_first_step_s(process_index)
    pace_s = float(os.environ.get(PACE_ENV) or 0)
    if not plant and not late_s and not pace_s:
        return train_step
    drawn = 0       # batches drawn in this start, rolled-back ones included

    def hooked(state, batch):
        nonlocal drawn
        drawn += 1
        if drawn == 1 and late_s:
            time.sleep(late_s)      # this host reaches its first step (and compiles it) late
        elif drawn > 1 and pace_s:
            time.sleep(pace_s)
        state, metrics = train_step(state, batch)
        return nan_params(state, metrics) if drawn in plant else (state, metrics)

    return hooked

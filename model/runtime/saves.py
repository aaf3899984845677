"""When the loop saves a step, and where: one path for both tiers, timed and recorded once.

The durable tier (checkpoint.dir, model/runtime/checkpoint.py) saves every checkpoint.every
steps, at the last step and on a preemption; the local tier (model/runtime/local_tier.py) every
checkpoint.local_every steps that the durable one does not save. The time the loop is blocked
counts as paused ("save") in the meter and is one "save" event in the goodput log.
"""
from __future__ import annotations

import contextlib
import time

DURABLE, LOCAL = "durable", "local"


class Saves:
    def __init__(self, ckpt, local_tier, *, last_step: int, meter, events, watchdog):
        self.ckpt, self.local_tier = ckpt, local_tier
        self._last_step = last_step
        self._meter, self._events = meter, events
        # An async save blocks the loop briefly, in Orbax's barriers with the other hosts: a peer
        # frozen there is a hang like one in a step, so the watchdog stays armed. A synchronous
        # save writes the whole state in the loop and is paused like an evaluation.
        self._durable_guard = contextlib.nullcontext if ckpt.cfg["async"] else watchdog.paused

    def due(self, step: int, *, preempted: bool = False) -> tuple[str, ...]:
        """The tiers `step` is saved to, in order: the local tier at its steps that the durable
        schedule does not take, then the durable tier by its schedule or on a preemption."""
        durable = self.ckpt.should_save(step, self._last_step)
        local = self.local_tier is not None and self.local_tier.should_save(step) and not durable
        return (LOCAL,) * local + (DURABLE,) * (durable or preempted)

    def save(self, tier: str, step: int, state, data_state: dict, meta: dict) -> None:
        """Saves to `tier`; the local tier is not collective, and the loop waits only for the
        shards' hand-over to its writer thread."""
        t0 = time.perf_counter()
        if tier == LOCAL:
            self.local_tier.save(step, state, data_state, meta)
        else:
            with self._durable_guard():
                self.ckpt.save(step, state, data_state, meta)
        blocked = time.perf_counter() - t0
        self._meter.paused(blocked, kind="save")
        self._events.add("save", step=step, **({"tier": LOCAL} if tier == LOCAL else {}), blocked_s=blocked)

    def wait(self) -> None:
        """Every started save complete (the last one's wait is not a step)."""
        self.ckpt.wait()

"""Resuming on changed data: what a resumed run keeps of its saved data position.

The checkpoint's data fingerprint (data/state.py fingerprint) says what the saved positions
refer to. On resume the current fingerprint is compared with it (model/runtime/checkpoint.py
check_fingerprint names every differing key); this module decides beforehand which
differences a run may accept and how:
  - checkpoint.allow_data_change=true: any data change; the pipeline starts afresh on the new
    data (the saved positions describe another data set);
  - data.mixture_change=continue: a re-weighted mixture, sources added or dropped; every kept
    source continues from its saved position, dropped ones stay parked in the state;
  - otherwise no change at all, with a hint when `continue` would have accepted it.
"""
from __future__ import annotations

import dataclasses

from data.state import carry_parked_sources, mixture_changes

ALLOW_HINT = ("set data.mixture_change=continue to continue every source from its saved position, "
              "or checkpoint.allow_data_change=true to read the data afresh")


@dataclasses.dataclass
class ResumePlan:
    fingerprint: dict               # the data fingerprint to compare and save (parked sources carried)
    accepted: set[str]              # fingerprint keys ("data.<key>") the change may differ in
    hint: str | None = None         # what to say when a refused change could be accepted
    notes: list[str] = dataclasses.field(default_factory=list)   # the accepted mixture changes


def plan_resume(saved: dict, current: dict, *, mixture_change: str, allow_data_change: bool) -> ResumePlan:
    """The plan for resuming with data fingerprint `current` from a checkpoint saved with
    `saved` (both data fingerprints). Raises ValueError (one line) for a mixture change that
    cannot continue exactly."""
    if allow_data_change:
        return ResumePlan(current, set())
    # The positions of parked sources travel on in the data state: so does what they were read
    # from (data/state.py carry_parked_sources).
    current = carry_parked_sources(saved, current)
    if mixture_change == "continue":
        keys, notes = mixture_changes(saved, current)
        return ResumePlan(current, {f"data.{k}" for k in keys}, notes=notes)
    try:
        could = bool(mixture_changes(saved, current)[0])
    except ValueError:
        could = False
    return ResumePlan(current, set(), hint=ALLOW_HINT if could else None)

"""Resuming on changed data: what a resumed run keeps of its saved data position.

The checkpoint's data fingerprint (data/state.py fingerprint) says what the saved positions
refer to. On resume the current fingerprint is compared with it (model/runtime/checkpoint.py
check_fingerprint names every differing key); this module decides beforehand which
differences a run may accept and how:
  - checkpoint.allow_data_change=true: any data change; the pipeline starts afresh on the new
    data (the saved positions describe another data set);
  - data.mixture_change=continue: a re-weighted mixture, sources added or dropped; every kept
    source continues from its saved position, dropped ones stay parked in the state;
  - data.shape_change=continue: another seq_len (and global batch, decided by the caller: it is
    no part of the fingerprint); every shard continues from its saved position, re-packed at the
    new length (continue_at_length);
  - otherwise no change at all, with a hint when `continue` would have accepted it.
"""
from __future__ import annotations

import dataclasses

from data.state import carry_parked_sources, merge_host_states, mixture_changes, same_value
from data.streams.shard import RESHAPE, STATE_MARK, STATE_VERSION

ALLOW_HINT = ("set data.mixture_change=continue to continue every source from its saved position, "
              "or checkpoint.allow_data_change=true to read the data afresh")
SHAPE_HINT = ("set data.shape_change=continue to continue the data at the new row length, "
              "or checkpoint.allow_data_change=true to read the data afresh")


@dataclasses.dataclass
class ResumePlan:
    fingerprint: dict               # the data fingerprint to compare and save (parked sources carried)
    accepted: set[str]              # fingerprint keys ("data.<key>") the change may differ in
    hint: str | None = None         # what to say when a refused change could be accepted
    notes: list[str] = dataclasses.field(default_factory=list)   # the accepted mixture changes
    saved_seq_len: int | None = None    # data.shape_change=continue: the length the states were saved at


def plan_resume(saved: dict, current: dict, *, mixture_change: str, allow_data_change: bool,
                shape_change: str = "refuse") -> ResumePlan:
    """The plan for resuming with data fingerprint `current` from a checkpoint saved with
    `saved` (both data fingerprints). Raises ValueError (one line) for a mixture change that
    cannot continue exactly, and for another data.num_shards under data.shape_change=continue."""
    if allow_data_change:
        return ResumePlan(current, set())
    # The positions of parked sources travel on in the data state: so does what they were read
    # from (data/state.py carry_parked_sources).
    current = carry_parked_sources(saved, current)
    relength = bool(saved) and "seq_len" in saved and not same_value(saved["seq_len"], current["seq_len"])
    accepted, saved_seq_len = set(), None
    if shape_change == "continue" and saved:
        if not same_value(saved.get("num_shards"), current["num_shards"]):
            # the batch layout and every saved position are per virtual shard
            raise ValueError(f"data.shape_change=continue: data.num_shards changed ({saved.get('num_shards')} -> "
                             f"{current['num_shards']}); the virtual shards must stay those of the checkpoint "
                             "(each one's position continues), or set checkpoint.allow_data_change=true")
        if relength:
            accepted.add("data.seq_len")
            saved_seq_len = int(saved["seq_len"])
            saved = {**saved, "seq_len": current["seq_len"]}     # the mixture rules see the rest
    if mixture_change == "continue":
        keys, notes = mixture_changes(saved, current)
        return ResumePlan(current, accepted | {f"data.{k}" for k in keys}, notes=notes, saved_seq_len=saved_seq_len)
    if relength and shape_change != "continue" and all(
            same_value(saved.get(k), current.get(k)) for k in set(saved) | set(current) if k != "seq_len"):
        return ResumePlan(current, set(), hint=SHAPE_HINT)
    try:
        could = bool(mixture_changes(saved, current)[0])
    except ValueError:
        could = False
    return ResumePlan(current, accepted, hint=ALLOW_HINT if could else None, saved_seq_len=saved_seq_len)


def continue_at_length(host_states: list[dict], saved_seq_len: int) -> list[dict]:
    """Every host's saved data states (data.shape_change=continue: saved at `saved_seq_len`) as one
    merged host state whose shard states (a mixture's: each source's, parked ones included) carry
    the length they were saved at (data/streams/shard.py RESHAPE). A stream restored from one
    rebuilds that window at the old length and continues from what it had not handed out
    (WindowRows.remainder_state), in whichever process builds it (the trainer's head batch, an
    input worker, data.torch.Batches). A state already marked keeps its mark: a parked source
    saved at an even older length."""
    merged = merge_host_states(host_states)
    return [{STATE_MARK: STATE_VERSION, "num_shards": merged["num_shards"], "topology": [0, 1, 0],
             "shards": mark_length(merged["shards"], saved_seq_len)}]


def mark_length(shard_states: dict, saved_seq_len: int) -> dict:
    """{shard: state} with each stream state marked as saved at `saved_seq_len` (see continue_at_length)."""
    def mark(st: dict) -> dict:
        return {RESHAPE: saved_seq_len, **st}
    out = {}
    for v, st in shard_states.items():
        if "sources" in st:       # a mixture's shard: its sources' streams (data/streams/mixture.py)
            st = {**st, "sources": {n: mark(s) for n, s in st["sources"].items()},
                  "parked": {n: mark(s) for n, s in st.get("parked", {}).items()}}
        else:
            st = mark(st)
        out[v] = st
    return out

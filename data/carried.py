"""The next batch, carried by a checkpoint (data.carry_next_batch).

A restore used to tokenize before its first batch: the host's head batch rebuilds every shard's
window from its saved position (1.04-1.09 s on a 16-core H100 host with 8 workers, ~2 s on
2 cores; BENCHMARKS.md). At a save the host's next batch is usually made already: it waits in
the device prefetcher's buffer. So a save writes it beside the data state, with the shard states
after it, and a restore hands it out first while the pipeline starts from the states after it:
nothing is tokenized before the first step, and the pipeline's own start (the head batch, the
workers' spawn) makes the batch after, behind the restore and the first compile.

What a save writes, per host: in the data state (JSON) `next_batch` = {"digest", "state"} and,
in a file of its own beside it (`*.next_batch.npz`: plain int arrays, loaded without pickle),
the batch's arrays. A batch is a host's own (its rows of the global batch), so a restore uses it
only on the same host of the same host count, and only when the digest of what the batches
depend on (the data fingerprint, the global batch, the host, the debug keys) is the one saved:
any change (another host count, data.shape_change, a mixture change) restores as before. The
data order is a function of the shard states, so the carried batch is the one the pipeline
would make from the saved states, and the states after it are where it would stand.

A save never waits for it: when no batch is ready (the loop waits on its input, the last save of
the data), the checkpoint carries none and a restore makes it, as before.
"""
from __future__ import annotations

import hashlib
import io
import json

import numpy as np

NEXT = "next_batch"            # the data state's key: {"digest": str, "state": the state after it}
ARRAYS = "arrays"              # in memory only: {key: int array}; written to the .npz, never to JSON
FILE_SUFFIX = ".next_batch.npz"


def batch_digest(fingerprint: dict, global_batch_size: int, process_index: int, process_count: int,
                 debug: bool) -> str:
    """What a host's next batch depends on beyond the shard states."""
    key = {"fingerprint": fingerprint, "global_batch_size": int(global_batch_size),
           "process": [int(process_index), int(process_count)], "debug": bool(debug)}
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:32]


def with_next(consumed: dict, digest: str, batch: dict, state_after: dict) -> dict:
    """The state to save: the consumed state and the next batch with the states after it."""
    return {**consumed, NEXT: {"digest": digest, "state": state_after,
                               ARRAYS: {k: np.asarray(v) for k, v in batch.items()}}}


# ---------------------------------------------------------------- on disk
def split_arrays(state: dict) -> tuple[dict, bytes | None]:
    """(the state as JSON holds it, the .npz bytes of its next batch or None)."""
    nxt = state.get(NEXT)
    if not isinstance(nxt, dict) or ARRAYS not in nxt:
        return state, None
    buf = io.BytesIO()
    np.savez(buf, **nxt[ARRAYS])
    return {**state, NEXT: {k: v for k, v in nxt.items() if k != ARRAYS}}, buf.getvalue()


def attach_arrays(state: dict, read_bytes) -> dict:
    """This host's restored state with its next batch's arrays from `read_bytes()` (the .npz);
    without the file, or with one that does not read back, the state without a next batch (the
    pipeline makes it, as before)."""
    if not isinstance(state, dict) or NEXT not in state:
        return state
    try:
        with np.load(io.BytesIO(read_bytes()), allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except Exception:  # noqa: BLE001 - missing or damaged: only the start is slower
        return drop_next(state)
    return {**state, NEXT: {**state[NEXT], ARRAYS: arrays}}


def drop_next(state):
    if isinstance(state, dict) and NEXT in state:
        return {k: v for k, v in state.items() if k != NEXT}
    return state


# ---------------------------------------------------------------- restore
def take(host_states: list | None, process_index: int, process_count: int, digest: str,
         expect: dict[str, tuple]) -> tuple[list | None, tuple[dict, dict, dict] | None]:
    """(every host's state for the pipeline, (batch, state before, state after) or None).

    With a usable next batch this host's state is the one after it (the pipeline starts there);
    otherwise every state as saved. Every host's next-batch entry is removed either way.
    expect: the shape of each of the model's batch arrays on this host."""
    if not host_states:
        return host_states, None
    mine = host_states[process_index] if len(host_states) == process_count else None
    clean = [drop_next(s) for s in host_states]
    nxt = mine.get(NEXT) if isinstance(mine, dict) else None
    if not isinstance(nxt, dict) or nxt.get("digest") != digest or ARRAYS not in nxt:
        return clean, None
    batch = nxt[ARRAYS]
    if any(k not in batch or tuple(batch[k].shape) != tuple(shape) for k, shape in expect.items()):
        return clean, None
    before = clean[process_index]
    clean[process_index] = nxt["state"]
    return clean, (batch, before, nxt["state"])


class CarriedBatch:
    """A host iterator that hands out the carried batch first, then the iterator's own batches
    (started from the states after it). get_state before the first batch is the saved consumed
    state, as the iterator it stands in for would give."""

    def __init__(self, it, batch: dict, state_before: dict):
        self._it = it
        self._batch = batch
        self._before = state_before

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if self._batch is not None:
            batch, self._batch = self._batch, None
            return batch
        return next(self._it)

    def get_state(self):
        return self._before if self._batch is not None else self._it.get_state()

    def __getattr__(self, name):
        # stage_times, runs_in_process, close, worker_stage_times: the pipeline's own
        return getattr(self._it, name)

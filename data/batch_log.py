"""The per-step batch log of `train.debug_batches=true`, and the row hash it shares with
scripts/show_step.py (which replays a step's rows and must name the very same hashes).

One line per step and process: {"step", "batch_hash": of this host's batch arrays, "rows":
[[virtual shard, first and last document id, row hash], ...], "docs": [[[document id, its tokens
in the row], ...] per row]}. The tests of exact resume compare these lines across runs, and count
every document's tokens over a run from "docs"; the log costs a host sync per step.
"""
from __future__ import annotations

import hashlib
import json

import numpy as np

from data.pipeline import BATCH_KEYS


def row_hash(inputs_r: np.ndarray, targets_r: np.ndarray, doc_ids_r: np.ndarray) -> str:
    """sha256(inputs + targets + document ids)[:16] of one row (int32, int32, int64)."""
    return hashlib.sha256(np.ascontiguousarray(inputs_r, np.int32).tobytes()
                          + np.ascontiguousarray(targets_r, np.int32).tobytes()
                          + np.ascontiguousarray(doc_ids_r, np.int64).tobytes()).hexdigest()[:16]


def host_rows(arr) -> np.ndarray:
    """This process's rows of a batch-sharded global array, in order (replicas dropped)."""
    parts = {s.index[0].start or 0: np.asarray(s.data) for s in arr.addressable_shards}
    return np.concatenate([parts[k] for k in sorted(parts)])


class BatchLog:
    """Appends one line per step to `path`; `log` returns the batch without the debug-only keys
    ("doc_ids", "row_shard") that the train step does not take."""

    def __init__(self, path):
        self._f = open(path, "a")

    def log(self, step: int, batch: dict) -> dict:
        local = {k: np.ascontiguousarray(host_rows(batch[k])) for k in BATCH_KEYS}
        doc_ids, shards = np.asarray(batch["doc_ids"]), np.asarray(batch["row_shard"])
        digest = hashlib.sha256(b"".join(local[k].tobytes() for k in BATCH_KEYS)).hexdigest()[:16]
        rows, docs = [], []
        for b in range(len(shards)):
            real = doc_ids[b][doc_ids[b] >= 0]
            rows.append([int(shards[b]), int(real[0]) if real.size else -1, int(real[-1]) if real.size else -1,
                         row_hash(local["inputs"][b], local["targets"][b], doc_ids[b])])
            ids, counts = np.unique(real, return_counts=True)
            docs.append([[int(d), int(n)] for d, n in zip(ids, counts, strict=True)])
        self._f.write(json.dumps({"step": step, "batch_hash": digest, "rows": rows, "docs": docs}) + "\n")
        self._f.flush()
        return {k: batch[k] for k in BATCH_KEYS}

    def close(self) -> None:
        self._f.close()


def logging_step(train_step, path, cleanup):
    """train.debug_batches=true: the train step with each batch logged before it runs (a host sync
    per step). The step a batch feeds is the state's step + 1, after a rollback too. The log
    closes with `cleanup` (the run's ExitStack)."""
    log = BatchLog(path)
    cleanup.callback(log.close)

    def logged(state, batch):
        return train_step(state, log.log(int(state["step"]) + 1, batch))

    return logged

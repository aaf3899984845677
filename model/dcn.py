"""What a compiled multislice program sends over the data-center network (DCN), read from its HLO.

On TPU, XLA splits a collective whose groups span slices in two: the part inside each slice stays
an ICI collective (its replica groups name one slice's devices only) and the part between slices
becomes host transfers to the Megascale runtime: `send`/`recv` pairs carrying
`_xla_megascale_transfer_type` (ALL_REDUCE, ALL_GATHER, ...). Each send's buffer is what one chip
hands to its host for the other slices, once per execution of the computation it sits in; a send
inside a loop body (the scan over layers, the microbatches) counts once per trip.

The bytes one chip's transfers put on the network depend on how Megascale moves them among k
slices; the estimate assumes the bandwidth-optimal ring over the k slices: an all-reduce sends
2(k-1)/k of its buffer, an all-gather, reduce-scatter or all-to-all (k-1)/k, anything else its
whole buffer. Compile-time figures: no TPU is needed, nothing runs. model/hlo.py reads the
program (its computations and loop trips), as it does for model/ici.py's collectives inside a slice.
"""
from __future__ import annotations

import dataclasses
import re

from model import hlo

_TRANSFER = re.compile(r'_xla_megascale_transfer_type="([A-Z_]+)"')


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One Megascale send: its kind, its buffer's bytes per chip, and how often it runs per step."""

    kind: str        # ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, ...
    nbytes: int      # the buffer handed to the host per execution, per chip
    times: int       # executions per step (loop trips of the computations around it)


def megascale_transfers(hlo_text: str) -> list[Transfer]:
    """Every Megascale send of the compiled program `hlo_text` (compiled.as_text()), with its trips per
    step. Empty for a one-slice program."""
    out = []
    for _, text, times in hlo.executed_instructions(hlo_text):
        kind = _TRANSFER.search(text)
        if kind and re.search(r"[)\]}] send\(", text):
            out.append(Transfer(kind.group(1), hlo.array_bytes(text), times))
    return out


RING_SHARE = {"ALL_REDUCE": lambda k: 2 * (k - 1) / k, "ALL_GATHER": lambda k: (k - 1) / k,
              "REDUCE_SCATTER": lambda k: (k - 1) / k, "ALL_TO_ALL": lambda k: (k - 1) / k}


def dcn_bytes_per_chip(transfers: list[Transfer], n_slices: int) -> dict:
    """Per chip and step: the buffers handed to Megascale (payload) and the bytes a ring over the
    slices puts on the network for them (sent), in total and per transfer kind."""
    payload: dict[str, int] = {}
    sent: dict[str, float] = {}
    for t in transfers:
        payload[t.kind] = payload.get(t.kind, 0) + t.nbytes * t.times
        share = RING_SHARE.get(t.kind, lambda k: 1.0)(n_slices)
        sent[t.kind] = sent.get(t.kind, 0.0) + t.nbytes * t.times * share
    return {"payload_bytes": sum(payload.values()), "sent_bytes": sum(sent.values()),
            "payload_by_kind": payload, "transfers": len(transfers)}

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
whole buffer. Compile-time figures: no TPU is needed, nothing runs.
"""
from __future__ import annotations

import dataclasses
import re

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
               "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1}

_COMPUTATION = re.compile(r"^(?:ENTRY )?%(\S+) \(.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.*)$")
_ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_CALLEES = re.compile(r"\b(calls|to_apply|body|condition)=%([^\s,)}]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRANSFER = re.compile(r'_xla_megascale_transfer_type="([A-Z_]+)"')


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One Megascale send: its kind, its buffer's bytes per chip, and how often it runs per step."""

    kind: str        # ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, ...
    nbytes: int      # the buffer handed to the host per execution, per chip
    times: int       # executions per step (loop trips of the computations around it)


def _array_bytes(shape_text: str) -> int:
    m = _ARRAY.search(shape_text)
    if not m or m.group(1) not in DTYPE_BYTES:
        return 0
    n = 1
    for d in filter(None, m.group(2).split(",")):
        n *= int(d)
    return n * DTYPE_BYTES[m.group(1)]


def _parse(hlo: str) -> tuple[dict[str, dict[str, str]], str | None]:
    """{computation: {instruction: its text after '='}} and the entry computation's name."""
    comps: dict[str, dict[str, str]] = {}
    entry, current = None, None
    for line in hlo.splitlines():
        m = _COMPUTATION.match(line)
        if m:
            current = m.group(1)
            comps[current] = {}
            if line.startswith("ENTRY"):
                entry = current
            continue
        if current is None:
            continue
        if line.rstrip() == "}":    # a lone brace: a "}" opening a line may continue an instruction
            current = None
            continue
        m = _INSTRUCTION.match(line)
        if m:
            comps[current][m.group(1)] = m.group(2)
    return comps, entry


def _scalar(comp: dict[str, str], name: str, depth: int = 0) -> int | None:
    """The value of an integer scalar that is a constant, or a copy/bitcast of one."""
    text = comp.get(name)
    if text is None or depth > 8:
        return None
    m = re.search(r"\bconstant\((-?\d+)\)", text)
    if m:
        return int(m.group(1))
    m = re.search(r"\b(?:copy|bitcast|convert)\(%([^\s,)]+)\)", text)
    return _scalar(comp, m.group(1), depth + 1) if m else None


def _trip_count(comps, caller: str, while_text: str, condition: str) -> int:
    """Trips of a counted loop (i from a constant start while i < a constant limit; XLA may have
    peeled trips off, which then appear beside the loop). 1 when it cannot be read."""
    cond = comps.get(condition, {})
    limit = None
    for text in cond.values():
        m = re.search(r"compare\(%([^\s,)]+), %([^\s,)]+)\), direction=LT", text)
        if m:
            limit = _scalar(cond, m.group(2))
    init = re.search(r"\bwhile\(%([^\s,)]+)\)", while_text)
    start = None
    if init:
        tup = comps[caller].get(init.group(1), "")
        first = re.search(r"\btuple\(%([^\s,)]+)", tup)
        start = _scalar(comps[caller], first.group(1)) if first else None
    if limit is None:
        return 1
    return max(limit - (start or 0), 0)


def megascale_transfers(hlo: str) -> list[Transfer]:
    """Every Megascale send of the compiled program `hlo` (compiled.as_text()), with its trips per
    step. Empty for a one-slice program."""
    comps, entry = _parse(hlo)
    if entry is None:
        return []
    times: dict[str, int] = {entry: 1}
    order = [entry]
    for comp in order:            # callers before callees: HLO's call graph is acyclic
        for text in comps.get(comp, {}).values():
            callees = [(kind, name) for kind, name in _CALLEES.findall(text)]
            for branches in _BRANCHES.findall(text):
                callees += [("branch", b.strip().lstrip("%")) for b in branches.split(",") if b.strip()]
            cond = next((n for k, n in callees if k == "condition"), None)
            for kind, name in callees:
                n = times[comp]
                if kind == "body" and cond is not None:
                    n *= _trip_count(comps, comp, text, cond)
                times[name] = times.get(name, 0) + n
                if name not in order:
                    order.append(name)
    out = []
    for comp, instructions in comps.items():
        for text in instructions.values():
            kind = _TRANSFER.search(text)
            if kind and re.search(r"[)\]}] send\(", text):
                out.append(Transfer(kind.group(1), _array_bytes(text), times.get(comp, 0)))
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

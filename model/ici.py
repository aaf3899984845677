"""What a compiled program's collectives move over the chips' links (ICI), per mesh axis, read from
its HLO (`compiled.as_text()`; model/hlo.py reads the program, model/dcn.py the part between slices).

Each collective (all-gather, reduce-scatter, all-reduce, all-to-all, collective-permute; a sync
instruction or the start of an asynchronous pair) names the devices that exchange data: replica
groups, as explicit lists `{{0,1},{2,3}}`, as an iota `[2,2]<=[4]` (optionally transposed,
`[2,2]<=[2,2]T(1,0)`), or over a mesh of the partitioner's own `mesh['axis_0'=2,'axis_1'=2] {'axis_1'}`
(with `device_ids=(...)` where its order is not the plain one); a collective-permute names
`source_target_pairs`. Under SPMD these ids are partition ids: positions in the run's mesh's
flattened devices (model/sharding.py MESH_AXES order), so id i sits at np.unravel_index(i, mesh
shape). The axes a collective spans are those along which its groups' members differ; its bytes
are keyed by them, "+"-joined in MESH_AXES order ("context", "fsdp+context"). A collective whose
groups cannot be read goes under "unparsed", with its bytes.

Bytes per chip per execution, a bandwidth-optimal ring over the k chips of a group (as model/dcn.py
prices the DCN): an all-gather sends (k-1)/k of its result, a reduce-scatter (k-1)/k of its operand,
an all-reduce 2(k-1)/k of its operand, an all-to-all (k-1)/k, a collective-permute its whole
buffer; times the executions per step of the computation it sits in (loop trips: the scanned
layers, the microbatches). A combined (variadic) collective counts every array it carries.
Compile-time figures: no TPU is needed, nothing runs.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Mapping

import numpy as np

from model import hlo
from model.dcn import RING_SHARE

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
UNPARSED = "unparsed"

_EXPLICIT = re.compile(r"replica_groups=\{((?:\{[0-9,]*\},?)*)\}")
_IOTA = re.compile(r"replica_groups=\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?")
_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\((.*?)\))? \{([^}]*)\}")
_CHANNEL = re.compile(r"\bchannel_id=(\d+)")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{[0-9,]*\},?)*)\}")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of the program: what it is, the chips it spans, and its bytes per chip."""

    kind: str        # one of KINDS
    axes: str        # the mesh axes its groups span, "+"-joined ("" within a chip), or "unparsed"
    group_size: int  # k: chips per group (2 for a collective-permute's pair)
    nbytes: float    # bytes one chip sends per execution (the ring model above)
    times: int       # executions per step (loop trips of the computations around it)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _iota(reshape: list[int], perm: list[int] | None) -> np.ndarray:
    ids = np.arange(math.prod(reshape)).reshape(reshape)
    return ids.transpose(perm) if perm else ids


def _mesh_groups(axes_text: str, device_ids: str | None, grouped: str) -> np.ndarray | None:
    """[groups, k] ids of a replica-group list over the partitioner's mesh: its devices laid out on
    the mesh's axes (in `device_ids` order, else 0..n-1), grouped along the named axes or
    sub-axes ('a':(pre)size: the size-long part of axis a after its pre-sized major part)."""
    mesh = [(name, int(size)) for name, size in re.findall(r"'?([^',=]+)'?=(\d+)", axes_text)]
    sizes = [size for _, size in mesh]
    n = math.prod(sizes)
    if device_ids is None:
        devices = np.arange(n)
    else:
        m = re.fullmatch(r"\[([0-9,]+)\](?:T\(([0-9,]+)\))?", device_ids.strip())
        if m:
            perm = _ints(m.group(2)) if m.group(2) else None
            devices = _iota(_ints(m.group(1)), perm).reshape(-1)
        elif re.fullmatch(r"(?:\[[0-9,]+\])?[0-9,]+", device_ids.strip()):
            devices = np.array(_ints(device_ids.strip().split("]")[-1]))
        else:
            return None
        if devices.size != n:
            return None
    index = {name: i for i, (name, _) in enumerate(mesh)}
    refs: dict[int, list[tuple[int, int]]] = {}     # mesh axis -> (pre-size, size) of each grouped part
    order: list[tuple[int, int]] = []               # the grouped parts as listed: (axis, pre-size)
    for ref in filter(None, (r.strip() for r in grouped.split(","))):
        m = re.fullmatch(r"'?([^':]+)'?(?::\((\d+)\)(\d+))?", ref)
        if not m or m.group(1) not in index:
            return None
        axis = index[m.group(1)]
        pre, size = (int(m.group(2)), int(m.group(3))) if m.group(2) else (1, sizes[axis])
        refs.setdefault(axis, []).append((pre, size))
        order.append((axis, pre))
    # Split each grouped axis into its parts (major to minor, filler between), keep the rest whole,
    # then move the grouped parts, in the order listed, last: each row is one group.
    dims: list[int] = []
    position: dict[tuple[int, int], int] = {}
    for axis, size in enumerate(sizes):
        done = 1
        for pre, part in sorted(refs.get(axis, [])):
            if pre % done or size % (pre * part):
                return None
            if pre > done:
                dims.append(pre // done)
            position[(axis, pre)] = len(dims)
            dims.append(part)
            done = pre * part
        if axis not in refs or done < size:
            dims.append(size // done)
    last = [position[key] for key in order]
    perm = [d for d in range(len(dims)) if d not in last] + last
    k = math.prod(dims[d] for d in last)
    return devices.reshape(dims).transpose(perm).reshape(-1, k)


def replica_groups(text: str, n_devices: int) -> np.ndarray | None:
    """[groups, k] partition ids of a collective's replica groups; None where they cannot be read.
    An empty list means every device in one group."""
    m = _EXPLICIT.search(text)
    if m:
        groups = [_ints(g) for g in re.findall(r"\{([0-9,]*)\}", m.group(1))]
        if not groups:
            return np.arange(n_devices).reshape(1, -1)
        if len({len(g) for g in groups}) != 1:
            return None
        return np.array(groups)
    m = _IOTA.search(text)
    if m:
        shape = _ints(m.group(1))
        reshape = _ints(m.group(2))
        perm = _ints(m.group(3)) if m.group(3) else None
        if len(shape) != 2 or math.prod(shape) != math.prod(reshape):
            return None
        return _iota(reshape, perm).reshape(shape)
    m = _MESH.search(text)
    if m:
        return _mesh_groups(m.group(1), m.group(2), m.group(3))
    return None


def _axes_between(ids: np.ndarray, mesh: dict[str, int]) -> str | None:
    """The mesh axes along which each row's ids differ, "+"-joined in the mesh's axis order; None
    when the ids are not the mesh's devices."""
    n = math.prod(mesh.values())
    if ids.size == 0 or ids.min() < 0 or ids.max() >= n:
        return None
    coords = np.stack(np.unravel_index(ids, tuple(mesh.values())), axis=-1)    # [rows, members, axis]
    differ = (coords != coords[:, :1]).any(axis=(0, 1))
    return "+".join(a for a, d in zip(mesh, differ, strict=True) if d)


def _groups_and_axes(kind: str, text: str, mesh: dict[str, int]) -> tuple[int, str]:
    """(k, the axes spanned) of one collective; (1, "unparsed") where its groups cannot be read."""
    n = math.prod(mesh.values())
    if kind == "collective-permute":
        m = _PAIRS.search(text)
        pairs = [_ints(p) for p in re.findall(r"\{([0-9,]*)\}", m.group(1))] if m else []
        if not m or any(len(p) != 2 for p in pairs):
            return 1, UNPARSED
        moved = np.array([p for p in pairs if p[0] != p[1]]).reshape(-1, 2)
        axes = _axes_between(moved, mesh) if moved.size else ""
        return 2, UNPARSED if axes is None else axes
    groups = replica_groups(text, n)
    if groups is None or len(np.unique(groups)) != groups.size:
        return 1, UNPARSED       # unreadable, or a device in two groups
    axes = _axes_between(groups, mesh)
    return groups.shape[1], UNPARSED if axes is None else axes


def collectives(hlo_text: str, mesh: Mapping[str, int]) -> list[Collective]:
    """Every ICI collective of the compiled program `hlo_text`, run over `mesh` ({axis: size} in the
    mesh's axis order, `dict(mesh.shape)`: model/sharding.py MESH_AXES), with its executions per
    step."""
    mesh = {str(a): int(n) for a, n in mesh.items()}
    out = []
    channels: set[str] = set()
    for comp, text, times in hlo.executed_instructions(hlo_text):
        op = hlo.opcode(text)
        if op is None:
            continue
        name, shape = op
        kind = name.removesuffix("-start")
        if kind not in KINDS:
            continue
        # One collective, one channel id: libtpu's async collective fusion
        # (--xla_tpu_enable_async_collective_fusion, tpu_flags.py) prints it in up to three
        # computations (its start, the compute fusion it overlaps, its done), each run as often.
        channel = _CHANNEL.search(text)
        if channel:
            if channel.group(1) in channels:
                continue
            channels.add(channel.group(1))
        tree = hlo.shape_tree(shape)
        if name.endswith("-start") and kind != "all-reduce":
            # (operands, results, context...): an all-gather-start, collective-permute-start or
            # an asynchronous reduce-scatter/all-to-all; an all-reduce-start's shape is its result
            tree = tree[1] if isinstance(tree, list) and len(tree) > 1 else tree
        buffer = hlo.total_bytes(tree)        # the result: the buffer each kind's share is of ...
        k, axes = _groups_and_axes(kind, text, mesh)
        if kind == "all-reduce" and comp.startswith("all-reduce-scatter"):
            # ... but libtpu's all-reduce-scatter fusion: an all-reduce whose result is sliced to
            # this chip's part, run as a reduce-scatter of the all-reduce's operand
            kind = "reduce-scatter"
        elif kind == "reduce-scatter":
            buffer *= k                            # ... but a reduce-scatter's operand: k results
        if axes == UNPARSED:
            sent = float(buffer)                   # k unknown: its whole buffer
        elif axes == "":
            sent = 0.0                             # nothing leaves a chip
        else:
            sent = buffer * RING_SHARE.get(kind.upper().replace("-", "_"), lambda k: 1.0)(k)
        out.append(Collective(kind, axes, k, sent, times))
    return out


def ici_bytes_per_chip(hlo_text: str, mesh: Mapping[str, int]) -> dict:
    """{"bytes_by_axes": {axes: bytes per chip per step}, "total_bytes": their sum} over the
    program's collectives; axes that move nothing (a group within one chip) are left out."""
    by_axes: dict[str, float] = {}
    for c in collectives(hlo_text, mesh):
        sent = c.nbytes * c.times
        if sent:
            by_axes[c.axes] = by_axes.get(c.axes, 0.0) + sent
    names = list(mesh)

    def order(axes: str) -> tuple:      # single axes first in the mesh's order, then pairs, ...; unparsed last
        if axes == UNPARSED:
            return (len(names) + 1,)
        parts = axes.split("+")
        return (len(parts), *[names.index(p) for p in parts])

    ordered = dict(sorted(by_axes.items(), key=lambda kv: order(kv[0])))
    return {"bytes_by_axes": ordered, "total_bytes": sum(ordered.values())}

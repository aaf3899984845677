"""Mesh and logical-axis rules: the only place that knows about mesh axes.

The model names logical axes ("embed", "mlp", "act_batch", ...). A rules table from
configs/mesh/*.yaml maps each to a mesh axis, a list of mesh axes, or null (replicated):

    rules:
      - [embed, [fsdp, context]]
      - [act_batch, [data, fsdp]]
      - [head_dim, null]

Mesh axes: `data` (pure data parallel: parameters replicated), `fsdp` (batch split and
parameters/optimizer state sharded, ZeRO-3 style), `context` (the activations' sequence split:
context parallelism, docs/long-context.md and model/context.py; the state is sharded over it as over
fsdp), `tensor` (Megatron-style
heads/MLP split, innermost: the fastest links).
Over several slices `mesh.dcn_data` and `mesh.dcn_fsdp` say how the slices extend `data` and
`fsdp` across the data-center network (make_mesh).
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Iterable, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "context", "tensor")
Rules = tuple[tuple[str, tuple[str, ...]], ...]


# ----------------------------------------------------------------------------- mesh


def mesh_shape(mesh_cfg: Mapping[str, Any], n_devices: int) -> tuple[int, ...]:
    """Resolve one -1 axis to fill the device count; raise naming mesh.* on mismatch."""
    return _fill(mesh_cfg, MESH_AXES, n_devices, "devices")


def _fill(mesh_cfg: Mapping[str, Any], axes: Sequence[str], total: int, what: str) -> tuple[int, ...]:
    """The sizes of `axes` (config keys, one of them may be -1) whose product is `total`."""
    sizes = [int(mesh_cfg.get(a, 1)) for a in axes]
    named = dict(zip(axes, sizes, strict=True))
    fill = [a for a, s in named.items() if s == -1]
    if len(fill) > 1:
        raise ValueError(f"only one of {', '.join('mesh.' + a for a in axes)} may be -1, got {named}")
    if any(s == 0 or s < -1 for s in sizes):
        raise ValueError(f"mesh sizes must be positive or -1, got {named}")
    known = math.prod(s for s in sizes if s != -1)
    if fill:
        if total % known:
            raise ValueError(
                f"mesh.{fill[0]}=-1 cannot fill {total} {what}: the other axes "
                f"({named}) multiply to {known}, which does not divide it")
        sizes[axes.index(fill[0])] = total // known
    if math.prod(sizes) != total:
        raise ValueError(
            f"{'*'.join('mesh.' + a for a in axes)} = {math.prod(sizes)} ({named}) "
            f"but there are {total} {what}; set one axis to -1 to fill")
    return tuple(sizes)


def hybrid_shape(mesh_cfg: Mapping[str, Any], n_devices: int, n_slices: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(per-slice shape, across-slices shape), both over MESH_AXES: `mesh.data/fsdp/tensor` split a
    slice's devices, `mesh.dcn_data/dcn_fsdp` the slices (defaults: -1 and 1, data parallel across
    slices). The run's mesh is their product per axis. Tensor and context parallelism never leave a
    slice: they need the fast links (ICI) at every layer. Raises one line naming mesh.* on a mismatch."""
    if n_devices % n_slices:
        raise ValueError(f"{n_devices} devices do not split into {n_slices} equal slices")
    dcn_cfg = {"dcn_data": mesh_cfg.get("dcn_data", -1), "dcn_fsdp": mesh_cfg.get("dcn_fsdp", 1)}
    dcn = _fill(dcn_cfg, ("dcn_data", "dcn_fsdp"), n_slices, "slices")
    ici = _fill(mesh_cfg, MESH_AXES, n_devices // n_slices, "devices per slice" if n_slices > 1 else "devices")
    return ici, (dcn[0], dcn[1], 1, 1)


class _SliceDevice:
    """A device seen with the slice it is told to belong to: CPU devices have no `slice_index`, so a
    simulated multislice run (scripts/launch_local.py --slices) lends them one, and JAX's hybrid mesh
    groups them exactly as it groups a real multislice job's TPU devices."""

    def __init__(self, device, slice_index: int):
        self.device, self.slice_index = device, slice_index

    def __getattr__(self, name):
        return getattr(self.device, name)


# Each process's slice where the devices do not say (CPU): set by model/runtime/distributed.py from
# `distributed.slice_index` once every process has reported its own; None: devices carry their own
# `slice_index` (a TPU multislice job) or there is one slice.
_PROCESS_SLICES: list[tuple[int, ...] | None] = [None]


def set_process_slices(slices: Sequence[int] | None) -> None:
    """Slice of each process (index = process_index), for devices without a `slice_index`."""
    _PROCESS_SLICES[0] = None if slices is None else tuple(int(s) for s in slices)


def slice_of(device) -> int:
    """The device's slice: its process's told slice in a simulated multislice run, else its own
    `slice_index` (TPU; CPU devices of a multi-process job report 0), else 0."""
    told = _PROCESS_SLICES[0]
    if told is not None:
        return told[device.process_index]
    return int(getattr(device, "slice_index", None) or 0)


def make_mesh(mesh_cfg: Mapping[str, Any], devices: Sequence[jax.Device] | None = None,
              device_slice: Callable[[Any], int] | None = None) -> Mesh:
    """Mesh over all processes' devices (jax.devices() is global after jax.distributed).

    jax.make_mesh orders devices by the physical topology (TPU torus, hosts), so the
    innermost axis (tensor) lands on the fastest links. Auto axes: GSPMD propagates
    shardings from the jit boundaries and the with_sharding_constraint annotations.

    Over several slices (devices' `slice_index`, or the slices processes were told): JAX's hybrid
    mesh, each slice's devices laid out as one slice's mesh (per-slice shape) and the slices in
    blocks along `data`/`fsdp` (the across-slices shape), so only what those axes reduce crosses
    the DCN (by default the gradients' data-parallel reduction). device_slice: a device's slice in
    place of slice_of (tests that split one process's devices into slices).
    """
    devices = list(jax.devices() if devices is None else devices)
    slices = [(device_slice or slice_of)(d) for d in devices]
    counts = {s: slices.count(s) for s in sorted(set(slices))}
    if len(set(counts.values())) > 1:
        raise ValueError(f"slices hold different device counts {counts}: every slice must be the same size")
    n_slices = len(counts)
    ici, dcn = hybrid_shape(mesh_cfg, len(devices), n_slices)
    axis_types = (AxisType.Auto,) * len(MESH_AXES)
    layout = mesh_cfg.get("layout", "torus")
    if layout not in LAYOUTS:
        raise ValueError(f"mesh.layout={layout!r}: expected one of {LAYOUTS}")
    if layout == "blocks":
        if n_slices > 1:
            raise ValueError("mesh.layout=blocks lays out one slice; a multislice job takes mesh.layout=torus")
        grid = block_grid(ici, devices)
        if grid is not None:
            return Mesh(grid, MESH_AXES, axis_types=axis_types)
    if n_slices == 1:
        return jax.make_mesh(ici, MESH_AXES, axis_types=axis_types, devices=devices)
    from jax.experimental import mesh_utils

    # Every device seen with the slice found above (on TPU its own), so a told slice wins over the
    # 0 that CPU devices of a multi-process job report.
    told = [_SliceDevice(d, s) for d, s in zip(devices, slices, strict=True)]
    grid = mesh_utils.create_hybrid_device_mesh(ici, dcn, told, allow_split_physical_axes=True)
    grid = np.vectorize(lambda d: d.device, otypes=[object])(grid)
    return Mesh(grid, MESH_AXES, axis_types=axis_types)


LAYOUTS = ("torus", "blocks")


def block_grid(shape: Sequence[int], devices: Sequence[jax.Device]) -> np.ndarray | None:
    """The devices as a mesh of `shape` (over MESH_AXES) whose every axis's groups are compact
    blocks of the slice's torus: from the innermost axis out, each takes a block as square as the
    torus allows (a group of 4 on a 4x4 is a 2x2 square, not a line of 4). A square's 4 chips close
    a ring over their own links (2 per chip, model/predict.py links_by_axes) where a line of 4
    without wraparound drives 1. None where the devices carry no torus coordinates (CPU).
    ValueError naming mesh.layout where an axis cannot be made of whole blocks."""
    coords = [getattr(d, "coords", None) for d in devices]
    if any(c is None for c in coords):
        return None
    # A chip's cores are the innermost dimension (the fastest links): the tensor axis takes them first.
    coords = [(int(getattr(d, "core_on_chip", 0)), *c) for d, c in zip(devices, coords, strict=True)]
    dims = [max(c[i] for c in coords) + 1 for i in range(len(coords[0]))]
    if math.prod(dims) != len(devices):
        return None      # not a whole torus (a subset of a slice's devices): nothing to lay out
    used = [1] * len(dims)              # the block side already taken along each dimension
    factors = []                        # per mesh axis (innermost first): its block side per dimension
    for axis, n in reversed(list(zip(MESH_AXES, shape, strict=True))):
        side = [1] * len(dims)
        rest = int(n)
        while rest > 1:
            grow = [i for i in range(len(dims)) if (dims[i] // used[i]) % (side[i] * 2) == 0]
            if rest % 2 or not grow:
                torus = "x".join(map(str, dims[1:]))
                raise ValueError(f"mesh.layout=blocks: mesh.{axis}={n} does not tile the {torus} torus in blocks "
                                 "beside the inner axes; mesh.layout=torus lays it out")
            i = min(grow, key=lambda j: (side[j], j))
            side[i] *= 2
            rest //= 2
        factors.append((MESH_AXES.index(axis), side, used.copy()))
        used = [u * s for u, s in zip(used, side, strict=True)]
    by_coord = {c: d for d, c in zip(devices, coords, strict=True)}
    grid = np.empty(tuple(shape), dtype=object)
    for index in np.ndindex(*shape):
        pos = [0] * len(dims)
        for axis, side, below in factors:
            i = index[axis]
            for d in reversed(range(len(dims))):     # the axis's index in its block, one dimension at a time
                i, digit = divmod(i, side[d])
                pos[d] += digit * below[d]
        grid[index] = by_coord[tuple(pos)]
    return grid


def mesh_slices(mesh: Mesh) -> int:
    """How many slices the mesh's devices span."""
    return len({slice_of(d) for d in mesh.devices.flat})


def rules_from_cfg(mesh_cfg: Mapping[str, Any]) -> Rules:
    """The `rules` list of [logical, mesh axis | [mesh axes] | null] as a hashable tuple."""
    out = []
    for entry in mesh_cfg["rules"]:
        logical, axes = entry[0], entry[1]
        if axes is None:
            axes = ()
        elif isinstance(axes, str):
            axes = (axes,)
        else:
            axes = tuple(axes)
        bad = [a for a in axes if a not in MESH_AXES]
        if bad:
            raise ValueError(f"mesh.rules: {logical!r} -> unknown mesh axes {bad}; known {MESH_AXES}")
        out.append((str(logical), axes))
    names = [n for n, _ in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"mesh.rules: logical names listed twice: {dup}")
    return tuple(out)


# ----------------------------------------------------------------------------- rules -> specs


def mesh_axes_for(logical: str | None, rules: Rules) -> tuple[str, ...]:
    if logical is None:
        return ()
    for name, axes in rules:
        if name == logical:
            return axes
    raise KeyError(f"logical axis {logical!r} has no entry in mesh.rules")


def logical_to_spec(names: Iterable[str | None], rules: Rules, shape: Sequence[int] | None = None,
                    mesh: Mesh | None = None) -> PartitionSpec:
    """PartitionSpec for an array whose dims carry `names`.

    A mesh axis is used once per array (the first dim that claims it wins). With `shape` and
    `mesh`, axes that do not divide the dim are dropped (e.g. 2 kv heads on tensor=4): that
    dim is then replicated over them instead of failing to compile; so are axes of size 1.
    """
    used: set[str] = set()
    spec = []
    for i, name in enumerate(names):
        axes = [a for a in mesh_axes_for(name, rules) if a not in used]
        if shape is not None and mesh is not None:
            kept, size = [], 1
            for a in axes:
                if mesh.shape[a] == 1:
                    continue        # splits nothing: left out, so the spec reads as without it
                if shape[i] % (size * mesh.shape[a]) == 0:
                    kept.append(a)
                    size *= mesh.shape[a]
            axes = kept
        used.update(axes)
        spec.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    while spec and spec[-1] is None:
        spec.pop()
    return PartitionSpec(*spec)


def named_sharding(mesh: Mesh, rules: Rules, names, shape=None) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(names, rules, shape, mesh))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


# ----------------------------------------------------------------------------- activations

# (mesh, rules) while a step function is traced; None outside, so the model also runs
# un-annotated (single device, eager, tests).
_ACTIVE: list[tuple[Mesh, Rules]] = []


@contextlib.contextmanager
def activation_sharding(mesh: Mesh, rules: Rules):
    """Within this context `constrain` pins activations to the rules' shardings.

    Enter it *inside* the function being jitted: it acts at trace time.
    """
    _ACTIVE.append((mesh, rules))
    try:
        yield
    finally:
        _ACTIVE.pop()


def current() -> tuple[Mesh | None, Rules]:
    return _ACTIVE[-1] if _ACTIVE else (None, ())


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """with_sharding_constraint by logical names; identity outside activation_sharding."""
    mesh, rules = current()
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, named_sharding(mesh, rules, names, x.shape))


def table_for_lookup(table_vd: jax.Array, dtype) -> jax.Array:
    """The embedding table [vocab, embed] as the token lookup reads it. When its embed dim is split
    over two or more mesh axes (fsdp x context: parameters sharded over both), it is cast to the
    compute dtype and gathered whole along embed first, as FSDP gathers any layer's weight: XLA's
    gather partitioner moves one mesh axis from the looked-up rows' embed dim to their batch dims
    (an all-to-all) but not two, and would otherwise replicate the whole batch's embeddings on every
    chip ("Involuntary full rematerialization"). Otherwise the table as it is (today's plans)."""
    mesh, rules = current()
    if mesh is None or len([a for a in mesh_axes_for("embed", rules) if mesh.shape[a] > 1]) < 2:
        return table_vd
    return constrain(table_vd.astype(dtype), ("vocab", None))


def describe(mesh: Mesh) -> str:
    n_slices = mesh_slices(mesh)
    return (" × ".join(f"{k}={v}" for k, v in mesh.shape.items()) + f" ({np.prod(list(mesh.shape.values()))} devices"
            + (f", {n_slices} slices)" if n_slices > 1 else ")"))

"""Mesh and logical-axis rules: the only place that knows about mesh axes.

The model names logical axes ("embed", "mlp", "act_batch", ...). A rules table from
configs/mesh/*.yaml maps each to a mesh axis, a list of mesh axes, or null (replicated):

    rules:
      - [embed, fsdp]
      - [act_batch, [data, fsdp]]
      - [head_dim, null]

Mesh axes: `data` (pure data parallel: parameters replicated), `fsdp` (batch split and
parameters/optimizer state sharded, ZeRO-3 style), `tensor` (Megatron-style heads/MLP split).
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Iterable, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")
Rules = tuple[tuple[str, tuple[str, ...]], ...]


# ----------------------------------------------------------------------------- mesh


def mesh_shape(mesh_cfg: Mapping[str, Any], n_devices: int) -> tuple[int, ...]:
    """Resolve one -1 axis to fill the device count; raise naming mesh.* on mismatch."""
    sizes = [int(mesh_cfg[a]) for a in MESH_AXES]
    fill = [a for a, s in zip(MESH_AXES, sizes, strict=True) if s == -1]
    if len(fill) > 1:
        raise ValueError(f"only one of mesh.data/fsdp/tensor may be -1, got {dict(zip(MESH_AXES, sizes, strict=True))}")
    if any(s == 0 or s < -1 for s in sizes):
        raise ValueError(f"mesh sizes must be positive or -1, got {dict(zip(MESH_AXES, sizes, strict=True))}")
    known = math.prod(s for s in sizes if s != -1)
    if fill:
        if n_devices % known:
            raise ValueError(
                f"mesh.{fill[0]}=-1 cannot fill {n_devices} devices: the other axes "
                f"({dict(zip(MESH_AXES, sizes, strict=True))}) multiply to {known}, which does not divide it")
        sizes[MESH_AXES.index(fill[0])] = n_devices // known
    if math.prod(sizes) != n_devices:
        raise ValueError(
            f"mesh.data*mesh.fsdp*mesh.tensor = {math.prod(sizes)} ({dict(zip(MESH_AXES, sizes, strict=True))}) "
            f"but there are {n_devices} devices; set one axis to -1 to fill")
    return tuple(sizes)


def make_mesh(mesh_cfg: Mapping[str, Any], devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Mesh over all processes' devices (jax.devices() is global after jax.distributed).

    jax.make_mesh orders devices by the physical topology (TPU torus, hosts), so the
    innermost axis (tensor) lands on the fastest links. Auto axes: GSPMD propagates
    shardings from the jit boundaries and the with_sharding_constraint annotations.
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_shape(mesh_cfg, len(devices))
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)


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
    dim is then replicated over them instead of failing to compile.
    """
    used: set[str] = set()
    spec = []
    for i, name in enumerate(names):
        axes = [a for a in mesh_axes_for(name, rules) if a not in used]
        if shape is not None and mesh is not None:
            kept, size = [], 1
            for a in axes:
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


def describe(mesh: Mesh) -> str:
    return " × ".join(f"{k}={v}" for k, v in mesh.shape.items()) + f" ({np.prod(list(mesh.shape.values()))} devices)"

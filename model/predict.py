"""A train step's time predicted from its compiled program, before a TPU is rented.

The terms, each the least time its resource needs for the step, per chip:
- compute_s: the step's executed FLOPs (model/flops.py: the useful FLOPs, causal attention,
  times the recompute factor of remat and a chunked loss) at the chip's peak bf16 FLOP/s. Not
  XLA's cost analysis: it counts a loop body once (the tiny model at 1, 2 and 4 scanned layers:
  4.95 GFLOP per chip each time, the formula 4.6-8.9) and Pallas kernels (splash) not at all.
- ici_s: model/ici.py's bytes per chip per step on each set of mesh axes, over the physical links
  that set's groups span on the slice's torus: per torus dimension the group covers, 2 links (a
  ring both ways) where that dimension wraps around, 1 where it does not (a line: its end links
  carry the whole ring's share one way), at the generation's one-way bandwidth per link. The axes'
  times add up (one collective at a time); ici_s_by_axes gives each.
- hbm_s: the bytes XLA's cost analysis says the program accesses, at the chip's HBM bandwidth.
  A floor: it counts a loop body (the scanned layers, the microbatches) once.
- dcn_s (several slices): what each host sends over the data-center network, at --dcn-gbps.
- host_s: what crosses a chip's PCIe link to its host each step, where the plan keeps buffers in
  host memory (offloaded activations, a host-resident optimizer state): the compiler's host
  temporaries written in the forward and read back in the backward, and host-resident arguments
  read in and written back, so twice their bytes, at the generation's PCIe bandwidth. One
  direction at a time (the writes and the reads fall in different halves of the step). Zero for
  plans that offload nothing (every shipped experiment).

Overlap: step_s assumes every collective runs under compute (libtpu's async collective fusion
and overlap flags, model/tpu_flags.py, gather the next layer's weights while this one computes):
step_s = max(compute_s, ici_s, hbm_s, dcn_s, host_s) — the lower bound (host transfers are
asynchronous copies too). step_s_upper assumes none does: max(compute_s, hbm_s) + ici_s + dcn_s +
host_s. `bound` names the largest term. mfu divides the useful FLOPs (no recompute) by step_s at
every chip's peak; mfu_lower by step_s_upper.

What it does not know: how close the MXUs get to peak (MaxText's published runs without offload
sit at 55-70% MFU, so a measured step is slower than step_s by about 1/that), the latency of small
collectives, the links a collective shares with another running at the same time, host input and
Python time.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Sequence

import numpy as np

from model.flops import PEAK_FLOPS


@dataclasses.dataclass(frozen=True)
class Chip:
    """What the prediction needs of one TPU generation."""

    peak_flops: float       # bf16 dense FLOP/s per chip
    hbm_bps: float          # HBM bytes/s per chip
    link_bps: float         # ICI bytes/s per link, one way
    links: int              # ICI ports per chip: 6 on a 3-D torus, 4 on a 2-D one
    wrap: str               # when a torus dimension wraps around (see wraps())
    pcie_bps: float         # bytes/s between one chip and its host, one way


# Every constant the prediction uses, and where it comes from (read 2026-11):
# - peak_flops: model/flops.py PEAK_FLOPS (Cloud TPU's system-architecture pages, bf16).
# - hbm_bps: Cloud TPU pages: v4 1.2 TB/s (TPU v4 page), v5e 819 GB/s and v6e 1,640 GB/s (TPU v6e
#   page, its v5e/v6e table), v5p 2,765 GB/s (TPU v5p page: 2,575 GiB/s).
# - link_bps: the JAX scaling book ("How to Think About TPUs", its hardware table): one way per link
#   v4 4.5e10, v5e 4.5e10, v5p 9e10, v6e 9e10. Cloud TPU's pages agree for v5p (1,200 GB/s both ways
#   per chip over 6 ports = 1e11 per link one way) and v6e (800 GB/s over 4 ports = 1e11); their v5e
#   figure (1,600 Gbit/s per chip = 2.5e10 per port one way) is lower than the book's, so a v5e's
#   ici_s may be up to 1.8x short.
# - links: Cloud TPU pages: v4 and v5p 3-D torus (6 ports), v5e and v6e 2-D torus (4 ports).
# - wrap: the scaling book and Cloud TPU's topology pages: v4 and v5p slices wrap around only when
#   built of whole 4x4x4 cubes (64 chips and up; a v4-32 is 2x2x4, no wraparound); v5e and v6e
#   only along a dimension of 16 chips (a full pod's side; a v5e-16 or v6e-16 is 4x4, none).
# - pcie_bps: the JAX scaling book ("How to Think About TPUs"): PCIe between a chip and its host
#   "typically around 1.5e10 bytes / second per chip" (v4, v5e, v5p here), and v6e (Trillium) 32 GB/s,
#   "about 2x higher than v5": 3.2e10, PCIe 4.0 x16's one way.
CHIPS: dict[str, Chip] = {
    "v4": Chip(PEAK_FLOPS["TPU v4"], 1.2e12, 4.5e10, 6, "cubes", 1.5e10),
    "v5p": Chip(PEAK_FLOPS["TPU v5p"], 2.765e12, 9e10, 6, "cubes", 1.5e10),
    "v5e": Chip(PEAK_FLOPS["TPU v5e"], 8.19e11, 4.5e10, 4, "16", 1.5e10),
    "v6e": Chip(PEAK_FLOPS["TPU v6e"], 1.64e12, 9e10, 4, "16", 3.2e10),
}
CHIPS["v5litepod"] = CHIPS["v5e"]


def wraps(chip: Chip, torus: Sequence[int]) -> tuple[bool, ...]:
    """Which of the slice's torus dimensions wrap around."""
    if chip.wrap == "cubes":
        whole = len(torus) == 3 and all(n % 4 == 0 for n in torus)
        return tuple(whole for _ in torus)
    return tuple(n == 16 for n in torus)


def links_by_axes(mesh_axes: Sequence[str], coords: np.ndarray, torus: Sequence[int],
                  wrap: Sequence[bool]) -> dict[str, int]:
    """{axes: links} for every set of mesh axes ("fsdp", "fsdp+context", ...): the links one chip
    drives for a collective over a group along those axes. coords: [*mesh shape, torus dims], each
    device's position on the torus, laid out as the mesh is. A group covering n > 1 positions of a
    torus dimension drives 2 links along it where it spans a whole wrapped dimension, else 1."""
    names = list(mesh_axes)
    out: dict[str, int] = {}
    for mask in range(1, 2 ** len(names)):
        chosen = [a for i, a in enumerate(names) if mask >> i & 1]
        index = tuple(slice(None) if a in chosen else 0 for a in names)
        group = coords[index].reshape(-1, coords.shape[-1])
        links = 0
        for d, size in enumerate(torus):
            n = len(np.unique(group[:, d]))
            if n > 1:
                links += 2 if wrap[d] and n == size else 1
        out["+".join(chosen)] = links
    return out


def host_bytes(temporaries: float, arguments: float) -> float:
    """What crosses a chip's PCIe link per step for the buffers a plan keeps in host memory (bytes
    per chip): temporaries (offloaded activations) written in the forward and read back in the
    backward, host-resident arguments read in and written back: twice their bytes."""
    return 2 * (temporaries + arguments)


def predict(*, useful_flops: float, executed_flops: float, chips: int, chip: Chip,
            ici_bytes_by_axes: Mapping[str, float], links: Mapping[str, int],
            hbm_bytes: float | None = None, dcn_s: float = 0.0, host_bytes: float = 0.0) -> dict:
    """The step's predicted time and its terms (module doc). FLOPs are the whole step's (every
    chip's); bytes are per chip per step (`host_bytes`: what crosses the chip's PCIe link, both
    directions summed). A set of axes missing from `links` (model/ici.py's "unparsed") is priced
    at one link."""
    compute_s = executed_flops / (chips * chip.peak_flops)
    ici_by_axes = {axes: nbytes / (max(links.get(axes, 1), 1) * chip.link_bps)
                   for axes, nbytes in ici_bytes_by_axes.items()}
    ici_s = sum(ici_by_axes.values())
    hbm_s = hbm_bytes / chip.hbm_bps if hbm_bytes else 0.0
    host_s = host_bytes / chip.pcie_bps
    terms = {"compute": compute_s, "ici": ici_s, "hbm": hbm_s, "dcn": dcn_s, "host": host_s}
    step_s = max(terms.values())
    upper = max(compute_s, hbm_s) + ici_s + dcn_s + host_s
    peak_all = chips * chip.peak_flops
    return {
        "step_s": step_s, "step_s_upper": upper, "compute_s": compute_s, "ici_s": ici_s,
        "ici_s_by_axes": ici_by_axes, "hbm_s": hbm_s, "dcn_s": dcn_s,
        "host_s": host_s,
        "mfu": useful_flops / (step_s * peak_all) if step_s else None,
        "mfu_lower": useful_flops / (upper * peak_all) if upper else None,
        "bound": max(terms, key=terms.get),
        "ici_over_compute": ici_s / compute_s if compute_s else math.inf,
        "links_by_axes": {axes: links.get(axes, 1) for axes in ici_bytes_by_axes},
        "overlap": "step_s: every collective under compute (the lower bound); step_s_upper: none",
    }

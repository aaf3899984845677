"""Compile a run's train and eval steps for a TPU slice on any machine, before renting it.

    pip install -e ".[tpu]"          # libtpu, the TPU compiler; no TPU needed
    python scripts/compile_tpu.py experiment=v4_32_llama_1b
    python scripts/compile_tpu.py experiment=v4_32_llama_1b --topology v5e-16 model.remat=dots --json plan.json
    python scripts/compile_tpu.py experiment=v4_32_llama_1b --quick model.remat=full   # ~3x faster, +-9%
    python scripts/compile_tpu.py experiment=v4_32_llama_1b tpu.slices=2 --dcn-gbps 100   # 2 x v4-32
    python scripts/compile_tpu.py experiment=v5e_16_llama_1b --search [--search-budget 6] [--search-by step]
    python scripts/compile_tpu.py experiment=v4_32_llama3_1_8b --no-compile   # the checks and the plan, ~10 s
    python scripts/compile_tpu.py experiment=gpu_8_llama_1b --no-compile      # GPU plans: plan.hosts x devices

Before anything compiles, the run passes every check train.py runs at its start (train.py
check_config and check_plan, the same functions): the settings, the data settings at the planned
host count (the slice's hosts, times tpu.slices: a v4-32 has 4 hosts of 4 chips), the tokenizer
against the model where the tokenizer is a local file (a hub id is "not checked: tokenizer not
local"), the mesh over the slice's devices and the batch over its data axes. A failed check stops
it in one line naming the key (exit code 2). `--no-compile` stops there and prints the plan: hosts,
devices, mesh, virtual shards per host, rows per chip and per microbatch, tokens per step, steps,
the schedule's token budget and learning rate. An experiment without a TPU slice (a GPU one, the
sample) states its hosts and devices in `plan.hosts` and `plan.devices_per_host`, and is checked
over that many fake CPU devices (--no-compile only: the compile is for TPUs).

The topology is the experiment's `tpu.topology` (e.g. v4-32) or `--topology`; the rest are the
same Hydra overrides train.py takes. libtpu describes the slice's devices
(`jax.experimental.topologies`), and train.py's own `build_program` builds the mesh, rules,
shardings, abstract state and jitted steps over them, so this compiles exactly what the run
would execute, from `jax.ShapeDtypeStruct`s: nothing is allocated and no data is read.

Prints per chip what XLA reports (arguments, temporaries, outputs and the part of them aliased
to donated arguments, generated code, total) against the chip's usable HBM, "fits" with the
margin or "does not fit" with the compiler's own statement of what overflows, and the compile
time; `--json` writes the same figures. Each step's figures are kept under the fingerprint of what
was compiled (model/compile_cache.py: the program without source locations, the devices, the
compiler and its flags; `--cache-dir`, default ~/.cache/jaxpt/tpu_compiles): the same step asked
again is not compiled again, and says so ("kept"). `--no-cache` compiles regardless.

Under the train step, its predicted time (`train_step.predicted`, model/predict.py): the step's
FLOPs at the chips' peak (model/flops.py's count, remat and a chunked loss included: XLA's cost
analysis counts a scanned layer once and misses the Pallas kernels), the ICI bytes below over the
links each mesh axis spans on the slice's torus, XLA's bytes accessed at the HBM bandwidth (a
floor), and any buffers kept in host memory over PCIe, out and back; the step between every
collective hidden under compute and none, the MFU, and which term bounds it. The compile runs with
libtpu's collective/compute overlap flags (model/tpu_flags.py), as `scripts/tpu.py run` starts the
pod's run; LIBTPU_INIT_ARGS set in the environment comes first.

For each step it also prints the bytes per chip that the step's collectives move over the slice's
links (ICI), by the mesh axes their groups span ("context", "fsdp", "fsdp+context": model/ici.py
reads the compiled program, loop trips counted, a ring over each group), to set a mesh with an axis
against the same shapes without it.

Several slices (`tpu.slices=N`, a multislice job over the data-center network): libtpu describes N
copies of the slice, the mesh spans them (`mesh.dcn_data`/`mesh.dcn_fsdp`, model/sharding.py), and
the report adds, per step, the bytes each chip hands over to the DCN (the compiled program's
Megascale transfers: the parts of collectives whose groups span slices, model/dcn.py), what a host
sends for its chips and the seconds that takes at `--dcn-gbps` per host, beside the step's compute
at the chips' peak FLOP/s (the least it can take).

`--search` ranks the slice's plans (model/plan_search.py): every mesh (data x fsdp x context x tensor
ways multiplying to the chips), microbatch count, remat policy (offload included), loss chunk and
the loss's way with the head (train.loss_head, with a chunk) that divides; a cheap
estimate of each one's memory and ICI bytes prunes those far over the HBM limit and orders the rest;
the shipped plan and the best-estimated ones, `--search-budget` in all, compile --quick and rank by
predicted step (the middle of its range, half the collective time hidden; `--search-by step` or
`upper`: all or none hidden) among those within the limit (90% of the usable HBM, less --quick's
4%). It prints a row per compile as it goes and the table, then compiles the winner in full (with
--quick: takes its quick compile), prints its report and the overrides that give a run its plan;
`--json` adds the ranking under "search" and the winner under "winner". One slice only.

`--quick` tells the compiler to spend no effort on the program's speed
(jax_exec_time_optimization_effort=-1): a 1B plan compiles in ~20 CPU-s instead of ~70-110, for
trying many variants. Its scheduling differs, so its memory figures differ from the run's by a few
per cent either way (measured: -4% to +9%) and its ICI bytes by more (the 128k plan's `context`:
125 GiB quick, 31.6 full); quote the full compile's.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
import time
from pathlib import Path

GIB = 2**30


# ----------------------------------------------------------------------------- TPU slices


@dataclasses.dataclass(frozen=True)
class Generation:
    """What libtpu needs to describe a slice of one TPU generation, and its HBM per chip."""

    name: str               # libtpu's topology prefix: "v4" in "v4:2x2x4"
    cores_per_name: int     # the slice name counts TensorCores (v4, v5p: 2 per chip) or chips
    torus_dims: int         # 3-D torus (v4, v5p) or 2-D (v5e, v6e)
    chip_config: str        # "megacore": the chip's two TensorCores act as one device
    hbm_gib: float          # HBM per chip, as sold
    usable_gib: float       # what the compiler may allocate: plans are judged against this


# HBM per chip from Google's TPU system-architecture pages; usable HBM as libtpu 0.0.42.1 states
# it when a program exceeds it ("exceeds available HBM (30.75G)" on v4): the rest is reserved.
GENERATIONS = {
    "v4": Generation("v4", 2, 3, "megacore", 32, 30.75),
    "v5p": Generation("v5p", 2, 3, "megacore", 95, 95.74),
    "v5e": Generation("v5e", 1, 2, "default", 16, 15.75),
    "v6e": Generation("v6e", 1, 2, "default", 32, 31.25),
}
GENERATIONS["v5litepod"] = GENERATIONS["v5e"]     # the Cloud TPU API's name for v5e slices


@dataclasses.dataclass(frozen=True)
class Slice:
    name: str               # "v4-32", as `gcloud compute tpus tpu-vm create --accelerator-type` spells it
    generation: Generation
    chips: int
    torus: tuple[int, ...]  # chips along each torus axis, e.g. (2, 2, 4)

    @property
    def libtpu_name(self) -> str:
        return f"{self.generation.name}:{'x'.join(map(str, self.torus))}"


def parse_slice(name: str) -> Slice:
    """"v4-32" -> 16 chips on a 2x2x4 torus. Raises ValueError naming the accepted forms."""
    m = re.fullmatch(r"(v\w+?)-(\d+)", name.strip())
    gen = GENERATIONS.get(m.group(1)) if m else None
    count = int(m.group(2)) if m else 0
    chips = count // gen.cores_per_name if gen else 0
    if gen is None or chips < 1 or count % gen.cores_per_name or chips & (chips - 1):
        raise ValueError(f"TPU topology {name!r}: expected <generation>-<size> with generation one of "
                         f"{', '.join(sorted(GENERATIONS))} and a power-of-two size, e.g. v4-32, v5e-16, v6e-16")
    # Cloud TPU's slice shapes: 3-D slices grow from one 2x2x1 host, 2-D ones from 1x1, doubling the
    # shortest axis (the last of equals) until the slice has its chips: v4-32 = 2x2x4, v6e-32 = 4x8.
    torus = [2, 2, 1] if gen.torus_dims == 3 and chips >= 4 else [1] * gen.torus_dims
    while math.prod(torus) < chips:
        shortest = min(torus)
        axis = max(i for i, n in enumerate(torus) if n == shortest)
        torus[axis] *= 2
    return Slice(name.strip(), gen, chips, tuple(torus))


def chips_per_host(tpu: Slice) -> int:
    """Cloud TPU hosts drive 4 chips (2x2), or the whole slice when it is smaller."""
    return 4 if tpu.chips >= 4 else tpu.chips


def slice_devices(tpu: Slice, num_slices: int = 1):
    """The devices of `num_slices` copies of the slice as libtpu describes them (not attached:
    compile only); over several slices each carries its `slice_index`."""
    from jax.experimental import topologies

    desc = topologies.get_topology_desc(
        platform="tpu", topology_name=tpu.libtpu_name, chip_config_name=tpu.generation.chip_config,
        chips_per_host_bounds=(2, 2, 1) if tpu.chips >= 4 else (1, 1, 1), num_slices=int(num_slices))
    return desc.devices


def libtpu_env(tpu: Slice) -> None:
    """Environment for libtpu as a compiler only, set before its first use in the process."""
    # Which slice this is and that no other worker exists: libtpu's start-up otherwise logs that
    # it could not find them.
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", tpu.name)
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    # libtpu takes a machine-wide lock meant for processes that drive TPU chips; compiling drives
    # none, and two checks at once (or one beside a test run) must not fail on the lock.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    # The collective/compute overlap flags a pod run gets from scripts/tpu.py (model/tpu_flags.py):
    # the compiled program is the one the run executes, and its predicted time assumes the overlap.
    from model.tpu_flags import init_args

    os.environ["LIBTPU_INIT_ARGS"] = init_args(os.environ.get("LIBTPU_INIT_ARGS"))


def slice_name(tpu: Slice, n_slices: int) -> str:
    return f"{n_slices} x {tpu.name}" if n_slices > 1 else tpu.name


def require_libtpu() -> None:
    try:
        import libtpu  # noqa: F401  (the TPU compiler ships in this wheel)
    except ImportError:
        raise SystemExit('compile_tpu: the TPU compiler (libtpu) is not installed; install it with '
                         'pip install -e ".[tpu]"') from None


# ----------------------------------------------------------------------------- compile


def _compile_one(fn, args, capacity: int, n_slices: int = 1, mesh: dict | None = None, cache=None,
                 facts: dict | None = None, label: str = "") -> dict:
    """Compile `fn` at `args`; XLA's per-chip memory figures, or the compiler's out-of-memory report.
    With the `mesh` ({axis: size}) the program runs over, the bytes its collectives move per chip
    and step over each mesh axis (model/ici.py); over several slices also what each chip sends over
    the DCN per step (model/dcn.py). With a `cache` (model/compile_cache.py), figures kept for the
    same lowered program, compiler and `facts` (where it runs) are taken instead of compiling it
    again ("cached": True; "compile_s" is the compile's that made them)."""
    t0 = time.perf_counter()
    lowered = fn.lower(*args)
    if cache is None:
        return _compiled_figures(lowered, t0, capacity, n_slices, mesh)
    from model.compile_cache import fingerprint

    key = fingerprint(lowered, {**(facts or {}), "capacity": capacity, "slices": n_slices, "mesh": mesh,
                                "figures_code": _figures_code()})
    kept = cache.get(key)
    if kept is not None:
        return {**kept, "cached": True}
    figures = _compiled_figures(lowered, t0, capacity, n_slices, mesh)
    cache.put(key, figures, label)
    return figures


def _figures_code() -> str:
    """The digest of the code that reads a compiled program's figures (model/compile_cache.py)."""
    from model import dcn, ici
    from model.compile_cache import code_digest

    return code_digest(_compiled_figures, ici, dcn)


def _compiled_figures(lowered, t0: float, capacity: int, n_slices: int, mesh: dict | None) -> dict:
    try:
        compiled = lowered.compile()
    except Exception as e:  # the TPU compiler reports a program that exceeds HBM as RESOURCE_EXHAUSTED
        if "RESOURCE_EXHAUSTED" not in str(e) and "Ran out of memory" not in str(e):
            raise
        # libtpu 0.0.42.1 stops at its first check and names only the overflowing total ("... HLO
        # temporaries (33.70G) exceeds available HBM (30.75G)"), no buffer list.
        return {"fits": False, "compile_s": time.perf_counter() - t0,
                "compiler_says": str(e).splitlines()[0][:300]}
    compile_s = time.perf_counter() - t0
    m = compiled.memory_analysis()
    # Outputs aliased to donated arguments (the new train state) reuse the arguments' buffers.
    total = (m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
             + m.generated_code_size_in_bytes)
    traffic = {}
    # XLA's bytes accessed (a floor: it counts a loop body once); model/predict.py's hbm_s
    cost = compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, (list, tuple)) and cost else cost) or {}
    if cost.get("bytes accessed"):
        traffic["hbm_bytes_accessed"] = float(cost["bytes accessed"])
    if mesh is not None or n_slices > 1:
        hlo_text = compiled.as_text()
    if mesh is not None:
        from model.ici import ici_bytes_per_chip

        traffic["ici"] = ici_bytes_per_chip(hlo_text, mesh)
    if n_slices > 1:
        from model.dcn import dcn_bytes_per_chip, megascale_transfers

        traffic["dcn"] = dcn_bytes_per_chip(megascale_transfers(hlo_text), n_slices)
    return {
        **traffic,
        "fits": total <= capacity, "compile_s": compile_s,
        "arguments_gib": m.argument_size_in_bytes / GIB, "temporaries_gib": m.temp_size_in_bytes / GIB,
        "outputs_gib": m.output_size_in_bytes / GIB, "aliased_gib": m.alias_size_in_bytes / GIB,
        "code_gib": m.generated_code_size_in_bytes / GIB, "total_gib": total / GIB,
        "hbm_fraction": total / capacity, "margin_gib": (capacity - total) / GIB,
        # buffers the plan keeps in the host's memory (offloaded activations, a host-resident state):
        # model/predict.py prices their trips over PCIe
        "host_temporaries_gib": m.host_temp_size_in_bytes / GIB,
        "host_arguments_gib": m.host_argument_size_in_bytes / GIB,
    }


# What --quick sets: effort in [-1, 1]; 0 is XLA's default, -1 the least spent on execution time.
QUICK_EXEC_TIME_EFFORT = -1.0


# --search's compiles when --search-budget is not given: model/plan_search.py's default (no import
# of the model at start-up: --help and the flag checks stay instant)
DEFAULT_SEARCH_BUDGET = 6


# What --dcn-gbps states when not given: the DCN bandwidth of one host, Gbit/s. A stated figure to
# price the transfers, not a measured one: pass what your hosts get.
DEFAULT_DCN_GBPS = 100.0


def slices_from_cfg(cfg) -> int:
    """`tpu.slices` (default 1) as a count; ValueError naming it otherwise."""
    value = cfg.tpu.get("slices", 1)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"tpu.slices={value!r}: expected a whole number of slices, 1 or more")
    return value


def compile_plan(cfg, tpu: Slice, quick: bool = False, dcn_gbps: float = DEFAULT_DCN_GBPS,
                 eval_step: dict | None = None, cache=None) -> dict:
    """Compile the run `cfg` describes for `tpu` (times `tpu.slices`): {"train_step": figures,
    "eval_step": figures, ...}. quick: the least compiler effort on execution time (see the module
    doc); the memory fitting effort stays XLA's default. dcn_gbps: the DCN bandwidth per host the
    transfers between slices are priced at. eval_step: that step's figures from a compile of the
    same mesh and loss chunk, taken instead of compiling it again (--search: remat and microbatches
    do not reach the eval step, a forward pass over the whole batch). cache: a
    model/compile_cache.py CompileCache; a step whose program, compiler and devices are the same as
    a kept one's takes its figures instead of compiling (its "cached" is True)."""
    import jax

    from model import sharding
    from model.flops import flops_per_token, peak_flops, recompute_factor

    n_slices = slices_from_cfg(cfg)
    settings, program, tokenizer = check_run(cfg, slice_devices(tpu, n_slices))
    model_cfg = settings.model
    batch = program.abstract_batch(int(cfg.data.global_batch_size), int(cfg.data.seq_len))
    capacity = int(tpu.generation.usable_gib * GIB)
    device_kind = program.mesh.devices.flat[0].device_kind
    seq_len, global_batch = int(cfg.data.seq_len), int(cfg.data.global_batch_size)
    factor = recompute_factor(model_cfg, seq_len, int(cfg.train.loss_chunk))
    peak = peak_flops(device_kind)
    step_flops = flops_per_token(model_cfg, seq_len, causal=True) * global_batch * seq_len * factor
    plan = {
        "topology": tpu.name, "libtpu_topology": tpu.libtpu_name, "chips": tpu.chips * n_slices,
        "slices": n_slices, "chips_per_slice": tpu.chips, "chips_per_host": chips_per_host(tpu),
        "mesh_slices": sharding.mesh_slices(program.mesh),
        "mesh_dcn": dict(zip(sharding.MESH_AXES, sharding.hybrid_shape(cfg.mesh, tpu.chips * n_slices, n_slices)[1],
                             strict=True)),
        "dcn_gbps_per_host": float(dcn_gbps),
        # the train step's executed FLOPs at every chip's peak: the least time the step can take
        "compute_s_at_peak": step_flops / (tpu.chips * n_slices * peak) if peak else None,
        "device_kind": device_kind, "hbm_gib_per_chip": tpu.generation.hbm_gib,
        "usable_hbm_gib_per_chip": tpu.generation.usable_gib,
        "mesh": dict(program.mesh.shape), "model": {k: cfg.model[k] for k in ("attention", "remat")},
        "microbatches": int(cfg.train.microbatches), "loss_chunk": int(cfg.train.loss_chunk),
        "seq_len": int(cfg.data.seq_len),
        "global_batch_size": int(cfg.data.global_batch_size),
        # executed / useful FLOPs: what rematerialisation and a chunked loss cost in compute
        "recompute_factor": factor,
        "quick": quick,
        "plan": make_plan(cfg, settings, program, tokenizer, slice_name(tpu, n_slices)),
    }
    # A process-wide setting, read when each program compiles: put back after, as a test process
    # (or anything else calling this) goes on compiling its own programs.
    effort = jax.config.jax_exec_time_optimization_effort
    if quick:
        jax.config.update("jax_exec_time_optimization_effort", QUICK_EXEC_TIME_EFFORT)
    # where the program runs, for the cache's fingerprint: the slice and its devices in mesh order
    facts = {"topology": tpu.libtpu_name, "chip_config": tpu.generation.chip_config,
             "devices": [[d.id, getattr(d, "slice_index", 0)] for d in program.mesh.devices.flat]}
    label = f"{slice_name(tpu, n_slices)}, {cfg.name}, {'quick' if quick else 'full'} compile"
    try:
        plan["train_step"] = _compile_one(program.train_step, (program.abstract_state, batch), capacity, n_slices,
                                          plan["mesh"], cache, facts, f"train_step: {label}")
        plan["eval_step"] = eval_step if eval_step is not None else _compile_one(
            program.eval_step, (program.abstract_state["params"], batch), capacity, n_slices, plan["mesh"],
            cache, facts, f"eval_step: {label}")
    finally:
        jax.config.update("jax_exec_time_optimization_effort", effort)
    for step in ("train_step", "eval_step"):
        dcn = plan[step].get("dcn")
        if dcn is not None:
            dcn["sent_bytes_per_host"] = dcn["sent_bytes"] * plan["chips_per_host"]
            dcn["seconds_at_dcn_gbps"] = dcn["sent_bytes_per_host"] * 8 / (dcn_gbps * 1e9)
    plan["libtpu_init_args"] = os.environ.get("LIBTPU_INIT_ARGS", "")
    train = plan["train_step"]
    if "ici" in train:    # compiled (it may still not fit): its predicted time
        useful = flops_per_token(model_cfg, seq_len, causal=True) * global_batch * seq_len
        train["predicted"] = predicted_step(program.mesh, tpu, useful, step_flops, train)
    return plan


def predicted_step(mesh, tpu: Slice, useful_flops: float, executed_flops: float, compiled: dict) -> dict:
    """model/predict.py's step time for a compiled train step over `mesh` on the slice `tpu`."""
    from model.predict import CHIPS, predict

    chip = CHIPS[tpu.generation.name]
    links = mesh_links(mesh, tpu)
    dcn_s = compiled.get("dcn", {}).get("seconds_at_dcn_gbps", 0.0)
    return predict(useful_flops=useful_flops, executed_flops=executed_flops, chips=mesh.devices.size, chip=chip,
                   ici_bytes_by_axes=compiled["ici"]["bytes_by_axes"], links=links,
                   hbm_bytes=compiled.get("hbm_bytes_accessed"), dcn_s=dcn_s,
                   host_bytes=host_bytes_per_step(compiled))


def host_bytes_per_step(compiled: dict) -> float:
    """model/predict.py host_bytes of a compiled step's figures (none in figures kept before them)."""
    from model.predict import host_bytes

    return host_bytes(compiled.get("host_temporaries_gib", 0.0) * GIB, compiled.get("host_arguments_gib", 0.0) * GIB)


def _size(nbytes: float) -> str:
    """Bytes in the largest binary unit that leaves at least 1 of it (3 significant digits)."""
    for unit, scale in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            v = nbytes / scale
            return f"{v:,.0f} {unit}" if v >= 1000 else f"{v:.3g} {unit}"
    return f"{nbytes:.0f} B"


def _secs(s: float) -> str:
    return f"{s:.3g} s" if s >= 1 else f"{s * 1e3:.3g} ms"


def predicted_line(p: dict) -> str:
    """The prediction as the console shows it, under the train step."""
    axes = ", ".join(f"{a} {_secs(t)} over {p['links_by_axes'][a]} link(s)" for a, t in p["ici_s_by_axes"].items())
    extra = (f", dcn {_secs(p['dcn_s'])}" if p["dcn_s"] else "") + (
        f", host (PCIe) {_secs(p['host_s'])}" if p.get("host_s") else "")
    return (f"    predicted: step {_secs(p['step_s'])} (every collective under compute) to {_secs(p['step_s_upper'])} "
            f"(none); MFU {p['mfu']:.0%} to {p['mfu_lower']:.0%}; {p['bound']}-bound; compute {_secs(p['compute_s'])} "
            f"at peak, ici {_secs(p['ici_s'])} ({axes or 'none'}; {p['ici_over_compute']:.0%} of compute), "
            f"hbm >= {_secs(p['hbm_s'])}{extra}")


def report(plan: dict) -> str:
    """The plan's figures as the console shows them."""
    cap = plan["usable_hbm_gib_per_chip"]
    slices = plan.get("slices", 1)
    lines = [(f"{slices} x " if slices > 1 else "")
             + f"{plan['topology']} ({plan['chips']} x {plan['device_kind']}, {plan['hbm_gib_per_chip']:g} GiB HBM "
             f"each, {cap:g} usable), "
             f"mesh {plan['mesh']}" + (f" (across slices {plan['mesh_dcn']})" if slices > 1 else "")
             + f", attention {plan['model']['attention']}, remat {plan['model']['remat']}, "
             f"microbatches {plan['microbatches']}, loss_chunk {plan['loss_chunk']}, "
             f"batch {plan['global_batch_size']} x {plan['seq_len']}; recompute factor {plan['recompute_factor']:.3f}"
             + ("; QUICK compile (no effort on speed): memory figures within a few per cent of the run's"
                if plan.get("quick") else "")]
    for step in ("train_step", "eval_step"):
        r = plan[step]
        if not r["fits"] and "total_gib" not in r:
            lines.append(f"  {step}: does not fit ({r['compiler_says']}); compiler ran {r['compile_s']:.1f} s"
                         + (" (kept)" if r.get("cached") else ""))
            continue
        verdict = (f"fits, margin {r['margin_gib']:.2f} GiB ({1 - r['hbm_fraction']:.0%})" if r["fits"]
                   else f"does not fit, over by {-r['margin_gib']:.2f} GiB")
        lines.append(f"  {step}: per chip {r['total_gib']:.2f} of {cap:g} GiB ({r['hbm_fraction']:.0%}): arguments "
                     f"{r['arguments_gib']:.2f}, temporaries {r['temporaries_gib']:.2f}, outputs "
                     f"{r['outputs_gib']:.2f} (aliased {r['aliased_gib']:.2f}), code {r['code_gib']:.2f} GiB; "
                     f"{verdict}; compiled in {r['compile_s']:.1f} s"
                     + (" (kept: the same program, devices and compiler; --no-cache compiles it)"
                        if r.get("cached") else ""))
        if host_bytes_per_step(r):
            lines.append(f"    in the host's memory: temporaries {r.get('host_temporaries_gib', 0.0):.2f}, arguments "
                         f"{r.get('host_arguments_gib', 0.0):.2f} GiB per chip (over PCIe twice a step)")
        if "ici" in r:
            moved = [f"{axes} {_size(sent)}" for axes, sent in r["ici"]["bytes_by_axes"].items() if sent]
            lines.append(f"    ici per chip per step: {', '.join(moved) or 'none'}")
        if "predicted" in r:
            lines.append(predicted_line(r["predicted"]))
        if "dcn" in r:
            d = r["dcn"]
            compute = plan.get("compute_s_at_peak")
            beside = (f"; the train step's compute at peak {compute * 1e3:.1f} ms" if compute and step == "train_step"
                      else "")
            lines.append(f"    over the DCN ({slices} slices): per chip {d['payload_bytes'] / 2**20:.1f} MiB handed to "
                         f"Megascale in {d['transfers']} transfers ({', '.join(sorted(d['payload_by_kind']))}), "
                         f"{d['sent_bytes'] / 2**20:.1f} MiB sent; per host ({plan['chips_per_host']} chips) "
                         f"{d['sent_bytes_per_host'] / 2**20:.1f} MiB = {d['seconds_at_dcn_gbps'] * 1e3:.1f} ms at "
                         f"{plan['dcn_gbps_per_host']:g} Gbit/s{beside}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the plan search (--search)


def search_plans(overrides: list[str], cfg, tpu: Slice, budget: int, by: str = "mid",
                 quick: bool = False, cache=None) -> dict:
    """--search (model/plan_search.py): every plan of the slice that divides, the estimate's pruning
    and order, `budget` quick compiles ranked by predicted step, then a full compile of the winner
    (quick too with `quick`: the ranking's own compile is taken). Prints as it goes; returns the
    winner's compiled plan with the ranking under "search"."""
    import dataclasses as dc

    from model import plan_search as ps
    from model import sharding
    from model.flops import flops_per_token, recompute_factor
    from model.predict import CHIPS

    if slices_from_cfg(cfg) > 1:
        raise ValueError(f"tpu.slices={cfg.tpu.slices}: --search plans one slice (the mesh within it); "
                         "search with tpu.slices=1, then add the slices")
    import train

    model = train.check_config(cfg).model
    seq, batch = int(cfg.data.seq_len), int(cfg.data.global_batch_size)
    devices = slice_devices(tpu)
    own = ps.plan_of({"mesh": dict(zip(sharding.MESH_AXES, sharding.mesh_shape(cfg.mesh, tpu.chips), strict=True)),
                      "train": cfg.train, "model": cfg.model})
    chip = CHIPS[tpu.generation.name]
    useful = flops_per_token(model, seq, causal=True) * batch * seq
    links: dict[tuple, dict | None] = {}   # per mesh shape: the links each set of axes drives on the torus
    estimated, unplaced = [], set()
    layout = cfg.mesh.get("layout", "torus")     # every plan is compiled in the config's layout: estimated in it too
    for plan in ps.candidates(model, seq, batch, tpu.chips, own):
        shape = tuple(plan.mesh.values())
        if shape not in links:
            try:
                links[shape] = mesh_links(sharding.make_mesh({**plan.mesh, "layout": layout}, devices), tpu)
            except (NotImplementedError, ValueError):   # jax.make_mesh: whole torus axes; blocks: whole blocks
                links[shape] = None
        if links[shape] is None:
            unplaced.add(shape)
            continue
        est = ps.estimate(plan, model, seq, batch)
        executed = useful * recompute_factor(dc.replace(model, remat=plan.remat), seq, plan.loss_chunk)
        estimated.append((plan, est.memory_bytes, ps.estimated_step(
            est, useful_flops=useful, executed_flops=executed, chips=tpu.chips, chip=chip, links=links[shape])))
    capacity = tpu.generation.usable_gib * GIB
    chosen, pruned = ps.to_compile(estimated, own, budget, capacity, by)
    no_layout = f" ({len(unplaced)} more meshes have no layout on the torus)" if unplaced else ""
    print(f"search {cfg.name} on {tpu.name}: {len(estimated)} plans divide{no_layout}; {pruned} pruned by the estimate "
          f"(memory above {ps.PRUNE_OVER:g} x {ps.HBM_LIMIT:.0%} of {tpu.generation.usable_gib:g} GiB); compiling "
          f"{len(chosen)} (--search-budget {budget}, the shipped plan first), --quick, ranked by {by}", flush=True)
    evals: dict[tuple, dict] = {}     # per (mesh, loss chunk): the eval step does not see remat or microbatches
    compiled: dict = {}

    def compile_one(i, plan):
        t0 = time.perf_counter()
        try:
            got = compile_plan(compose([*overrides, *plan.overrides()]), tpu, quick=True,
                               eval_step=evals.get((tuple(plan.mesh.values()), plan.loss_chunk)), cache=cache)
        except ValueError as e:     # a check the divisibility rules do not cover: listed, not ranked
            result = ps.result_of(plan, None, error=" ".join(str(e).split()))
        else:
            evals[(tuple(plan.mesh.values()), plan.loss_chunk)] = got["eval_step"]
            compiled[plan] = got
            result = ps.result_of(plan, got)
        print(f"  [{i}] {search_row(result)} ({time.perf_counter() - t0:.0f} s)", flush=True)
        return result

    ranking = ps.rank([compile_one(i, p) for i, p in enumerate(chosen, 1)], by)
    print(search_table(ranking, own), flush=True)
    winner = ranking[0]
    out = {"search": {"candidates": len(estimated), "pruned": pruned, "compiled": len(chosen), "budget": budget,
                      "by": by, "hbm_limit": ps.HBM_LIMIT, "quick_limit": ps.QUICK_LIMIT,
                      "shipped": own.overrides(),
                      "ranking": [{"plan": r.plan.label(), "overrides": r.plan.overrides(), "fits": r.fits,
                                   "train_hbm_fraction": r.train_fraction, "eval_hbm_fraction": r.eval_fraction,
                                   "predicted": r.predicted, "note": r.note} for r in ranking]}}
    if not winner.fits:
        print(f"search: no compiled plan fits under {ps.QUICK_LIMIT:.1%} of the usable HBM (quick); "
              f"raise --search-budget or change the batch", flush=True)
        return {**out, "winner": None}
    final = compiled[winner.plan] if quick else compile_plan(compose([*overrides, *winner.plan.overrides()]), tpu,
                                                             cache=cache)
    print(plan_report(final["plan"]) + "\n" + report(final), flush=True)
    line = " ".join(winner.plan.overrides())
    verdict = ("the shipped plan wins" if winner.plan == own else
               f"beats the shipped plan ({search_row(next(r for r in ranking if r.plan == own))})")
    print(f"winner: {winner.plan.label()}: {verdict}\n  overrides: {line}", flush=True)
    return {**final, **out, "winner": {"plan": winner.plan.label(), "overrides": winner.plan.overrides(),
                                       "override_line": line, "is_shipped": winner.plan == own}}


def mesh_links(mesh, tpu: Slice) -> dict:
    """{axes: links} a collective over each set of the mesh's axes drives on the slice's torus."""
    import numpy as np

    from model.predict import CHIPS, links_by_axes, wraps

    coords = np.array([d.coords for d in mesh.devices.flat]).reshape(*mesh.devices.shape, -1)
    return links_by_axes(mesh.axis_names, coords, tpu.torus, wraps(CHIPS[tpu.generation.name], tpu.torus))


def search_row(r) -> str:
    """One ranked plan, as the search prints it while compiling."""
    if not r.compiled:
        return f"{r.plan.label()}: not compiled ({r.note})"
    text = f"{r.plan.label()}: " + ("fits" if r.fits else f"does not fit ({r.note})")
    p = r.predicted
    if p is not None:
        text += (f"; step {_secs(p['step_s'])}-{_secs(p['step_s_upper'])}, MFU {p['mfu']:.0%}, {p['bound']}-bound, "
                 f"ICI {p['ici_over_compute']:.0%} of compute")
    return text


def search_table(ranking, own) -> str:
    """The ranking as a table: the fitting plans by predicted step, then the rest."""
    def pct(x):
        return f"{x:.0%}" if x is not None else "-"

    rows = [("#", "plan", "fits", "train / eval HBM", "step s (lower-upper)", "MFU", "bound", "ICI / compute")]
    for i, r in enumerate(ranking, 1):
        p = r.predicted
        rows.append((str(i), r.plan.label() + (" (shipped)" if r.plan == own else ""), "yes" if r.fits else "no",
                     f"{pct(r.train_fraction)} / {pct(r.eval_fraction)}",
                     f"{p['step_s']:.3f}-{p['step_s_upper']:.3f}" if p else "-", pct(p["mfu"]) if p else "-",
                     p["bound"] if p else "-", pct(p["ici_over_compute"]) if p else "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows)


# ----------------------------------------------------------------------------- the checks and the plan


def check_run(cfg, devices):
    """train.py's start-up checks (check_config, check_plan: the same functions) for a run over
    `devices`, at as many hosts as they belong to; a hub tokenizer is not fetched (not checked).
    -> (Settings, Program, the tokenizer or None). Raises train.ConfigError naming the key."""
    import train

    settings = train.check_config(cfg)
    hosts = len({d.process_index for d in devices})
    program, tokenizer = train.check_plan(cfg, settings, hosts, devices, hub_tokenizer=False)
    return settings, program, tokenizer


def stated_hosts(cfg) -> tuple[int, int]:
    """(plan.hosts, plan.devices_per_host): the hardware an experiment without a TPU slice is planned
    for; ValueError naming the key when unset or not a whole number above 0."""
    plan = cfg.get("plan") or {}
    out = []
    for key in ("hosts", "devices_per_host"):
        value = plan.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"plan.{key}={value!r}: without tpu.topology the experiment states its hardware in "
                             "plan.hosts and plan.devices_per_host (whole numbers, 1 or more)")
        out.append(value)
    return out[0], out[1]


def cpu_devices(hosts: int, per_host: int):
    """hosts x per_host fake CPU devices, each host's block carrying its process index: the stand-ins
    of a GPU (or CPU) plan's devices. The process must expose that many (main sets the XLA flag)."""
    import jax

    need = hosts * per_host
    devices = jax.devices("cpu")
    if len(devices) < need:
        raise SystemExit(f"compile_tpu: the plan needs {need} devices and this process has {len(devices)} CPU "
                         f"devices: run it as its own process (it sets --xla_force_host_platform_device_count)")
    return [_OnHost(d, i // per_host) for i, d in enumerate(devices[:need])]


class _OnHost:
    """A CPU device seen as one of a planned host's: one process stands for all the plan's hosts."""

    def __init__(self, device, process_index: int):
        self.device, self.process_index = device, process_index

    def __getattr__(self, name):
        return getattr(self.device, name)


def force_cpu_devices(count: int) -> None:
    """At least `count` CPU devices in this process: read by XLA when its backend starts."""
    flags = os.environ.get("XLA_FLAGS", "")
    have = re.search(r"--xla_force_host_platform_device_count=(\d+)", flags)
    if have and int(have.group(1)) >= count:
        return
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", flags)
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()


def make_plan(cfg, settings, program, tokenizer, hardware: str) -> dict:
    """What the run will do, from its checked settings and program (nothing compiled, no data read)."""
    import jax

    from model.flops import flops_per_token, peak_flops, recompute_factor
    from model.optimizer import resolve_warmup

    mesh = dict(program.mesh.shape)
    devices = list(program.mesh.devices.flat)
    hosts = len({d.process_index for d in devices})
    data = settings.data
    batch, seq, microbatches = data.global_batch_size, data.seq_len, int(cfg.train.microbatches)
    batch_ways = mesh["data"] * mesh["fsdp"]
    steps = int(cfg.train.steps)
    # a later stage of a staged run resumes at stage_start: its own steps run at this shape
    stage_start = cfg.train.get("stage_start")
    stage_start = int(stage_start) if stage_start is not None else None
    stage_steps = steps - (stage_start or 0)
    warmup, decay_steps, notice = resolve_warmup(cfg.optimizer, steps)
    lr = float(cfg.optimizer.lr)
    params = sum(x.size for x in jax.tree.leaves(program.abstract_state["params"]))
    tokens_per_step = batch * seq
    # The run's executed FLOPs at every chip's peak: the least time it can take (TPUs; a fake CPU
    # device has no peak).
    peak = peak_flops(devices[0].device_kind)
    run_flops = (flops_per_token(settings.model, seq, causal=True) * stage_steps * tokens_per_step
                 * recompute_factor(settings.model, seq, int(cfg.train.loss_chunk)))
    if tokenizer is not None:
        tok = f"checked: {tokenizer.get_vocab_size():,} ids within model.vocab_size {settings.model.vocab_size:,}"
    else:
        tok = f"not checked: tokenizer not local ({data.tokenizer})"
    return {
        "experiment": str(cfg.name), "hardware": hardware, "hosts": hosts, "devices": len(devices),
        "devices_per_host": len(devices) // hosts, "device_kind": devices[0].device_kind, "mesh": mesh,
        "params": int(params), "tokenizer": tok,
        "num_shards": data.num_shards, "shards_per_host": data.num_shards // hosts,
        "rows_per_shard": batch // data.num_shards, "num_workers": data.num_workers,
        "add_bos": data.add_bos,
        "global_batch_size": batch, "seq_len": seq, "tokens_per_step": tokens_per_step,
        "rows_per_chip": batch // batch_ways, "microbatches": microbatches,
        "rows_per_microbatch": batch // batch_ways // microbatches, "tensor": mesh["tensor"],
        "steps": steps, "token_budget": steps * tokens_per_step,
        "stage_start": stage_start, "stage_tokens": stage_steps * tokens_per_step,
        "lr": lr, "warmup_steps": warmup, "decay_steps": decay_steps,
        "min_lr": lr * float(cfg.optimizer.min_lr_ratio), "schedule_notice": notice,
        "days_at_peak": run_flops / (len(devices) * peak) / 86400 if peak else None,
    }


def duration(days: float) -> str:
    return f"{days:.1f} days" if days >= 2 else f"{days * 24:.1f} hours"


def plan_report(plan: dict) -> str:
    """The plan as the console shows it (--no-compile, and above the compiled figures)."""
    def tokens(n):
        return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"

    mesh = " x ".join(f"{k} {v}" for k, v in plan["mesh"].items())
    # the least time the run (a later stage: the stage) can take, TPUs only
    floor = (f"; at least {duration(plan['days_at_peak'])} (every chip at its peak FLOP/s)"
             if plan["days_at_peak"] else "")
    shared = f" (shared by the {plan['tensor']} chips of a tensor group)" if plan["tensor"] > 1 else ""
    lines = [
        f"plan {plan['experiment']}: every check passed; tokenizer {plan['tokenizer']}",
        f"  hardware  {plan['hardware']}: {plan['hosts']} host(s) x {plan['devices_per_host']} devices = "
        f"{plan['devices']} ({plan['device_kind']}); mesh {mesh}",
        f"  model     {plan['params'] / 1e9:.2f}B parameters",
        f"  data      {plan['num_shards']} virtual shards: {plan['shards_per_host']} per host, "
        f"{plan['rows_per_shard']} row(s) each; data.num_workers {plan['num_workers']} per host; "
        f"data.add_bos {str(plan['add_bos']).lower()}",
        f"  batch     {plan['global_batch_size']} rows x {plan['seq_len']} = {plan['tokens_per_step']:,} tokens per "
        f"step; {plan['rows_per_chip']} rows per chip{shared}, {plan['rows_per_microbatch']} per microbatch "
        f"({plan['microbatches']} microbatches)",
        f"  run       {plan['steps']:,} steps x {plan['tokens_per_step']:,} tokens = "
        f"{tokens(plan['token_budget'])} tokens ({plan['token_budget'] / plan['params']:.1f} per parameter)"
        + (floor if plan.get("stage_start") is None else ""),
        f"  schedule  lr {plan['lr']:g}, linear warmup {plan['warmup_steps']:,} steps "
        f"({tokens(plan['warmup_steps'] * plan['tokens_per_step'])} tokens), cosine decay to {plan['min_lr']:g} "
        f"at step {plan['decay_steps']:,}" + (" (then held)" if plan["decay_steps"] < plan["steps"] else ""),
    ]
    if plan.get("stage_start") is not None:
        # a later stage: its own steps, resumed from the run's checkpoint at train.stage_start
        first = plan["stage_start"] + 1
        lines.insert(-1, f"  stage     steps {first:,}-{plan['steps']:,} of the run (train.stage_start "
                     f"{plan['stage_start']:,}): {plan['steps'] - plan['stage_start']:,} steps = "
                     f"{tokens(plan['stage_tokens'])} tokens{floor}")
    if plan["schedule_notice"]:
        lines.append(f"  {plan['schedule_notice']}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- CLI


def compose(overrides: list[str]):
    """The run's config as train.py would see it (Hydra compose; no run directory is created: its
    path is the one train.py's Hydra would give it, runs/<name>)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    import train  # registers the ${project_root:} resolver

    with initialize_config_dir(config_dir=str(train.PROJECT_ROOT / "configs"), version_base="1.3"):
        return hydra_compose(config_name="train", overrides=["paths.run_dir=${paths.runs_dir}/${name}", *overrides])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--topology", help="TPU slice, e.g. v4-32, v5e-16, v6e-16 (default: the config's tpu.topology)")
    parser.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    parser.add_argument("--quick", action="store_true",
                        help="~3x faster compile with no effort on the program's speed; memory figures within a "
                             "few per cent of the full compile's (to compare variants, not to quote)")
    parser.add_argument("--no-compile", action="store_true",
                        help="stop after train.py's checks and the mesh over the planned devices, and print the "
                             "plan (hosts, mesh, shards, rows per chip, tokens, steps, schedule); an experiment "
                             "without tpu.topology is checked at plan.hosts x plan.devices_per_host")
    parser.add_argument("--dcn-gbps", type=float, default=DEFAULT_DCN_GBPS,
                        help="over several slices (tpu.slices=N): the DCN bandwidth of one host in Gbit/s that the "
                             f"transfers between slices are priced at (default {DEFAULT_DCN_GBPS:g}, a stated figure)")
    parser.add_argument("--search", action="store_true",
                        help="rank the slice's plans (mesh ways, microbatches, remat, loss chunk) under the HBM "
                             "limit by predicted step time, compiling each --quick, then compile the winner and "
                             "print its overrides (model/plan_search.py; docs/tpu-pod.md)")
    parser.add_argument("--search-budget", type=int, default=None,
                        help="--search: how many plans to compile, the shipped one included (default "
                             "%d; each a quick compile of 1-2 min on 2 cores for a 1B)" % DEFAULT_SEARCH_BUDGET)
    parser.add_argument("--search-by", choices=("mid", "step", "upper"), default=None,
                        help="--search: rank by the middle of the predicted step's range (mid, the default: half "
                             "the collectives' time hidden), its lower bound (step: all hidden) or its upper "
                             "bound (upper: none hidden)")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="where compiled plans' figures are kept by their program's fingerprint, so an unchanged "
                             "program is not compiled again (default $JAXPT_TPU_COMPILE_CACHE, else "
                             "~/.cache/jaxpt/tpu_compiles; model/compile_cache.py)")
    parser.add_argument("--no-cache", action="store_true",
                        help="compile every step even when its figures are kept, and keep nothing")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for train.py (experiment=...)")
    args = parser.parse_intermixed_args(argv)   # overrides before and after the options
    if not args.search and (args.search_budget is not None or args.search_by is not None):
        print("compile_tpu: --search-budget and --search-by apply to --search", file=sys.stderr)
        return 2
    if args.search and args.no_compile:
        print("compile_tpu: --search compiles its plans: drop --no-compile", file=sys.stderr)
        return 2
    if args.search_budget is not None and args.search_budget < 1:
        print(f"compile_tpu: --search-budget {args.search_budget}: expected 1 or more compiles", file=sys.stderr)
        return 2

    from omegaconf.errors import InterpolationResolutionError

    try:
        cfg = compose(args.overrides)
        name = args.topology or cfg.tpu.topology
        if not name and not args.no_compile:
            raise SystemExit("compile_tpu: no TPU topology: pass --topology (e.g. v4-32) or set tpu.topology "
                             "in the experiment (--no-compile checks a GPU plan: plan.hosts, plan.devices_per_host)")
        if args.dcn_gbps <= 0:
            raise SystemExit(f"compile_tpu: --dcn-gbps {args.dcn_gbps:g}: expected a bandwidth above 0")
        tpu = parse_slice(name) if name else None
        n_slices = slices_from_cfg(cfg) if name else 1
        if tpu is None:
            hosts, per_host = stated_hosts(cfg)
            force_cpu_devices(hosts * per_host)
    except (ValueError, InterpolationResolutionError) as e:
        print(f"compile_tpu: config error: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
        return 2
    if tpu is not None:
        require_libtpu()
        libtpu_env(tpu)
    from model.compile_cache import CompileCache, default_dir

    cache = None if args.no_cache else CompileCache(args.cache_dir or default_dir())
    try:
        if args.search:
            plan = search_plans(args.overrides, cfg, tpu, args.search_budget or DEFAULT_SEARCH_BUDGET,
                                args.search_by or "mid", quick=args.quick, cache=cache)
        elif not args.no_compile:
            plan = compile_plan(cfg, tpu, quick=args.quick, dcn_gbps=args.dcn_gbps, cache=cache)
            print(plan_report(plan["plan"]), flush=True)
            print(report(plan), flush=True)
        else:
            if tpu is not None:
                devices, hardware = slice_devices(tpu, n_slices), slice_name(tpu, n_slices)
            else:
                devices = cpu_devices(hosts, per_host)
                hardware = "plan.hosts x plan.devices_per_host, over fake CPU devices"
            plan = make_plan(cfg, *check_run(cfg, devices), hardware)
            print(plan_report(plan), flush=True)
    except (ValueError, InterpolationResolutionError) as e:   # a config mistake (train.ConfigError included): one line
        print(f"compile_tpu: config error: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
        return 2
    if args.json:
        args.json.write_text(json.dumps(plan, indent=1) + "\n")
    if args.no_compile:
        return 0
    if args.search and plan["winner"] is None:
        return 1
    return 0 if plan["train_step"]["fits"] and plan["eval_step"]["fits"] else 1


if __name__ == "__main__":
    # The compile runs on libtpu's description of the slice; the local backend only holds
    # host-side constants, so keep it on CPU (no TPU probe on a machine without one).
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.exit(main())

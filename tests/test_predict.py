"""The predicted step time (model/predict.py) on hand-made slices and numbers, the libtpu overlap
flags (model/tpu_flags.py) on their way to a pod run and to the compile, and model/ici.py on an
async collective fusion as libtpu prints it under those flags. No compile: a few seconds.

    pytest tests/test_predict.py -q
"""
import importlib.util
import os
import shlex
import sys
from pathlib import Path

import numpy as np
import pytest

from model import ici, predict, tpu_flags
from model.flops import PEAK_FLOPS

ROOT = Path(__file__).resolve().parents[1]


def _script(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def torus_coords(torus, mesh_shape):
    """[*mesh_shape, len(torus)] coordinates of a mesh laid over the torus in row-major order (the
    mesh's last axis along the torus's last dimension), as a hand-made stand-in for libtpu's."""
    pos = np.stack(np.unravel_index(np.arange(int(np.prod(torus))), torus), axis=-1)
    return pos.reshape(*mesh_shape, len(torus))


AXES = ("data", "fsdp", "context", "tensor")


def test_wraparound_only_on_whole_cubes_and_full_pod_sides():
    v4, v6e = predict.CHIPS["v4"], predict.CHIPS["v6e"]
    assert predict.wraps(v4, (2, 2, 4)) == (False, False, False)       # v4-32
    assert predict.wraps(v4, (2, 4, 4)) == (False, False, False)       # v4-64: not a whole cube
    assert predict.wraps(v4, (4, 4, 4)) == (True, True, True)          # v4-128
    assert predict.wraps(v4, (4, 4, 8)) == (True, True, True)
    assert predict.wraps(v6e, (4, 4)) == (False, False)                # v6e-16
    assert predict.wraps(v6e, (8, 16)) == (False, True)
    assert predict.wraps(predict.CHIPS["v5litepod"], (16, 16)) == (True, True)


def test_links_per_mesh_axis_follow_the_torus_dimensions_a_group_spans():
    # v4-32 (2x2x4, no wraparound), fsdp 4 x context 4: context runs along the 4-long dimension
    # (one link: a line), fsdp over the 2x2 plane (one link along each of two dimensions)
    coords = torus_coords((2, 2, 4), (1, 4, 4, 1))
    links = predict.links_by_axes(AXES, coords, (2, 2, 4), (False, False, False))
    assert links["context"] == 1 and links["fsdp"] == 2 and links["fsdp+context"] == 3
    assert links["data"] == 0 and links["tensor"] == 0    # size-1 axes: nothing to cross
    # fsdp over all 16 chips: every dimension once
    flat = predict.links_by_axes(AXES, torus_coords((2, 2, 4), (1, 16, 1, 1)), (2, 2, 4), (False,) * 3)
    assert flat["fsdp"] == 3
    # a v4-128 (4x4x4, wrapped): context 4 along a whole wrapped dimension drives both ways
    cube = predict.links_by_axes(AXES, torus_coords((4, 4, 4), (1, 16, 4, 1)), (4, 4, 4), (True,) * 3)
    assert cube["context"] == 2 and cube["fsdp"] == 4 and cube["fsdp+context"] == 6
    # a group covering part of a wrapped dimension is a line: one link
    half = predict.links_by_axes(AXES, torus_coords((4, 4, 4), (1, 32, 2, 1)), (4, 4, 4), (True,) * 3)
    assert half["context"] == 1


def test_predicted_terms_bound_and_mfu_on_hand_made_numbers():
    v4 = predict.CHIPS["v4"]
    chips, peak = 16, PEAK_FLOPS["TPU v4"]
    useful = 1.5 * chips * peak            # 1.5 s of useful work at peak ...
    executed = 2.0 * chips * peak          # ... 2 s executed (remat)
    link = v4.link_bps
    p = predict.predict(useful_flops=useful, executed_flops=executed, chips=chips, chip=v4,
                        ici_bytes_by_axes={"fsdp": 3 * link * 0.5, "context": link * 1.5, "unparsed": link * 0.25},
                        links={"fsdp": 3, "context": 1}, hbm_bytes=v4.hbm_bps * 0.1)
    assert p["compute_s"] == pytest.approx(2.0)
    # fsdp 0.5 s over 3 links, context 1.5 s over 1, unparsed priced at one link
    assert p["ici_s_by_axes"] == pytest.approx({"fsdp": 0.5, "context": 1.5, "unparsed": 0.25})
    assert p["ici_s"] == pytest.approx(2.25) and p["hbm_s"] == pytest.approx(0.1)
    assert p["bound"] == "ici" and p["step_s"] == pytest.approx(2.25)
    assert p["step_s_upper"] == pytest.approx(2.0 + 2.25)
    assert p["mfu"] == pytest.approx(1.5 / 2.25) and p["mfu_lower"] == pytest.approx(1.5 / 4.25)
    assert p["ici_over_compute"] == pytest.approx(2.25 / 2.0)
    assert p["links_by_axes"] == {"fsdp": 3, "context": 1, "unparsed": 1}
    # half the bytes: compute-bound, and the links' time is 56% of compute
    q = predict.predict(useful_flops=useful, executed_flops=executed, chips=chips, chip=v4,
                        ici_bytes_by_axes={"fsdp": 3 * link * 0.25, "context": link * 0.75, "unparsed": link * 0.125},
                        links={"fsdp": 3, "context": 1})
    assert q["bound"] == "compute" and q["step_s"] == pytest.approx(2.0) and q["hbm_s"] == 0
    assert q["mfu"] == pytest.approx(0.75)
    # several slices: the DCN's seconds join the terms
    r = predict.predict(useful_flops=useful, executed_flops=executed, chips=chips, chip=v4, ici_bytes_by_axes={},
                        links={}, dcn_s=3.0)
    assert r["bound"] == "dcn" and r["step_s"] == 3.0 and r["step_s_upper"] == 5.0
    # host offload: what crosses the PCIe link (both directions summed) at the generation's rate
    h = predict.predict(useful_flops=useful, executed_flops=executed, chips=chips, chip=v4, ici_bytes_by_axes={},
                        links={}, host_bytes=v4.pcie_bps * 2.5)
    assert h["host_s"] == pytest.approx(2.5) and h["bound"] == "host"
    assert h["step_s"] == pytest.approx(2.5) and h["step_s_upper"] == pytest.approx(2.0 + 2.5)
    assert r["host_s"] == 0.0


def test_maxtexts_published_v6e_run_falls_within_a_quarter_once_its_host_trips_are_priced():
    """#57's calibration: MaxText's compiled figures for its v6e-16 Llama-3.1-8B recipe (recorded in
    scripts/bench/bench_predict.py) priced by this model; the no-overlap end of the range within
    25% of the published 3.393 s, which it is not without the offloaded activations' PCIe trips."""
    path = ROOT / "scripts" / "bench" / "bench_predict.py"
    spec = importlib.util.spec_from_file_location("bench_predict", path)
    cal = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cal)
    c = cal.calibration()
    published = cal.MAXTEXT_V6E_16_8B["published_step_s"]
    assert abs(c["with_host"]["step_s_upper"] / published - 1) <= 0.25
    assert abs(c["without_host"]["step_s_upper"] / published - 1) > 0.25
    assert c["with_host"]["host_s"] > c["with_host"]["ici_s"] > 0


@pytest.mark.parametrize("row", ["MAXTEXT_V5E_256_16B", "OURS_AT_MAXTEXT_V5E_256_16B"])
def test_maxtexts_published_v5e_256_run_falls_within_a_quarter(row):
    """The v5e row: MaxText's 16B on a v5e-256 (120 TFLOP/s per chip published, 61.1% MFU), its step
    derived by MaxText's count; MaxText's own program for that recipe, and ours compiled at its
    shapes (figures recorded in scripts/bench/bench_predict.py), each predict both ends of the
    range within 25% of it, and more tokens per second per chip than MaxText measured (#57 item
    2's goal)."""
    path = ROOT / "scripts" / "bench" / "bench_predict.py"
    spec = importlib.util.spec_from_file_location("bench_predict", path)
    cal = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cal)
    m = getattr(cal, row)
    p, published = cal.calibration(m)["with_host"], cal.published_step_s(m)
    assert published == pytest.approx(10.31, abs=0.01)      # 1.0e11 FLOPs a token x 12,288 tokens / 120 TFLOP/s
    assert all(abs(s / published - 1) <= 0.25 for s in (p["step_s"], p["step_s_upper"]))
    assert p["step_s_upper"] < published and p["bound"] == "compute"


def test_a_plans_host_buffers_cross_pcie_twice_a_step_and_are_printed():
    """compile_tpu's figures of a compiled program that keeps buffers in host memory (as MaxText's
    offloaded activations): twice their bytes reach the host term, and the report says so."""
    ct = _script("compile_tpu")
    figures = {"host_temporaries_gib": 1.5, "host_arguments_gib": 0.5}
    assert ct.host_bytes_per_step(figures) == 2 * 2.0 * 2**30
    assert ct.host_bytes_per_step({}) == 0.0          # figures kept before the host fields: nothing offloaded
    v6e = predict.CHIPS["v6e"]
    p = predict.predict(useful_flops=1.0, executed_flops=1.0, chips=16, chip=v6e, ici_bytes_by_axes={}, links={},
                        host_bytes=ct.host_bytes_per_step(figures))
    assert p["host_s"] == pytest.approx(4 * 2**30 / v6e.pcie_bps)
    assert "host (PCIe) " in ct.predicted_line(p)
    assert "host (PCIe)" not in ct.predicted_line({**p, "host_s": 0.0})


def test_every_generation_has_its_constants():
    for name in ("v4", "v5p", "v5e", "v6e"):
        chip = predict.CHIPS[name]
        assert chip.peak_flops > 0 and chip.hbm_bps > 0 and chip.link_bps > 0 and chip.links in (4, 6)
        assert 1e10 <= chip.pcie_bps <= 4e10
    ct = _script("compile_tpu")
    assert set(ct.GENERATIONS) <= set(predict.CHIPS)   # every slice compile_tpu takes can be predicted


# An async collective fusion as libtpu 0.0.42.1 prints it with the overlap flags, cut to what
# model/ici.py reads: in a loop of 3 trips, one all-gather (channel 80) appears in its start's
# computation, in the compute fusion it overlaps and in its done's; one reduce-scatter (channel 81)
# outside the loop appears once.
ASYNC_FUSION_HLO = """HloModule jit_step, is_scheduled=true

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}

%fused_start (p0: bf16[1,32,2,32]) -> bf16[1,128,2,32] {
  %p0 = bf16[1,32,2,32]{3,2,0,1} parameter(0)
  ROOT %all-gather.185 = bf16[1,128,2,32]{3,2,0,1} all-gather(%p0), channel_id=80, \
replica_groups=mesh['axis_0'=4,'axis_1'=1] {'axis_0'}, dimensions={1}, use_global_device_ids=true
}

%async_collective_fusion.422 (p1: bf16[1,32,2,32]) -> bf16[1,128,2,32] {
  %p1 = bf16[1,32,2,32]{3,2,0,1} parameter(0)
  ROOT %all-gather.187 = bf16[1,128,2,32]{3,2,0,1} all-gather(%p1), channel_id=80, \
replica_groups=mesh['axis_0'=4,'axis_1'=1] {'axis_0'}, dimensions={1}, use_global_device_ids=true
}

%fused_done (p2: bf16[1,32,2,32]) -> bf16[1,128,2,32] {
  %p2 = bf16[1,32,2,32]{3,2,0,1} parameter(0)
  ROOT %all-gather.189 = bf16[1,128,2,32]{3,2,0,1} all-gather(%p2), channel_id=80, \
replica_groups=mesh['axis_0'=4,'axis_1'=1] {'axis_0'}, dimensions={1}, use_global_device_ids=true
}

%body (p: (s32[], bf16[1,32,2,32])) -> (s32[], bf16[1,32,2,32]) {
  %p = (s32[]{:T(128)}, bf16[1,32,2,32]{3,2,0,1}) parameter(0)
  %w = bf16[1,32,2,32]{3,2,0,1} get-tuple-element(%p), index=1
  %async-collective-start.3 = (bf16[1,32,2,32]{3,2,0,1}, bf16[1,128,2,32]{3,2,0,1}) fusion(%w), kind=kCustom, \
calls=%fused_start
  %fusion.422 = bf16[1,128,2,32]{3,2,0,1} fusion(%w), kind=kCustom, calls=%async_collective_fusion.422
  %async-collective-done.3 = bf16[1,128,2,32]{3,2,0,1} fusion(%async-collective-start.3), kind=kCustom, \
calls=%fused_done
}

%cond (q: (s32[], bf16[1,32,2,32])) -> pred[] {
  %q = (s32[]{:T(128)}, bf16[1,32,2,32]{3,2,0,1}) parameter(0)
  %limit = s32[]{:T(128)} constant(3)
  %i = s32[]{:T(128)} get-tuple-element(%q), index=0
  ROOT %lt = pred[]{:T(512)} compare(%i, %limit), direction=LT
}

ENTRY %main (a: bf16[1,32,2,32]) -> f32[16] {
  %zero = s32[]{:T(128)} constant(0)
  %tuple.1 = (s32[]{:T(128)}, bf16[1,32,2,32]{3,2,0,1}) tuple(%zero, %a)
  %while.1 = (s32[]{:T(128)}, bf16[1,32,2,32]{3,2,0,1}) while(%tuple.1), condition=%cond, body=%body
  ROOT %reduce-scatter.1 = f32[16]{0} reduce-scatter(%r), channel_id=81, \
replica_groups=[1,4]<=[4], dimensions={0}, to_apply=%add
}
""".replace("\\\n", "")


def test_an_async_collective_fusion_counts_once_per_trip():
    mesh = {"data": 1, "fsdp": 4, "context": 1, "tensor": 1}
    got = ici.ici_bytes_per_chip(ASYNC_FUSION_HLO, mesh)
    gather = 1 * 128 * 2 * 32 * 2 * 3 / 4 * 3        # its result, 3/4 sent, 3 trips: once each, not thrice
    scatter = 16 * 4 * 4 * 3 / 4                     # the operand (4 results), 3/4 sent
    assert got["bytes_by_axes"] == {"fsdp": pytest.approx(gather + scatter)}
    kinds = sorted((c.kind, c.times) for c in ici.collectives(ASYNC_FUSION_HLO, mesh))
    assert kinds == [("all-gather", 3), ("reduce-scatter", 1)]


def test_overlap_flags_join_the_users_own_and_the_user_wins():
    flags = tpu_flags.init_args(None).split()
    assert flags == list(tpu_flags.OVERLAP_FLAGS)
    mine = "--xla_tpu_enable_async_collective_fusion=false --xla_tpu_scoped_vmem_limit_kib=98304"
    words = tpu_flags.init_args(mine).split()
    assert words[:2] == mine.split()                                        # the user's, first and kept
    assert "--xla_tpu_enable_async_collective_fusion=true" not in words    # the user's value wins
    assert set(tpu_flags.OVERLAP_FLAGS[1:]) <= set(words)
    assert tpu_flags.init_args(tpu_flags.init_args(None)) == tpu_flags.init_args(None)   # idempotent


def test_the_flags_reach_the_compile_and_the_pod(monkeypatch, capsys):
    # compile_tpu sets them before libtpu starts (libtpu reads LIBTPU_INIT_ARGS when it loads, also
    # to compile only: an unknown flag there stops it, "Unknown command line flag")
    ct = _script("compile_tpu")
    monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_tpu_scoped_vmem_limit_kib=98304")
    for key in ("TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES", "ALLOW_MULTIPLE_LIBTPU_LOAD"):
        monkeypatch.delenv(key, raising=False)
    ct.libtpu_env(ct.parse_slice("v4-32"))
    assert os.environ["LIBTPU_INIT_ARGS"] == tpu_flags.init_args("--xla_tpu_scoped_vmem_limit_kib=98304")
    # scripts/tpu.py run exports them on every worker, joined to a LIBTPU_INIT_ARGS given with --env
    tpu = _script("tpu")
    for extra, expected in (([], tpu_flags.init_args(None)),
                            (["--env", "LIBTPU_INIT_ARGS=--xla_foo=1"], tpu_flags.init_args("--xla_foo=1"))):
        rc = tpu.main(["--dry-run", "run", "--name", "pod", "--zone", "z", *extra, "--", "train.steps=1"],
                      runner=lambda cmd: pytest.fail(f"a dry run ran {cmd}"))
        assert rc == 0
        argv = shlex.split(capsys.readouterr().out.splitlines()[0])
        script = argv[argv.index("--command") + 1]
        assert script.count("export LIBTPU_INIT_ARGS=") == 1
        assert f"export LIBTPU_INIT_ARGS={shlex.quote(expected)}" in script, script
        assert script.index("export LIBTPU_INIT_ARGS=") < script.index("setsid nohup")   # before train.py starts


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason='libtpu not installed: pip install -e ".[tpu]"')
def test_libtpu_reads_the_flags_in_compile_tpus_process():
    # A flag libtpu does not know stops it as it loads: what compile_tpu puts in LIBTPU_INIT_ARGS
    # reaches the compiler (and so the overlap flags, which test_compile_tpu's compiles carry). ~4 s.
    import subprocess

    env = {**os.environ, "JAX_PLATFORMS": "cpu", "LIBTPU_INIT_ARGS": "--xla_no_such_flag_57=true"}
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "compile_tpu.py"), "--topology", "v5e-4",
                             "--quick"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert result.returncode != 0
    assert "Unknown command line flag 'xla_no_such_flag_57'" in result.stdout + result.stderr

"""Every experiment that declares a TPU slice (tpu.topology) compiles for it and fits in 90% of its
usable HBM, compiled by the real TPU compiler (libtpu) on this CPU machine: scripts/compile_tpu.py.
The experiments compile with --quick (no compiler effort on speed: ~20 CPU-s each instead of 70-110,
a quarter of the suite's CPU otherwise); its figures came out up to 3.7% below the full compile's
(BENCHMARKS.md "Quick TPU compiles"), so they are held to 90% less that gap.

    pip install -e ".[tpu]"   # CI installs it; without libtpu the compile tests skip
    pytest tests/test_compile_tpu.py -q -s   # -s prints each plan's per-chip figures
"""
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "compile_tpu.py"
HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None
needs_libtpu = pytest.mark.skipif(not HAS_LIBTPU, reason='libtpu not installed: pip install -e ".[tpu]" (CI does)')
MAX_HBM_FRACTION = 0.9   # XLA's figures are exact, but leave the run room (fragmentation, a bigger eval)
QUICK_BELOW_FULL = 0.04  # the most a --quick figure fell below the full compile's (3.7%, v5e_16 eval step)


def _load_script():
    spec = importlib.util.spec_from_file_location("compile_tpu", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["compile_tpu"] = mod   # its dataclasses look their module up while being defined
    spec.loader.exec_module(mod)
    return mod


ct = _load_script()


def planned_experiments() -> list[str]:
    """Experiment files that declare a TPU slice (read as YAML: no composing at collection)."""
    out = []
    for path in sorted((ROOT / "configs" / "experiment").glob("*.yaml")):
        if OmegaConf.select(OmegaConf.load(path), "tpu.topology"):
            out.append(path.stem)
    return out


def run_script(*args, env_extra=None):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", **(env_extra or {})}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=600)


# ---------------------------------------------------------------- slices (no libtpu needed)
@pytest.mark.parametrize("name,chips,torus", [
    ("v4-8", 4, (2, 2, 1)), ("v4-32", 16, (2, 2, 4)), ("v4-64", 32, (2, 4, 4)), ("v4-256", 128, (4, 4, 8)),
    ("v5p-128", 64, (4, 4, 4)), ("v5e-16", 16, (4, 4)), ("v5litepod-32", 32, (4, 8)), ("v6e-8", 8, (2, 4)),
    ("v6e-256", 256, (16, 16)), ("v5e-1", 1, (1, 1)),
])
def test_slice_names_map_to_cloud_tpu_shapes(name, chips, torus):
    tpu = ct.parse_slice(name)
    assert (tpu.chips, tpu.torus) == (chips, torus)


@pytest.mark.parametrize("bad", ["v4-31", "v4-3", "v3-32", "tpu-v4-32", "v6e"])
def test_bad_slice_name_is_named(bad):
    with pytest.raises(ValueError, match=f"TPU topology '{bad}'.*v4-32"):
        ct.parse_slice(bad)


def test_every_planned_experiment_declares_a_known_slice():
    names = planned_experiments()
    assert {"v4_32_llama_1b", "v4_32_llama2_7b"} <= set(names)
    assert {ct.parse_slice(OmegaConf.load(ROOT / "configs" / "experiment" / f"{n}.yaml").tpu.topology)
            .generation.name for n in names} >= {"v4", "v5e", "v6e"}


@pytest.mark.slow
def test_without_libtpu_it_fails_in_one_line(tmp_path):
    # A libtpu that cannot be imported stands in for a plain dev install (CI has the real one).
    (tmp_path / "libtpu.py").write_text("raise ImportError('no libtpu in this test')\n")
    result = run_script("experiment=v4_32_llama_1b",
                        env_extra={"PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])})
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and 'pip install -e ".[tpu]"' in lines[0], result.stderr


# ---------------------------------------------------------------- plans (--no-compile): every experiment
def experiments() -> list[str]:
    """Every experiment file: a new one is checked without being listed here."""
    return sorted(path.stem for path in (ROOT / "configs" / "experiment").glob("*.yaml"))


@pytest.mark.parametrize("experiment", experiments())
def test_every_experiment_passes_every_check_before_anything_is_rented(experiment, tmp_path):
    """train.py's start-up checks at the experiment's own hosts (a TPU slice's, or plan.hosts x
    plan.devices_per_host), then the plan: seconds, nothing compiled, no data read. A pod or GPU
    experiment carries a real job: its header states the token budget the config runs."""
    if experiment in planned_experiments() and not HAS_LIBTPU:
        pytest.skip('the slice\'s devices come from libtpu: pip install -e ".[tpu]"')
    out = tmp_path / "plan.json"
    result = run_script(f"experiment={experiment}", "--no-compile", "--json", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    plan = json.loads(out.read_text())
    # The plan names the run: the file's name, or the run its stages share (a staged extension)
    run_name = OmegaConf.load(ROOT / "configs" / "experiment" / f"{experiment}.yaml").get("name", experiment)
    assert f"plan {run_name}: every check passed" in result.stdout
    assert "train_step" not in plan and "compiled" not in result.stdout
    assert plan["devices"] == plan["hosts"] * plan["devices_per_host"] == math.prod(plan["mesh"].values())
    assert plan["global_batch_size"] % plan["num_shards"] == 0 and plan["num_shards"] % plan["hosts"] == 0
    assert plan["token_budget"] == plan["steps"] * plan["global_batch_size"] * plan["seq_len"]
    if experiment.startswith("sample"):
        return
    header = (ROOT / "configs" / "experiment" / f"{experiment}.yaml").read_text()
    assert f"{plan['steps']:,} steps x {plan['tokens_per_step']:,} tokens" in header, "the header's budget"
    assert plan["token_budget"] >= 1e9 and plan["warmup_steps"] < plan["steps"] and plan["lr"] <= 3e-4
    assert plan["add_bos"] is True    # every experiment trains a Llama tokenizer, which puts BOS first


@pytest.mark.parametrize("override, key", [
    ("data.num_shards=3", "data.num_shards=3"),                  # does not divide the batch of 512
    ("data.num_workers=256", "data.num_shards=512"),             # 4 hosts x 256 workers > 512 shards
    ("mesh.tensor=3", "mesh.fsdp=-1 cannot fill 16 devices"),    # 3 does not divide the v4-32's 16
    ("train.microbatches=64", "train.microbatches=64"),          # 32 rows per chip
    ("train.loss_chunk=1000", "train.loss_chunk=1000"),          # does not divide seq 1024
    ("data.seq_len=4096", "data.seq_len=4096"),                  # above model.max_seq_len
])
@needs_libtpu
def test_a_broken_experiment_fails_in_one_line_naming_the_key(override, key):
    result = run_script("experiment=v4_32_llama_1b", override, "--no-compile")
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("compile_tpu: config error: ") and key in lines[0], result.stderr
    assert "plan " not in result.stdout


def test_a_gpu_plan_checks_its_tokenizer_and_states_its_hardware():
    # A local tokenizer is loaded and checked against the model (the sample's 4,096 ids)...
    result = run_script("experiment=sample_125m", "model.vocab_size=1000", "--no-compile")
    assert result.returncode == 2 and "model.vocab_size=1000 is smaller than the tokenizer's 4096" in result.stderr
    # ... and a plan without a TPU slice names the keys that state its hardware.
    result = run_script("experiment=sample_125m", "plan.hosts=null", "--no-compile")
    assert result.returncode == 2 and "plan.hosts=None" in result.stderr, result.stderr
    result = run_script("experiment=gpu_8_llama_1b", "plan.hosts=3", "--no-compile")   # the batch of 256 over 3 hosts
    assert result.returncode == 2 and "data.global_batch_size=256 is not divisible by the process count 3" \
        in result.stderr, result.stderr


# ---------------------------------------------------------------- compiles (libtpu)
@pytest.mark.slow
@needs_libtpu
def test_cli_prints_and_writes_the_compiled_figures(tmp_path):
    # The default run (tiny model, batch 16 x 256) on a v5e-4: seconds to compile.
    out = tmp_path / "plan.json"
    result = run_script("--topology", "v5e-4", "--json", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    plan = json.loads(out.read_text())
    assert plan["quick"] is False and "QUICK" not in result.stdout
    assert plan["chips"] == 4 and plan["device_kind"].startswith("TPU v5") and plan["mesh"]["data"] == 4
    for step in ("train_step", "eval_step"):
        r = plan[step]
        assert r["fits"] and 0 < r["total_gib"] < 1
        assert r["total_gib"] == pytest.approx(r["arguments_gib"] + r["temporaries_gib"] + r["outputs_gib"]
                                               - r["aliased_gib"] + r["code_gib"])
        assert f"{step}: per chip {r['total_gib']:.2f} of 15.75 GiB" in result.stdout
    # The train state is donated: the new state's buffers alias the old one's.
    assert plan["train_step"]["aliased_gib"] == pytest.approx(plan["train_step"]["arguments_gib"], rel=0.01)


@pytest.mark.slow
@needs_libtpu
def test_a_plan_that_exceeds_hbm_does_not_fit(tmp_path):
    # 65,536 rows of 256 on 4 chips: the fp32 logits alone are 64 GiB per chip. --quick says so too.
    out = tmp_path / "plan.json"
    result = run_script("--topology", "v5e-4", "--quick", "--json", str(out), "data.global_batch_size=65536")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "train_step: does not fit" in result.stdout and "exceeds available HBM" in result.stdout
    assert "QUICK compile" in result.stdout
    plan = json.loads(out.read_text())
    assert plan["train_step"]["fits"] is False and plan["quick"] is True


@pytest.mark.slow
@needs_libtpu
@pytest.mark.parametrize("experiment", planned_experiments())
def test_experiment_compiles_for_its_slice_and_fits(experiment):
    # libtpu_env (and libtpu itself) write os.environ: restored after the test, or every later
    # train.py subprocess would see TPU_WORKER_HOSTNAMES, take itself for a TPU VM and try
    # jax.distributed
    saved = dict(os.environ)
    try:
        _compile_and_check(experiment)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _compile_and_check(experiment):
    cfg = ct.compose([f"experiment={experiment}"])    # as the script composes it (the run's directory named)
    tpu = ct.parse_slice(cfg.tpu.topology)
    ct.libtpu_env(tpu)   # before libtpu's first use in this process
    import jax

    effort = jax.config.jax_exec_time_optimization_effort
    plan = ct.compile_plan(cfg, tpu, quick=True)
    print("\n" + ct.report(plan))
    assert plan["quick"] and jax.config.jax_exec_time_optimization_effort == effort   # put back for later tests
    limit = MAX_HBM_FRACTION * (1 - QUICK_BELOW_FULL)
    for step in ("train_step", "eval_step"):
        r = plan[step]
        assert r["fits"], f"{experiment}: {step} does not fit on {tpu.name}: {r}"
        assert "dcn" not in r   # one slice: nothing crosses a data-center network
        assert r["hbm_fraction"] <= limit, (
            f"{experiment}: {step} needs {r['total_gib']:.2f} GiB per chip (quick compile), {r['hbm_fraction']:.0%} "
            f"of the {tpu.generation.usable_gib} GiB usable on {tpu.name} (limit {limit:.1%}: "
            f"{MAX_HBM_FRACTION:.0%} less the quick compile's gap); check with the full compile: "
            f"python scripts/compile_tpu.py experiment={experiment}")


# ---------------------------------------------------------------- several slices (tpu.slices=N)
# A compiled multislice program as libtpu prints it, cut to what model/dcn.py reads: a counted loop
# (one trip peeled off before it: counter 1..4) holding one Megascale all-reduce, one outside it,
# and an instruction whose metadata runs over two lines ("}" opening the second).
MULTISLICE_HLO = """HloModule jit_step, is_scheduled=true

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[]{:T(128)}, f32[8]{0}) parameter(0)
  %after-all.1 = token[] after-all(), frontend_attributes={MegascaleRendezvousKeyName="all-reduce.1_0"}
  %odd = f32[8]{0} add(%x, %x), metadata={op_name="splash
}}, stack_frame_id=3"}
  %send.1 = (bf16[704,8,128]{2,1,0}, u32[], token[]) send(%x, %after-all.1), frontend_attributes={@MS@="ALL_REDUCE"}
  %recv.1 = (bf16[704,8,128]{2,1,0}, u32[], token[]) recv(%after-all.1), frontend_attributes={@MS@="ALL_REDUCE"}
}

%cond (q: (s32[], f32[8])) -> pred[] {
  %q = (s32[]{:T(128)}, f32[8]{0}) parameter(0)
  %limit = s32[]{:T(128)} constant(4)
  %i = s32[]{:T(128)} get-tuple-element(%q), index=0
  ROOT %lt = pred[]{:T(512)} compare(%i, %limit), direction=LT
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %one = s32[]{:T(128)} constant(1)
  %start = s32[]{:T(128)} copy(%one)
  %tuple.1 = (s32[]{:T(128)}, f32[8]{0}) tuple(%start, %a)
  %while.1 = (s32[]{:T(128)}, f32[8]{0}) while(%tuple.1), condition=%cond, body=%body
  %send.2 = (f32[1000,8,128]{2,1,0}, u32[], token[]) send(%y, %after-all.2), frontend_attributes={@MS@="ALL_GATHER"}
}
""".replace("@MS@", "_xla_megascale_transfer_type")


def test_dcn_transfers_are_read_from_the_compiled_program():
    from model import dcn

    transfers = sorted(dcn.megascale_transfers(MULTISLICE_HLO), key=lambda t: t.kind)
    assert transfers == [dcn.Transfer("ALL_GATHER", 1000 * 8 * 128 * 4, 1),
                         dcn.Transfer("ALL_REDUCE", 704 * 8 * 128 * 2, 3)]   # recvs are not counted
    four = dcn.dcn_bytes_per_chip(transfers, 4)
    assert four["payload_bytes"] == 704 * 8 * 128 * 2 * 3 + 1000 * 8 * 128 * 4
    # a ring over 4 slices: an all-reduce sends 2*3/4 of its buffer, an all-gather 3/4
    assert four["sent_bytes"] == pytest.approx(1.5 * 704 * 8 * 128 * 2 * 3 + 0.75 * 1000 * 8 * 128 * 4)
    assert dcn.megascale_transfers(MULTISLICE_HLO.replace("megascale", "other")) == []


@pytest.mark.slow
@needs_libtpu
@pytest.mark.parametrize("experiment,slices", [("v4_32_llama2_7b", 2), ("v5e_16_llama_1b", 2)])
def test_experiment_compiles_for_two_slices_with_its_dcn_traffic(tmp_path, experiment, slices):
    out = tmp_path / "plan.json"
    result = run_script(f"experiment={experiment}", "--quick", f"tpu.slices={slices}", "--dcn-gbps", "50",
                        "--json", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    plan = json.loads(out.read_text())
    tpu = ct.parse_slice(plan["topology"])
    assert plan["slices"] == plan["mesh_slices"] == slices and plan["chips"] == slices * tpu.chips
    # data parallel across the slices (mesh.dcn_data=-1), FSDP over each slice's chips
    assert plan["mesh"] == {"data": slices, "fsdp": tpu.chips, "context": 1, "tensor": 1}
    assert plan["mesh_dcn"] == {"data": slices, "fsdp": 1, "context": 1, "tensor": 1}
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("train", overrides=[f"experiment={experiment}"])
    from model.llama import LlamaConfig

    params = LlamaConfig.from_mapping(cfg.model).num_params()
    train, evals = plan["train_step"], plan["eval_step"]
    assert train["fits"] and evals["fits"]
    # The gradients' reduction is what crosses: each chip's FSDP shard of every gradient, in the
    # backward's bf16 or in fp32, once per microbatch (XLA reduces inside the accumulation loop).
    shard_bytes = params / tpu.chips * plan["microbatches"]
    assert 2 * shard_bytes * 0.95 <= train["dcn"]["payload_bytes"] <= 4 * shard_bytes * 1.05, train["dcn"]
    assert evals["dcn"]["payload_bytes"] < 2**20      # evaluation sends only its loss sums
    d = train["dcn"]
    assert d["sent_bytes_per_host"] == d["sent_bytes"] * 4
    assert d["seconds_at_dcn_gbps"] == pytest.approx(d["sent_bytes_per_host"] * 8 / 50e9)
    assert f"over the DCN ({slices} slices)" in result.stdout and "at 50 Gbit/s" in result.stdout
    assert plan["compute_s_at_peak"] > 0

"""Every experiment that declares a TPU slice (tpu.topology) compiles for it and fits in 90% of its
usable HBM, compiled by the real TPU compiler (libtpu) on this CPU machine: scripts/compile_tpu.py.
The experiments compile with --quick (no compiler effort on speed: ~20 CPU-s each instead of 70-110,
a quarter of the suite's CPU otherwise); its figures came out up to 3.7% below the full compile's
(BENCHMARKS.md "Quick TPU compiles"), so they are held to 90% less that gap.

Each experiment's compiled figures are kept in tests/tpu_compiles/<experiment>.json under the
fingerprint of what was compiled (model/compile_cache.py: the lowered program without source
locations, the slice's devices, jax/jaxlib/libtpu and their flags, the code that reads the
figures). The test lowers the experiment's steps every time; where the fingerprint is the kept one,
the compiler would produce the same executable, and its kept figures are checked; otherwise (a
change that reaches the program, another libtpu) it compiles and rewrites the file: commit it.
The two-slice plan is kept the same way (<experiment>_<N>_slices.json). The CLI tests below
compile for real every time (a fresh cache per session, tests/conftest.py).

    pip install -e ".[tpu]"   # CI installs it; without libtpu the compile tests skip
    pytest tests/test_compile_tpu.py -q -s   # -s prints each plan's per-chip figures
"""
import contextlib
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
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
NO_COMPILE_TPU_EXAMPLE = "v4_32_llama3_1_8b"     # the module doc's --no-compile example


def experiments() -> list[str]:
    """Every experiment file: a new one is checked without being listed here."""
    return sorted(path.stem for path in (ROOT / "configs" / "experiment").glob("*.yaml"))


def check_plan_facts(experiment: str, plan: dict, text: str) -> None:
    """What every experiment's plan must say (the --no-compile JSON, or a compiled plan's "plan"):
    it names the run, its devices fill its mesh, its shards divide the batch and the hosts, its
    token budget is the steps' and, for a pod or GPU experiment, its header's (a real job)."""
    # The plan names the run: the file's name, or the run its stages share (a staged extension)
    run_name = OmegaConf.load(ROOT / "configs" / "experiment" / f"{experiment}.yaml").get("name", experiment)
    assert f"plan {run_name}: every check passed" in text
    assert plan["devices"] == plan["hosts"] * plan["devices_per_host"] == math.prod(plan["mesh"].values())
    assert plan["global_batch_size"] % plan["num_shards"] == 0 and plan["num_shards"] % plan["hosts"] == 0
    assert plan["token_budget"] == plan["steps"] * plan["global_batch_size"] * plan["seq_len"]
    own = OmegaConf.load(ROOT / "configs" / "experiment" / f"{experiment}.yaml")
    stage_start = own.get("train", {}).get("stage_start")
    assert plan["stage_start"] == stage_start
    if stage_start is not None:     # a later stage: the plan counts its own steps
        assert f"steps {stage_start + 1:,}-{plan['steps']:,} of the run" in text
        assert plan["stage_tokens"] == (plan["steps"] - stage_start) * plan["tokens_per_step"]
    if experiment.startswith("sample"):
        return
    header = (ROOT / "configs" / "experiment" / f"{experiment}.yaml").read_text()
    assert f"{plan['steps']:,} steps x {plan['tokens_per_step']:,} tokens" in header, "the header's budget"
    assert plan["token_budget"] >= 1e9 and plan["warmup_steps"] < plan["steps"] and plan["lr"] <= 3e-4
    assert plan["add_bos"] is True    # every experiment trains a Llama tokenizer, which puts BOS first


@pytest.mark.parametrize("experiment", experiments())
def test_every_experiment_passes_every_check_before_anything_is_rented(experiment, tmp_path):
    """train.py's start-up checks at the experiment's own hosts (a TPU slice's, or plan.hosts x
    plan.devices_per_host), then the plan: seconds, nothing compiled, no data read. A pod or GPU
    experiment carries a real job: its header states the token budget the config runs.
    Where libtpu is installed, a TPU experiment's plan is checked by its compile instead
    (test_experiment_compiles_for_its_slice_and_fits: the same checks, check_plan_facts, on the
    compiled plan's "plan", in the process that compiles it): one CLI run here keeps --no-compile's
    own output checked for a slice."""
    if experiment in planned_experiments() and experiment != NO_COMPILE_TPU_EXAMPLE:
        pytest.skip("checked by its compile (test_experiment_compiles_for_its_slice_and_fits)" if HAS_LIBTPU
                    else 'the slice\'s devices come from libtpu: pip install -e ".[tpu]"')
    if experiment in planned_experiments() and not HAS_LIBTPU:
        pytest.skip('the slice\'s devices come from libtpu: pip install -e ".[tpu]"')
    out = tmp_path / "plan.json"
    result = run_script(f"experiment={experiment}", "--no-compile", "--json", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    plan = json.loads(out.read_text())
    assert "train_step" not in plan and "compiled" not in result.stdout
    check_plan_facts(experiment, plan, result.stdout)


@pytest.mark.slow
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


@pytest.mark.slow
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


@contextlib.contextmanager
def environ_restored():
    """libtpu_env (and libtpu itself) write os.environ: restored after a compile in this process, or
    every later train.py subprocess of the test worker would see TPU_WORKER_HOSTNAMES, take itself
    for a TPU VM and try jax.distributed."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


# ---------------------------------------------------------------- kept compiles (model/compile_cache.py)
class RecordedCompiles:
    """model/compile_cache.py's get/put over one experiment's file in tests/tpu_compiles: an entry
    per step (its label), replaced when its program's fingerprint changes, so the file holds only
    what the experiment compiles today."""

    def __init__(self, path: Path):
        self.path = path

    def _entries(self) -> dict:
        return json.loads(self.path.read_text()) if self.path.exists() else {}

    def get(self, key: str) -> dict | None:
        return next((e["figures"] for e in self._entries().values() if e["fingerprint"] == key), None)

    def put(self, key: str, figures: dict, label: str = "") -> None:
        entries = {**self._entries(), label: {"fingerprint": key, "figures": figures}}
        self.path.parent.mkdir(exist_ok=True)
        self.path.write_text(json.dumps(entries, indent=1, sort_keys=True) + "\n")


RECORDED = ROOT / "tests" / "tpu_compiles"


def _lowered(shape=(8, 4), scale=2.0):
    import jax
    import jax.numpy as jnp

    def step(x):
        return jnp.tanh(x) * scale

    return jax.jit(step).lower(jax.ShapeDtypeStruct(shape, jnp.float32))


def _lowered_elsewhere(shape=(8, 4)):
    # the same program from another function on other lines: source locations are not the program
    import jax
    import jax.numpy as jnp

    def step(x):  # the function's name is the module's: train.py's steps keep theirs
        return jnp.tanh(x) * 2.0

    return jax.jit(step).lower(jax.ShapeDtypeStruct(shape, jnp.float32))


def test_a_program_fingerprint_is_its_program_devices_and_compiler(monkeypatch):
    from model.compile_cache import fingerprint

    facts = {"topology": "v4:2x2x4", "devices": [[0, 0], [1, 0]]}
    key = fingerprint(_lowered(), facts)
    assert fingerprint(_lowered(), facts) == key == fingerprint(_lowered_elsewhere(), facts)
    changed = {
        "shape": fingerprint(_lowered((8, 8)), facts),
        "op": fingerprint(_lowered(scale=3.0), facts),
        "devices": fingerprint(_lowered(), {**facts, "devices": [[1, 0], [0, 0]]}),
    }
    monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_tpu_some_flag=true")
    changed["libtpu flags"] = fingerprint(_lowered(), facts)
    monkeypatch.delenv("LIBTPU_INIT_ARGS")
    import jax

    effort = jax.config.jax_exec_time_optimization_effort
    jax.config.update("jax_exec_time_optimization_effort", -1.0)    # --quick
    try:
        changed["effort"] = fingerprint(_lowered(), facts)
    finally:
        jax.config.update("jax_exec_time_optimization_effort", effort)
    assert len({key, *changed.values()}) == len(changed) + 1, changed


def test_kept_figures_are_json_by_fingerprint_and_a_foreign_entry_is_not_taken(tmp_path, monkeypatch):
    from model import compile_cache

    cache = compile_cache.CompileCache(tmp_path / "kept")
    assert cache.get("a" * 64) is None
    figures = {"fits": True, "total_gib": 1.25, "ici": {"bytes_by_axes": {"fsdp": 3.0}}}
    cache.put("a" * 64, figures, "train_step: v4-32")
    assert cache.get("a" * 64) == figures
    entry = json.loads((tmp_path / "kept" / f"{'a' * 64}.json").read_text())
    assert entry["label"] == "train_step: v4-32" and entry["figures"] == figures
    # an entry copied under another name, or cut short, is compiled again, not taken
    (tmp_path / "kept" / f"{'b' * 64}.json").write_text(json.dumps(entry))
    (tmp_path / "kept" / f"{'c' * 64}.json").write_text(json.dumps(entry)[:40])
    assert cache.get("b" * 64) is None and cache.get("c" * 64) is None
    # the newest MAX_ENTRIES are kept
    for path in (tmp_path / "kept").glob("*.json"):
        path.unlink()
    monkeypatch.setattr(compile_cache, "MAX_ENTRIES", 2)
    for i, key in enumerate(("d" * 64, "e" * 64)):
        cache.put(key, {"n": i})
        os.utime(tmp_path / "kept" / f"{key}.json", (1e9 + i, 1e9 + i))   # d, then e, before now
    cache.put("f" * 64, {"n": 2})
    assert sorted(p.stem[0] for p in (tmp_path / "kept").glob("*.json")) == ["e", "f"]
    monkeypatch.setenv("JAXPT_TPU_COMPILE_CACHE", str(tmp_path / "elsewhere"))
    assert compile_cache.default_dir() == tmp_path / "elsewhere"


@pytest.mark.slow
@needs_libtpu
def test_a_pallas_kernels_source_paths_are_not_its_fingerprint():
    """Splash attention lowers to a TPU custom call holding the kernel's MLIR bytecode, with source
    locations: this checkout's path (model/context.py's mask) and the venv's. Another checkout (CI's)
    must find the kept figures: the kernel is fingerprinted printed without them. Lowering only."""
    import base64
    import re

    from model.compile_cache import _KERNEL_BODY, program_text

    with environ_restored():
        tpu = ct.parse_slice("v5e-4")
        ct.libtpu_env(tpu)
        cfg = ct.compose(["model.attention=splash", "mesh=context", "mesh.context=2"])
        _, program, _ = ct.check_run(cfg, ct.slice_devices(tpu))
        batch = program.abstract_batch(int(cfg.data.global_batch_size), int(cfg.data.seq_len))
        lowered = [program.eval_step.lower(program.abstract_state["params"], batch) for _ in range(2)]
    raw = lowered[0].as_text(debug_info=False)
    bodies = [base64.b64decode(m.group(2)) for m in _KERNEL_BODY.finditer(raw)]
    assert bodies and any(str(ROOT / "model").encode() in b for b in bodies)    # the checkout's path is in the kernel
    text = program_text(lowered[0])
    assert len(re.findall(r"kernel-sha256:[0-9a-f]{64}", text)) == len(bodies)
    assert str(ROOT) not in text and text == program_text(lowered[1])


def test_recorded_compiles_replace_a_steps_entry_and_find_by_fingerprint(tmp_path):
    record = RecordedCompiles(tmp_path / "x.json")
    record.put("1" * 64, {"total_gib": 1.0}, "train_step: v4-32")
    record.put("2" * 64, {"total_gib": 0.5}, "eval_step: v4-32")
    record.put("3" * 64, {"total_gib": 1.1}, "train_step: v4-32")    # the program changed
    assert record.get("1" * 64) is None and record.get("3" * 64) == {"total_gib": 1.1}
    assert sorted(json.loads((tmp_path / "x.json").read_text())) == ["eval_step: v4-32", "train_step: v4-32"]


# ---------------------------------------------------------------- compiles (libtpu)
@pytest.mark.slow
@needs_libtpu
def test_cli_prints_and_writes_the_compiled_figures(tmp_path):
    # The default run (tiny model, batch 16 x 256) on a v5e-4: seconds to compile.
    out = tmp_path / "plan.json"
    cache = ["--cache-dir", str(tmp_path / "kept")]
    result = run_script("--topology", "v5e-4", "--json", str(out), *cache)
    assert result.returncode == 0, result.stdout + result.stderr
    plan = json.loads(out.read_text())
    assert plan["quick"] is False and "QUICK" not in result.stdout
    assert "kept" not in result.stdout and not any("cached" in plan[step] for step in ("train_step", "eval_step"))
    assert len(list((tmp_path / "kept").glob("*.json"))) == 2     # one entry per step, named by its fingerprint
    # Again: the same programs, devices and compiler; the kept figures, nothing compiled, the same report
    again = run_script("--topology", "v5e-4", "--json", str(tmp_path / "again.json"), *cache)
    kept = json.loads((tmp_path / "again.json").read_text())
    for step in ("train_step", "eval_step"):
        assert kept[step].pop("cached") is True and kept[step] == plan[step]
        assert f"compiled in {plan[step]['compile_s']:.1f} s (kept: the same program" in again.stdout
    assert again.stdout.replace(" (kept: the same program, devices and compiler; --no-cache compiles it)", "") \
        == result.stdout
    assert plan["chips"] == 4 and plan["device_kind"].startswith("TPU v5") and plan["mesh"]["data"] == 4
    for step in ("train_step", "eval_step"):
        r = plan[step]
        assert r["fits"] and 0 < r["total_gib"] < 1
        assert r["total_gib"] == pytest.approx(r["arguments_gib"] + r["temporaries_gib"] + r["outputs_gib"]
                                               - r["aliased_gib"] + r["code_gib"])
        assert f"{step}: per chip {r['total_gib']:.2f} of 15.75 GiB" in result.stdout
    # The train state is donated: the new state's buffers alias the old one's.
    assert plan["train_step"]["aliased_gib"] == pytest.approx(plan["train_step"]["arguments_gib"], rel=0.01)
    # compiled with libtpu's overlap flags (libtpu accepts each: it stops on one it does not know)
    from model.tpu_flags import OVERLAP_FLAGS

    assert set(OVERLAP_FLAGS) <= set(plan["libtpu_init_args"].split())
    # the predicted step (model/predict.py): compute at peak is the plan's floor; the step is the
    # largest term, the upper bound their sum; data parallel over a v5e-4 (2x2): 2 links
    p = plan["train_step"]["predicted"]
    assert p["compute_s"] == pytest.approx(plan["compute_s_at_peak"]) and p["hbm_s"] > 0
    assert p["step_s"] == max(p["compute_s"], p["ici_s"], p["hbm_s"]) and p["bound"] in ("compute", "ici", "hbm")
    assert p["step_s_upper"] == pytest.approx(max(p["compute_s"], p["hbm_s"]) + p["ici_s"])
    assert p["links_by_axes"] == {"data": 2} and 0 < p["mfu_lower"] <= p["mfu"] <= 1
    assert "    predicted: step " in result.stdout and "predicted" not in plan["eval_step"]


@pytest.mark.slow
@needs_libtpu
def test_remat_offload_keeps_each_layers_named_activations_on_the_host_and_prices_their_trips(tmp_path):
    # The default tiny model (fp32 activations: d 128, 4 query and 2 kv heads of 32) on a v5e-4: 4 rows
    # of 256 per chip. model.remat=offload keeps each layer's input and its q, k, v and output
    # projections in host memory: 4 layers x 4 rows x 256 x (128 + 128 + 64 + 64 + 128) x 4 bytes.
    out = tmp_path / "plan.json"
    result = run_script("--topology", "v5e-4", "--quick", "--json", str(out), "model.remat=offload")
    assert result.returncode == 0, result.stdout + result.stderr
    train = json.loads(out.read_text())["train_step"]
    assert train["host_temporaries_gib"] * 2**30 == pytest.approx(4 * 4 * 256 * 512 * 4, rel=0.01)
    assert "in the host's memory: temporaries" in result.stdout
    # priced: written in the forward and read back in the backward, over the chip's PCIe link
    from model.predict import CHIPS, host_bytes

    assert train["predicted"]["host_s"] == pytest.approx(
        host_bytes(train["host_temporaries_gib"] * 2**30, train["host_arguments_gib"] * 2**30) / CHIPS["v5e"].pcie_bps)


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
    with environ_restored():
        _compile_and_check(experiment)


def _compile_and_check(experiment):
    cfg = ct.compose([f"experiment={experiment}"])    # as the script composes it (the run's directory named)
    tpu = ct.parse_slice(cfg.tpu.topology)
    ct.libtpu_env(tpu)   # before libtpu's first use in this process
    import jax

    effort = jax.config.jax_exec_time_optimization_effort
    plan = ct.compile_plan(cfg, tpu, quick=True, cache=RecordedCompiles(RECORDED / f"{experiment}.json"))
    text = ct.plan_report(plan["plan"]) + "\n" + ct.report(plan)
    print("\n" + text)
    check_plan_facts(experiment, plan["plan"], text)     # what --no-compile checks, on the compiled plan
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
# The multislice page's plan (docs/multislice.md), compiled as the CLI compiles it. The 7B and the
# v5e-16 1B at two slices were compiled here too: with data parallel across slices each slice holds
# the single-slice plan's state and half its rows, so their fit is the single-slice compile's
# above, and the DCN bytes are read and priced by the same code whatever the model.
@pytest.mark.parametrize("experiment,slices", [("v4_32_llama_1b", 2)])
def test_experiment_compiles_for_two_slices_with_its_dcn_traffic(experiment, slices):
    # In this process over the kept figures, as the single-slice compiles above: a change that reaches
    # the program, the devices or model/dcn.py is a new fingerprint, compiled (--quick) and recorded.
    with environ_restored():
        cfg = ct.compose([f"experiment={experiment}", f"tpu.slices={slices}"])
        tpu = ct.parse_slice(cfg.tpu.topology)
        ct.libtpu_env(tpu)
        plan = ct.compile_plan(cfg, tpu, quick=True, dcn_gbps=50,
                               cache=RecordedCompiles(RECORDED / f"{experiment}_{slices}_slices.json"))
    report = ct.report(plan)
    assert plan["slices"] == plan["mesh_slices"] == slices and plan["chips"] == slices * tpu.chips
    # data parallel across the slices (mesh.dcn_data=-1), FSDP over each slice's chips
    assert plan["mesh"] == {"data": slices, "fsdp": tpu.chips, "context": 1, "tensor": 1}
    assert plan["mesh_dcn"] == {"data": slices, "fsdp": 1, "context": 1, "tensor": 1}
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
    assert f"over the DCN ({slices} slices)" in report and "at 50 Gbit/s" in report
    assert plan["compute_s_at_peak"] > 0


# ---------------------------------------------------------------- ICI bytes per mesh axis (model/ici.py)
# A compiled program cut to what model/ici.py reads (channel ids and use_global_device_ids left out:
# not read), over a mesh of fsdp 4 x context 4 (partition id = 4 fsdp + context): a counted loop
# (counter 1..4: 3 trips) holding a K/V-style all-gather over an iota's groups {0,1,2,3} (context)
# and a libtpu all-reduce-scatter fusion over transposed iota groups {0,4,8,12} (fsdp); beside it an
# async all-gather over fsdp and an async reduce-scatter over context (their done halves not
# counted), a variadic all-reduce over every chip, a reduce-scatter over the partitioner's mesh in
# its own device order, an all-reduce over a sub-axis, a collective-permute along fsdp (one pair
# stays on its chip), groups of one chip (nothing moves) and an all-to-all whose groups are in no
# known form. A backslash ends a line that the program prints on one.
ICI_HLO = """HloModule jit_step, is_scheduled=true

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}

%all-reduce-scatter.1 (input: f32[64,32]) -> f32[16,32] {
  %input = f32[64,32]{1,0} parameter(0)
  %all-reduce.1 = f32[64,32]{1,0:T(8,128)} all-reduce(%input), replica_groups=[4,4]<=[4,4]T(1,0), to_apply=%add
  ROOT %slice = f32[16,32]{1,0} dynamic-slice(%all-reduce.1, %i, %i), dynamic_slice_sizes={16,32}
}

%wrapped_reduce_scatter (w: f32[64]) -> f32[16] {
  %w = f32[64]{0} parameter(0)
  ROOT %reduce-scatter.2 = f32[16]{0} reduce-scatter(%w), replica_groups=[4,4]<=[16], dimensions={0}, to_apply=%add
}

%body (p: (s32[], bf16[1,128,8,64])) -> (s32[], bf16[1,128,8,64]) {
  %p = (s32[]{:T(128)}, bf16[1,128,8,64]{3,2,1,0}) parameter(0)
  %kv = bf16[1,128,8,64]{3,2,1,0} get-tuple-element(%p), index=1
  %all-gather.1 = bf16[1,512,8,64]{3,2,1,0:T(8,128)(2,1)} all-gather(%kv), replica_groups=[4,4]<=[16], \
dimensions={1}, metadata={op_name="attention"}
  %fusion.1 = f32[16,32]{1,0} fusion(%g), kind=kCustom, calls=%all-reduce-scatter.1
}

%cond (q: (s32[], bf16[1,128,8,64])) -> pred[] {
  %q = (s32[]{:T(128)}, bf16[1,128,8,64]{3,2,1,0}) parameter(0)
  %limit = s32[]{:T(128)} constant(4)
  %i = s32[]{:T(128)} get-tuple-element(%q), index=0
  ROOT %lt = pred[]{:T(512)} compare(%i, %limit), direction=LT
}

ENTRY %main (a: bf16[256,64]) -> f32[8] {
  %one = s32[]{:T(128)} constant(1)
  %start = s32[]{:T(128)} copy(%one)
  %tuple.1 = (s32[]{:T(128)}, bf16[1,128,8,64]{3,2,1,0}) tuple(%start, %kv0)
  %while.1 = (s32[]{:T(128)}, bf16[1,128,8,64]{3,2,1,0}) while(%tuple.1), condition=%cond, body=%body
  %all-gather-start = (bf16[256,64]{1,0}, bf16[1024,64]{1,0}) all-gather-start(%a), @FSDP@, dimensions={0}
  %all-gather-done = bf16[1024,64]{1,0} all-gather-done(%all-gather-start)
  %async-start = ((f32[64]{0}), f32[16]{0}, s32[]) async-start(%m), calls=%wrapped_reduce_scatter
  %async-done = f32[16]{0} async-done(%async-start), calls=%wrapped_reduce_scatter
  %all-reduce.2 = (f32[128]{0}, f32[64,8]{1,0}, /*index=2*/bf16[16]{0}) all-reduce(%u, %v, %w), \
replica_groups=mesh['axis_0'=4,'axis_1'=4] {'axis_0','axis_1'}, to_apply=%add
  %reduce-scatter.1 = f32[16]{0} reduce-scatter(%r), \
replica_groups=mesh['axis_0'=4,'axis_1'=4], device_ids=([4,4]T(1,0)) {'axis_1'}, dimensions={0}, to_apply=%add
  %all-reduce.3 = f32[256]{0} all-reduce(%s), replica_groups=mesh['axis_0'=16] {'axis_0':(4)4}, to_apply=%add
  %collective-permute-start = (f32[32,32]{1,0}, f32[32,32]{1,0}, u32[]{:S(2)}, u32[]{:S(2)}) \
collective-permute-start(%c), source_target_pairs={{0,4},{4,8},{8,12},{12,0},{1,1}}
  %collective-permute-done = f32[32,32]{1,0} collective-permute-done(%collective-permute-start)
  %all-reduce.4 = f32[1000]{0} all-reduce(%z), replica_groups=@ONES@, to_apply=%add
  %all-to-all.1 = bf16[4,64]{1,0} all-to-all(%t), replica_groups=hypercube<4>, dimensions={0}
}
""".replace("@FSDP@", "replica_groups=[4,4]<=[4,4]T(1,0)").replace(
    "@ONES@", "{" + ",".join(f"{{{i}}}" for i in range(16)) + "}")   # 16 groups of one chip
ICI_MESH = {"data": 1, "fsdp": 4, "context": 4, "tensor": 1}


def test_ici_bytes_are_read_per_mesh_axis_from_the_compiled_program():
    from model import ici

    got = ici.ici_bytes_per_chip(ICI_HLO, ICI_MESH)
    trips = 3
    # a ring over k = 4 chips: an all-gather sends 3/4 of its result, a reduce-scatter 3/4 of its
    # operand (k results), an all-reduce 2 * 3/4 of its operand; over k = 16, 2 * 15/16
    context = (1 * 512 * 8 * 64 * 2 * 3 / 4 * trips      # the loop's all-gather
               + 256 * 4 * 2 * 3 / 4                      # the all-reduce over context, a sub-axis of 16
               + 16 * 4 * 4 * 3 / 4)                      # the async reduce-scatter
    fsdp = (64 * 32 * 4 * 3 / 4 * trips                   # the loop's all-reduce-scatter: a reduce-scatter
            + 1024 * 64 * 2 * 3 / 4                       # the async all-gather's result
            + 16 * 4 * 4 * 3 / 4                          # the reduce-scatter (fsdp in its device order)
            + 32 * 32 * 4)                                # the collective-permute: its whole buffer
    both = (128 * 4 + 64 * 8 * 4 + 16 * 2) * 2 * 15 / 16  # the variadic all-reduce over all 16 chips
    unparsed = 4 * 64 * 2                                 # the all-to-all: its whole buffer
    assert got["bytes_by_axes"] == {"fsdp": fsdp, "context": context, "fsdp+context": both, "unparsed": unparsed}
    assert got["total_bytes"] == fsdp + context + both + unparsed
    kinds = sorted((c.kind, c.axes, c.group_size, c.times) for c in ici.collectives(ICI_HLO, ICI_MESH))
    assert kinds == [("all-gather", "context", 4, 3), ("all-gather", "fsdp", 4, 1),
                     ("all-reduce", "", 1, 1), ("all-reduce", "context", 4, 1), ("all-reduce", "fsdp+context", 16, 1),
                     ("all-to-all", "unparsed", 1, 1), ("collective-permute", "fsdp", 2, 1),
                     ("reduce-scatter", "context", 4, 1), ("reduce-scatter", "fsdp", 4, 1),
                     ("reduce-scatter", "fsdp", 4, 3)]
    # the ids are positions in the mesh (data, fsdp, context, tensor): on fsdp 2 x context 8 the
    # loop's groups {0,1,2,3} are half a context row
    wide = ici.collectives(ICI_HLO, {"data": 1, "fsdp": 2, "context": 8, "tensor": 1})
    assert [c.axes for c in wide if c.kind == "all-gather" and c.times == trips] == ["context"]
    # a mesh too small for the ids: its collectives are unparsed, not dropped
    assert set(ici.ici_bytes_per_chip(ICI_HLO, {"data": 1, "fsdp": 2, "context": 2, "tensor": 1})["bytes_by_axes"]) \
        == {"unparsed"}


@pytest.mark.parametrize("groups, mesh, expected", [
    ("replica_groups={{0,2},{1,3}}", (2, 2), [[0, 2], [1, 3]]),
    ("replica_groups={}", (2, 2), [[0, 1, 2, 3]]),
    ("replica_groups=[2,4]<=[8]", (2, 4), [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ("replica_groups=[4,2]<=[2,4]T(1,0)", (2, 4), [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ("replica_groups=mesh['a'=2,'b'=4] {'a'}", (2, 4), [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ("replica_groups=mesh['a'=2,'b'=4] {'b','a'}", (2, 4), [[0, 4, 1, 5, 2, 6, 3, 7]]),
    ("replica_groups=mesh['a'=2,'b'=4], device_ids=([4,2]T(1,0)) {'b'}", (2, 4), [[0, 2, 4, 6], [1, 3, 5, 7]]),
    ("replica_groups=mesh['a'=8] {'a':(2)2}", (8,), [[0, 2], [1, 3], [4, 6], [5, 7]]),
    ("replica_groups=mesh['a'=8] {'a':(1)2,'a':(4)2}", (8,), [[0, 1, 4, 5], [2, 3, 6, 7]]),
])
def test_replica_groups_in_every_printed_form(groups, mesh, expected):
    from model import ici

    assert ici.replica_groups(f"all-reduce(%x), {groups}, to_apply=%add", math.prod(mesh)).tolist() == expected


@pytest.mark.slow
@needs_libtpu
def test_context_bytes_cross_ici_only_with_a_context_axis():
    """The tiny model (4 layers, batch 16 x 256, 2 of 4 KV heads of 32) on a v4-8: fsdp 2 x context
    2 all-gathers each layer's keys and values over `context` and its weights over fsdp x context;
    the same shapes at mesh.context=1 (fsdp 4) send nothing over an axis named context. ~30 s when
    compiled, ~5 s when tests/tpu_compiles keeps both plans' figures."""
    with environ_restored():
        tpu = ct.parse_slice("v4-8")
        ct.libtpu_env(tpu)
        # kept like the experiments' (a change to model/ici.py is a new fingerprint: compiled again)
        plans = {c: ct.compile_plan(ct.compose(["mesh=context", f"mesh.context={c}"]), tpu, quick=True,
                                    cache=RecordedCompiles(RECORDED / f"tiny_v4_8_context_{c}.json"))
                 for c in (2, 1)}
    assert plans[2]["mesh"] == {"data": 1, "fsdp": 2, "context": 2, "tensor": 1}
    assert plans[1]["mesh"] == {"data": 1, "fsdp": 4, "context": 1, "tensor": 1}
    # the forward's K/V all-gathers alone: K and V of 8 rows x 256 x 2 heads x 32 in fp32 per layer,
    # half of each received from the other chip, 4 layers (the scanned loop's trips)
    kv_gathers = 2 * 4 * (8 * 256 * 2 * 32 * 4) / 2
    for step in ("train_step", "eval_step"):
        with_context, without = plans[2][step]["ici"]["bytes_by_axes"], plans[1][step]["ici"]["bytes_by_axes"]
        # the parameters are sharded over fsdp x context: their gathers span both axes
        assert with_context["context"] >= kv_gathers and with_context["fsdp+context"] > 0, with_context
        assert not any("context" in axes for axes in without) and without["fsdp"] > 0, without
        assert "unparsed" not in with_context and "unparsed" not in without
        assert plans[2][step]["ici"]["total_bytes"] == pytest.approx(sum(with_context.values()))
    text = ct.report(plans[2])
    assert text.count("    ici per chip per step: ") == 2 and "context " in text.split("ici per chip per step")[1]

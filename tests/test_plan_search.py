"""compile_tpu.py --search (model/plan_search.py): the candidate plans, the estimate that prunes and
orders them, the ranking and the override line, on hand-made predictions and compiled figures. No
compile but one (marked slow: the CLI end to end on the default tiny run, ~13 CPU-s).

    pytest tests/test_plan_search.py -q
"""
import functools
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from model import plan_search as ps
from model import predict
from model.llama import LlamaConfig
from model.loss import HEAD_GATHERS
from tests.run_helpers import make_cfg

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30
HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None


@functools.lru_cache(maxsize=None)
def _model_1b() -> dict:
    return dict(make_cfg("runs/unused", "experiment=v5e_16_llama_1b").model)


def llama_1b(**changes) -> LlamaConfig:
    return LlamaConfig.from_mapping({**_model_1b(), **changes})


SHIPPED_V5E = ps.Plan(1, 16, 1, 1, 4, "dots", 0)


# ---------------------------------------------------------------- candidates
def test_every_candidate_divides_the_chips_the_heads_the_row_and_the_batch():
    model = llama_1b()      # 32 heads, 4 KV heads, splash
    plans = ps.candidates(model, 1024, 512, 16, SHIPPED_V5E)
    assert SHIPPED_V5E in plans and len(plans) == len(set(plans))
    for p in plans:
        assert p.data * p.fsdp * p.context * p.tensor == 16
        assert model.n_kv_heads % p.tensor == 0 and model.n_heads % p.tensor == 0
        assert 1024 % p.context == 0 and (1024 // p.context) % 128 == 0     # splash's blocks
        assert 512 % (p.data * p.fsdp * p.microbatches) == 0
        assert p.loss_chunk == 0 or 1024 % p.loss_chunk == 0
    assert {p.tensor for p in plans} == {1, 2, 4}           # 8 and 16 would split a KV head
    assert {p.context for p in plans} == {1, 2, 4, 8}       # 16 leaves 64-token parts: below splash's 128
    # dots_all / dots_attention are dots with splash
    assert {p.remat for p in plans} == {"none", "dots", "full", "offload"}
    assert {p.loss_chunk for p in plans} == {0, 512}
    # the loss's way with the head is a choice only for a chunked loss
    assert {p.loss_head for p in plans if p.loss_chunk} == set(ps.LOSS_HEADS) == set(HEAD_GATHERS)
    assert {p.loss_head for p in plans if not p.loss_chunk} == {"once"}
    # a slice of 12 chips (no such slice, but the rule): 3 ways never split 4 KV heads
    assert all(p.tensor in (1, 2, 4) for p in ps.candidates(model, 1024, 384, 12, SHIPPED_V5E))
    # the XLA reference keeps attention's einsums under dots_all: a different program, a candidate
    assert "dots_all" in {p.remat for p in ps.candidates(llama_1b(attention="xla"), 1024, 512, 16, SHIPPED_V5E)}


def test_loss_chunks_halve_the_row_down_to_512():
    assert ps.loss_chunks(1024, 0) == [0, 512]
    assert ps.loss_chunks(32768, 4096) == [0, 2048, 4096, 8192, 16384]
    assert ps.loss_chunks(256, 0) == [0]
    assert ps.loss_chunks(256, 128) == [0, 128]       # the run's own always stays


# ---------------------------------------------------------------- the estimate
# Compiled per-chip train-step memory (BENCHMARKS.md "Compiled memory plans", full compiles,
# libtpu 0.0.42.1): llama_1b at seq 1024, batch 512, fsdp 16.
COMPILED_GIB = {("dots", 2): 21.22, ("dots", 4): 11.47, ("full", 1): 12.68, ("dots", 1): 33.70 + 0.77}


def test_the_estimate_is_near_the_compiled_memory_and_counts_the_fsdp_bytes():
    model = llama_1b()
    for (remat, mb), gib in COMPILED_GIB.items():
        est = ps.estimate(ps.Plan(1, 16, 1, 1, mb, remat, 0), model, 1024, 512)
        assert abs(est.memory_bytes / GIB / gib - 1) <= 0.2, (remat, mb, est.memory_bytes / GIB, gib)
    # the FSDP bytes: 24.0 GiB per chip per step compiled at 2 microbatches, 47.6 at 4 (BENCHMARKS.md
    # "Predicted step times"); one pass each way per microbatch
    for mb, gib in ((2, 24.0), (4, 47.6)):
        got = ps.estimate(ps.Plan(1, 16, 1, 1, mb, "dots", 0), model, 1024, 512).ici_bytes_by_axes
        assert set(got) == {"fsdp"} and abs(got["fsdp"] / GIB / gib - 1) <= 0.1
    # beside data ways the compiled gathers carry bf16: data 2 x fsdp 8 moved 21.8 GiB over fsdp
    got = ps.estimate(ps.Plan(2, 8, 1, 1, 4, "dots", 0), model, 1024, 512).ici_bytes_by_axes
    assert set(got) == {"fsdp", "data"} and abs(got["fsdp"] / GIB / 21.8 - 1) <= 0.1
    # each axis's collectives land under its own key; the chunked loss re-gathers the head per chunk
    split = ps.estimate(ps.Plan(2, 4, 2, 1, 4, "dots", 512), model, 1024, 512).ici_bytes_by_axes
    assert set(split) == {"fsdp+context", "context", "data"}
    tensor = ps.estimate(ps.Plan(1, 8, 1, 2, 4, "full", 0), model, 1024, 512).ici_bytes_by_axes
    assert set(tensor) == {"fsdp", "tensor"}
    whole, chunked = (ps.estimate(ps.Plan(1, 16, 1, 1, 4, "dots", c), model, 1024, 512) for c in (0, 512))
    per_chunk = ps.estimate(ps.Plan(1, 16, 1, 1, 4, "dots", 512, "per_chunk"), model, 1024, 512)
    # train.loss_head once: the head gathered once a pass as unchunked; per_chunk: again per chunk
    assert chunked.ici_bytes_by_axes["fsdp"] == whole.ici_bytes_by_axes["fsdp"] < per_chunk.ici_bytes_by_axes["fsdp"]
    assert per_chunk.memory_bytes < chunked.memory_bytes < whole.memory_bytes
    # once holds the whole head in bf16 and its gradient's fp32 sum: 6 B a head parameter more
    head = model.d_model * model.vocab_size
    assert chunked.memory_bytes - per_chunk.memory_bytes == pytest.approx(6 * head)


def test_offload_keeps_no_activations_on_the_chip_and_prices_their_pcie_trips():
    """remat offload in the estimate, against the compiled program of the 8B at MaxText's v6e-16
    plan (BENCHMARKS.md "The output head gathered once, and MaxText at equal plans"): fsdp 16, one
    pass of 3 rows of 8,192 per chip, 21.00 GiB of host temporaries per chip, out and back."""
    model = LlamaConfig.from_mapping(OmegaConf.load(ROOT / "configs" / "model" / "llama3_1_8b.yaml"))
    offload, dots, full = (ps.estimate(ps.Plan(1, 16, 1, 1, 1, remat, 512), model, 8192, 48)
                           for remat in ("offload", "dots", "full"))
    assert offload.host_bytes / GIB == pytest.approx(2 * 21.0, rel=0.01)
    assert dots.host_bytes == full.host_bytes == 0.0
    assert offload.memory_bytes < full.memory_bytes < dots.memory_bytes
    assert offload.ici_bytes_by_axes == dots.ici_bytes_by_axes     # the same gathers: remat is not re-gathered here
    # tensor ways split the q, k, v projections' host copies, not the layer's input or output
    split = ps.estimate(ps.Plan(1, 8, 1, 2, 1, "offload", 512), model, 8192, 48).host_bytes
    d, q, kv = model.d_model, model.n_heads * model.head_dim, model.n_kv_heads * model.head_dim
    assert split / offload.host_bytes == pytest.approx((2 * d + (q + 2 * kv) / 2) / (2 * d + q + 2 * kv) * 16 / 8)
    # the predicted step adds their PCIe time
    v6e = predict.CHIPS["v6e"]
    step = ps.estimated_step(offload, useful_flops=1e15, executed_flops=1.3e15, chips=16, chip=v6e,
                             links={"fsdp": 2})
    assert step["host_s"] == pytest.approx(offload.host_bytes / v6e.pcie_bps)


# ---------------------------------------------------------------- choosing what to compile
def pred(step, upper):
    return {"step_s": step, "step_s_upper": upper}


def test_the_shipped_plan_comes_first_and_the_estimate_prunes_and_orders_the_rest():
    cap = 10 * GIB                                    # the limit: 9 GiB; pruned above 1.25 x 9
    a, b, c, d, e = (ps.Plan(1, 16, 1, 1, mb, "dots", 0) for mb in (1, 2, 4, 8, 16))
    estimated = [
        (a, 12.0 * GIB, pred(1.0, 1.1)),   # over 1.25 x the limit: never compiled
        (b, 10.0 * GIB, pred(1.0, 1.2)),   # a near miss: after every plan estimated to fit
        (c, 8.0 * GIB, pred(1.0, 1.5)),    # the shipped plan
        (d, 7.0 * GIB, pred(1.0, 1.4)),
        (e, 6.0 * GIB, pred(1.2, 1.3)),
    ]
    chosen, pruned = ps.to_compile(estimated, c, budget=10, capacity=cap)
    assert chosen == [c, d, e, b] and pruned == 1
    assert ps.to_compile(estimated, c, budget=2, capacity=cap)[0] == [c, d]
    assert ps.to_compile(estimated, c, budget=1, capacity=cap)[0] == [c]
    # ranked by the upper bound first, e (1.3) comes before d (1.4)
    assert ps.to_compile(estimated, c, budget=10, capacity=cap, by="upper")[0] == [c, e, d, b]
    # the shipped plan is compiled even where the estimate would prune it (it is the reference)
    assert ps.to_compile(estimated, a, budget=2, capacity=cap)[0] == [a, d]


# ---------------------------------------------------------------- ranking compiled plans
def compiled(train_fraction, eval_fraction, step, upper, fits=True):
    return {"train_step": {"fits": fits, "hbm_fraction": train_fraction, "predicted": pred(step, upper)},
            "eval_step": {"fits": True, "hbm_fraction": eval_fraction}}


def test_ranking_orders_by_predicted_step_and_an_over_hbm_plan_never_wins():
    a, b, c, d, e = (ps.Plan(1, 16, 1, 1, mb, "dots", 0) for mb in (1, 2, 4, 8, 16))
    results = [
        ps.result_of(a, compiled(0.95, 0.4, 0.5, 0.6)),                 # fastest, but above the limit
        ps.result_of(b, compiled(0.5, 0.4, 1.1, 1.3)),
        ps.result_of(c, compiled(0.5, 0.4, 1.0, 1.6)),
        ps.result_of(d, compiled(0.5, 0.88, 0.9, 1.0)),                 # the eval step over the limit
        ps.result_of(e, None, error="train.microbatches=16 does not divide"),   # stopped by a check
    ]
    assert [r.fits for r in results] == [False, True, True, False, False]
    assert "train step at 95% of HBM" in results[0].note and "eval step at 88%" in results[3].note
    # by the middle of the range (the default): b 1.2, c 1.3; then the plans over the limit, a, d;
    # then the one that did not compile
    assert [r.plan for r in ps.rank(results)] == [b, c, a, d, e]
    assert [r.plan for r in ps.rank(results, by="step")] == [c, b, a, d, e]      # lower bounds 1.0, 1.1
    assert [r.plan for r in ps.rank(results, by="upper")] == [b, c, a, d, e]     # upper bounds 1.3, 1.6
    # the three orders differ: lower bound 1.0 - 2.2 (mid 1.6) against 1.2 - 1.6 (1.4) and 1.3 - 1.5 (1.4)
    spread = [ps.result_of(a, compiled(0.5, 0.4, 1.0, 2.2)), ps.result_of(b, compiled(0.5, 0.4, 1.2, 1.6)),
              ps.result_of(c, compiled(0.5, 0.4, 1.3, 1.5))]
    assert [r.plan for r in ps.rank(spread)] == [b, c, a]          # equal middles: the lower bound decides
    assert [r.plan for r in ps.rank(spread, by="step")] == [a, b, c]
    assert [r.plan for r in ps.rank(spread, by="upper")] == [c, b, a]
    # equal lower bounds: the smaller upper bound first (less of the step hangs on the overlap)
    tie = [ps.result_of(c, compiled(0.5, 0.4, 1.0, 1.6)), ps.result_of(b, compiled(0.5, 0.4, 1.0, 1.2))]
    assert [r.plan for r in ps.rank(tie)] == [b, c] == [r.plan for r in ps.rank(tie, by="step")]
    # the compiler's own "does not fit" (no figures) never wins either
    oom = {"train_step": {"fits": False, "compiler_says": "RESOURCE_EXHAUSTED: ... exceeds available HBM"},
           "eval_step": {"fits": True, "hbm_fraction": 0.3}}
    assert ps.rank([ps.result_of(a, oom), results[1]])[0].plan == b
    with pytest.raises(ValueError, match="rank by 'fast'"):
        ps.sort_key(pred(1, 1), "fast")


# ---------------------------------------------------------------- the override line
def test_the_override_line_composes_to_the_plan(tmp_path):
    # every field differs from the experiment's (data 2, fsdp -1, 4 microbatches, dots, chunk 0)
    plan = ps.Plan(1, 4, 2, 2, 8, "full", 512, "per_chunk")
    cfg = make_cfg(tmp_path, "experiment=v5e_16_llama_1b", *plan.overrides())
    assert ps.plan_of(cfg) == plan
    assert plan.label() == "fsdp 4 x context 2 x tensor 2, 8 mb, remat full, chunk 512, head per chunk"
    offload = ps.Plan(1, 16, 1, 1, 4, "offload", 0)
    assert ps.plan_of(make_cfg(tmp_path, "experiment=v5e_16_llama_1b", *offload.overrides())) == offload


# ---------------------------------------------------------------- the CLI
def _compile_tpu():
    spec = importlib.util.spec_from_file_location("compile_tpu", ROOT / "scripts" / "compile_tpu.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["compile_tpu"] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("args, says", [
    (["--search", "--search-budget", "0"], "--search-budget 0: expected 1 or more compiles"),
    (["--search-budget", "3"], "--search-budget and --search-by apply to --search"),
    (["--search", "--no-compile"], "--search compiles its plans: drop --no-compile"),
])
def test_bad_search_flags_fail_in_one_line(capsys, args, says):
    assert _compile_tpu().main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0]


@pytest.mark.slow
@pytest.mark.skipif(not HAS_LIBTPU, reason='libtpu not installed: pip install -e ".[tpu]"')
def test_cli_search_prints_a_table_and_an_override_line_that_composes(tmp_path):
    """The default tiny run on a v5e-4, one quick compile (the budget of 1 is the shipped plan, and
    --quick takes its compile as the winner's): ~13 CPU-s, 28-60 s wall on a loaded 2-core machine."""
    out = tmp_path / "search.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "compile_tpu.py"), "--topology", "v5e-4",
                             "--search", "--search-budget", "1", "--quick", "--json", str(out)],
                            capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    got = json.loads(out.read_text())
    search = got["search"]
    assert search["compiled"] == 1 and search["candidates"] > 1 and got["winner"]["is_shipped"]
    assert "  #  plan" in result.stdout and "(shipped)" in result.stdout
    line = next(x for x in result.stdout.splitlines() if x.strip().startswith("overrides: ")).split(": ", 1)[1]
    cfg = make_cfg(tmp_path, *line.split())
    assert ps.plan_of(cfg).overrides() == got["winner"]["overrides"] == search["ranking"][0]["overrides"]
    assert got["train_step"]["predicted"]["step_s"] == search["ranking"][0]["predicted"]["step_s"]
    assert math.prod(got["mesh"].values()) == 4

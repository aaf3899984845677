"""FLOPs per token and the peak table. Run: pytest tests/test_flops.py -q"""
import pytest

from model import flops
from model.llama import LlamaConfig

LLAMA2_7B = LlamaConfig(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32, d_ff=11008)


def test_flops_per_token_llama2_7b():
    # matmul params: all but the input embedding table and the norm scales
    n_matmul = LLAMA2_7B.num_params() - 32000 * 4096 - (2 * 32 + 1) * 4096
    assert flops.matmul_params(LLAMA2_7B) == n_matmul
    got = flops.flops_per_token(LLAMA2_7B, 1024)
    assert got == 6 * n_matmul + 12 * 32 * 4096 * 1024
    assert got == pytest.approx(6 * 6.61e9 + 1.61e9, rel=0.01)  # ~41.3 GFLOP/token
    # causal: the useful attention is the lower triangle, half the square
    assert flops.flops_per_token(LLAMA2_7B, 1024, causal=True) == 6 * n_matmul + 6 * 32 * 4096 * 1024


def test_recompute_factor():
    import dataclasses

    fpt = flops.flops_per_token(LLAMA2_7B, 1024)
    attention_fwd = 4 * 32 * 4096 * 1024
    head = 2 * 4096 * 32000
    layers_fwd = 2 * (flops.matmul_params(LLAMA2_7B) - 4096 * 32000) + attention_fwd
    assert flops.recompute_factor(dataclasses.replace(LLAMA2_7B, remat="none"), 1024) == 1.0
    full = dataclasses.replace(LLAMA2_7B, remat="full")
    assert flops.recompute_factor(full, 1024) == pytest.approx(1 + layers_fwd / fpt)
    assert flops.recompute_factor(full, 1024) == pytest.approx(4 / 3, abs=0.01)  # 8ND vs 6ND
    assert flops.recompute_factor(full, 1024, loss_chunk=256) == pytest.approx(1 + (layers_fwd + head) / fpt)
    for attention, dots_all in (("xla", 1.0), ("splash", 1 + attention_fwd / fpt)):
        cfg = dataclasses.replace(LLAMA2_7B, attention=attention)
        assert flops.recompute_factor(dataclasses.replace(cfg, remat="dots"), 1024) == pytest.approx(
            1 + attention_fwd / fpt)
        assert flops.recompute_factor(dataclasses.replace(cfg, remat="dots_all"), 1024) == pytest.approx(dots_all)
    # dots_attention keeps the cuDNN kernel's outputs (nothing re-run); with any other attention it is dots
    for attention, factor in (("cudnn", 1.0), ("xla", 1 + attention_fwd / fpt), ("splash", 1 + attention_fwd / fpt)):
        cfg = dataclasses.replace(LLAMA2_7B, attention=attention, remat="dots_attention")
        assert flops.recompute_factor(cfg, 1024) == pytest.approx(factor)
    # offload keeps the layer's input and q, k, v, o projections: attention and the MLP run again
    mlp_fwd = 2 * 32 * 3 * 4096 * 11008
    assert flops.recompute_factor(dataclasses.replace(LLAMA2_7B, remat="offload"), 1024) == pytest.approx(
        1 + (attention_fwd + mlp_fwd) / fpt)


def test_tied_head_still_counts_output_projection():
    tied = LlamaConfig(vocab_size=100, d_model=8, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=16, tie_embeddings=True)
    assert flops.matmul_params(tied) == tied.layer_params() - 16 + 800


@pytest.mark.parametrize("kind,peak", [
    ("TPU v4", 275e12), ("TPU v5 lite", 197e12), ("TPU v5p", 459e12), ("TPU v5", 459e12),
    ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H200", 989e12), ("NVIDIA A100-SXM4-40GB", 312e12)])
def test_peak_table(kind, peak):
    assert flops.peak_flops(kind) == peak


def test_peak_unknown_and_override():
    assert flops.peak_flops("cpu") is None
    assert flops.peak_flops("cpu", override=1e12) == 1e12
    assert flops.mfu(1000.0, 1e9, 2, None) is None
    assert flops.mfu(1000.0, 1e9, 2, 1e12) == pytest.approx(0.5)


# ---------------------------------------------------------------- the MFU sweep (scripts/bench/bench_mfu.py)
def _bench_mfu():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "bench" / "bench_mfu.py"
    spec = importlib.util.spec_from_file_location("bench_mfu", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_mfu_sweep_names_why_a_try_failed():
    bench_mfu = _bench_mfu()
    oom = "Traceback...\njaxlib.XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying to allocate"
    assert bench_mfu.error_line(oom) == "out of memory"
    assert bench_mfu.error_line("warning: x\nValueError: batch 15 not divisible by microbatches=2\n") == \
        "ValueError: batch 15 not divisible by microbatches=2"
    assert bench_mfu.error_line("") == "no output"
    names = [t["name"] for t in bench_mfu.gpu_plan()]
    assert len(names) == len(set(names)) and names[0].startswith("1b_s2048")   # the goal first
    with pytest.raises(SystemExit, match="no try named nope"):
        bench_mfu.main(["--plan", "cpu", "--names", "tiny_b16,nope"])


def test_profile_top_sums_a_devices_kernels_by_kind_and_its_busy_time(tmp_path):
    """scripts/bench/profile_top.py on a trace of known kernels: two streams overlapping for 2 us,
    an XLA Ops line that repeats them (left out), and a host process (not the device)."""
    import gzip
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "bench" / "profile_top.py"
    spec = importlib.util.spec_from_file_location("profile_top", path)
    profile_top = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(profile_top)

    meta = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/host:CPU"}},
            {"ph": "M", "pid": 1, "tid": 7, "name": "thread_name", "args": {"name": "Stream #7"}},
            {"ph": "M", "pid": 1, "tid": 8, "name": "thread_name", "args": {"name": "Stream #8"}},
            {"ph": "M", "pid": 1, "tid": 9, "name": "thread_name", "args": {"name": "XLA Ops"}}]
    kernels = [(7, 0, 10, "nvjet_sm90_tst_128x160_NNT"), (7, 10, 6, "cudnn_generated_fort_native_sdpa_flash_fprop"),
               (8, 14, 4, "loop_add_fusion"), (7, 30, 10, "nvjet_sm90_tst_128x160_NNT"),
               (9, 0, 40, "fusion.1"), (8, 40, 0, "memcpy128")]
    events = meta + [{"ph": "X", "pid": 1, "tid": t, "ts": ts, "dur": d, "name": n} for t, ts, d, n in kernels]
    events.append({"ph": "X", "pid": 2, "tid": 1, "ts": 0, "dur": 100, "name": "host work"})
    run = tmp_path / "plugins" / "profile" / "2026_11_26"
    run.mkdir(parents=True)
    with gzip.open(run / "vm.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)

    s = profile_top.summarize(profile_top.newest_trace(str(tmp_path)), steps=2)
    d = s["devices"]["/device:GPU:0"]
    assert (d["span_ms"], d["busy_ms"], d["kernels"]) == (0.04, 0.028, 5)   # 0-18 and 30-40 busy of 0-40
    assert {k: v["frac"] for k, v in d["by_kind"].items()} == {"matmul": 0.6667, "attention": 0.2,
                                                                "other (fusions)": 0.1333, "copy": 0.0}
    assert d["top"][0] == {"name": "nvjet_sm90_tst_128x160_NNT", "kind": "matmul", "ms_per_step": 0.01,
                           "calls_per_step": 1.0, "frac": 0.6667}
    with pytest.raises(SystemExit, match="no process named /device:TPU"):
        profile_top.summarize(profile_top.newest_trace(str(tmp_path)), device_prefix="/device:TPU")


@pytest.mark.slow
def test_mfu_sweep_records_each_try_and_a_failed_one_as_a_row(tmp_path):
    """Each try in its own process with its own XLA flags; the accumulation, chunked loss and MFU
    counts reach the row; a try that fails is a row with its reason and the sweep goes on."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "bench" / "bench_mfu.py"
    out = tmp_path / "mfu.jsonl"
    proc = subprocess.run([sys.executable, str(script), "--plan", "cpu", "--only", "mb2", "--out", str(out),
                           "--profile-dir", str(tmp_path / "prof")], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "JAX_PLATFORMS": "cpu", "BENCH_MFU_DEVICE_PREFIX": "/host:CPU"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ok, failed = [json.loads(line) for line in out.read_text().splitlines()]
    assert ok["status"] == "ok" and (ok["microbatches"], ok["loss_chunk"]) == (2, 32)
    assert ok["xla_flags"].endswith("--xla_cpu_enable_fast_math=false")
    assert ok["recompute_factor"] > 1.0                      # the chunked loss re-runs the head
    assert 0 < ok["mfu_causal"] < ok["mfu"]                  # half the attention square is not useful work
    assert failed["status"] == "failed" and "15" in failed["error"]
    # --profile-dir: the try's traced steps summed by kernel, in its row and printed before it
    assert ok["profile"]["steps"] == 3 and ok["profile"]["devices"]["/host:CPU"]["kernels"] > 0
    rows = [line.split()[0] for line in proc.stdout.splitlines() if line.startswith("tiny_")]
    assert rows == ["tiny_b16_mb2_chunk32", "tiny_b15_mb2_fails"]
    assert "--- profile of tiny_b16_mb2_chunk32" in proc.stdout

"""model.attention=cudnn: when the cuDNN kernel is chosen, the fallback to the XLA reference when it
cannot run (CPU, fp32, an unsupported head dim), and, on an NVIDIA GPU, the kernel's numbers.

    pytest tests/test_attention_cudnn.py -q                          # CPU: selection and fallback
    JAX_PLATFORMS=cuda pytest tests/test_attention_cudnn.py -q       # a GPU host: the kernel too

(tests/conftest.py pins JAX_PLATFORMS=cpu unless it is set, hence the variable on a GPU host.)
The GPU tests skip elsewhere; the document-isolation test also runs with the XLA reference on any
backend, which checks the test itself.
"""
import dataclasses
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import yaml
from flax import nnx

from model import llama, step
from model.llama import Llama, LlamaConfig

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
ON_GPU = jax.default_backend() == "gpu"
needs_gpu = pytest.mark.skipif(not ON_GPU,
                               reason=f"cuDNN attention needs an NVIDIA GPU (backend: {jax.default_backend()})")

# head_dim 64 as in the 125m and 1b presets; bf16 compute as on a GPU.
CFG = LlamaConfig(vocab_size=256, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=512,
                  max_seq_len=256, dtype="bfloat16", remat="none")
# For the CPU fallback: small and fp32, so the compiles take seconds (the platform decides first).
CPU_CFG = LlamaConfig(vocab_size=128, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96,
                      dtype="float32", remat="none")


@pytest.fixture(autouse=True)
def fresh_notices(monkeypatch):
    monkeypatch.setattr(llama, "_NOTICES_SHOWN", set())


# ---------------------------------------------------------------- the choice, on any machine
@pytest.mark.parametrize("platform,dtype,head_dim,seq,capability,needle", [
    ("gpu", "bfloat16", 64, 2048, "9.0", None),
    ("gpu", "float16", 128, 1024, "8.0", None),
    ("gpu", "bfloat16", 256, 2048, "9.0", None),        # Hopper takes head dim 256
    ("gpu", "bfloat16", 256, 2048, "8.0", "up to 128"),  # an A100 does not
    ("cpu", "bfloat16", 64, 2048, None, "devices are cpu"),
    ("tpu", "bfloat16", 64, 2048, None, "devices are tpu"),
    ("gpu", "float32", 64, 2048, "9.0", "model.dtype=float32"),
    ("gpu", "bfloat16", 60, 2048, "9.0", "head_dim=60"),
    ("gpu", "bfloat16", 64, 2047, "9.0", "sequence length 2047"),
])
def test_cudnn_is_chosen_only_where_it_runs(platform, dtype, head_dim, seq, capability, needle):
    reason = llama.cudnn_unavailable(platform, jnp.dtype(dtype), head_dim, seq, capability)
    if needle is None:
        assert reason is None
    else:
        assert needle in reason


def test_jax_refusing_the_kernel_at_trace_time_falls_back_with_its_reason(monkeypatch, capfd):
    """A GPU that passes our checks but whose cuDNN JAX refuses when tracing (no cuDNN library, an
    old version): the reference attention's numbers, and JAX's first line as the reason, once."""
    monkeypatch.setattr(llama, "_devices_here", lambda: ("gpu", "9.0"))

    def refuse(*args, **kwargs):
        raise RuntimeError("cuDNN is not detected.\nsecond line of the message")
    monkeypatch.setattr(llama, "attention_dpa", refuse)
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for shape in
               ((2, 16, 4, 64), (2, 16, 2, 64), (2, 16, 2, 64)))
    seg = jnp.asarray(np.repeat([[1] * 10 + [2] * 6], 2, 0), jnp.int32)
    out = llama.attention(q, k, v, seg, "cudnn")
    np.testing.assert_array_equal(out, llama.attention_xla(q, k, v, seg))
    llama.attention(q, k, v, seg, "cudnn")
    lines = [x for x in capfd.readouterr().err.splitlines() if "model.attention=cudnn" in x]
    assert lines == ["model.attention=cudnn unavailable (cuDNN is not detected.); using the XLA reference "
                     "attention"], lines


def _batch(seed=0, b=2, t=128, vocab=CFG.vocab_size, cuts=(40, 90)):
    """Packed rows of three documents: [0, 40), [40, 90), [90, t)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (b, t + 1)).astype(np.int32)
    seg = (np.digitize(np.arange(t), cuts) + 1).astype(np.int32)
    starts = np.array([0, *cuts])[seg - 1]
    return dict(inputs=tokens[:, :-1], targets=tokens[:, 1:], segment_ids=np.repeat(seg[None], b, 0),
                positions=np.repeat((np.arange(t) - starts)[None], b, 0).astype(np.int32),
                loss_mask=np.ones((b, t), np.int32))


def _loss_and_grads(cfg, batch, params=None):
    graphdef, init = nnx.split(Llama(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    params = nnx.to_pure_dict(init) if params is None else params
    fn = jax.jit(jax.value_and_grad(lambda p: step.loss_fn(p, graphdef, batch, 0.0)[0]))
    return params, fn, fn(params)


@pytest.mark.slow
@pytest.mark.skipif(ON_GPU, reason="checks the fallback where cuDNN cannot run")
def test_cudnn_falls_back_to_the_reference_with_its_numbers_and_says_so_once(capfd):
    batch = _batch(t=32, cuts=(10, 20), vocab=CPU_CFG.vocab_size)
    params, _, (ref_loss, ref_g) = _loss_and_grads(CPU_CFG, batch)
    cfg = dataclasses.replace(CPU_CFG, attention="cudnn")
    _, fn, (loss, g) = _loss_and_grads(cfg, batch, params)
    # The fallback is the reference itself: the same numbers bit for bit, not merely close.
    np.testing.assert_array_equal(loss, ref_loss)
    jax.tree.map(np.testing.assert_array_equal, g, ref_g)
    fn(jax.tree.map(lambda x: x * 1.0, params))                    # same trace again
    _loss_and_grads(cfg, _batch(t=16, cuts=(5, 9), vocab=cfg.vocab_size), params)      # a new trace (other shapes)
    lines = [x for x in capfd.readouterr().err.splitlines() if "model.attention=cudnn" in x]
    assert lines == [f"model.attention=cudnn unavailable (the devices are {jax.default_backend()}, not NVIDIA "
                     "GPUs); using the XLA reference attention"], lines


@pytest.mark.slow
@pytest.mark.skipif(ON_GPU, reason="checks the fallback where cuDNN cannot run")
def test_cudnn_fallback_under_a_mesh_reads_the_mesh_devices(capfd):
    """On the 8 fake CPU devices with the fsdp rules the train step runs and names the devices' platform."""

    with open(CONFIGS / "mesh" / "fsdp.yaml") as f:
        mesh_cfg = yaml.safe_load(f)
    cfg = dataclasses.replace(CPU_CFG, attention="cudnn")
    program = step.build_program(cfg, optax.adamw(1e-3), mesh_cfg, global_batch=8, z_loss=0.0, microbatches=1)
    assert program.mesh.shape["fsdp"] == 8
    state, _ = step.init_train_state(cfg, optax.adamw(1e-3), program.mesh, program.rules, seed=0)
    batch = {k: np.concatenate([v] * 4) for k, v in _batch(t=32, cuts=(10, 20), vocab=cfg.vocab_size).items()}
    _, metrics = program.train_step(state, batch)
    assert np.isfinite(float(metrics["loss"]))
    assert "model.attention=cudnn unavailable (the devices are cpu" in capfd.readouterr().err


@pytest.mark.parametrize("max_segments", [2, 3, 5, 8])
def test_packed_layout_names_each_rows_documents_as_cudnn_takes_them(max_segments):
    """Offsets and lengths for cuDNN's packed layout, checked by rebuilding each token's run from
    them: every token of a fitting row lies in exactly one run, that run is its document's, and the
    -1 fill follows the last run; a row with more runs than max_segments makes `fits` false."""
    rng = np.random.default_rng(max_segments)
    b, t = 12, 40
    rows = []
    for i in range(b):
        n_docs = i % 6 + 1
        cuts = np.sort(rng.choice(np.arange(1, t), n_docs - 1, replace=False))
        seg = np.digitize(np.arange(t), cuts) + 1
        if i % 3 == 0:
            seg[t - 5:] = 0      # a padding tail: a run of its own
        rows.append(seg)
    seg_bt = np.stack(rows).astype(np.int32)
    runs_b = [1 + int(np.sum(r[1:] != r[:-1])) for r in seg_bt]

    offsets, seqlen, fits = jax.jit(llama.packed_layout, static_argnums=1)(jnp.asarray(seg_bt), max_segments)
    offsets, seqlen = np.asarray(offsets), np.asarray(seqlen)
    assert offsets.shape == (b, max_segments + 1) and seqlen.shape == (b, max_segments)
    assert offsets.dtype == np.int32 and seqlen.dtype == np.int32
    assert bool(fits) == (max(runs_b) <= max_segments)
    for row, n in enumerate(runs_b):
        if n > max_segments:
            continue
        assert list(offsets[row, n:]) == [-1] * (max_segments + 1 - n)
        assert list(seqlen[row, n:]) == [-1] * (max_segments - n)
        run_of_token = np.full(t, -1)
        for r in range(n):
            assert seqlen[row, r] > 0
            span = slice(offsets[row, r], offsets[row, r] + seqlen[row, r])
            assert (run_of_token[span] == -1).all()
            run_of_token[span] = r
        expected = np.concatenate([[0], np.cumsum(seg_bt[row, 1:] != seg_bt[row, :-1])])
        np.testing.assert_array_equal(run_of_token, expected)
    # Only full rows can spill: each row's runs beyond the limit are the ones cut.
    assert sum(n > max_segments for n in runs_b) > 0 or max_segments >= 6


def test_packed_segments_is_validated():
    with pytest.raises(ValueError, match="model.cudnn_packed_segments=1"):
        LlamaConfig(vocab_size=8, d_model=8, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=8, cudnn_packed_segments=1)


# ---------------------------------------------------------------- the kernel, on a GPU
def _ragged_batch(seed=0, b=4, t=256, vocab=CFG.vocab_size):
    """Rows that differ: 1 to 5 documents at random cuts, some with a padding tail (id 0)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (b, t + 1)).astype(np.int32)
    seg, pos = np.zeros((b, t), np.int32), np.zeros((b, t), np.int32)
    for i in range(b):
        cuts = np.sort(rng.choice(np.arange(8, t - 8), i % 5, replace=False))
        seg[i] = np.digitize(np.arange(t), cuts) + 1
        starts = np.array([0, *cuts])[seg[i] - 1]
        pos[i] = np.arange(t) - starts
        if i % 2:
            seg[i, t - 24:] = 0
    return dict(inputs=tokens[:, :-1], targets=tokens[:, 1:], segment_ids=seg, positions=pos,
                loss_mask=(seg > 0).astype(np.int32))


@needs_gpu
@pytest.mark.parametrize("max_segments", [8, 3], ids=["rows_fit", "a_row_spills_to_the_mask"])
def test_cudnn_packed_layout_matches_the_reference_loss_and_grads(max_segments, capfd):
    """GQA (4 query heads, 2 key/value heads) and rows of different documents: a kernel reading
    another row's or another head's keys would be far off. With max_segments 3 the batch holds a
    row of 5 documents, so the masked kernel runs instead: the same numbers either way."""
    batch = _ragged_batch()
    params, _, (ref_loss, ref_g) = _loss_and_grads(CFG, batch)
    cfg = dataclasses.replace(CFG, attention="cudnn", cudnn_packed_segments=max_segments)
    _, _, (loss, g) = _loss_and_grads(cfg, batch, params)
    err = capfd.readouterr().err
    assert "packed layout (rows of up to" in err and "refused" not in err, err
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-2)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g), jax.tree.leaves(ref_g), strict=True):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        rel = np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-12)
        assert rel < 3e-2, (jax.tree_util.keystr(path), rel)


@needs_gpu
def test_cudnn_runs_the_kernel_and_matches_the_reference_loss_and_grads(capfd):
    batch = _batch(t=256, cuts=(70, 200))
    params, _, (ref_loss, ref_g) = _loss_and_grads(CFG, batch)
    cfg = dataclasses.replace(CFG, attention="cudnn")
    graphdef, _ = nnx.split(Llama(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    lowered = jax.jit(jax.grad(lambda p: step.loss_fn(p, graphdef, batch, 0.0)[0])).lower(params).as_text()
    assert "__cudnn$fmha" in lowered, "the cuDNN kernel is not in the program (silent fallback?)"
    assert "unavailable" not in capfd.readouterr().err
    _, _, (loss, g) = _loss_and_grads(cfg, batch, params)
    # bf16 compute on both sides, accumulated in different orders: a few bf16 ulps.
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-2)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g), jax.tree.leaves(ref_g), strict=True):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        rel = np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-12)
        assert rel < 3e-2, (jax.tree_util.keystr(path), rel)


@needs_gpu
@pytest.mark.parametrize("packed", [0, 4], ids=["masked", "packed"])
def test_remat_dots_attention_keeps_the_kernels_outputs_instead_of_rerunning_it(packed):
    """Under remat "dots" the backward pass runs cuDNN's attention forward again; "dots_attention"
    keeps its outputs, so the compiled step holds one forward kernel fewer, and the same numbers.
    Packed: both kernels sit in a lax.cond, whose branches the policy reaches too."""
    batch = _batch(t=256, cuts=(70, 200))

    def forwards(remat):
        cfg = dataclasses.replace(CFG, attention="cudnn", remat=remat, cudnn_packed_segments=packed)
        graphdef, params = nnx.split(Llama(cfg, rngs=nnx.Rngs(0)), nnx.Param)
        params = nnx.to_pure_dict(params)
        fn = jax.jit(jax.value_and_grad(lambda p: step.loss_fn(p, graphdef, batch, 0.0)[0]))
        # The program as JAX hands it to XLA: remat's re-runs are already written out there.
        targets = re.findall(r"__cudnn\$fmha\w*", fn.lower(params).as_text())
        n_fwd = sum(not t.endswith("Backward") for t in targets)
        return n_fwd, fn(params)

    n_dots, (loss_dots, g_dots) = forwards("dots")
    n_kept, (loss_kept, g_kept) = forwards("dots_attention")
    assert n_kept < n_dots, (n_kept, n_dots)
    np.testing.assert_allclose(float(loss_kept), float(loss_dots), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g_kept), jax.tree.leaves(g_dots), strict=True):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("impl,packed", [("xla", 0), pytest.param("cudnn", 0, marks=needs_gpu),
                                         pytest.param("cudnn", 4, marks=needs_gpu)])
def test_changing_one_packed_document_leaves_the_others_logits(impl, packed):
    cfg = dataclasses.replace(CFG, attention=impl, cudnn_packed_segments=packed)
    model = Llama(cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    fwd = jax.jit(lambda p, b: nnx.merge(graphdef, p)(b["inputs"], b["positions"], b["segment_ids"]))
    batch = _batch(t=256, cuts=(70, 200))
    changed = dict(batch, inputs=batch["inputs"].copy())
    doc2 = batch["segment_ids"][0] == 2
    changed["inputs"][:, doc2] = (changed["inputs"][:, doc2] + 1) % cfg.vocab_size
    before, after = np.asarray(fwd(params, batch)), np.asarray(fwd(params, changed))
    # Documents 1 and 3 see nothing of document 2: their logits are unchanged.
    np.testing.assert_allclose(after[:, ~doc2], before[:, ~doc2], atol=1e-5, rtol=0)
    assert np.abs(after[:, doc2] - before[:, doc2]).max() > 1e-2   # and document 2's did change

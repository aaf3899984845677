"""KV-cache generation: cached decoding equals recomputing the whole prefix; generate.py samples
from a briefly trained checkpoint.

Run: pytest tests/test_generate.py -q
"""
import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hydra import compose, initialize_config_dir

import train as train_mod
from model.llama import Llama, LlamaConfig
from tests.run_helpers import MICRO

# Module fixtures train real runs: the whole file belongs to the slow tier.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SMALL = dict(vocab_size=96, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=64,
             dtype="float32", remat="none")


def load_script(name):
    spec = importlib.util.spec_from_file_location(f"scripts_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


generate = load_script("generate")


def random_params(cfg: LlamaConfig, seed=0, std=0.3):
    """Every weight N(0, std), norm scales 1 + N(0, 0.1): larger than the model's init, so
    greedy continuations vary instead of repeating one token."""
    model = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
    leaves, treedef = jax.tree.flatten_with_path(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    out = []
    for (path, a), key in zip(leaves, keys, strict=False):
        noise = jax.random.normal(key, a.shape, a.dtype)
        out.append(1.0 + 0.1 * noise if "scale_d" in jax.tree_util.keystr(path) else std * noise)
    return jax.tree.unflatten(treedef, out)


def greedy_uncached(cfg, params, prompt, n_new):
    """Reference: the full training forward over the whole sequence for every new token.

    The sequence is zero-padded to its final length so one compile serves every step; the
    forward is causal, so the padding cannot change the logits read at position len - 1.
    """
    from model.step import model_from_params

    total = len(prompt) + n_new
    forward = jax.jit(lambda p, tokens: model_from_params(cfg, p)(
        tokens, jnp.arange(total)[None], jnp.ones((1, total), jnp.int32)))
    seq = list(prompt)
    for _ in range(n_new):
        logits = forward(params, jnp.asarray([seq + [0] * (total - len(seq))], jnp.int32))
        seq.append(int(jnp.argmax(logits[0, len(seq) - 1])))
    return seq[len(prompt):]


@pytest.mark.slow
@pytest.mark.parametrize("scan_layers, tie", [(True, False), (False, True)])
def test_cached_greedy_equals_uncached(scan_layers, tie):
    cfg = LlamaConfig(**SMALL, scan_layers=scan_layers, tie_embeddings=tie)
    params = random_params(cfg)
    prompt = [int(x) for x in np.random.default_rng(0).integers(0, cfg.vocab_size, 7)]
    want = greedy_uncached(cfg, params, prompt, 16)
    got = generate.generate(cfg, params, prompt, 16, temperature=0.0)
    assert got == want
    assert len(set(want)) > 1  # not a degenerate constant continuation


# The open-checkpoint variants (model/hf.py): a window shorter than the sequence (Mistral), q/k/v
# biases and a decoupled head_dim (Qwen2-like), q/k norms (Qwen3), Llama 3.1's RoPE scaling.
VARIANTS = {"llama2": {}, "window": dict(sliding_window=6), "bias_head_dim": dict(qkv_bias=True, head_dim=16),
            "qk_norm": dict(qk_norm=True),
            "llama3_rope": dict(rope_type="llama3", rope_theta=500000.0, rope_factor=8.0, rope_low_freq_factor=1.0,
                                rope_high_freq_factor=4.0, rope_original_max_len=16)}


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_decode_logits_match_forward_in_chunks(variant):
    """Prefill + uneven chunks through the cache reproduce the training forward's logits."""
    from model.step import model_from_params

    cfg = LlamaConfig(**SMALL, **VARIANTS[variant])
    model = model_from_params(cfg, random_params(cfg, seed=1, std=0.1))
    b, t = 2, 20
    tokens = jax.random.randint(jax.random.key(0), (b, t), 0, cfg.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    want = model(tokens, positions, jnp.ones((b, t), jnp.int32))
    cache = model.init_cache(b, 32)
    pieces = []
    for lo, hi in [(0, 9), (9, 10), (10, 15), (15, 20)]:
        logits, cache = model.decode(tokens[:, lo:hi], positions[:, lo:hi], cache)
        pieces.append(logits)
    assert int(cache["length"]) == t
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), want, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_sampling_temperature_top_p_and_vocab_padding():
    logits = jnp.log(jnp.asarray([[0.05, 0.6, 0.3, 0.05, 10.0]]))  # id 4 is vocabulary padding
    keys = jax.random.split(jax.random.key(0), 200)
    draw = lambda t, p: np.array([int(generate.sample_logits(logits, k, t, p, 4)[0]) for k in keys])  # noqa: E731
    assert set(draw(0.0, 1.0)) == {1}                 # greedy, padding id never chosen
    assert set(draw(1.0, 0.5)) == {1}                 # nucleus of mass 0.5 is the top token
    assert set(draw(1.0, 0.8)) == {1, 2}              # 0.6 + 0.3 covers 0.8
    assert set(draw(1.0, 1.0)) <= {0, 1, 2, 3} and len(set(draw(1.0, 1.0))) >= 3


# ---------------------------------------------------------------- the CLI on a trained checkpoint
TINY_RUN = [*MICRO, "data.seq_len=64",
            "data.global_batch_size=8", "data.num_workers=0", "train.steps=4", "train.log_every=2",
            "train.eval_every=0", "checkpoint.every=2", "optimizer.warmup_steps=1", "logger.wandb.mode=disabled"]


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("gen_run")
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("train", overrides=[f"paths.run_dir={run_dir}", "logger.progress_bar=false", *TINY_RUN])
    train_mod.train(cfg)
    return run_dir


@pytest.mark.slow
@pytest.mark.parametrize("where", ["run", "checkpoints", "step"])
def test_generate_cli_prints_prompt_and_continuation(trained_run, where, capsys):
    path = {"run": trained_run, "checkpoints": trained_run / "checkpoints",
            "step": trained_run / "checkpoints" / "2"}[where]
    prompt = "The river was"
    generate.main(["--checkpoint", str(path), "--prompt", prompt, "--max-new-tokens", "12",
                   "--temperature", "0.9", "--top-p", "0.95", "--seed", "3"])
    captured = capsys.readouterr()
    assert captured.out.startswith(prompt)
    assert len(captured.out.strip()) > len(prompt)
    step = "2" if where == "step" else "4"
    assert f"checkpoints/{step}:" in captured.err


@pytest.mark.slow
def test_generate_greedy_is_deterministic_and_bounded(trained_run, capsys):
    args = ["--checkpoint", str(trained_run), "--prompt", "Once", "--max-new-tokens", "300", "--temperature", "0"]
    with pytest.raises(ValueError, match="max_seq_len"):
        generate.main(args)                      # 300 new tokens exceed the model's 256
    args[5] = "20"
    generate.main(args + ["--seed", "1"])
    first = capsys.readouterr().out
    generate.main(args + ["--seed", "2"])
    assert capsys.readouterr().out == first      # greedy ignores the seed

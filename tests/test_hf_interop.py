"""Hugging Face interop: export -> import is the identity on parameters, the exported directory
loads in `transformers` and gives our logits to 1e-4 (fp32), sharded safetensors import, and
`checkpoint.init_from` with an imported checkpoint trains from exactly those parameters.

Run: pytest tests/test_hf_interop.py -q   (the transformers checks skip without torch/transformers)
"""
import dataclasses
import importlib.util
import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hydra import compose, initialize_config_dir

import train as train_mod
from model import hf
from model.llama import Llama, LlamaConfig
from model.runtime import checkpoint as ckpt_lib
from model.step import model_from_params
from tests.run_helpers import MICRO

# Module fixtures train real runs: the whole file belongs to the slow tier.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = str(ROOT / "data" / "sample" / "tokenizer.json")


def load_script(name):
    spec = importlib.util.spec_from_file_location(f"scripts_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


export_hf, import_hf = load_script("export_hf"), load_script("import_hf")


def assert_same_params(a, b):
    fa, fb = jax.tree_util.tree_flatten_with_path(a)[0], jax.tree_util.tree_flatten_with_path(b)[0]
    assert [p for p, _ in fa] == [p for p, _ in fb]
    for (path, x), (_, y) in zip(fa, fb, strict=False):
        assert np.asarray(x).dtype == np.asarray(y).dtype == np.float32, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path))


def random_checkpoint(directory, cfg: LlamaConfig, seed=0):
    """A checkpoint of random weights with non-trivial norm scales (a swapped or transposed
    norm would show), carrying the meta a training run writes."""
    params = nnx.to_pure_dict(nnx.state(Llama(cfg, rngs=nnx.Rngs(seed)), nnx.Param))
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    params = jax.tree.unflatten(treedef, [
        x * (1.0 + 0.1 * jax.random.normal(key, x.shape)) if "scale_d" in jax.tree_util.keystr(path) else x
        for (path, x), key in zip(leaves, keys, strict=False)])
    meta = {"config": {"model": dataclasses.asdict(cfg), "tokenizer": {"path": TOKENIZER}, "data": {"add_bos": False}}}
    ckpt_lib.save_params(directory, params, meta)
    return params


# ---------------------------------------------------------------- a briefly trained run
TINY_RUN = [*MICRO, "model.tie_embeddings=false",
            "data.seq_len=64", "data.global_batch_size=8", "data.num_workers=0", "train.log_every=1",
            "train.eval_every=0", "checkpoint.every=0", "optimizer.warmup_steps=1", "logger.wandb.mode=disabled"]


def make_cfg(run_dir, *overrides):
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose("train", overrides=[f"paths.run_dir={run_dir}", "logger.progress_bar=false", *overrides])


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(trained run dir, its HF export, the export imported back)."""
    base = tmp_path_factory.mktemp("hf")
    train_mod.train(make_cfg(base / "run", *TINY_RUN, "train.steps=3"))
    export_hf.export(str(base / "run"), str(base / "hf"), dtype="float32")
    import_hf.import_hf(str(base / "hf"), str(base / "imported"), dtype="float32", remat="none")
    return base / "run", base / "hf", base / "imported"


@pytest.mark.slow
def test_export_import_round_trip_is_identity(exported):
    run, hf_dir, imported = exported
    cfg_a, params_a, _ = ckpt_lib.load_params(run)
    cfg_b, params_b, meta_b = ckpt_lib.load_params(imported)
    assert cfg_a == cfg_b  # the run's model config (shapes and runtime settings) comes back
    assert_same_params(params_a, params_b)
    assert meta_b["config"]["tokenizer"]["path"] == str(hf_dir.resolve() / "tokenizer.json")
    config = json.loads((hf_dir / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and config["num_key_value_heads"] == cfg_a.n_kv_heads


def test_sharded_safetensors_import(exported, tmp_path):
    """model.safetensors.index.json + shards (how large HF models ship) reads like one file."""
    from safetensors.numpy import save_file

    run, hf_dir, _ = exported
    sd = hf.read_safetensors(hf_dir)
    names = sorted(sd)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    for f in ("config.json", "tokenizer.json"):
        (sharded / f).write_bytes((hf_dir / f).read_bytes())
    for fname, keys in shards.items():
        save_file({k: sd[k] for k in keys}, str(sharded / fname))
    index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    import_hf.import_hf(str(sharded), str(tmp_path / "ckpt"), dtype="float32", remat="none")
    assert_same_params(ckpt_lib.load_params(run)[1], ckpt_lib.load_params(tmp_path / "ckpt")[1])


BASE_HF = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
               num_attention_heads=2, num_key_value_heads=1)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}  # Qwen2.5's, old "type" key
# config.json changes that would make another network: (change, what the one line must name)
REFUSED = [
    ({"model_type": "gemma"}, "model_type='gemma'"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, "rope_scaling.rope_type='longrope'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.original_max_position_embeddings=None"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "original_max_position_embeddings": 32}},
     "rope_parameters.factor=None"),
    ({"rope_scaling": {**YARN, "truncate": None}}, "rope_scaling.truncate=None"),
    ({"rope_scaling": {**YARN, "rope_type": "linear"}}, "rope_scaling.type='yarn'"),
    ({"rope_scaling": {**YARN, "beta_slow": 0}}, "model.rope_beta_slow=0.0"),
    ({"rope_scaling": YARN, "original_max_position_embeddings": 4096}, "original_max_position_embeddings=4096"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
     "rope_parameters.rope_type='linear'"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling.rope_type='dynamic'"),
    ({"rope_scaling": {k: v for k, v in LLAMA3.items() if k != "low_freq_factor"}},
     "rope_scaling.low_freq_factor=None"),
    ({"rope_scaling": LLAMA3, "rope_parameters": {**LLAMA3, "factor": 32.0}}, "rope_scaling.factor=8.0"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25}},
     "rope_parameters.partial_rotary_factor=0.25"),
    ({"attention_bias": True}, "attention_bias=True"),
    ({"model_type": "qwen3", "attention_bias": True}, "attention_bias=True"),
    ({"mlp_bias": True}, "mlp_bias=True"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"num_local_experts": 8}, "num_local_experts=8"),
    ({"model_type": "qwen2", "use_sliding_window": True}, "use_sliding_window=True"),
    ({"layer_types": ["sliding_attention"]}, "layer_types=['sliding_attention']"),
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0"),
]


@pytest.mark.parametrize("change, names", REFUSED, ids=[n for _, n in REFUSED])
def test_unsupported_hf_variants_are_refused_in_one_line(change, names):
    with pytest.raises(ValueError) as e:
        hf.from_hf_config({**BASE_HF, **change})
    message = str(e.value)
    assert names in message and "\n" not in message, message


def test_supported_hf_variants_read_their_fields():
    assert hf.from_hf_config(BASE_HF).head_dim == 8
    cfg = hf.from_hf_config({**BASE_HF, "head_dim": 4, "rope_theta": 5e5, "rope_scaling": LLAMA3})
    assert (cfg.head_dim, cfg.rope_type, cfg.rope_theta, cfg.rope_llama3) == (4, "llama3", 5e5, (8.0, 1.0, 4.0, 8192))
    assert cfg == hf.from_hf_config({**BASE_HF, "head_dim": 4, "rope_parameters": {**LLAMA3, "rope_theta": 5e5}})
    assert hf.from_hf_config({**BASE_HF, "model_type": "mistral", "sliding_window": None}).sliding_window is None
    assert hf.from_hf_config({**BASE_HF, "model_type": "mistral"}).sliding_window == 4096  # MistralConfig's default
    assert hf.from_hf_config({**BASE_HF, "model_type": "qwen3"}).head_dim == 128  # Qwen3Config's default
    cfg = hf.from_hf_config({**BASE_HF, "model_type": "qwen2", "rope_theta": 1e6, "rope_scaling": YARN})
    assert (cfg.rope_type, cfg.rope_theta, cfg.rope_factor, cfg.rope_original_max_len) == ("yarn", 1e6, 4.0, 32768)
    assert (cfg.rope_yarn, cfg.rope_scale) == ((4.0, 32768, 32.0, 1.0, True), 0.1 * np.log(4.0) + 1)
    yarn = {"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 32768, "rope_theta": 1e6}
    assert cfg == hf.from_hf_config({**BASE_HF, "model_type": "qwen2", "rope_parameters": yarn})
    # a top-level original_max_position_embeddings (which transformers reads over the dict's) that agrees
    inner = {k: v for k, v in yarn.items() if k != "original_max_position_embeddings"}
    assert cfg == hf.from_hf_config({**BASE_HF, "model_type": "qwen2", "rope_parameters": inner,
                                     "original_max_position_embeddings": 32768})


def test_weights_without_a_place_and_unfit_exports_are_refused_in_one_line():
    cfg = hf.from_hf_config(BASE_HF, dtype="float32")
    sd = hf.to_hf_state_dict(nnx.to_pure_dict(nnx.state(Llama(cfg, rngs=nnx.Rngs(0)), nnx.Param)), cfg)
    hf.from_hf_state_dict(sd, cfg)
    with pytest.raises(ValueError, match=r"^weight 'model.layers.0.self_attn.o_proj.bias' \(and 0 more\)[^\n]*$"):
        hf.from_hf_state_dict({**sd, "model.layers.0.self_attn.o_proj.bias": np.zeros(16, np.float32)}, cfg)
    for fields, names in [(dict(qk_norm=True), "model.qk_norm=True"),
                          (dict(sliding_window=8), "model.sliding_window=8"),
                          (dict(hf_model_type="qwen2"), "model.qkv_bias=False")]:
        with pytest.raises(ValueError, match=f"^{re.escape(names)}[^\n]*$"):
            hf.to_hf_config(dataclasses.replace(cfg, **fields))


# ---------------------------------------------------------------- transformers loads the export
@pytest.mark.slow
@pytest.mark.parametrize("tie", [False, True])
def test_exported_model_logits_match_transformers(tmp_path, tie):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = LlamaConfig(vocab_size=4096, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=160,
                      rope_theta=5000.0, norm_eps=1e-5, max_seq_len=64, tie_embeddings=tie,
                      dtype="float32", remat="none")
    params = random_checkpoint(tmp_path / "ckpt", cfg)
    export_hf.export(str(tmp_path / "ckpt"), str(tmp_path / "hf"), dtype="float32")

    model = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "hf"), attn_implementation="eager").eval()
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 24))
    with torch.no_grad():
        want = model(torch.from_numpy(tokens)).logits.numpy()
    b, t = tokens.shape
    got = np.asarray(model_from_params(cfg, params)(jnp.asarray(tokens, jnp.int32),
                                                    jnp.broadcast_to(jnp.arange(t), (b, t)),
                                                    jnp.ones((b, t), jnp.int32)))
    assert np.abs(want).max() > 1.0  # not vacuous
    assert np.abs(got - want).max() <= 1e-4, np.abs(got - want).max()


@pytest.mark.slow
def test_export_writes_hub_style_bf16_shards_that_transformers_loads(tmp_path):
    """Default export: bf16 weights; with a small --max-shard-size, several
    model-0000i-of-0000N.safetensors files plus an index whose weight_map names every tensor once
    and whose total_size is their bytes; no file over the limit unless one tensor is; transformers
    loads the directory and holds our parameters rounded to bf16. One file when everything fits."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import ml_dtypes
    from safetensors import safe_open

    cfg = LlamaConfig(vocab_size=4096, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=160,
                      max_seq_len=64, tie_embeddings=False, dtype="float32", remat="none")
    params = random_checkpoint(tmp_path / "ckpt", cfg)
    limit = 60_000      # bytes: a layer's tensors are 8-20 kB in bf16, the embeddings 512 kB
    export_hf.main([str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--max-shard-size", f"{limit}B"])
    out = tmp_path / "hf"

    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in out.glob("*.safetensors"))
    n = len(files)
    assert n >= 3 and files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    want = hf.hf_shapes(cfg)
    assert sorted(index["weight_map"]) == sorted(want) and sorted(set(index["weight_map"].values())) == files
    total = 0
    for fname in files:
        with safe_open(str(out / fname), framework="numpy") as f:
            names = sorted(f.keys())
            assert names == sorted(k for k, v in index["weight_map"].items() if v == fname)
            sizes = []
            for name in names:
                w = f.get_tensor(name)
                assert w.dtype == ml_dtypes.bfloat16 and w.shape == want[name], name
                sizes.append(w.nbytes)
        assert sum(sizes) <= limit or len(sizes) == 1, (fname, sizes)
        total += sum(sizes)
    assert index["metadata"]["total_size"] == total == sum(int(np.prod(s)) * 2 for s in want.values())
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"

    model = transformers.LlamaForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    expected = {k: v.astype(ml_dtypes.bfloat16).astype(np.float32) for k, v in hf.to_hf_state_dict(params, cfg).items()}
    got = {k: v.numpy() for k, v in model.state_dict().items()}
    assert sorted(got) == sorted(expected)
    for name, w in expected.items():
        np.testing.assert_array_equal(got[name], w, err_msg=name)

    export_hf.export(str(tmp_path / "ckpt"), str(tmp_path / "one"))      # the default: 5GB files
    assert sorted(p.name for p in (tmp_path / "one").glob("*.safetensors*")) == ["model.safetensors"]
    with pytest.raises(SystemExit, match=r"^export_hf: --max-shard-size='5 parsecs': expected a size"):
        export_hf.main([str(tmp_path / "ckpt"), str(tmp_path / "bad"), "--max-shard-size", "5 parsecs"])


def test_exported_tokenizer_loads_offline(exported):
    transformers = pytest.importorskip("transformers")
    from data.tokenizer import load_tokenizer

    _, hf_dir, _ = exported
    tok = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    ours = load_tokenizer(TOKENIZER)
    text = "The river was wide and slow."
    assert tok(text)["input_ids"] == ours.encode(text, add_special_tokens=False).ids  # no BOS: add_bos=false
    assert (tok.bos_token, tok.eos_token, tok.unk_token) == ("<s>", "</s>", "<unk>")
    assert tok.eos_token_id == ours.token_to_id("</s>")
    assert tok.decode(tok(text)["input_ids"]).strip() == text


# ---------------------------------------------------------------- init_from an imported checkpoint
@pytest.mark.slow
def test_init_from_imported_checkpoint_trains_from_its_params(exported, tmp_path):
    """lr=0: the step changes nothing, so the saved parameters must be the imported ones, not
    a fresh init (a different seed makes a fresh init visibly different)."""
    run, _, imported = exported
    cfg = make_cfg(tmp_path / "run2", *TINY_RUN, "train.steps=2", "seed=7", "optimizer.lr=0.0",
                   "model.dtype=float32", "model.remat=none", f"checkpoint.init_from={imported}")
    summary = train_mod.train(cfg)
    assert summary["start_step"] == 0 and summary["steps"] == 2
    assert_same_params(ckpt_lib.load_params(tmp_path / "run2")[1], ckpt_lib.load_params(imported)[1])


# ---------------------------------------------------------------- the open-checkpoint families, both ways
def _family_variants():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import hf_helpers

    return hf_helpers


@pytest.mark.parametrize("name", ["llama2", "llama3", "llama3_hub_spelling", "llama_head_dim", "qwen2", "qwen3",
                                  "mistral", "smollm2", "tinyllama", "llama_yarn", "llama_yarn_hub_spelling",
                                  "qwen2_yarn", "qwen2_yarn_hub_spelling", "qwen3_yarn", "qwen3_yarn_hub_spelling"])
def test_import_then_export_writes_the_same_directory(name, tmp_path):
    """transformers' directory -> import_hf -> export_hf: the same model_type and architectures,
    the RoPE fields in the spelling it came in, every tensor back equal (fp32)."""
    variants = _family_variants()
    variants.save_variant(name, tmp_path / "hf")
    cfg, _ = import_hf.import_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"), dtype="float32", remat="none")
    export_hf.export(str(tmp_path / "ckpt"), str(tmp_path / "out"), dtype="float32")
    source = json.loads((tmp_path / "hf" / "config.json").read_text())
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    for key in ("model_type", "architectures", "hidden_size", "num_key_value_heads", "tie_word_embeddings",
                "intermediate_size", "vocab_size"):
        assert written[key] == source[key], key
    if "head_dim" in source:
        assert written["head_dim"] == source["head_dim"]
    # the spelling it came in holds the same RoPE (the other spelling is written too, equal); the old
    # "type" key (Qwen2.5's) comes back as "rope_type", which transformers, vLLM and llama.cpp read
    rope_in = source.get("rope_scaling") or source.get("rope_parameters") or {}
    rope_key = "rope_scaling" if source.get("rope_scaling") else "rope_parameters"
    for key, value in rope_in.items():
        key = "rope_type" if key == "type" else key
        got = written[rope_key].get(key, written["rope_theta"] if key == "rope_theta" else None)
        assert got == value, (rope_key, key)
    if rope_in:  # and nothing more: an optional key left out stays out (transformers' default)
        assert set(written[rope_key]) - {"rope_theta"} == {"rope_type" if k == "type" else k for k in rope_in} - {
            "rope_theta"}
    if "sliding_window" in source:
        assert written.get("sliding_window") == source["sliding_window"]
    a, b = hf.read_safetensors(tmp_path / "hf"), hf.read_safetensors(tmp_path / "out")
    assert sorted(a) == sorted(b)
    for key in a:
        assert b[key].dtype == np.float32
        np.testing.assert_array_equal(b[key], a[key], err_msg=key)
    assert hf.from_hf_config(written, dtype="float32", remat="none") == cfg


# Trained between import and export: the families whose parameters the others lack (Qwen2's q/k/v
# biases, Qwen3's q/k norms and its own head_dim), which the optimizer and checkpoint.init_from must
# carry. The rest check that the printed overrides compose to the imported model and go import ->
# export -> transformers without the training run (~15 s each): Llama 3's whole journey, trained, is
# also docs/continue.md's runnable block and tests/test_hf_continue_gcs.py.
TRAINED = {"qwen2", "qwen3"}


@pytest.mark.parametrize("name", ["llama3", "qwen2", "qwen3", "mistral", "qwen2_yarn_hub_spelling"])
def test_import_train_export_loads_in_transformers(name, tmp_path):
    """import_hf -> train.py a few steps from it (checkpoint.init_from, the printed overrides) ->
    export_hf -> transformers' AutoModelForCausalLM is the family's class and gives our logits."""
    variants = _family_variants()     # skips without torch and transformers (the [hf] extra)
    import torch
    import transformers

    variants.save_variant(name, tmp_path / "hf", vocab_size=4096)  # the bundled tokenizer's ids
    cfg, ckpt = import_hf.import_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"), dtype="float32", remat="none")
    run_args = [a for a in TINY_RUN if not a.startswith("model.")]
    run_cfg = make_cfg(tmp_path / "run", *run_args, *import_hf.model_overrides(cfg), "train.steps=3",
                       f"checkpoint.init_from={ckpt}", f"tokenizer.path={TOKENIZER}")
    assert LlamaConfig.from_mapping(run_cfg.model) == cfg      # the printed overrides are the family's model
    if name in TRAINED:
        train_mod.train(run_cfg)
        cfg_run, params, _ = ckpt_lib.load_params(tmp_path / "run")
        assert cfg_run == cfg
        before = ckpt_lib.load_params(ckpt)[1]
        assert np.abs(np.asarray(params["embed_vd"]) - np.asarray(before["embed_vd"])).max() > 0  # it trained
        export_hf.export(str(tmp_path / "run"), str(tmp_path / "out"), dtype="float32")
    else:
        params = ckpt_lib.load_params(ckpt)[1]
        export_hf.export(str(ckpt), str(tmp_path / "out"), dtype="float32")

    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), attn_implementation="eager")
    assert type(model).__name__ == variants.VARIANTS[name][0]
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 40))  # longer than the Mistral window
    with torch.no_grad():
        want = model.eval()(torch.from_numpy(tokens)).logits.numpy()
    b, t = tokens.shape
    got = np.asarray(model_from_params(cfg, params)(jnp.asarray(tokens, jnp.int32),
                                                    jnp.broadcast_to(jnp.arange(t), (b, t)),
                                                    jnp.ones((b, t), jnp.int32)))
    assert np.abs(want).max() > 1.0
    assert np.abs(got - want).max() <= 1e-4, np.abs(got - want).max()

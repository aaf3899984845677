"""The lm-evaluation-harness against our checkpoints: model "jaxpt" (model/evals/harness.py) and the
in-loop scorer (model/evals/evaluate.py) give the log-likelihoods of the Hugging Face Llama exported
from the same weights (scripts/export_hf.py) through the harness's own HF backend (HFLM), within
1e-4 per request in fp32, hence the same acc/acc_norm; `scripts/run_lm_eval.py` (the harness's CLI
with "jaxpt" registered) gives the same accuracy. Local task YAMLs only (no hub).

Run: pytest tests/test_lm_eval.py -q    (~2-3 min; skips without torch, transformers or lm_eval)
"""
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from data.tokenizer import load_tokenizer
from model import sharding as shd
from model.evals.evaluate import Scorer
from model.evals.tasks import RequestEncoder, TaskSpec, read_task
from model.llama import Llama, LlamaConfig
from model.runtime import checkpoint as ckpt_lib
from model.step import param_shardings
from tests.run_helpers import without_device_count

# The harness and torch load only where these tests run: found, not imported, at collection (each
# test worker collects every file; importing lm_eval and torch there cost seconds per worker).
# accelerate: the harness's HF backend imports it.
MISSING = [m for m in ("torch", "transformers", "lm_eval", "accelerate") if importlib.util.find_spec(m) is None]

pytestmark = [pytest.mark.slow, pytest.mark.skipif(bool(MISSING), reason=f"not installed: {MISSING}")]
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = str(ROOT / "data" / "sample" / "tokenizer.json")
SAMPLE = ROOT / "data" / "sample_tasks"
SEQ = 96
CFG = LlamaConfig(vocab_size=4096, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=SEQ,
                  dtype="float32", remat="none")

MC_YAML = """task: jx_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{gold}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
"""
# lm_eval/tasks/lambada/lambada_openai.yaml's request strings, on a local file.
LAMBADA_YAML = """task: jx_lambada
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{text.split(' ')[:-1]|join(' ')}}}}"
doc_to_target: "{{{{' '+text.split(' ')[-1]}}}}"
target_delimiter: ""
metric_list:
  - metric: perplexity
  - metric: acc
"""


def load_script(name):
    spec = importlib.util.spec_from_file_location(f"scripts_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def trained_params(cfg: LlamaConfig = CFG, steps=40):
    """fp32 weights trained a few dozen AdamW steps on the bundled sample's text: predictions as
    peaked as a real checkpoint's (the init's are near-uniform), norm scales away from 1."""
    import gzip
    import itertools

    import jax.numpy as jnp
    import optax

    tok = load_tokenizer(TOKENIZER)
    with gzip.open(ROOT / "data" / "sample" / "0000" / "en_head.json.gz", "rt") as f:
        texts = [json.loads(line)["raw_content"] for line in itertools.islice(f, 64)]
    ids = np.concatenate([e.ids for e in tok.encode_batch(texts)])[: 16 * (SEQ + 1)].reshape(16, SEQ + 1)
    model = Llama(cfg, rngs=nnx.Rngs(3))
    graphdef, params = nnx.split(model, nnx.Param)
    pos, seg = jnp.broadcast_to(jnp.arange(SEQ), (16, SEQ)), jnp.ones((16, SEQ), jnp.int32)

    def loss(p):
        logits = nnx.merge(graphdef, p)(jnp.asarray(ids[:, :-1]), pos, seg)
        return optax.softmax_cross_entropy_with_integer_labels(logits, jnp.asarray(ids[:, 1:])).mean()

    tx = optax.adamw(1e-2)
    opt = tx.init(params)

    @jax.jit
    def step(p, o):
        g = jax.grad(loss)(p)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o

    first = float(loss(params))
    for _ in range(steps):
        params, opt = step(params, opt)
    assert float(loss(params)) < first - 1.0, "the fixture's model did not learn"
    return nnx.to_pure_dict(params)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(checkpoint dir, HF export dir, task dir, mc task file): a tiny trained fp32 checkpoint,
    and a task with a context longer than the model's window."""
    base = tmp_path_factory.mktemp("lm_eval")
    params = trained_params()
    meta = {"config": {"model": dataclasses.asdict(CFG), "tokenizer": {"path": TOKENIZER}, "data": {"add_bos": False}}}
    ckpt = ckpt_lib.save_params(base / "ckpt", params, meta)
    load_script("export_hf").export(ckpt, str(base / "hf"), dtype="float32")
    lines = (SAMPLE / "definitions_mc.jsonl").read_text().splitlines()
    long_ctx = " ".join(["A word, defined at length, with its etymology and uses."] * 20)   # > SEQ tokens
    lines.append(json.dumps({"context": long_ctx + " The young of a cat is a", "choices": ["kitten", "puppy"],
                             "gold": 0}))
    lines.append(json.dumps({"context": "", "choices": ["Water", "Fire"], "gold": 0}))   # empty: the prefix token
    mc = base / "tasks" / "mc.jsonl"
    mc.parent.mkdir()
    mc.write_text("\n".join(lines) + "\n")
    (base / "tasks" / "jx_mc.yaml").write_text(MC_YAML.format(path=mc))
    (base / "tasks" / "jx_lambada.yaml").write_text(LAMBADA_YAML.format(path=SAMPLE / "definitions_lambada.jsonl"))
    return ckpt, base / "hf", base / "tasks", mc


def harness():
    """model/evals/harness.py, imported (which registers "jaxpt" with lm_eval) where a test runs."""
    import model.evals.harness

    return model.evals.harness


def hf_backend(hf_dir):
    """The harness's own HF backend on an exported model (transformers' classes, fp32 on CPU)."""
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=str(hf_dir), device="cpu", dtype="float32", batch_size=4)


def run(model, task_dir, **kw):
    import lm_eval
    from lm_eval.tasks import TaskManager

    harness()
    # Only the local tasks: indexing the harness's ~15k built-in task YAMLs costs 10-20 s a call.
    tasks = TaskManager(include_path=str(task_dir), include_defaults=False)
    return lm_eval.simple_evaluate(model=model, tasks=["jx_mc", "jx_lambada"], task_manager=tasks,
                                   log_samples=True, bootstrap_iters=0, **kw)


def lls(results, task):
    samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
    return np.array([[float(r[0][0]) for r in s["resps"]] for s in samples], dtype=object)


@pytest.fixture(scope="module")
def both(setup):
    ckpt, hf_dir, task_dir, _ = setup
    hf = run(hf_backend(hf_dir), task_dir)
    ours = run("jaxpt", task_dir, model_args=f"run_dir={ckpt},step=0,batch_rows=8")
    return hf, ours


def test_adapter_matches_the_hf_backend_per_request(both):
    hf, ours = both
    for task in ("jx_mc", "jx_lambada"):
        a, b = lls(hf, task), lls(ours, task)
        assert a.shape == b.shape and len(a) >= 12
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            np.testing.assert_allclose(np.asarray(y, float), np.asarray(x, float), atol=1e-4, rtol=0,
                                       err_msg=f"{task} doc {i}")
        for metric, value in hf["results"][task].items():
            if metric.split(",")[0] in ("acc", "acc_norm"):
                assert ours["results"][task][metric] == value, (task, metric)
    greedy = [r[0][1] for s in ours["samples"]["jx_lambada"] for r in s["resps"]]
    assert greedy == [r[0][1] for s in hf["samples"]["jx_lambada"] for r in s["resps"]]


def test_in_loop_scorer_matches_the_hf_backend(setup, both):
    """The in-loop path (our reader, our tokenization, the Scorer on a mesh) on the same examples."""
    ckpt, _, _, mc = setup
    hf, _ = both
    _, params, _ = ckpt_lib.load_params(ckpt)
    mesh_cfg = harness()._MESH
    mesh, rules = shd.make_mesh(mesh_cfg), shd.rules_from_cfg(mesh_cfg)
    shardings = param_shardings(CFG, mesh, rules)
    scorer = Scorer(CFG, mesh, rules, shardings, seq_len=SEQ, batch_rows=len(jax.devices()))
    encoder = RequestEncoder(load_tokenizer(TOKENIZER))
    for spec, task in [(TaskSpec("jx_mc", str(mc)), "jx_mc"),
                       (TaskSpec("l", str(SAMPLE / "definitions_lambada.jsonl"), "lambada", "loglikelihood"),
                        "jx_lambada")]:
        examples, _ = read_task(spec)
        ll, _ = scorer.score(jax.device_put(params, shardings),
                             encoder.encode([(ex.context, c) for ex in examples for c in ex.choices]))
        ref = np.concatenate([np.asarray(x, float) for x in lls(hf, task)])
        np.testing.assert_allclose(ll, ref, atol=1e-4, rtol=0, err_msg=task)


def test_cli_wrapper(setup, both, tmp_path):
    ckpt, _, task_dir, _ = setup
    _, ours = both
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "run_lm_eval.py"), "--model", "jaxpt", "--model_args",
         f"run_dir={ckpt},step=0", "--tasks", "jx_mc", "--include_path", str(task_dir), "--output_path",
         str(tmp_path / "out")], capture_output=True, text=True, env=cli_env(), timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (out,) = list((tmp_path / "out").rglob("results*.json"))
    got = json.loads(out.read_text())["results"]["jx_mc"]
    assert got["acc,none"] == ours["results"]["jx_mc"]["acc,none"]


def cli_env():
    env = {**without_device_count(), "PYTHONPATH": str(ROOT), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    return env


def test_registering_jaxpt_keeps_every_harness_model():
    """A fresh process (the other tests' HFLM import fills the registry and would hide the bug): after
    our module registers "jaxpt", every model of the harness's catalogue still resolves by name. With
    test_cli_wrapper (the script through lm_eval's own cli_evaluate, which resolves --model by this
    registry) it stands for `run_lm_eval.py --model hf ...` being the `lm_eval` command."""
    # The lookups come before the catalogue's import: importing lm_eval.models registers it.
    probe = ("import model.evals.harness\n"
             "from lm_eval.api.registry import get_model, model_registry\n"
             "found = [get_model(name).__name__ for name in ('dummy', 'jaxpt')]\n"
             "names = set(model_registry)\n"
             "from lm_eval.models import MODEL_MAPPING\n"
             "print(sorted(set(MODEL_MAPPING) - names), *found)\n")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=cli_env(),
                            timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["[]", "DummyLM", "JaxptLM"]


def test_bad_model_args_and_generation_are_one_line(setup):
    ckpt, _, _, _ = setup
    with pytest.raises(ValueError, match="unknown model_args.*'temperature'"):
        harness().JaxptLM(run_dir=ckpt, temperature=1.0)
    with pytest.raises(FileNotFoundError, match="no checkpoint at step 7"):
        harness().JaxptLM(run_dir=ckpt, step=7)


def _mc_lines(task_dir):
    return (task_dir / "mc.jsonl").read_text().splitlines()


# ---------------------------------------------------------------- one exported model per family
# Each family's peculiarity at this size (model/hf.py): Llama 3's RoPE scaling (original length 32,
# so the rows use the scaled bands) with a tied head, Qwen2's q/k/v biases, Qwen3's q/k norms and
# a head_dim apart from d_model / n_heads, Mistral's window (shorter than the rows and contexts).
FAMILIES = {
    "llama3": dict(rope_type="llama3", rope_theta=500000.0, rope_factor=8.0, rope_low_freq_factor=1.0,
                   rope_high_freq_factor=4.0, rope_original_max_len=32, tie_embeddings=True),
    "qwen2": dict(qkv_bias=True, tie_embeddings=True, hf_model_type="qwen2"),
    "qwen3": dict(qk_norm=True, head_dim=32, hf_model_type="qwen3"),
    "mistral": dict(sliding_window=16, hf_model_type="mistral"),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_family_matches_the_hf_backend_per_request(family, setup, tmp_path):
    """The family's export through the harness's HF backend (transformers' own class) and
    "jaxpt" on our checkpoint give the same log-likelihood per request (8 documents of each task:
    the first 6 multiple-choice ones, then the context longer than the model's rows and the empty one)."""
    _, _, task_dir, _ = setup
    cfg = dataclasses.replace(CFG, **FAMILIES[family])
    meta = {"config": {"model": dataclasses.asdict(cfg), "tokenizer": {"path": TOKENIZER},
                       "data": {"add_bos": False}}}
    ckpt = ckpt_lib.save_params(tmp_path / "ckpt", trained_params(cfg), meta)
    load_script("export_hf").export(ckpt, str(tmp_path / "hf"), dtype="float32")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == cfg.hf_model_type
    n_mc = len(_mc_lines(task_dir))
    docs = {"jx_mc": [0, 1, 2, 3, 4, 5, n_mc - 2, n_mc - 1], "jx_lambada": list(range(8))}
    hf = run(hf_backend(tmp_path / "hf"), task_dir,
             samples=docs)
    ours = run("jaxpt", task_dir, model_args=f"run_dir={ckpt},step=0,batch_rows=8", samples=docs)
    for task in ("jx_mc", "jx_lambada"):
        a, b = lls(hf, task), lls(ours, task)
        assert a.shape == b.shape and len(a) == 8
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            np.testing.assert_allclose(np.asarray(y, float), np.asarray(x, float), atol=1e-4, rtol=0,
                                       err_msg=f"{family} {task} doc {i}")

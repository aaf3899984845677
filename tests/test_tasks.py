"""In-loop downstream tasks without the harness: task formats -> the harness's request strings,
malformed lines named by file:line (or skipped and counted), one-line config errors, and the
packed scorer against each request scored alone (left truncation included).

Run: pytest tests/test_tasks.py -q      (~20 s; the harness/HF parity is tests/test_lm_eval.py)
"""
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from flax import nnx

from data.tokenizer import load_tokenizer
from model import sharding as shd
from model.evals.evaluate import TaskEvaluator, TasksConfig, task_metrics
from model.evals.tasks import Request, RequestEncoder, TaskSpec, pack_requests, read_task
from model.llama import Llama, LlamaConfig
from model.step import param_shardings

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "data" / "sample" / "tokenizer.json"
SAMPLE_TASKS = ROOT / "data" / "sample_tasks"
CFG = LlamaConfig(vocab_size=4096, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, dtype="float32",
                  remat="none", max_seq_len=128)


def write_jsonl(path, docs):
    path.write_text("".join((d if isinstance(d, str) else json.dumps(d)) + "\n" for d in docs))
    return str(path)


def test_formats_give_the_harness_strings(tmp_path):
    # The strings lm_eval's task YAMLs build (tasks/hellaswag/utils.py, arc_easy.yaml, piqa.yaml,
    # lambada_openai.yaml), written out by hand.
    hs = {"activity_label": "Roof shingle removal", "ctx_a": "A man is sitting on a roof.", "ctx_b": "he",
          "endings": ["is using wrap to wrap a pair of skis.", "starts pulling up roofing [title] on a roof."],
          "label": "1"}
    (ex,), _ = read_task(TaskSpec("hs", write_jsonl(tmp_path / "hs.jsonl", [hs]), "hellaswag"))
    assert ex.context == "Roof shingle removal: A man is sitting on a roof. He"
    assert ex.choices == (" is using wrap to wrap a pair of skis.", " starts pulling up roofing. on a roof.")
    assert ex.gold == 1 and ex.norm_lens == (37.0, 37.0)   # len() of the choice, no delimiter

    arc = {"question": "Which is a gas?", "choices": {"text": ["ice", "steam"], "label": ["A", "B"]}, "answerKey": "B"}
    (ex,), _ = read_task(TaskSpec("arc", write_jsonl(tmp_path / "arc.jsonl", [arc]), "arc"))
    assert (ex.context, ex.choices, ex.gold) == ("Question: Which is a gas?\nAnswer:", (" ice", " steam"), 1)

    piqa = {"goal": "Open a jar", "sol1": "twist the lid", "sol2": "eat the lid", "label": 0}
    (ex,), _ = read_task(TaskSpec("piqa", write_jsonl(tmp_path / "piqa.jsonl", [piqa]), "piqa"))
    assert (ex.context, ex.choices, ex.gold) == ("Question: Open a jar\nAnswer:", (" twist the lid", " eat the lid"), 0)

    spec = TaskSpec.from_mapping({"name": "lam", "path": write_jsonl(tmp_path / "l.jsonl", [{"text": "a b c"}]),
                                  "format": "lambada"})
    (ex,), _ = read_task(spec)
    assert spec.kind == "loglikelihood" and (ex.context, ex.choices) == ("a b", (" c",))


def test_malformed_lines_named_or_skipped(tmp_path):
    good = {"context": "x", "choices": ["a", "b"], "gold": 1}
    path = write_jsonl(tmp_path / "t.jsonl", [good, "{not json", {"context": "x", "choices": ["a"], "gold": 3},
                                              {"choices": ["a"], "gold": 0}, "", good])
    with pytest.raises(ValueError, match=rf"^{tmp_path}/t.jsonl:2: .*on_bad_line=skip") as e:
        read_task(TaskSpec("t", path))
    assert "\n" not in str(e.value)
    examples, skipped = read_task(TaskSpec("t", path), on_bad_line="skip")
    assert [ex.line for ex in examples] == [1, 6] and skipped == 3
    # Each kind of bad line on its own, named with its line and what is wrong.
    for doc, words in [({"context": "x", "choices": ["a"], "gold": 3}, "gold=3"),
                       ({"choices": ["a"], "gold": 0}, "missing field 'context'"), ("[1, 2]", "JSON object")]:
        with pytest.raises(ValueError, match=f":2: .*{words}"):
            read_task(TaskSpec("t", write_jsonl(tmp_path / "one.jsonl", [good, doc])))


@pytest.mark.parametrize("bad, words", [
    ({"tasks": [{"name": "x"}]}, r"eval.tasks\[0\]: missing 'path'"),
    ({"tasks": [{"name": "x", "path": "p", "format": "mmlu"}]}, r"eval.tasks\[0\].format='mmlu'"),
    ({"tasks": [{"name": "x", "path": "p", "format": "lambada", "kind": "multiple_choice"}]}, "is a loglikelihood"),
    ({"tasks": [{"name": "x", "path": "p"}, {"name": "x", "path": "q"}]}, "listed twice"),
    ({"tasks_every": -1}, "eval.tasks_every=-1"),
    ({"batch_rows": 0}, "eval.batch_rows=0"),
    ({"on_bad_line": "ignore"}, "eval.on_bad_line='ignore'"),
    ({"task": []}, "unknown setting.*eval.task"),
])
def test_config_errors_are_one_line(bad, words):
    with pytest.raises(ValueError, match=words) as e:
        TasksConfig.from_mapping(bad)
    assert "\n" not in str(e.value)


def test_sample_config_composes_and_validates():
    m = yaml.safe_load((ROOT / "configs" / "eval" / "sample.yaml").read_text())
    cfg = TasksConfig.from_mapping({k: v for k, v in m.items() if k != "defaults"})
    assert [t.name for t in cfg.tasks] == ["definitions", "definitions_lambada"] and cfg.tasks_every == 100


def test_encoder_moves_trailing_spaces_and_prefixes_empty_contexts():
    tok = load_tokenizer(str(TOKENIZER))
    enc = RequestEncoder(tok)
    (a, b, c) = enc.encode([("The cat ", "sat"), ("The cat", " sat"), ("", "The cat")])
    assert a == b                         # "ctx " + "x" scores as "ctx" + " x"
    assert a.context == tuple(tok.encode("The cat").ids)
    assert a.context + a.continuation == tuple(tok.encode("The cat sat").ids)
    assert c.context == (enc.prefix_id,) and c.continuation == tuple(tok.encode("The cat").ids)


@jax.jit
def _logits_alone(params, inp):
    # One row, one segment from position 0; padding after the request cannot reach it (causal).
    model = nnx.merge(nnx.graphdef(Llama(CFG, rngs=nnx.Rngs(0))), params)
    return model(inp, jnp.arange(inp.shape[1])[None], jnp.ones(inp.shape, jnp.int32))[0]


def _alone(params, req: Request, seq_len: int):
    """Log-likelihood and greedy flag of one request scored on its own, unpacked: the reference."""
    toks = (req.context + req.continuation)[-(seq_len + 1):]
    t = len(toks) - 1
    tgt = np.asarray(toks[1:])
    logits = np.asarray(_logits_alone(params, jnp.asarray([list(toks[:-1]) + [0] * (seq_len - t)])))[:t]
    lp = np.asarray(jax.nn.log_softmax(logits.astype(np.float32)))
    n = min(len(req.continuation), t)
    idx = np.arange(t - n, t)
    return float(lp[idx, tgt[idx]].sum()), bool((np.asarray(logits).argmax(-1)[idx] == tgt[idx]).all())


@pytest.mark.slow
def test_packed_scores_equal_requests_scored_alone():
    model = Llama(CFG, rngs=nnx.Rngs(0))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    rng = np.random.default_rng(0)
    reqs = [Request(tuple(rng.integers(1, 4096, rng.integers(1, 40))), tuple(rng.integers(1, 4096, rng.integers(1, 6))))
            for _ in range(23)]
    reqs.append(Request(tuple(rng.integers(1, 4096, 90)), tuple(rng.integers(1, 4096, 3))))   # > seq_len: truncated
    reqs.append(Request((5,), (7,) * 40))                                                       # continuation > seq_len
    # The argmax continuation of a prefix, so some requests are greedy.
    ctx = tuple(rng.integers(1, 4096, 10))
    nxt = int(np.asarray(model(jnp.asarray([ctx]), jnp.arange(10)[None], jnp.ones((1, 10), jnp.int32)))[0, -1].argmax())
    reqs.append(Request(ctx, (nxt,)))
    # Choices of one context share it (one prefix, a branch each): a group that fits one row,
    # one that must be split over two units, and a member that needs truncation on its own.
    shared = tuple(rng.integers(1, 4096, 12))
    reqs += [Request(shared, tuple(rng.integers(1, 4096, k))) for k in (1, 4, 2, 3)]
    wide = tuple(rng.integers(1, 4096, 20))
    reqs += [Request(wide, tuple(rng.integers(1, 4096, k))) for k in (5, 6, 4, 14)]

    mesh_cfg = yaml.safe_load((ROOT / "configs" / "mesh" / "default.yaml").read_text())
    mesh, rules = shd.make_mesh(mesh_cfg), shd.rules_from_cfg(mesh_cfg)
    from model.evals.evaluate import Scorer

    seq_len = 32
    scorer = Scorer(CFG, mesh, rules, param_shardings(CFG, mesh, rules), seq_len=seq_len, batch_rows=8)
    packed = scorer.pack(reqs)
    assert packed.inputs.shape[0] < len(reqs) and packed.inputs.shape[0] % 8 == 0    # packed, whole batches
    ll, greedy = scorer.score(params, reqs)
    for i, r in enumerate(reqs):
        ref_ll, ref_g = _alone(params, r, seq_len)
        assert abs(ll[i] - ref_ll) <= 1e-4 * max(1.0, abs(ref_ll)), (i, ll[i], ref_ll)
        assert greedy[i] == ref_g, i
    assert greedy[reqs.index(Request(ctx, (nxt,)))] and not greedy.all()
    # The shared contexts were packed once per unit: fewer tokens than the requests alone.
    alone = sum(min(len(r.context) + len(r.continuation), seq_len + 1) - 1 for r in reqs)
    # (12-token context: 3 of 4 copies saved; 20-token: the 5 and 6 share, 4 is split off, 14 is truncated)
    assert int((packed.segment_ids > 0).sum()) == alone - 3 * 11 - 19


def test_pack_rows_are_disjoint_segments():
    reqs = [Request((1,) * n, (2, 3)) for n in (3, 9, 1, 14, 5, 6)]
    p = pack_requests(reqs, seq_len=16, rows_multiple=2)
    assert p.inputs.shape == (4, 16)               # 44 tokens: 3 rows, rounded up to 2 x 2
    assert len(set(p.row.tolist())) == 3
    for i, r in enumerate(reqs):
        m = len(r.context) + len(r.continuation) - 1
        assert (p.end[i] - p.start[i]) == 2
        seg = p.segment_ids[p.row[i], p.end[i] - m:p.end[i]]
        assert (seg == seg[0]).all() and seg[0] > 0
        assert p.positions[p.row[i], p.end[i] - m:p.end[i]].tolist() == list(range(m))
        assert p.targets[p.row[i], p.start[i]:p.end[i]].tolist() == [2, 3]


def test_choices_of_one_context_share_it_and_see_only_themselves():
    ctx = (11, 12, 13, 14)
    reqs = [Request(ctx, (21, 22)), Request((9,), (5,)), Request(ctx, (31,)), Request(ctx, (41, 42, 43))]
    p = pack_requests(reqs, seq_len=16)
    assert p.inputs.shape == (1, 16)
    r = p.row[0]
    seg = p.segment_ids[r]
    shared = (0, 2, 3)
    assert len({int(seg[p.start[i]]) for i in shared}) == 1              # one unit, one segment
    assert int((seg == seg[p.start[0]]).sum()) == 3 + 2 + 1 + 3          # prefix once + each branch
    for i, b in zip(shared, (1, 2, 3), strict=True):
        cont = reqs[i].continuation
        sl = slice(p.start[i], p.end[i])
        assert p.targets[r, sl].tolist() == list(cont)
        assert p.inputs[r, sl].tolist() == [14, *cont[:-1]]              # the context's last token leads
        assert p.positions[r, sl].tolist() == list(range(3, 3 + len(cont)))
        assert (p.branch_ids[r, sl] == b).all()
    pre = (seg == seg[p.start[0]]) & (p.branch_ids[r] == 0)
    assert p.inputs[r, pre].tolist() == [11, 12, 13] and p.positions[r, pre].tolist() == [0, 1, 2]
    # A tight row splits the group: each unit repeats the prefix and stays within seq_len.
    p = pack_requests(reqs, seq_len=8)
    assert p.end.max() <= 8 and len({(int(p.row[i]), int(p.segment_ids[p.row[i], p.start[i]])) for i in shared}) == 2


def test_metrics_follow_the_harness_definitions():
    from model.evals.tasks import Example

    exs = [Example("t", 1, "c", (" a", " bbbb"), 1, (1.0, 4.0)), Example("t", 2, "c", (" a", " b"), 0, (1.0, 1.0))]
    ll = np.array([-2.0, -4.0, -1.0, -1.0])          # ex 1: a wins raw, bbbb per char; ex 2: a tie -> first
    m = task_metrics(exs, ll, np.zeros(4, bool), "multiple_choice")
    assert m == {"acc": 0.5, "acc_norm": 1.0}
    m = task_metrics([Example("t", 1, "c", (" x",), 0, (1.0,))] * 2, np.array([-1.0, -3.0]), np.array([True, False]),
                     "loglikelihood")
    assert m["acc"] == 0.5 and abs(m["ppl"] - np.exp(2.0)) < 1e-9


def test_evaluator_on_the_sample_tasks(tmp_path):
    mesh_cfg = yaml.safe_load((ROOT / "configs" / "mesh" / "default.yaml").read_text())
    mesh, rules = shd.make_mesh(mesh_cfg), shd.rules_from_cfg(mesh_cfg)
    tasks = TasksConfig.from_mapping({"tasks": [
        {"name": "mc", "path": str(SAMPLE_TASKS / "definitions_mc.jsonl")},
        {"name": "lam", "path": str(SAMPLE_TASKS / "definitions_lambada.jsonl"), "format": "lambada"}]})
    ev = TaskEvaluator(tasks, load_tokenizer(str(TOKENIZER)), model_cfg=CFG, mesh=mesh, rules=rules,
                       param_shardings=param_shardings(CFG, mesh, rules), seq_len=64, batch_rows=8)
    params = nnx.to_pure_dict(nnx.state(Llama(CFG, rngs=nnx.Rngs(0)), nnx.Param))
    m = ev.evaluate(params)
    assert set(m) == {"tasks/mc/acc", "tasks/mc/acc_norm", "tasks/lam/acc", "tasks/lam/ppl"}
    assert ev.evaluate(params) == m                          # deterministic
    # The same numbers from the per-request scores directly.
    ll, greedy = ev.scorer.score(params, ev.requests)
    spec, examples, _ = ev.tasks[0]
    n = sum(len(e.choices) for e in examples)
    assert task_metrics(examples, ll[:n], greedy[:n], "multiple_choice")["acc"] == m["tasks/mc/acc"]
    assert ev.should_run(100, 300) is False and ev.should_run(300, 300)


@pytest.mark.slow
def test_in_loop_tasks_are_logged_and_equal_after_a_resume(tmp_path):
    """train.py scores eval.tasks every tasks_every steps and at the end; a run resumed half way
    logs the same task metrics at the end as an uninterrupted one (same params, same requests)."""
    from run_helpers import TINY_FAST, make_cfg, read_metrics

    import train as train_mod

    # TINY_FAST's decay_steps is fixed (run_helpers.ONE_SCHEDULE): the schedule must not depend on
    # train.steps for the two runs to agree
    common = [*TINY_FAST, "eval=sample", "eval.tasks_every=4", "checkpoint.every=4", "train.eval_every=0"]
    train_mod.train(make_cfg(tmp_path / "whole", *common, "train.steps=8"))
    train_mod.train(make_cfg(tmp_path / "split", *common, "train.steps=4"))
    train_mod.train(make_cfg(tmp_path / "split", *common, "train.steps=8"))

    def task_rows(run):
        return {r["step"]: {k: v for k, v in r.items() if k.startswith("tasks/")}
                for r in read_metrics(tmp_path / run) if any(k.startswith("tasks/") for k in r)}

    whole, split = task_rows("whole"), task_rows("split")
    assert sorted(whole) == [4, 8] and sorted(split) == [4, 8]
    assert set(whole[8]) >= {"tasks/definitions/acc", "tasks/definitions/acc_norm", "tasks/definitions_lambada/acc"}
    assert whole == split

"""Long-context evaluations: the held-out loss by position (model/step.py make_eval_step's sums by
position, model/evals/evaluate.py position_losses), the passkey task (model/evals/tasks.py), and
the report's loss-by-position plot.

    pytest tests/test_eval_long_context.py -q        (~1 min on 2 shared cores)
"""
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import yaml
from flax import nnx

from data.tokenizer import load_tokenizer
from model import sharding as shd
from model import step
from model.evals.evaluate import LoopEvals, TaskEvaluator, TasksConfig, passkey_metrics, position_losses
from model.evals.tasks import PASSKEY_INTRO, PASSKEY_LINE, PASSKEY_QUESTION, PasskeyConfig, passkey_examples
from model.llama import Llama, LlamaConfig
from model.step import param_shardings

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "data" / "sample" / "tokenizer.json"
CFG = LlamaConfig(vocab_size=4096, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, dtype="float32",
                  remat="none", max_seq_len=256)


def mesh_and_rules():
    mesh_cfg = yaml.safe_load((ROOT / "configs" / "mesh" / "default.yaml").read_text())
    return shd.make_mesh(mesh_cfg), shd.rules_from_cfg(mesh_cfg)


# ---------------------------------------------------------------- loss by position
def test_position_buckets_average_the_positions_they_span():
    t = 8
    loss = np.arange(t, dtype=float) * 2.0           # position p: tokens summing to 2p
    n = np.ones(t)
    n[5], loss[5] = 0, 0.0                            # no token at position 5
    m = position_losses(loss, n, 4)                   # buckets of positions {0,1} {2,3} {4,5} {6,7}
    assert m == {"eval_loss_pos/00": 1.0, "eval_loss_pos/01": 5.0, "eval_loss_pos/02": 8.0,
                 "eval_loss_pos/03": 13.0}
    assert list(position_losses(np.ones(t), np.zeros(t), 4)) == []           # no token: no metric
    assert list(position_losses(np.ones(200), np.ones(200), 100))[-1] == "eval_loss_pos/99"


@pytest.mark.slow
def test_eval_step_sums_by_the_tokens_position_in_its_document():
    mesh, rules = mesh_and_rules()
    b, t = 8, 32
    cfg = LlamaConfig(vocab_size=128, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64, dtype="float32",
                      remat="none", max_seq_len=64)
    state, shardings = step.init_train_state(cfg, optax.sgd(0.0), mesh, rules, seed=0)
    rng = np.random.default_rng(0)
    seg = np.repeat(np.r_[[1] * 12, [2] * 14, [0] * 6][None], b, axis=0)   # 2 documents and padding
    pos = np.repeat(np.r_[np.arange(12), np.arange(14), np.zeros(6)][None], b, axis=0)
    batch = {"inputs": rng.integers(0, 128, (b, t)), "targets": rng.integers(0, 128, (b, t)),
             "segment_ids": seg, "positions": pos, "loss_mask": seg > 0}
    bsh = step.batch_sharding(mesh, rules)

    def run(mask):
        put = {k: jax.device_put(jnp.asarray(v, jnp.int32), bsh) for k, v in {**batch, "loss_mask": mask}.items()}
        return jax.device_get(step.make_eval_step(cfg, mesh, rules, shardings)(state["params"], put))

    ev = run(batch["loss_mask"])
    np.testing.assert_allclose(ev["loss_by_pos"].sum(), ev["loss_sum"], rtol=1e-5)
    want_n = np.zeros(t)
    want_n[:12] += 2 * b                             # positions 0..11: both documents
    want_n[12:14] += b                               # 12, 13: the second one only
    np.testing.assert_array_equal(ev["tokens_by_pos"], want_n)
    for p in (0, 7, 13):                              # each position's sum: the loss of its tokens alone
        alone = run(batch["loss_mask"] & (pos == p))
        np.testing.assert_allclose(ev["loss_by_pos"][p], alone["loss_sum"], rtol=1e-5)


class _HeldOut:
    def __init__(self, sums):
        self._sums = sums

    def sums(self, params):
        return self._sums


class _Meter:
    def paused(self, seconds, kind):
        pass


def test_loop_evals_report_the_loss_and_its_position_buckets_in_one_row():
    sums = {"loss_sum": 12.0, "n_tokens": 4.0, "loss_by_pos": np.array([1.0, 2.0, 4.0, 5.0]),
            "tokens_by_pos": np.ones(4)}
    row = LoopEvals(_HeldOut(sums), 10, None, 100, position_buckets=2).run(10, None, _Meter())
    assert row["eval_loss"] == 3.0 and row["eval_loss_pos/00"] == 1.5 and row["eval_loss_pos/01"] == 4.5
    row = LoopEvals(_HeldOut(sums), 10, None, 100).run(10, None, _Meter())
    assert not any(k.startswith("eval_loss_pos") for k in row)


# ---------------------------------------------------------------- passkey
def test_passkey_prompts_fit_their_length_hide_the_key_at_its_depth_and_follow_the_seed():
    tok = load_tokenizer(str(TOKENIZER))
    cfg = PasskeyConfig.from_mapping({"lengths": [128, 256], "depths": [0.0, 0.5, 1.0], "samples": 3})
    examples, groups = passkey_examples(cfg, tok)
    assert len(examples) == 2 * 3 * 3
    assert groups[:3] == ["acc_len128_depth0"] * 3 and groups[-1] == "acc_len256_depth100"
    for ex, g in zip(examples, groups, strict=True):
        length = int(g.split("_")[1][3:])
        n = len(tok.encode(ex.context + ex.choices[0], add_special_tokens=False).ids)
        assert length - 12 < n <= length, (g, n)      # as long as a filler sentence allows
        key = ex.choices[0].strip()
        assert len(key) == 5 and ex.choices[0] == " " + key and ex.context.endswith(PASSKEY_QUESTION)
        assert PASSKEY_LINE.format(key=key) in ex.context
    # depth: the share of the filler (between the introduction and the question) before the key line
    at = {g: [] for g in groups}
    for ex, g in zip(examples, groups, strict=True):
        line = PASSKEY_LINE.format(key=ex.choices[0].strip())
        filler = len(ex.context) - len(PASSKEY_INTRO) - len(line) - len(PASSKEY_QUESTION)
        at[g].append((ex.context.index(line) - len(PASSKEY_INTRO)) / filler)
    for length in (128, 256):
        d0, d50, d100 = (np.mean(at[f"acc_len{length}_depth{d}"]) for d in (0, 50, 100))
        assert d0 == 0 and d100 == 1 and abs(d50 - 0.5) < 0.1, (length, d50)
    again, _ = passkey_examples(cfg, tok)
    assert again == examples                          # a pure function of the config
    other, _ = passkey_examples(PasskeyConfig.from_mapping({"lengths": [128, 256], "samples": 3, "seed": 1}), tok)
    assert [e.choices for e in other] != [e.choices for e in examples]


def test_passkey_scores_the_keys_tokens_per_length_and_depth():
    mesh, rules = mesh_and_rules()
    tok = load_tokenizer(str(TOKENIZER))
    tasks = TasksConfig.from_mapping({"passkey": {"lengths": [100, 129], "depths": [0.0, 1.0], "samples": 2}})
    assert tasks.any and not tasks.tasks
    ev = TaskEvaluator(tasks, tok, model_cfg=CFG, mesh=mesh, rules=rules,
                       param_shardings=param_shardings(CFG, mesh, rules), seq_len=128, batch_rows=8)
    # the scored tokens of each request are its key's, after a context that ends with the question
    _, examples, _ = ev.tasks[0]
    for req, ex in zip(ev.requests, examples, strict=True):
        assert tok.decode(list(req.continuation)).strip() == ex.choices[0].strip()
        assert len(req.context) + len(req.continuation) <= 129
    params = nnx.to_pure_dict(nnx.state(Llama(CFG, rngs=nnx.Rngs(0)), nnx.Param))
    m = ev.evaluate(params)
    cells = {f"tasks/passkey/acc_len{n}_depth{d}" for n in (100, 129) for d in (0, 100)}
    assert cells | {"tasks/passkey/acc", "tasks/passkey/ppl"} == set(m)
    _, greedy = ev.scorer.score(params, ev.requests)
    assert passkey_metrics(ev.passkey_groups, greedy) == {k: m[k] for k in cells}
    assert passkey_metrics(["a", "a", "b"], np.array([True, False, True])) == {
        "tasks/passkey/a": 0.5, "tasks/passkey/b": 1.0}
    # a length that the scoring rows cannot hold is refused before anything is scored
    with pytest.raises(ValueError, match=r"eval.passkey.lengths: 256 tokens do not fit .* eval.seq_len=128"):
        TaskEvaluator(TasksConfig.from_mapping({"passkey": {"lengths": [256]}}), tok, model_cfg=CFG, mesh=mesh,
                      rules=rules, param_shardings=param_shardings(CFG, mesh, rules), seq_len=128, batch_rows=8)


@pytest.mark.parametrize("passkey,needle", [
    ({"lengths": 256}, "eval.passkey.lengths=256"),
    ({"lengths": [16]}, "eval.passkey.lengths=[16]"),
    ({"lengths": [256], "depths": [1.5]}, "eval.passkey.depths=[1.5]"),
    ({"lengths": [256], "samples": 0}, "eval.passkey.samples=0"),
    ({"lengths": [256], "depth": [0.5]}, "eval.passkey: unknown key(s) ['depth']"),
])
def test_passkey_mistakes_fail_in_one_line(passkey, needle):
    with pytest.raises(ValueError) as e:
        TasksConfig.from_mapping({"passkey": passkey})
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


# ---------------------------------------------------------------- the report's plot
@pytest.mark.slow
def test_report_draws_the_loss_by_position_when_the_run_logged_it(tmp_path):
    import json

    pytest.importorskip("matplotlib")
    from tests.run_helpers import load_script

    report = load_script("report")
    rows = [{"step": 1, "loss": 8.0}, {"step": 2, "loss": 7.0, "eval_loss": 7.1,
                                        **{f"eval_loss_pos/{i:02d}": 7.5 - i * 0.1 for i in range(4)}}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert report.main([str(tmp_path)]) == 0
    page = (tmp_path / "report.html").read_text()
    assert 'alt="loss_by_position"' in page
    (tmp_path / "metrics.jsonl").write_text(json.dumps(rows[0]) + "\n")
    assert report.main([str(tmp_path)]) == 0
    assert 'alt="loss_by_position"' not in (tmp_path / "report.html").read_text()

"""data.torch.Batches: the JAX hosts' rows for PyTorch ranks, exact and elastic resume, DataLoader and
torchdata's StatefulDataLoader, real torch.distributed gloo ranks, bad input counted as in training.
Run: pytest -n0 tests/test_data_torch.py"""
import collections
import gzip
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import data  # noqa: E402
from data.pipeline import consumed_figures  # noqa: E402
from data.torch import Batches  # noqa: E402
from tests.data_helpers import REPO, TOKENIZER, cfg, doc_tokens, expected_tokens, take, write_corpus  # noqa: E402

KEYS = ("input_ids", "labels", "segment_ids", "positions")


def overrides(root, **kw):
    """Hydra overrides for a small corpus under `root` (no held-out file; in-process reading)."""
    base = {"data.paths": os.path.join(str(root), "*", "en_head.json.gz"), "tokenizer.path": TOKENIZER,
            "data.seq_len": 32, "data.global_batch_size": 4, "data.num_shards": 4, "data.num_workers": 0,
            "data.shuffle_window": 8, "data.eval.holdout_files": 0, "seed": 0}
    base.update(kw)
    return [f"{k}={v}" for k, v in base.items()]


def as_numpy(batch):
    return {k: v.numpy() for k, v in batch.items()}


def concat(parts):
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def assert_same(a, b, msg=""):
    assert a.keys() == b.keys(), msg
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=f"{msg} {k}")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    return root, write_corpus(root, n_files=4, docs_per_file=8, max_words=60)


def test_ranks_get_the_jax_hosts_rows_and_make_the_global_batch(corpus):
    root, _ = corpus
    ranks = [Batches(overrides(root), rank=r, world=2) for r in range(2)]
    whole = Batches(overrides(root))
    assert (whole.rank, whole.world) == (0, 1)        # torch.distributed not initialised
    # The JAX run's own host iterators for the same config and seed, hosts 0 and 1 of 2.
    jax_hosts = [data.make_host_iterator(cfg(root), h, 2) for h in range(2)]
    for step in range(6):
        parts = [as_numpy(next(b)) for b in ranks]
        for r, (part, host) in enumerate(zip(parts, jax_hosts, strict=True)):
            hb = next(host)
            assert part["input_ids"].shape == (2, 32) and part["input_ids"].dtype == np.int64
            np.testing.assert_array_equal(part["input_ids"], hb["inputs"], err_msg=f"step {step} rank {r}")
            np.testing.assert_array_equal(part["segment_ids"], hb["segment_ids"])
            np.testing.assert_array_equal(part["positions"], hb["positions"])
            # labels: the targets where the JAX loss counts them, -100 (cross_entropy's ignore_index) elsewhere
            np.testing.assert_array_equal(part["labels"], np.where(hb["loss_mask"] > 0, hb["targets"], -100))
            assert (part["labels"] == -100).any() or hb["loss_mask"].all()
        assert_same(concat(parts), as_numpy(next(whole)), f"step {step}")


def test_every_document_once_per_epoch_across_two_ranks(corpus):
    root, texts = corpus
    files = sorted({p for p, _ in texts})
    ranks = [Batches(overrides(root, **{"data.shuffle_window": 0}), rank=r, world=2, debug=True) for r in range(2)]
    per_shard = [0] * 4
    for (path, _), t in texts.items():
        per_shard[files.index(path) % 4] += len(expected_tokens(t))
    n = int(1.3 * max(per_shard) / 33) + 4          # one row of every shard per batch: past epoch 0
    rows = []
    for b in ranks:
        for batch in take(b, n):
            tok = torch.cat([batch["input_ids"], batch["labels"][:, -1:]], dim=1).numpy()
            rows += [(int(s), d, t) for s, d, t in zip(batch["row_shard"], batch["doc_ids"].numpy(), tok,
                                                        strict=True)]
    docs = doc_tokens(rows, len(files))
    epoch0 = {(files[f], line + 1): toks for (e, f, line), toks in docs.items() if e == 0}
    assert set(epoch0) == set(texts)
    for key, toks in epoch0.items():
        # Read once: its tokens, but for one that starts a row's last column, whose label is -100
        # (the model does not predict a document's first token from the one before).
        seen, want = sorted(t for t in toks if t >= 0), expected_tokens(texts[key])
        assert len(want) - 1 <= len(seen) <= len(want), key
        assert not (collections.Counter(seen) - collections.Counter(want)), key


def test_state_round_trip_and_world_change(corpus):
    root, _ = corpus
    ov = overrides(root)
    ranks = [Batches(ov, rank=r, world=2) for r in range(2)]
    take(ranks[0], 3)
    take(ranks[1], 3)
    states = [json.loads(json.dumps(b.state_dict())) for b in ranks]     # JSON, as a checkpoint keeps it
    after = [[as_numpy(x) for x in take(b, 3)] for b in ranks]
    # the same world: each rank from its own state
    for r in range(2):
        again = Batches(ov, rank=r, world=2)
        again.load_state_dict(states[r])
        for i in range(3):
            assert_same(as_numpy(next(again)), after[r][i], f"rank {r} batch {i}")
    # 2 -> 1: every old rank's state; the next global batches are the two ranks' rows
    one = Batches(ov)
    one.load_state_dict(states)
    for i in range(3):
        assert_same(as_numpy(next(one)), concat([after[0][i], after[1][i]]), f"world 1 batch {i}")
    # 1 -> 2 from there: world 1's state after those batches, resumed by two ranks
    both = [Batches(ov, rank=r, world=2) for r in range(2)]
    for b in both:
        b.load_state_dict([one.state_dict()])
    nxt = [as_numpy(next(b)) for b in both]
    assert_same(concat(nxt), concat([as_numpy(next(b)) for b in ranks]), "world 2 after world 1")


def test_bad_states_are_refused_in_one_line(corpus):
    root, _ = corpus
    ov = overrides(root)
    r0, r1 = Batches(ov, rank=0, world=2), Batches(ov, rank=1, world=2)
    next(r0)
    with pytest.raises(ValueError, match="a state of rank 0 of world 2 given to rank 1"):
        r1.load_state_dict(r0.state_dict())
    with pytest.raises(ValueError, match=r"states of ranks \[0\] of world\(s\) \[2\]"):
        Batches(ov).load_state_dict([r0.state_dict()])
    other = Batches(overrides(root, **{"data.seq_len": 16}), rank=0, world=2)
    with pytest.raises(ValueError, match="data.seq_len=32, this config has 16"):
        other.load_state_dict(r0.state_dict())
    with pytest.raises(ValueError, match="no Batches.state_dict"):
        r0.load_state_dict({"step": 3})


def test_the_same_overrides_compose_once_and_each_batches_gets_its_own_config():
    """data.torch.compose keeps Hydra's composition per overrides (~0.6 CPU-s each): a second call
    composes nothing, and returns a copy of its own, struct as Hydra's, its interpolations live."""
    from omegaconf import OmegaConf
    from omegaconf.errors import ConfigAttributeError

    from data.torch import _COMPOSED, compose

    ov = ("data.seq_len=48",)
    a = compose(ov)
    n = len(_COMPOSED)
    b = compose(ov)
    assert len(_COMPOSED) == n and a == b and a is not b
    b.data.seq_len = 16
    assert a.data.seq_len == compose(ov).data.seq_len == 48
    assert OmegaConf.is_struct(b)
    with pytest.raises(ConfigAttributeError):
        b.data.not_a_key = 1
    assert b.data.paths[0] == os.path.join(REPO, "data", "sample", "*", "en_head.json.gz")   # ${project_root:}


def test_config_mistakes_fail_in_one_line(corpus):
    root, _ = corpus
    with pytest.raises(ValueError, match="Could not override 'data.nope'"):
        Batches([*overrides(root), "data.nope=1"])
    with pytest.raises(ValueError, match="give both rank and world"):
        Batches(overrides(root), rank=1)
    with pytest.raises(ValueError, match="not divisible by the process count 3"):
        Batches(overrides(root), rank=0, world=3)
    with pytest.raises(ValueError, match="matches no file"):
        Batches(overrides(root, **{"data.paths": str(root / "none" / "*.json.gz")}))


def test_dataloader_and_stateful_dataloader(corpus):
    from torch.utils.data import DataLoader
    StatefulDataLoader = pytest.importorskip("torchdata.stateful_dataloader").StatefulDataLoader  # .[torch]

    root, _ = corpus
    ov = overrides(root)
    direct = [as_numpy(b) for b in take(Batches(ov, rank=1, world=2), 6)]
    plain = iter(DataLoader(Batches(ov, rank=1, world=2), batch_size=None))
    for i in range(6):
        assert_same(as_numpy(next(plain)), direct[i], f"DataLoader batch {i}")
    loader = StatefulDataLoader(Batches(ov, rank=1, world=2), batch_size=None)
    it = iter(loader)
    take(it, 3)
    state = json.loads(json.dumps(loader.state_dict()))
    resumed = StatefulDataLoader(Batches(ov, rank=1, world=2), batch_size=None)
    resumed.load_state_dict(state)
    for i, b in enumerate(resumed):
        assert_same(as_numpy(b), direct[3 + i], f"StatefulDataLoader batch {3 + i}")
        if i == 2:
            break
    if not torch.accelerator.is_available():     # as torch's DataLoader: a warning, and unpinned tensors
        with pytest.warns(UserWarning, match="no accelerator is available"):
            pinned = Batches(ov, rank=1, world=2, pin_memory=True)
        assert not next(pinned)["input_ids"].is_pinned()
    else:
        assert all(v.is_pinned() for v in next(Batches(ov, rank=1, world=2, pin_memory=True)).values())
    # DataLoader workers would each read the same rows: refused, naming the fix
    with pytest.raises(RuntimeError, match="num_workers=0"):
        next(iter(DataLoader(Batches(ov), batch_size=None, num_workers=1)))


@pytest.mark.slow
def test_bad_input_is_counted_and_named_as_in_training(tmp_path):
    write_corpus(tmp_path, n_files=4, docs_per_file=8)
    bad = tmp_path / "0002" / "en_head.json.gz"
    lines = gzip.open(bad).read().splitlines()
    lines[3] = b'{"raw_content": "cut off'
    with gzip.open(bad, "wb") as f:
        f.write(b"\n".join(lines) + b"\n")
    b = Batches(overrides(tmp_path), rank=1, world=2)       # shard 2 (the file 0002) is rank 1's
    host = data.make_host_iterator(cfg(tmp_path), 1, 2)
    take(b, 16)
    take(host, 16)
    stats = b.stats()
    expect = consumed_figures(host.get_state(), data.make_host_iterator(cfg(tmp_path), 1, 2).get_state())
    assert stats["bad_records"] == expect["bad_records"] and sum(stats["bad_records"].values()) == 1
    assert f"{bad}:4" in json.dumps(stats["bad_examples"])
    assert stats["documents"] == expect["documents"] > 0
    strict = Batches(overrides(tmp_path, **{"data.strict": "true"}), rank=1, world=2)
    with pytest.raises(data.BadDataError, match=f"{bad}:4"):
        take(strict, 16)


@pytest.mark.slow
def test_import_starts_no_jax_and_iteration_no_backend(corpus):
    root, _ = corpus
    code = ("import sys\nimport data.torch\n"
            "assert 'jax' not in sys.modules and 'grain' not in sys.modules, 'imported at import'\n"
            f"b = data.torch.Batches({overrides(root)!r})\nnext(b)\n"
            "import jax._src.xla_bridge as xb\nassert not xb._backends, xb._backends\nprint('ok')\n")
    env = {**os.environ, "PYTHONPATH": REPO}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]


@pytest.mark.slow
def test_two_gloo_ranks_with_stateful_dataloader_then_world_one(corpus, tmp_path):
    pytest.importorskip("torchdata.stateful_dataloader")     # the .[torch] extra
    root, _ = corpus
    ov = overrides(root, **{"data.num_workers": 1})      # the pipeline's own reader processes
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(REPO, "tests", "torch_ranks.py"), str(tmp_path), *ov]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    runs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [(x["rank"], x["world"]) for x in runs] == [(0, 2), (1, 2)]       # from the gloo group
    got = []
    for r in range(2):
        z = np.load(tmp_path / f"rank{r}.npz")
        got.append([{k: z[f"{i}/{k}"] for k in KEYS} for i in range(4)])
    whole = Batches(ov)
    for i in range(4):
        assert_same(concat([got[0][i], got[1][i]]), as_numpy(next(whole)), f"batch {i}")
    # The two ranks' loader states (saved after 2 batches), resumed at world 1: batches 3 and 4
    one = Batches(ov)
    one.load_state_dict([x["state"] for x in runs])
    for i in (2, 3):
        assert_same(as_numpy(next(one)), concat([got[0][i], got[1][i]]), f"world 1 resumed batch {i}")
    whole.close()
    one.close()


@pytest.mark.slow
def test_example_loop_learns_and_resumes_at_another_world(tmp_path):
    """scripts/torch_example.py, docs/pytorch.md: a tiny GPT's loss falls on the bundled sample
    over 2 gloo ranks; run again on 1 rank it continues from the saved model and data positions."""
    def run(ranks, steps):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
               os.path.join(REPO, "scripts", "torch_example.py"), "--steps", str(steps), "--out", str(tmp_path),
               "data.num_workers=0"]     # reading in the ranks' own processes: a quicker start
        out = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": REPO}, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        return {int(m[0]): float(m[1]) for m in re.findall(r"step (\d+) loss ([\d.]+)", out.stdout)}

    losses = run(2, 20)
    assert sorted(losses) == [1, 10, 20] and losses[20] < losses[1] - 1.0, losses
    assert [json.loads(p.read_text())["world"] for p in tmp_path.glob("data_rank*.json")] == [2, 2]
    assert sorted(run(1, 22)) == [21, 22]          # resumed at step 21, world 1 (the 2 ranks' states merged)
    assert [json.loads(p.read_text())["world"] for p in tmp_path.glob("data_rank*.json")] == [1]


def test_a_mixture_through_the_same_config_and_state():
    """configs/data/sample_mix.yaml (two sources, held-out files by path): a rank's rows are the JAX
    host's, the per-source figures are counted, and the state round trip holds."""
    ov = ["data=sample_mix", "data.num_workers=0", "data.seq_len=64", "data.global_batch_size=8"]
    b = Batches(ov, rank=1, world=2)
    assert set(b.files) == {"web", "code"} and not any("0007" in f for f in b.files["web"])   # held out
    host = data.make_host_iterator(b.cfg, 1, 2, files=b.files)
    for step in range(3):
        np.testing.assert_array_equal(next(b)["input_ids"].numpy(), next(host)["inputs"], err_msg=f"step {step}")
    stats = b.stats()
    assert stats["source/web/rows"] + stats["source/code/rows"] == stats["rows"] > 0
    state = json.loads(json.dumps(b.state_dict()))
    again = Batches(ov, rank=1, world=2)
    again.load_state_dict(state)
    np.testing.assert_array_equal(next(again)["input_ids"].numpy(), next(host)["inputs"])

"""Weighted mixtures (`data.sources`): shares, epochs per source, exact and elastic restore,
the fingerprint, the single-source path unchanged, config mistakes in one line.

    pytest tests/test_data_mixture.py -q        (~2-3 min on 2 shared cores)

Rows are traced to their source through the debug doc ids: a mixture tags them with the
source's index (data/streams/mixture.py SOURCE_ID_SHIFT); the rest is the source's own
(epoch, file, line) id.
"""
import hashlib
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import data
from data.host import find_shard_states
from data.streams.mixture import SOURCE_ID_SHIFT, source_counters, source_of_doc_id
from tests import forked
from tests.data_helpers import (
    REPO,
    SOURCES,
    TOKENIZER,
    assert_batches_equal,
    close,
    decode_doc_id,
    jround,
    mix_cfg,
    take,
    write_sources,
)
from tests.run_helpers import main_in_process, run_cli


def row_sources(batch) -> np.ndarray:
    """Source index of every row (a row holds documents of one source only)."""
    did = np.asarray(batch["doc_ids"])
    out = np.full(did.shape[0], -1)
    for r, row in enumerate(did):
        src = np.unique(source_of_doc_id(row[row >= 0]))
        assert len(src) == 1, f"row {r} mixes sources {src}"
        out[r] = src[0]
    return out


def doc_key(did: int, n_files: dict):
    """(source, epoch, file, line) of a tagged debug doc id."""
    src = did >> SOURCE_ID_SHIFT
    return (src, *decode_doc_id(did & ((1 << SOURCE_ID_SHIFT) - 1), n_files[src]))


def token_counts(batches, n_files) -> Counter:
    """Tokens per (source, epoch, file, line) over the batches' rows."""
    c = Counter()
    for b in batches:
        did = np.asarray(b["doc_ids"])
        ids, n = np.unique(did[did >= 0], return_counts=True)
        for d, k in zip(ids.tolist(), n.tolist(), strict=True):
            c[doc_key(d, n_files)] += k
    return c


def straight(c, n, P=1, h=0):
    it = data.make_host_iterator(c, h, P, debug=True)
    states, batches = [jround(it.get_state())], []
    for _ in range(n):
        batches.append(next(it))
        states.append(jround(it.get_state()))
    close(it)
    return batches, states


N_FILES = {i: s[2] for i, s in enumerate(SOURCES)}
WEIGHTS = np.array([s[1] for s in SOURCES]) / sum(s[1] for s in SOURCES)


# ---------------------------------------------------------------- shares
@pytest.mark.parametrize("packing", ["concat", "first_fit"])
def test_shares_hold_over_every_window_of_100_batches(tmp_path, packing):
    write_sources(tmp_path)
    batches, _ = straight(mix_cfg(tmp_path, packing=packing), 300)
    rows = np.stack([row_sources(b) for b in batches])                     # [batches, B]
    real = np.stack([(np.asarray(b["doc_ids"]) >= 0).sum(1) for b in batches])   # [batches, B]
    for t in range(0, len(batches) - 100 + 1):
        win_rows, win_real = rows[t:t + 100], real[t:t + 100]
        row_share = np.array([(win_rows == i).mean() for i in range(len(SOURCES))])
        np.testing.assert_allclose(row_share, WEIGHTS, atol=0.01, err_msg=f"rows, batches {t}..{t + 99}")
        if packing == "concat":   # full rows: token share = row share
            tok_share = np.array([win_real[win_rows == i].sum() for i in range(len(SOURCES))]) / win_real.sum()
            np.testing.assert_allclose(tok_share, WEIGHTS, atol=0.01, err_msg=f"tokens, batches {t}..{t + 99}")
    # Low discrepancy: even one batch (8 rows) holds each source's share to within 2 rows.
    per_batch = np.stack([(rows == i).sum(1) for i in range(len(SOURCES))], 1)   # [batches, sources]
    assert np.abs(per_batch - WEIGHTS * rows.shape[1]).max() <= 2


# ---------------------------------------------------------------- epochs per source
def test_a_source_that_runs_out_starts_its_next_epoch(tmp_path):
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P
    write_sources(tmp_path)
    c = mix_cfg(tmp_path, shuffle_window=1)
    batches, states = straight(c, 120)
    counts = token_counts(batches, N_FILES)
    tiny = 2
    epochs = sorted({e for (s, e, _, _) in counts if s == tiny})
    assert len(epochs) >= 4, epochs          # 12 tiny documents, read over and over
    assert max(e for (s, e, _, _) in counts if s == 0) == 0   # the large source is in its first
    # Every complete epoch of the small source holds each of its documents exactly once, whole
    # (each of its 4 files is one shard's; rows in stream order (no shuffle window), so only
    # the last epoch a shard reached may be partly read).
    tiny_counts = {k[1:]: n for k, n in counts.items() if k[0] == tiny}     # (epoch, file, line)
    for f in range(4):
        last = max(e for (e, ff, _) in tiny_counts if ff == f)
        assert last >= 1, f
        first = {ln: n for (e, ff, ln), n in tiny_counts.items() if ff == f and e == 0}
        assert sorted(first) == [0, 1, 2], (f, first)
        for e in range(1, last):
            assert {ln: n for (ee, ff, ln), n in tiny_counts.items() if ff == f and ee == e} == first, (f, e)
    per_source = source_counters(find_shard_states(states[-1]))
    assert per_source["tiny"]["epoch"] >= epochs[-2] and per_source["web"]["epoch"] == 0

    # The same figures reach the training log through DevicePrefetcher.stats.
    sharding = NamedSharding(Mesh(np.array(jax.devices()), ("data",)), P("data"))
    pf = data.DevicePrefetcher(data.make_host_iterator(c, 0, 1), sharding, prefetch=2)
    for _ in range(120):
        next(pf)
    s = pf.stats()
    pf.close()
    assert s["source/tiny/epoch"] == per_source["tiny"]["epoch"] >= 3
    assert s["source/web/epoch"] == 0
    assert sum(s[f"source/{n}/rows"] for n, *_ in SOURCES) == s["rows"] == 120 * 8
    assert sum(s[f"source/{n}/tokens"] for n, *_ in SOURCES) == s["tokens"]
    assert sum(s[f"source/{n}/documents"] for n, *_ in SOURCES) == s["documents"]
    for (name, *_), w in zip(SOURCES, WEIGHTS, strict=True):
        assert abs(s[f"source/{name}/row_share"] - w) <= 0.01
        assert s[f"source/{name}/bad_records"] == 0


# ---------------------------------------------------------------- exact restore
@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_restore_is_exact_at_every_point(tmp_path, workers):
    write_sources(tmp_path)
    c = mix_cfg(tmp_path, num_workers=workers)
    n = 24
    ref, states = straight(mix_cfg(tmp_path), n + 3)
    # A worker pipeline's saved state is its own: take the states from that topology.
    if workers:
        it = data.make_host_iterator(c, 0, 1, debug=True)
        wstates = [jround(it.get_state())]
        for k in range(n):
            assert_batches_equal(next(it), ref[k], f"workers, batch {k}")
            wstates.append(jround(it.get_state()))
        close(it)
        # Worker spawns are slow here: one point each way (both inside a worker group).
        by_merge, by_set_state = [13], [5]
    else:
        wstates, by_merge = states, range(n + 1)
        by_set_state = by_merge
    for k in by_merge:      # per-shard states (any topology)
        it = data.restore_host_iterator(c, 0, 1, [wstates[k]], debug=True)
        for j, b in enumerate(take(it, 3)):
            assert_batches_equal(b, ref[k + j], f"restore_host_iterator at {k}, batch {k + j}")
        close(it)
    # The iterator's own set_state (the same topology), on an iterator that is already running
    # (its streams built: they rewind in place).
    it = data.make_host_iterator(c, 0, 1, debug=True)
    next(it)
    for k in by_set_state:
        it.set_state(wstates[k])
        for j, b in enumerate(take(it, 3)):
            assert_batches_equal(b, ref[k + j], f"set_state at {k}, batch {k + j}")
    close(it)


# ---------------------------------------------------------------- elastic restore
@pytest.mark.slow
@pytest.mark.parametrize("N1,N2", [(0, 0), (2, 1)])
def test_elastic_restore_one_to_two_hosts_exactly_once_per_source(tmp_path, N1, N2):
    write_sources(tmp_path)
    k1, k2 = 9, 30
    ref, _ = straight(mix_cfg(tmp_path), k1 + k2)
    it = data.make_host_iterator(mix_cfg(tmp_path, num_workers=N1), 0, 1, debug=True)
    before = take(it, k1)
    saved = [jround(it.get_state())]
    close(it)
    after = [[] for _ in range(2)]
    for h in range(2):
        it = data.restore_host_iterator(mix_cfg(tmp_path, num_workers=N2), h, 2, saved, debug=True)
        after[h] = take(it, k2)
        close(it)
    glued = before + [{key: np.concatenate([after[0][t][key], after[1][t][key]]) for key in after[0][t]}
                      for t in range(k2)]
    # Every source's documents, token by token, exactly as often as in the uninterrupted run
    # (nothing lost or repeated at the seam) ...
    got, want = token_counts(glued, N_FILES), token_counts(ref, N_FILES)
    for src in range(len(SOURCES)):
        assert {k: v for k, v in got.items() if k[0] == src} == {k: v for k, v in want.items() if k[0] == src}, src
    # ... because the global batches are the uninterrupted run's.
    for t in range(k1 + k2):
        assert_batches_equal(glued[t], ref[t], f"batch {t}")


# ---------------------------------------------------------------- single source unchanged
def test_single_source_batches_are_unchanged():
    # Hashes of 40 batches of the bundled sample read through data.paths, computed with the
    # code before mixtures existed (commit a438be4): the single-source form is untouched.
    golden = {"concat": "c1c9db6ab02b5436", "first_fit": "d6066b0a9ce8abc8"}
    for packing, want in golden.items():
        c = data.DataConfig(paths=(os.path.join(REPO, "data/sample/000[0-6]/en_head.json.gz"),),
                            tokenizer=TOKENIZER, seq_len=64, global_batch_size=16, num_shards=4,
                            num_workers=0, packing=packing, shuffle_window=8)
        it = data.make_host_iterator(c, 0, 1)
        m = hashlib.sha256()
        for _ in range(40):
            b = next(it)
            for key in sorted(b):
                m.update(np.ascontiguousarray(b[key]).tobytes())
        assert m.hexdigest()[:16] == want, packing
        assert not any(key.startswith("source") for key in data.fingerprint(c))


def test_fingerprint_covers_the_mixture(tmp_path):
    write_sources(tmp_path)
    fp = data.fingerprint(mix_cfg(tmp_path))
    assert fp["source.web.share"] == 0.5 and fp["source.tiny.text_key"] == "text"
    # The same shares written with other numbers are the same data; other shares are not.
    doubled = [(n, 2 * w, *rest) for n, w, *rest in SOURCES]
    assert data.fingerprint(mix_cfg(tmp_path, sources=doubled)) == fp
    reweighted = [(n, w + (i == 0), *rest) for i, (n, w, *rest) in enumerate(SOURCES)]
    assert data.fingerprint(mix_cfg(tmp_path, sources=reweighted)) != fp


# ---------------------------------------------------------------- through train.py
@pytest.mark.slow
def test_train_resumes_a_mixture_exactly_and_refuses_a_weight_change(tmp_path):
    """Same process count: the resumed run repeats the straight run bit for bit. Two processes
    (real jax.distributed) resuming one process's checkpoint: the same rows."""
    import json

    from hydra import compose, initialize_config_dir

    import train as train_mod
    from tests.run_helpers import MICRO, ONE_SCHEDULE, env_for, free_port

    def make_overrides(*overrides):     # runs of 2, 4 and 6 steps: one compiled step (run_helpers.ONE_SCHEDULE)
        return ["data=sample_mix", *MICRO, *ONE_SCHEDULE, "logger.progress_bar=false", "logger.wandb.mode=disabled",
                "train.steps=4", "train.log_every=1", "checkpoint.every=2", "train.eval_every=0", "data.seq_len=32",
                "data.num_workers=0", "++train.debug_batches=true", *overrides]

    def make(run_dir, *overrides):
        with initialize_config_dir(config_dir=str(Path(REPO) / "configs"), version_base="1.3"):
            return compose("train", overrides=[f"paths.run_dir={run_dir}", *make_overrides(*overrides)])

    def per_step(run_dir):
        def last_per_step(name):
            return {r["step"]: r for r in map(json.loads, open(run_dir / name))}
        return last_per_step("metrics.jsonl"), last_per_step("debug_batches.p0.jsonl")

    straight, cut = tmp_path / "straight", tmp_path / "cut"
    train_mod.train(make(straight))
    train_mod.train(make(cut, "train.steps=2"))
    assert train_mod.train(make(cut))["start_step"] == 2
    (m_s, d_s), (m_c, d_c) = per_step(straight), per_step(cut)
    # the resumed run's steps 3-4: the straight run's batches and losses, bit for bit
    assert [d_c[t]["batch_hash"] for t in (3, 4)] == [d_s[t]["batch_hash"] for t in (3, 4)]
    assert [m_c[t]["loss"] for t in (3, 4)] == [m_s[t]["loss"] for t in (3, 4)]
    # The straight run's step-2 checkpoint continued by 2 processes (jax.distributed on localhost,
    # 2 devices each): every row of steps 3-4, of both sources, is the straight run's row.
    two = tmp_path / "two"
    two.mkdir()
    port = free_port()
    cli = [sys.executable, str(Path(REPO) / "train.py"), f"hydra.run.dir={two}",
           *(o for o in make_overrides() if not o.startswith("paths.run_dir")),
           f"checkpoint.resume_from={straight / 'checkpoints' / '2'}", "checkpoint.every=0",
           f"distributed.coordinator_address=localhost:{port}", "distributed.num_processes=2",
           "distributed.local_device_count=2"]
    procs = [forked.Popen(cli + [f"distributed.process_id={i}"], cwd=two, env=env_for(2),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outs = [pr.communicate(timeout=400)[0] for pr in procs]
    assert [pr.returncode for pr in procs] == [0, 0], outs
    rows_two = {t: [] for t in (3, 4)}
    for i in range(2):
        for r in map(json.loads, open(two / f"debug_batches.p{i}.jsonl")):
            rows_two[r["step"]] += r["rows"]
    assert sorted(rows_two) == [3, 4] and all(rows_two[t] == d_s[t]["rows"] for t in (3, 4))

    last = m_s[4]
    assert last["data/source/web/rows"] + last["data/source/code/rows"] == last["data/rows"]
    for key in ("tokens", "documents", "epoch", "bad_records", "token_share", "row_share"):
        assert f"data/source/code/{key}" in last, key

    with pytest.raises(train_mod.ConfigError) as e:
        train_mod.train(make(straight, "data.sources.1.weight=0.5", "train.steps=6"))
    msg = str(e.value)
    assert "data.source.code.share: checkpoint=0.2 now=" in msg and "allow_data_change=true" in msg, msg
    assert not (straight / "checkpoints" / "6").exists()


def test_bad_records_are_counted_per_source(tmp_path):
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from tests.data_helpers import write_lines
    write_sources(tmp_path)
    bad_file = os.path.join(str(tmp_path), "books", "0002", "en_head.json.gz")
    import gzip
    with gzip.open(bad_file) as f:
        lines = f.read().splitlines()
    write_lines(bad_file, lines[:1] + [b"{not json", b'{"other_key": "x"}'] + lines[1:])
    sharding = NamedSharding(Mesh(np.array(jax.devices()), ("data",)), P("data"))
    pf = data.DevicePrefetcher(data.make_host_iterator(mix_cfg(tmp_path), 0, 1), sharding, prefetch=1)
    for _ in range(30):   # every shard reads its first documents of every source
        next(pf)
    s = pf.stats()
    pf.close()
    assert (s["source/books/bad_records"], s["source/web/bad_records"], s["source/tiny/bad_records"]) == (2, 0, 0)
    assert sum(s["bad_records"].values()) == 2


# ---------------------------------------------------------------- config mistakes
@pytest.mark.parametrize("override, needle", [
    ("data.sources.1.weight=0", "data.sources[code].weight=0.0: must be a finite number > 0"),
    ("data.sources.1.weight=-1", "data.sources[code].weight=-1.0"),
    ("data.sources.1.name=web", "the name 'web' appears twice"),
    ("data.sources.1.paths=[]", "data.sources[code].paths is empty"),
    ("data.paths=[x.json.gz]", "set data.paths (one source) or data.sources (a mixture), not both"),
    ("data.mixture_change=yes", "data.mixture_change='yes': must be one of ('refuse', 'continue')"),
    ("data.eval.holdout_files=1 data.eval.paths=[]", "data.eval.holdout_files works with data.paths only"),
    ("data.eval.paths=[${project_root:}/data/sample_code/0001/code.jsonl.gz]",
     "data.eval.paths overlaps the training files"),
])
def test_config_mistakes_fail_in_one_line(tmp_path, capsys, override, needle):
    # in-process (tests/run_helpers.py main_in_process); the first case also on the command line
    code, lines = main_in_process(capsys, tmp_path / "run", "data=sample_mix", *override.split())
    assert code == 2
    assert len(lines) == 1 and needle in lines[0], lines
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.slow
def test_a_config_mistake_on_the_command_line_fails_in_one_line(tmp_path):
    r = run_cli(tmp_path, "data=sample_mix", "data.sources.1.weight=0")
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "data.sources[code].weight=0.0: must be a finite number > 0" in lines[0], r.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()

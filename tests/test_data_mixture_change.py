"""Changing a mixture on resume (data.mixture_change=continue): re-weighting, adding, dropping
and listing a source again, on the same or another host / worker count; the fingerprint rules.

    pytest tests/test_data_mixture_change.py -q        (~1.5 min on 2 shared cores; data-level
                                                         tests ~5 s, the two train.py ones the rest)

The reference for a source is that source read alone: a one-source mixture of the same name
reads the very sub-stream (files, text key, seed: data/streams/mixture.py mixture_spec) the source has
inside any mixture, whatever the weights, so per virtual shard the rows a source delivered
across every change must be the first rows of its alone-stream, in order: nothing lost, nothing
repeated, the packer's carry-over included. Debug doc ids tag a row with the index of its source
in the list of that phase (data/streams/mixture.py SOURCE_ID_SHIFT), so rows are traced by name.
"""
import os
from collections import Counter

import numpy as np
import pytest

import data
from data.state import mixture_changes
from data.streams.mixture import SOURCE_ID_SHIFT
from tests import forked
from tests.data_helpers import SOURCES, close, jround, mix_cfg, take, write_sources
from tests.run_helpers import MICRO, ONE_SCHEDULE

SRC = {name: (name, w, n_files, docs, key) for name, w, n_files, docs, key in SOURCES}
TAG_MASK = (1 << SOURCE_ID_SHIFT) - 1


def cfg_of(root, weights: dict, **kw):
    """A mixture of the named sources (in this order) with these weights."""
    kw.setdefault("mixture_change", "continue")
    return mix_cfg(root, sources=[(n, w, *SRC[n][2:]) for n, w in weights.items()], **kw)


def per_source_rows(batches, names) -> dict:
    """{(source name, shard): [(doc ids untagged, tokens) per row, in delivery order]}."""
    out: dict = {}
    for b in batches:
        tok = np.concatenate([b["inputs"], b["targets"][:, -1:]], axis=1)
        did = np.asarray(b["doc_ids"])
        for r in range(tok.shape[0]):
            real = did[r][did[r] >= 0]
            idx = np.unique(real >> SOURCE_ID_SHIFT)
            assert len(idx) == 1, f"a row mixes sources {idx}"
            ids = np.where(did[r] >= 0, did[r] & TAG_MASK, -1)
            out.setdefault((names[int(idx[0])], int(b["row_shard"][r])), []).append((ids, tok[r]))
    return out


def glue(*phases) -> dict:
    """Per-source rows of consecutive phases, [(batches, names), ...], one after the other."""
    out: dict = {}
    for batches, names in phases:
        for key, rows in per_source_rows(batches, names).items():
            out.setdefault(key, []).extend(rows)
    return out


def alone(root, name, n_batches) -> dict:
    it = data.make_host_iterator(cfg_of(root, {name: 1.0}), 0, 1, debug=True)
    batches = take(it, n_batches)
    close(it)
    return per_source_rows(batches, [name])


def assert_continues(got: dict, root, names, n_alone=40):
    """Each source's rows per shard are exactly the first rows of its stream read alone."""
    for name in names:
        ref = alone(root, name, n_alone)
        shards = sorted(s for n, s in got if n == name)
        assert shards and set(shards) <= {0, 1, 2, 3}, (name, shards)
        for shard in shards:
            rows, want = got[(name, shard)], ref[(name, shard)]
            assert len(rows) <= len(want), f"reference too short for {name} shard {shard}"
            for j, ((ids, tok), (ids_w, tok_w)) in enumerate(zip(rows, want, strict=False)):
                np.testing.assert_array_equal(ids, ids_w, err_msg=f"{name} shard {shard} row {j}: doc ids")
                np.testing.assert_array_equal(tok, tok_w, err_msg=f"{name} shard {shard} row {j}: tokens")


def doc_use(got: dict, name: str) -> Counter:
    """Tokens per (epoch, file, line) document of a source over the glued rows."""
    c = Counter()
    for (n, _), rows in got.items():
        if n == name:
            for ids, _ in rows:
                d, k = np.unique(ids[ids >= 0], return_counts=True)
                c.update(dict(zip(d.tolist(), k.tolist(), strict=True)))
    return c


def shares(batches, names) -> np.ndarray:
    """[batches, sources]: rows of each source per batch."""
    out = np.zeros((len(batches), len(names)), int)
    for t, b in enumerate(batches):
        did = np.asarray(b["doc_ids"])
        for r in range(did.shape[0]):
            out[t, int(did[r][did[r] >= 0][0] >> SOURCE_ID_SHIFT)] += 1
    return out


def run_phase(c, n, saved, P=1):
    """n batches of every host (P hosts) restored from `saved` host states -> (per-host
    batches glued into global batches, the hosts' states)."""
    per_host, states = [], []
    for h in range(P):
        it = data.restore_host_iterator(c, h, P, saved, debug=True)
        per_host.append(take(it, n))
        states.append(jround(it.get_state()))
        close(it)
    glued = [{k: np.concatenate([per_host[h][t][k] for h in range(P)]) for k in per_host[0][t]}
             for t in range(n)]
    return glued, states


# ---------------------------------------------------------------- re-weighting mid-epoch
@pytest.mark.slow
@pytest.mark.parametrize("P1,P2,N1,N2", [(1, 1, 0, 0), (2, 1, 0, 2)])
def test_reweighted_mid_epoch_every_document_once(tmp_path, P1, P2, N1, N2):
    """web:books 1:1 for 8 batches, then 4:1 (on another host / worker count in the second
    case): every row of each source continues its own stream, and the new shares hold from
    the first batch after the resume."""
    write_sources(tmp_path)
    before, saved = run_phase(cfg_of(tmp_path, {"web": 1.0, "books": 1.0}, num_workers=N1), 8, None, P1)
    w2 = {"web": 4.0, "books": 1.0}
    after, _ = run_phase(cfg_of(tmp_path, w2, num_workers=N2), 12, saved, P2)
    got = glue((before, ["web", "books"]), (after, ["web", "books"]))
    assert_continues(got, tmp_path, ["web", "books"])
    # Mid-epoch, so every document so far was used once: no document's tokens appear in two
    # places of the stream (a repeat), and all of them are epoch 0 (still in the first pass).
    for name in ("web", "books"):
        use = doc_use(got, name)
        assert use and all(d >> 24 < SRC[name][2] for d in use), name   # epoch 0: file < n_files
    # Shares: the schedule's low discrepancy holds from the first batch on (<= 2 rows of 8).
    per_batch = shares(after, ["web", "books"])
    want = np.array([0.8, 0.2]) * 8
    assert np.abs(per_batch - want).max() <= 2, per_batch
    np.testing.assert_allclose(per_batch.sum(0) / per_batch.sum(), [0.8, 0.2], atol=0.02)


def test_without_the_flag_the_restore_itself_still_continues(tmp_path):
    """The data layer never refuses (train.py does, on the fingerprint): a state restores into
    any mixture that lists its sources; the flag is about the run's fingerprint only."""
    write_sources(tmp_path)
    before, saved = run_phase(cfg_of(tmp_path, {"web": 1.0, "books": 1.0}), 4, None)
    after, _ = run_phase(cfg_of(tmp_path, {"books": 1.0, "web": 2.0}, mixture_change="refuse"), 6, saved)
    assert_continues(glue((before, ["web", "books"]), (after, ["books", "web"])), tmp_path, ["web", "books"])


# ---------------------------------------------------------------- drop, add, list again
@pytest.mark.slow
def test_dropped_source_is_parked_and_continues_when_listed_again(tmp_path):
    """(web, books) -> (web, tiny): books dropped, tiny added -> (books, web): books listed
    again (another order), tiny dropped. The middle phase runs with 2 input workers and is
    saved by 2 hosts, so the parked state also crosses worker states and a host merge."""
    write_sources(tmp_path)
    p1, s1 = run_phase(cfg_of(tmp_path, {"web": 1.0, "books": 1.0}), 6, None)
    p2, s2 = run_phase(cfg_of(tmp_path, {"web": 3.0, "tiny": 1.0}, num_workers=1), 6, s1, P=2)
    # books' position is parked in every shard's state, with its counters
    merged = data.merge_host_states(s2)["shards"]
    books_rows = 0
    for st in merged.values():
        assert sorted(st["sources"]) == ["tiny", "web"] and sorted(st["parked"]) == ["books"]
        books_rows += st["parked"]["books"]["c"]["rows"]
        # the shard's totals count every row it emitted, parked sources' included
        assert st["c"]["rows"] == st["sched"]["row"] == 12 * 2
    assert books_rows == shares(p1, ["web", "books"])[:, 1].sum()
    p3, s3 = run_phase(cfg_of(tmp_path, {"books": 1.0, "web": 1.0}), 8, s2)
    for st in data.merge_host_states(s3)["shards"].values():
        assert sorted(st["parked"]) == ["tiny"]
    got = glue((p1, ["web", "books"]), (p2, ["web", "tiny"]), (p3, ["books", "web"]))
    assert_continues(got, tmp_path, ["web", "books", "tiny"])
    # tiny (12 short documents) started from its beginning: its rows are its stream's first
    assert doc_use(got, "tiny")
    assert not any(n == "books" for n, _ in per_source_rows(p2, ["web", "tiny"]))


def test_metrics_after_a_change_count_from_the_resume(tmp_path):
    """Per-source metrics of the resumed run start from the restored positions: a source
    listed again is not credited with what it read before it was parked."""
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P
    write_sources(tmp_path)
    _, s1 = run_phase(cfg_of(tmp_path, {"web": 1.0, "books": 1.0}), 6, None)
    _, s2 = run_phase(cfg_of(tmp_path, {"web": 1.0}), 3, s1)
    sharding = NamedSharding(Mesh(np.array(jax.devices()), ("data",)), P("data"))
    c3 = cfg_of(tmp_path, {"web": 1.0, "books": 3.0})
    pf = data.DevicePrefetcher(data.restore_host_iterator(c3, 0, 1, s2, debug=True), sharding, prefetch=1)
    batches = [next(pf) for _ in range(5)]
    s = pf.stats()
    pf.close()
    rows = shares(batches, ["web", "books"]).sum(0)
    assert (s["source/web/rows"], s["source/books/rows"]) == tuple(rows) and s["rows"] == 5 * 8
    assert s["source/books/row_share"] == rows[1] / 40


# ---------------------------------------------------------------- the fingerprint rules
def fp(root, weights, **kw):
    return data.fingerprint(cfg_of(root, weights, **kw))


def test_fingerprint_accepts_shares_and_the_list_of_sources_only(tmp_path):
    write_sources(tmp_path)
    saved = fp(tmp_path, {"web": 1.0, "books": 1.0})
    keys, notes = mixture_changes(saved, data.carry_parked_sources(saved, fp(tmp_path, {"web": 4.0, "books": 1.0})))
    assert keys == {"source.web.share", "source.books.share"}
    assert notes == ["source web share 0.5 -> 0.8", "source books share 0.5 -> 0.2"]
    # drop books, add tiny: books' entries travel on (but its share), tiny is new
    now = data.carry_parked_sources(saved, fp(tmp_path, {"web": 1.0, "tiny": 1.0}))
    assert now["source.books.files"] == saved["source.books.files"] and "source.books.share" not in now
    keys, notes = mixture_changes(saved, now)
    assert "source.tiny.files" in keys and "source.books.files" not in keys
    assert notes == ["source tiny added: starts from its beginning", "source books dropped: its position is kept"]
    # the same config resumed again: nothing differs, books still parked
    again = data.carry_parked_sources(now, fp(tmp_path, {"web": 1.0, "tiny": 1.0}))
    assert again == now and mixture_changes(now, again) == (set(), [])
    # books listed again, with its files: continues; with another text key: refused
    keys, notes = mixture_changes(now, data.carry_parked_sources(now, fp(tmp_path, {"web": 1.0, "books": 1.0})))
    assert notes[0] == "source books listed again: continues where it stopped"
    other_key = [("web", 1.0, 8, 30, "raw_content"), ("books", 1.0, 4, 20, "text")]
    with pytest.raises(ValueError, match=r"data\.source\.books\.text_key changed \(checkpoint='raw_content' "
                                         r"now='text'\)") as e:
        mixture_changes(now, data.carry_parked_sources(now, data.fingerprint(
            mix_cfg(tmp_path, sources=other_key))))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("change, needle", [
    ({"seq_len": 32}, "data.seq_len changed (checkpoint=16 now=32)"),
    ({"packing": "first_fit"}, "data.packing changed"),
    ({"seed": 3}, "data.seed changed"),
    ({"num_shards": 8}, "data.num_shards changed"),
    ({"shuffle_window": 2}, "data.shuffle_window changed"),
])
def test_fingerprint_refuses_what_breaks_exact_continuation(tmp_path, change, needle):
    write_sources(tmp_path)
    saved = fp(tmp_path, {"web": 1.0, "books": 1.0})
    with pytest.raises(ValueError) as e:
        mixture_changes(saved, fp(tmp_path, {"web": 2.0, "books": 1.0}, **change))
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_fingerprint_refuses_one_source_to_a_mixture(tmp_path):
    write_sources(tmp_path)
    single = data.fingerprint(mix_cfg(tmp_path, sources=(), paths=(os.path.join(str(tmp_path), "web", "*", "*"),)))
    with pytest.raises(ValueError, match="the checkpoint read one source"):
        mixture_changes(single, fp(tmp_path, {"web": 1.0}))
    with pytest.raises(ValueError, match=r"the checkpoint read a mixture \(data.sources\)"):
        mixture_changes(fp(tmp_path, {"web": 1.0}), single)


def test_flag_value_is_checked_in_one_line(tmp_path):
    write_sources(tmp_path)
    with pytest.raises(ValueError) as e:
        data.validate_settings(cfg_of(tmp_path, {"web": 1.0}, mixture_change="yes"), 1)
    assert str(e.value) == "data.mixture_change='yes': must be one of ('refuse', 'continue')"


# ---------------------------------------------------------------- through train.py
# data=sample_mix: web (7 English shards, 80%) and code (this project's Python, 20%, text key
# "text"); rows traced through train.debug_batches (per row: shard, first and last doc id, a
# hash of its tokens and doc ids).
# The smallest Llama and one schedule for runs of any length (tests/run_helpers.py): one compiled step.
TRAIN_OVERRIDES = ["data=sample_mix", *MICRO, *ONE_SCHEDULE, "logger.progress_bar=false", "logger.wandb.mode=disabled",
                   "train.log_every=1", "checkpoint.every=2", "train.eval_every=0", "data.seq_len=32",
                   "data.num_workers=0", "++train.debug_batches=true"]


def compose_run(run_dir, steps, sources: dict | None = None, *overrides):
    """The sample_mix config of a run; `sources`: {name: weight} (that order) picked from its two."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    import train  # noqa: F401 - registers ${project_root:}
    from tests.data_helpers import REPO
    with initialize_config_dir(config_dir=os.path.join(REPO, "configs"), version_base="1.3"):
        c = compose("train", overrides=[f"paths.run_dir={run_dir}", f"train.steps={steps}", *TRAIN_OVERRIDES,
                                        *overrides])
    if sources is not None:
        by_name = {s.name: s for s in c.data.sources}
        c.data.sources = [{**OmegaConf.to_container(by_name[n], resolve=True), "weight": w} for n, w in sources.items()]
    return c


def logged_rows(run_dir, steps, names) -> dict:
    """{step: [(source name, source index in that run, shard, row hash), ...]} of all processes."""
    import glob
    import json
    out: dict = {}
    for f in sorted(glob.glob(os.path.join(str(run_dir), "debug_batches.p*.jsonl"))):
        last = {}
        for line in open(f):
            r = json.loads(line)
            last[r["step"]] = r["rows"]
        for s in steps:
            out.setdefault(s, []).extend((names[first >> SOURCE_ID_SHIFT], first >> SOURCE_ID_SHIFT, shard, h)
                                         for shard, first, _, h in last.get(s, []))
    # every step logged whole (all processes together): sample_mix's 16 rows
    assert sorted(out) == sorted(steps) and all(len(rows) == 16 for rows in out.values()), out.keys()
    return out


def alone_rows(run_cfg, name, n_batches) -> dict:
    """{shard: [(inputs, targets, untagged doc ids) per row]} of source `name` read alone."""
    from omegaconf import OmegaConf
    m = OmegaConf.to_container(run_cfg.data, resolve=True)
    m.pop("eval")
    m["sources"] = [s for s in m["sources"] if s["name"] == name]
    it = data.make_host_iterator(data.DataConfig.from_mapping({**m, "tokenizer": run_cfg.tokenizer.path}), 0, 1,
                                 debug=True)
    out: dict = {}
    for b in take(it, n_batches):
        for r in range(len(b["row_shard"])):
            out.setdefault(int(b["row_shard"][r]), []).append((b["inputs"][r], b["targets"][r], b["doc_ids"][r]))
    close(it)
    return out


def row_hash(row, tag: int) -> str:
    """train.py's debug hash of a row whose source is at list index `tag` (the hash covers the
    tagged doc ids)."""
    import hashlib
    inp, tgt, did = (np.ascontiguousarray(x) for x in row)
    ids = np.ascontiguousarray(np.where(did >= 0, did | (np.int64(tag) << SOURCE_ID_SHIFT), did))
    return hashlib.sha256(inp.tobytes() + tgt.tobytes() + ids.tobytes()).hexdigest()[:16]


def assert_rows_continue(run_cfg, phases):
    """phases: [(rows by step from logged_rows), ...] in order: each source's rows per shard
    are exactly the first rows of that source read alone."""
    got: dict = {}
    for by_step in phases:
        for s in sorted(by_step):
            for name, tag, shard, h in by_step[s]:
                got.setdefault((name, shard), []).append((tag, h))
    for name in {n for n, _ in got}:
        ref = alone_rows(run_cfg, name, 12)
        for (n, shard), rows in got.items():
            if n == name:
                assert len(rows) <= len(ref[shard]), (name, shard)
                assert [h for _, h in rows] == [row_hash(ref[shard][j], tag) for j, (tag, _) in enumerate(rows)], \
                    (name, shard)


@pytest.mark.slow
def test_train_reweights_drops_and_lists_again_on_resume(tmp_path):
    """One process: 2 steps at web:code 0.8:0.2, refused without the flag (one hint), then with
    data.mixture_change=continue 2 steps at 0.25:0.75, 2 with code dropped, 2 with code listed
    again: every row of each source continues its own stream across the three changes, and
    the new shares hold from the first step after each resume."""
    import train as train_mod
    run = tmp_path / "run"
    assert train_mod.train(compose_run(run, 2))["start_step"] == 0
    phase1 = logged_rows(run, [1, 2], ["web", "code"])
    with pytest.raises(train_mod.ConfigError) as e:
        train_mod.train(compose_run(run, 4, {"web": 0.25, "code": 0.75}))
    assert "set data.mixture_change=continue" in str(e.value) and "data.source.code.share" in str(e.value)
    assert not (run / "checkpoints" / "4").exists()

    flag = "data.mixture_change=continue"
    # What would change the meaning of a saved position stays refused, in one line naming it.
    with pytest.raises(train_mod.ConfigError) as e:
        train_mod.train(compose_run(run, 4, {"web": 0.25, "code": 0.75}, flag, "data.shuffle_window=8"))
    assert "data.shuffle_window changed (checkpoint=64 now=8)" in str(e.value) and "\n" not in str(e.value)
    assert train_mod.train(compose_run(run, 4, {"web": 0.25, "code": 0.75}, flag))["start_step"] == 2
    phase2 = logged_rows(run, [3, 4], ["web", "code"])
    for s in (3, 4):   # 16 rows a step: 4 web, 12 code, within the schedule's 2 rows
        n_code = sum(name == "code" for name, *_ in phase2[s])
        assert abs(n_code - 12) <= 2, (s, n_code)
    assert train_mod.train(compose_run(run, 6, {"web": 1.0}, flag))["start_step"] == 4
    phase3 = logged_rows(run, [5, 6], ["web"])
    assert all(name == "web" for s in (5, 6) for name, *_ in phase3[s])
    # Without the flag, the same config resumes (nothing left to train: the check only): the
    # parked source is carried in the checkpoint's fingerprint, so it is not a change.
    assert train_mod.train(compose_run(run, 6, {"web": 1.0}))["start_step"] == 6
    c = compose_run(run, 8, {"code": 1.0, "web": 1.0}, flag)
    assert train_mod.train(c)["start_step"] == 6
    phase4 = logged_rows(run, [7, 8], ["code", "web"])
    assert any(name == "code" for s in (7, 8) for name, *_ in phase4[s])
    assert_rows_continue(c, [phase1, phase2, phase3, phase4])


@pytest.mark.slow
def test_train_reweights_on_another_host_count(tmp_path):
    """2 processes (real jax.distributed) run 2 steps; 1 process resumes with other weights:
    each source's rows continue exactly."""
    import subprocess
    import sys

    import train as train_mod
    from tests.data_helpers import REPO
    from tests.run_helpers import env_for, free_port
    run = tmp_path / "run"
    run.mkdir()
    port = free_port()
    cli = [sys.executable, os.path.join(REPO, "train.py"), f"hydra.run.dir={run}", "train.steps=2", *TRAIN_OVERRIDES,
           f"distributed.coordinator_address=localhost:{port}", "distributed.num_processes=2",
           "distributed.local_device_count=2"]
    procs = [forked.Popen(cli + [f"distributed.process_id={i}"], cwd=run, env=env_for(2),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outs = [p.communicate(timeout=400)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    phase1 = logged_rows(run, [1, 2], ["web", "code"])
    c = compose_run(run, 4, {"web": 0.5, "code": 0.5}, "data.mixture_change=continue",
                    f"checkpoint.dir={run}/checkpoints")
    assert train_mod.train(c)["start_step"] == 2
    phase2 = logged_rows(run, [3, 4], ["web", "code"])
    for s in (3, 4):
        assert abs(sum(name == "code" for name, *_ in phase2[s]) - 8) <= 2
    assert_rows_continue(c, [phase1, phase2])


def test_listing_keeps_kept_sources_and_parks_dropped_ones(tmp_path):
    """The run's listing on resume (data/listing.py run_listing): a kept source reuses the
    checkpoint's list (files added since are not read: its saved position refers to that list),
    an added source is listed, a dropped one's patterns and files are kept for when it is
    listed again."""
    write_sources(tmp_path)
    pattern = {n: [os.path.join(str(tmp_path), n, "*", "*")] for n in SRC}
    listed = {n: data.list_paths(p).files for n, p in pattern.items()}
    saved = {"paths": {"web": pattern["web"], "books": pattern["books"]}, "eval_paths": [],
             "train": {"web": listed["web"][:5], "books": listed["books"]}, "eval": []}
    got = data.run_listing(cfg_of(tmp_path, {"web": 1.0, "tiny": 1.0}).patterns(), [], saved)
    assert got["train"] == {"web": listed["web"][:5], "tiny": listed["tiny"]}
    assert got["parked"] == {"books": {"paths": pattern["books"], "files": listed["books"]}}
    # books listed again: its parked files, web still the saved list; tiny parked in turn
    again = data.run_listing(cfg_of(tmp_path, {"books": 1.0, "web": 1.0}).patterns(), [], got)
    assert again["train"] == {"books": listed["books"], "web": listed["web"][:5]}
    assert again["parked"] == {"tiny": {"paths": pattern["tiny"], "files": listed["tiny"]}}

"""RedPajama-v2's quality signals and duplicates in the stream (data/readers/companions.py,
data/readers/quality.py): the documents handed out are exactly those a reference computed from
each document's markers keeps, each once, straight, resumed mid-epoch, on 2 hosts and resumed
on another host count; a deep restore seeks the signals file; every kind of bad input is counted
and named (lenient) or stops the run (strict); the selection is in the fingerprint and the stats;
data.dedup=fuzzy drops the rows of the conversion's fuzzy lists (the sample's, as fuzzy_dropped gives
them), refuses a missing data.fuzzy_lists or another threshold in one line, and a missing list is a
missing companion.

    pytest -n0 -q tests/test_data_quality.py
"""
from __future__ import annotations

import gzip
import json
import os
import random
import string

import numpy as np
import pytest

import data
from data.readers import companions, quality
from data.readers.sources import BadDataError, BadRecords, ShardReader
from tests.data_helpers import TOKENIZER, decode_doc_id, jround, rows_of, take, write_lines

N_FILES, DOCS = 4, 24


# ---------------------------------------------------------------- a marked RPv2-layout corpus
def _passing() -> dict:
    """Scores every gopher / c4 / rpv1 rule keeps."""
    s = {"rps_doc_word_count": 200, "rps_doc_mean_word_length": 5, "rps_doc_symbol_to_word_ratio": 0,
         "rps_doc_frac_lines_end_with_ellipsis": 0, "rps_doc_frac_no_alph_words": 0,
         "ccnet_nlines": 4, "rps_doc_num_sentences": 9, "rps_doc_ldnoobw_words": 0,
         "rps_doc_lorem_ipsum": 0, "rps_doc_curly_bracket": 0, "rps_doc_ml_wikiref_score": 0.9}
    s.update({f"rps_doc_frac_chars_top_{k}gram": 0.01 for k in (2, 3, 4)})
    s.update({f"rps_doc_frac_chars_dupe_{k}grams": 0.01 for k in range(5, 11)})
    return s


def marks(f: int, i: int) -> set[str]:
    """What document i of file f is marked as: the reference the selection must reproduce."""
    m = set()
    if i % 5 == 2:
        m.add("short")        # rps_doc_word_count 20
    if i % 7 == 3:
        m.add("bullets")      # every line starts with a bullet
    if (i + f) % 6 == 5:
        m.add("dup")          # listed in the duplicates file
    if i % 11 == 4:
        m.add("wikiref")      # rps_doc_ml_wikiref_score 0.1
    return m


def kept(f: int, i: int, rules=("short", "bullets", "dup")) -> bool:
    return not (marks(f, i) & set(rules))


def signals_of(f: int, i: int, lines: int = 4, pad: int = 0) -> dict:
    s = {k: [[0, 10, float(v)]] for k, v in _passing().items()}
    m = marks(f, i)
    if "short" in m:
        s["rps_doc_word_count"] = [[0, 10, 20.0]]
    if "wikiref" in m:
        s["rps_doc_ml_wikiref_score"] = [[0, 10, 0.1]]
    s["rps_lines_start_with_bulletpoint"] = [[k, k + 1, 1.0 if "bullets" in m else 0.0] for k in range(lines)]
    if pad:   # incompressible: a deep position in the text is deep in the .gz too
        s["padding"] = [[0, 1, "".join(random.Random(f * 100003 + i).choices(string.ascii_letters, k=pad))]]
    return s


def sig_line(rel: str, f: int, i: int, **kw) -> bytes:
    return json.dumps({"id": f"{rel}.json.gz/{i}", "id_int": (f << 24) | i, "metadata": {},
                       "quality_signals": signals_of(f, i, **kw)}).encode()


def write_rpv2(root, n_files=N_FILES, docs=DOCS, pad=0, words=6) -> list[str]:
    """root/documents/2023-06/000f/en_head.json.gz with its signals and duplicates files."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    paths = []
    for f in range(n_files):
        rel = f"2023-06/{f:04d}/en_head"
        doc = os.path.join(str(root), "documents", rel + ".json.gz")
        os.makedirs(os.path.dirname(doc), exist_ok=True)
        write_lines(doc, [json.dumps({"raw_content": f"doc {f}-{i} " + "word " * words}).encode()
                          for i in range(docs)])
        sp = companions.companion_path(doc, "signals")
        os.makedirs(os.path.dirname(sp), exist_ok=True)
        write_lines(sp, [sig_line(rel, f, i, pad=pad) for i in range(docs)])
        dp = companions.companion_path(doc, "duplicates")
        os.makedirs(os.path.dirname(dp), exist_ok=True)
        pq.write_table(pa.table({"doc_id": [f"{rel}.json.gz/{i}" for i in range(docs)
                                            if "dup" in marks(f, i)]}), dp)
        paths.append(doc)
    return paths


def qcfg(root, **kw):
    base = dict(paths=(os.path.join(str(root), "documents", "*", "*", "en_head.json.gz"),),
                tokenizer=TOKENIZER, seq_len=16, global_batch_size=4, num_workers=0, num_shards=4,
                shuffle_window=4, files_per_stream=2, seed=0,
                quality=["gopher", "rps_doc_word_count >= 30"], dedup="exact")
    base.update(kw)
    return data.DataConfig(**base)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("rpv2")
    write_rpv2(root)
    return root


def epoch0_docs(batches, n_files=N_FILES) -> dict:
    """{(file, line): tokens handed out} of epoch 0 (doc ids decoded)."""
    out = {}
    for _, did, _tok in rows_of(batches):
        for d in did.tolist():
            if d >= 0:
                e, f, line = decode_doc_id(d, n_files)
                if e == 0:
                    out[(f, line)] = out.get((f, line), 0) + 1
    return out


def reference() -> set:
    return {(f, i) for f in range(N_FILES) for i in range(DOCS) if kept(f, i)}


# The documents are ~9 tokens + EOS: one epoch of the kept ones is ~50 rows of 17 tokens.
STEPS = 40


# ---------------------------------------------------------------- rules and paths
def test_presets_rules_and_nulls():
    assert quality.parse(None) == ()
    both = quality.parse("gopher+c4")
    assert both[:len(quality.PRESETS["gopher"])] == tuple(f"gopher: {r}" for r in quality.PRESETS["gopher"])
    assert len(both) == len(quality.PRESETS["gopher"]) + len(quality.PRESETS["c4"])
    assert quality.parse(["rpv1", "rps_doc_word_count>=50"]) == (
        "rpv1: rps_doc_ml_wikiref_score >= 0.25", "rule: rps_doc_word_count>=50")
    with pytest.raises(ValueError, match="neither a preset"):
        quality.parse("gopher+c5")
    with pytest.raises(ValueError, match="cannot read the rule"):
        quality.Rule("rps_doc_word_count >>= 3", "")
    sig = {"ccnet_nlines": [[0, 9, 4.0]], "rps_lines_x": [[0, 1, 1.0], [2, 3, 0.0], [4, 5, 1.0], [6, 7, 1.0]]}
    assert quality.Rule("sum(rps_lines_x) / ccnet_nlines == 0.75", "").holds(sig)
    assert quality.Rule("frac(rps_lines_x) > 0.7", "").holds(sig)
    assert not quality.Rule("sum(rps_lines_x) < 3", "").holds(sig)
    with pytest.raises(ValueError, match="line-level"):
        quality.Rule("rps_lines_x < 3", "").holds(sig)
    sig["ccnet_nlines"] = [[0, 9, None]]
    with pytest.raises(quality.Null, match="ccnet_nlines"):
        quality.Rule("sum(rps_lines_x) / ccnet_nlines <= 0.9", "").holds(sig)
    with pytest.raises(quality.Null, match="absent"):
        quality.Rule("absent > 1", "").holds(sig)
    with pytest.raises(ValueError, match="data.dedup='fuzzy'.*conversion"):
        qcfg("/x", dedup="fuzzy")
    with pytest.raises(ValueError, match="data.sources\\[a\\].quality"):
        data.DataConfig(paths=(), sources=({"name": "a", "paths": ["x"], "weight": 1, "quality": "goph"},),
                        tokenizer=TOKENIZER, seq_len=8, global_batch_size=4)


def _rule_by_rule(rules: quality.Rules, sig: dict):
    """What Rules.first_failed must say: each Rule.holds in order (the verdict or the error)."""
    try:
        for r in rules.rules:
            if not r.holds(sig):
                return r.name
        return None
    except (quality.Null, ValueError) as e:
        return type(e), str(e)


def test_compiled_rules_judge_as_rule_by_rule():
    """Rules compiles its rules into one function (each score read once): on random signals,
    null and absent scores, line-level spans where one is expected, zero denominators and
    scores at the bounds, its verdict (or error) is the rules' own, taken one by one in order."""
    rng = random.Random(5)
    rules = quality.Rules(quality.parse(["gopher+c4+rpv1", "frac(rps_lines_x) > 0.25",
                                         "rps_doc_word_count / ccnet_nlines != 40"]))
    names = list(rules.signals)
    assert names[0] == "rps_doc_word_count" and "rps_lines_x" in names and len(set(names)) == len(names)
    verdicts = set()
    for _ in range(3000):
        sig = {n: [[0, 5, v]] for n, v in _passing().items()}
        sig["rps_lines_start_with_bulletpoint"] = sig["rps_lines_x"] = [[0, 1, 0.0], [1, 2, 1.0]]
        for n in rng.sample(names, 2):                     # two signals drawn anew
            pick = rng.random()
            if pick < 0.1:
                sig.pop(n, None)                           # absent
            elif n.startswith("rps_lines_"):
                sig[n] = [[0, 1, rng.choice([0.0, 1.0, None] if pick < 0.2 else [0.0, 1.0])]
                          for _ in range(rng.randrange(0, 6))]
            else:
                score = None if pick < 0.2 else rng.choice(
                    [0, 0.1, 0.16, 0.2, 0.25, 0.9, 3, 4, 10, 20, 50, rng.uniform(0, 1), rng.randrange(0, 400),
                     True, "0.15", "60", "n/a"])                # odd scores: the long way's
                span = [0, 5, score, 1] if pick > 0.95 else [0, 5, score]
                sig[n] = [span] * (2 if pick > 0.97 else 1) if pick < 0.99 else []
        want = _rule_by_rule(rules, sig)
        try:
            got = rules.first_failed(sig)
        except (quality.Null, ValueError) as e:
            got = type(e), str(e)
        assert got == want, sig
        verdicts.add(want if not isinstance(want, tuple) else want[0])
    # every kind of outcome was met: kept, dropped under several rules, Null, a multi-span value
    assert None in verdicts and quality.Null in verdicts and ValueError in verdicts
    assert len({v for v in verdicts if isinstance(v, str)}) >= 8
    # a well-formed document takes the short way; an odd one the long way, which judges it
    env = rules._check.__globals__
    long_way, calls = env["checked"], []
    env["checked"] = lambda s: calls.append(1) or long_way(s)
    well = {n: [[0, 5, v]] for n, v in _passing().items()}
    well["rps_lines_start_with_bulletpoint"] = well["rps_lines_x"] = [[0, 1, 0.0], [1, 2, 1.0]]
    assert rules.first_failed(well) is None and not calls
    with pytest.raises(quality.Null):
        rules.first_failed({**well, "rps_doc_word_count": [[0, 5, None]]})
    assert calls == [1]
    env["checked"] = long_way


def test_companion_paths_follow_the_documents_path():
    rp = "gs://b/rpv2/documents/2023-06/0000/en_head.json.gz"
    assert companions.companion_path(rp, "signals") == \
        "gs://b/rpv2/quality_signals/2023-06/0000/en_head.signals.json.gz"
    assert companions.companion_path(rp, "duplicates") == \
        "gs://b/rpv2/duplicates/2023-06/0000/en_head.duplicates.parquet"
    assert companions.companion_path(rp, "minhash", "/mnt/sig") == \
        "/mnt/sig/minhash/2023-06/0000/en_head.minhash.parquet"
    assert companions.companion_path("/repo/data/sample/0003/en_head.json.gz", "signals") == \
        "/repo/data/sample/quality_signals/0003/en_head.signals.json.gz"
    assert companions.row_of("2023-06/0000/en_head.json.gz/17") == 17


# ---------------------------------------------------------------- the selection in the stream
def read_epoch(root, n_files=N_FILES, quality_="gopher+rps_doc_word_count >= 30", dedup="exact",
               strict=False):
    """One epoch of one virtual shard holding every file, read by a ShardReader (no tokenizer):
    -> ({(file, line) handed out}, bad-record and drop counts, examples). Every file's row 0 is
    kept, so the first piece of epoch 1 comes before any of its drops."""
    paths = [os.path.join(str(root), "documents", "2023-06", f"{f:04d}", "en_head.json.gz")
             for f in range(n_files)]
    q = quality.parse(quality_.split("+", 1)[0]) + quality.parse(quality_.split("+", 1)[1:])
    bad = BadRecords(strict)
    r = ShardReader(paths, list(range(n_files)), n_files, 0, 0, 2, "raw_content", bad,
                    select=companions.Selection(q, dedup))
    got = set()
    while True:
        _, did, first, _ = r.next_piece()
        e, f, line = decode_doc_id(did, n_files)
        if e:
            break
        assert (f, line) not in got
        got.add((f, line))
    r.close()
    return got, bad.counts, bad.examples


def test_selection_is_the_reference_each_document_once_and_counted(corpus):
    it = data.make_host_iterator(qcfg(corpus), 0, 1, debug=True)
    got = epoch0_docs(take(it, STEPS))
    it.close()
    assert set(got) == reference()
    assert all(n >= 9 for n in got.values())   # each kept document whole: ~9 tokens + EOS
    docs, counts, examples = read_epoch(corpus)
    assert docs == reference() and not examples
    # counted under the first rule that drops it: dedup first, then the rules in order
    want = {"dedup: exact": sum("dup" in marks(f, i) for f, i in _all()),
            "gopher: rps_doc_word_count >= 50": sum("short" in marks(f, i) and "dup" not in marks(f, i)
                                                    for f, i in _all()),
            "gopher: sum(rps_lines_start_with_bulletpoint) / ccnet_nlines <= 0.9":
                sum(marks(f, i) & {"short", "dup", "bullets"} == {"bullets"} for f, i in _all())}
    assert counts == {f"dropped: {k}": v for k, v in want.items()}
    assert sum(counts.values()) + len(docs) == N_FILES * DOCS


def _all():
    return [(f, i) for f in range(N_FILES) for i in range(DOCS)]


def test_rpv1_and_a_plain_rule_select_their_own(corpus):
    it = data.make_host_iterator(qcfg(corpus, quality="rpv1", dedup=None), 0, 1, debug=True)
    assert set(epoch0_docs(take(it, STEPS + 10))) == {d for d in _all() if kept(*d, rules=("wikiref",))}
    it.close()


def test_resume_mid_epoch_is_exact_and_seeks_the_signals(corpus):
    c = qcfg(corpus)
    straight = take(data.make_host_iterator(c, 0, 1, debug=True), 20)
    it = data.make_host_iterator(c, 0, 1, debug=True)
    take(it, 9)       # inside each shard's second window: its start is mid-file
    st = jround(it.get_state())
    it.close()
    slots = [sl for sh in st["shards"].values() for sl in sh["start"]["reader"]["slots"]]
    assert slots and all(len(sl) == 7 and sl[6][0] > 0 for sl in slots)   # signals' [line, offset, point]
    again = data.make_host_iterator(c, 0, 1, debug=True)
    again.set_state(st)
    for k, b in enumerate(take(again, 11)):
        for key in b:
            np.testing.assert_array_equal(b[key], straight[9 + k][key], err_msg=f"batch {9 + k} {key}")
    again.close()


@pytest.mark.parametrize("P1,P2", [(2, 2), (1, 2)])
def test_two_hosts_and_another_host_count(corpus, P1, P2):
    """2 hosts hand out the reference between them; a 1-host state resumed on 2 hosts goes on
    with the 1-host run's batches (the hosts' batches side by side)."""
    c = qcfg(corpus)
    straight = take(data.make_host_iterator(c, 0, 1, debug=True), 2 * 6)
    states, before = [], []
    for h in range(P1):
        it = data.make_host_iterator(c, h, P1, debug=True)
        before.append(take(it, 6))
        states.append(jround(it.get_state()))
        it.close()
    merged = jround(data.merge_host_states(states))
    after = []
    for h in range(P2):
        it = data.make_host_iterator(c, h, P2, shard_states=merged, debug=True)
        after.append(take(it, 6))
        it.close()
    for step in range(12):
        hosts = [b[step] for b in before] if step < 6 else [a[step - 6] for a in after]
        for key in ("inputs", "doc_ids", "row_shard"):
            np.testing.assert_array_equal(np.concatenate([b[key] for b in hosts]), straight[step][key],
                                          err_msg=f"step {step} {key}")


def test_deep_restore_seeks_the_signals_file(tmp_path):
    """A signals file read past gzseek's free re-read holds a seek point in the state, and a
    reader restored from it (JSON round trip) goes on with the same documents."""
    write_rpv2(tmp_path, n_files=1, docs=900, pad=3000, words=1)   # ~2.8 MB of signals text
    doc = os.path.join(str(tmp_path), "documents", "2023-06", "0000", "en_head.json.gz")
    sel = companions.Selection(quality.parse("gopher"), "exact")

    def reader():
        return ShardReader([doc], [0], 1, 0, 0, 1, "raw_content", BadRecords(False), select=sel)

    r = reader()
    for _ in range(sum(kept(0, i) for i in range(800))):
        r.next_piece()
    st = jround(r.get_state())
    line, off, point = st["slots"][0][6]
    assert line == 800 and off > 2 << 20 and point is not None and point[3] <= off
    straight = [r.next_piece()[1] for _ in range(40)]
    r.close()
    again = reader()
    again.set_state(st)
    assert [again.next_piece()[1] for _ in range(40)] == straight
    again.close()
    assert all(kept(0, d & 0xFFFFFF) for d in straight)


def test_a_mixture_source_keeps_its_own_selection(corpus, tmp_path):
    plain = tmp_path / "plain" / "0000"
    os.makedirs(plain)
    write_lines(str(plain / "a.jsonl.gz"), [json.dumps({"text": f"plain {i} " + "x " * 5}).encode()
                                            for i in range(16)])
    c = qcfg(corpus, paths=(), quality=None, dedup=None, sources=(
        {"name": "rp", "paths": list(qcfg(corpus).paths), "weight": 1, "quality": "gopher", "dedup": "exact"},
        {"name": "plain", "paths": [str(tmp_path / "plain" / "*" / "*.gz")], "weight": 1, "text_key": "text"}))
    pf = data.make_host_iterator(c, 0, 1)
    take(pf, 12)
    st = pf.get_state()
    pf.close()
    from data.pipeline import consumed_figures
    figs = consumed_figures(st, data.make_host_iterator(c, 0, 1).get_state())
    assert figs["dropped_documents"] > 0 and figs["source/rp/dropped_documents"] == figs["dropped_documents"]
    assert figs["source/plain/dropped_documents"] == 0 and not figs["bad_records"]


def test_the_selection_is_in_the_fingerprint(corpus):
    fp = data.fingerprint(qcfg(corpus))
    assert fp["dedup"] == "exact" and "rule: rps_doc_word_count >= 30" in fp["quality"]
    assert data.fingerprint(qcfg(corpus, quality="gopher"))["quality"] != fp["quality"]
    assert not {"quality", "dedup", "companions"} & set(data.fingerprint(qcfg(corpus, quality=None, dedup=None)))


def test_stats_metrics_and_the_summary_line(corpus):
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from model.runtime.meters import skipped_line
    sh = NamedSharding(Mesh(np.array(jax.devices()[:4]), ("data",)), P("data"))
    pf = data.DevicePrefetcher(data.make_host_iterator(qcfg(corpus), 0, 1), sh)
    for _ in range(10):
        next(pf)
    s = pf.stats()
    pf.close()
    assert s["dropped_documents"] == sum(s["dropped_by_rule"].values()) > 0
    assert "dedup: exact" in s["dropped_by_rule"] and not s["bad_records"]
    line = skipped_line([{k: s[k] for k in ("bad_records", "bad_examples", "dropped_by_rule")}] * 2)
    assert line.startswith(f"Dropped {2 * s['dropped_documents']} document(s)") and "dedup: exact" in line


# ---------------------------------------------------------------- bad input
def _damage(root, kind) -> tuple[str, int]:
    """One damaged companion of file 0001 -> (the path named, its line)."""
    doc = os.path.join(str(root), "documents", "2023-06", "0001", "en_head.json.gz")
    sp = companions.companion_path(doc, "signals")
    rel = "2023-06/0001/en_head"
    lines = [sig_line(rel, 1, i) for i in range(DOCS)]
    if kind == "missing_signals":
        os.remove(sp)
        return sp, 0
    if kind == "missing_duplicates":
        dp = companions.companion_path(doc, "duplicates")
        os.remove(dp)
        return dp, 0
    if kind == "signals_row_mismatch":
        lines[2] = sig_line(rel, 1, 7)
    elif kind == "malformed_signals":
        lines[2] = b'{"id": "2023-06/0001/en_head.json.gz/2", "quality'
    elif kind == "null_signal":
        rec = json.loads(lines[2])
        rec["quality_signals"]["rps_doc_word_count"] = [[0, 10, None]]
        lines[2] = json.dumps(rec).encode()
    write_lines(sp, lines)
    return sp, 3


BAD = {"missing_signals": "missing_companion", "missing_duplicates": "missing_companion",
       "signals_row_mismatch": "signals_row_mismatch", "malformed_signals": "malformed_signals",
       "null_signal": "null_signal"}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_lenient_and_strict(tmp_path, case):
    write_rpv2(tmp_path, n_files=2)
    path, line = _damage(tmp_path, case)
    kind = BAD[case]
    docs, counts, examples = read_epoch(tmp_path, n_files=2)
    ref = {d for d in reference() if d[0] < 2}
    if line == 0:   # a missing file: none of its documents is handed out, each counted, named once
        assert docs == {d for d in ref if d[0] == 0}
        assert counts[kind] == (DOCS if "duplicates" in case else
                                sum("dup" not in marks(1, i) for i in range(DOCS)))
    else:           # one document without usable signals: not handed out, whatever its marks
        assert docs == ref - {(1, 2)} and counts[kind] == 1
    assert examples == [f"{path}:{line}: {kind}" + examples[0].split(kind, 1)[1]]
    with pytest.raises(BadDataError, match=f"{path}:{line}: {kind}"):
        read_epoch(tmp_path, n_files=2, strict=True)
    # and through the pipeline (the run's data.strict)
    c = qcfg(tmp_path, num_shards=1, global_batch_size=2, strict=True)
    strict = data.make_host_iterator(c, 0, 1)
    with pytest.raises(BadDataError, match=f"{path}:{line}: {kind}"):
        take(strict, STEPS)
    strict.close()


def test_the_sample_ships_its_companions():
    """data/sample's companion files (scripts/make_sample_companions.py) line up with its documents."""
    from tests.data_helpers import REPO
    doc = os.path.join(REPO, "data", "sample", "0003", "en_head.json.gz")
    with gzip.open(companions.companion_path(doc, "signals")) as f:
        recs = [json.loads(x) for x in f]
    with gzip.open(doc) as f:
        n = sum(1 for _ in f)
    assert len(recs) == n and [companions.row_of(r["id"]) for r in recs] == list(range(n))
    rules = quality.Rules(quality.parse("gopher+c4+rpv1"))
    assert all(rules.first_failed(r["quality_signals"]) in (None, *rules_names(rules)) for r in recs)
    assert companions.duplicate_rows(companions.companion_path(doc, "duplicates")) == set()
    import pyarrow.parquet as pq
    mh = pq.read_table(companions.companion_path(doc, "minhash"))
    assert mh.num_rows == n and len(mh.column("signature_sim0.8")[0]) == 9


def rules_names(rules):
    return [r.name for r in rules.rules]


@pytest.mark.slow
def test_input_workers_hand_out_the_same_selection(corpus):
    """The selection is made inside the worker processes: the same batches as in-process."""
    inproc = take(data.make_host_iterator(qcfg(corpus), 0, 1, debug=True), 8)
    it = data.make_host_iterator(qcfg(corpus, num_workers=1), 0, 1, debug=True)
    for k, b in enumerate(take(it, 8)):
        np.testing.assert_array_equal(b["doc_ids"], inproc[k]["doc_ids"], err_msg=f"batch {k}")
    it.close()


def test_companions_at_a_url(tmp_path):
    """Documents at an object-store URL (fsspec's memory://, as gs:// is read): their companions
    are found and read at the same URL root; a missing one is named by its URL."""
    import fsspec
    write_rpv2(tmp_path, n_files=2)
    fs = fsspec.filesystem("memory")
    for p in tmp_path.rglob("*"):
        if p.is_file():
            fs.pipe(f"memory://rp56/{p.relative_to(tmp_path)}", p.read_bytes())
    missing = "memory://rp56/quality_signals/2023-06/0001/en_head.signals.json.gz"
    fs.rm(missing)
    try:
        paths = [f"memory://rp56/documents/2023-06/{f:04d}/en_head.json.gz" for f in range(2)]
        bad = BadRecords(False)
        r = ShardReader(paths, [0, 1], 2, 0, 0, 2, "raw_content", bad,
                        select=companions.Selection(quality.parse("gopher"), "exact"))
        got = set()
        while True:
            e, f, line = decode_doc_id(r.next_piece()[1], 2)
            if e:
                break
            got.add((f, line))
        r.close()
        assert got == {d for d in reference() if d[0] == 0}
        assert bad.examples == [f"{missing}:0: missing_companion (no signals file)"]
    finally:
        fs.rm("memory://rp56", recursive=True)


# ---------------------------------------------------------------- the converter (scripts/prepare_data.py)
def _parts(out) -> list[list[list[int]]]:
    from array_record.python.array_record_module import ArrayRecordReader
    m = json.load(open(os.path.join(out, "manifest.json")))
    got = []
    for f in m["files"]:
        r = ArrayRecordReader(os.path.join(out, f["file"]))
        got.append([np.frombuffer(x, m["dtype"]).tolist() for x in r.read_all()])
        r.close()
    return got


def _texts(root, f, rows):
    doc = os.path.join(str(root), "documents", "2023-06", f"{f:04d}", "en_head.json.gz")
    with gzip.open(doc) as fh:
        lines = [json.loads(x)["raw_content"] for x in fh]
    return [lines[i] for i in rows]


def test_converter_keeps_what_the_stream_keeps(corpus, tmp_path):
    from tests.data_helpers import convert, expected_tokens
    out = str(tmp_path / "tok")
    convert(os.path.join(str(corpus), "documents", "*", "*", "en_head.json.gz"), out,
            "--quality", "gopher", "rps_doc_word_count >= 30", "--dedup", "exact")
    eos = expected_tokens("")[-1]
    for f, docs in enumerate(_parts(out)):
        rows = [i for i in range(DOCS) if kept(f, i)]
        assert docs == [expected_tokens(t)[:-1] for t in _texts(corpus, f, rows)], f"file {f}"
        assert eos not in sum(docs, [])
    m = json.load(open(os.path.join(out, "manifest.json")))
    assert m["selection"]["dedup"] == "exact" and m["documents"] == len(reference())
    assert m["dropped"]["dedup: exact"] == sum("dup" in marks(f, i) for f, i in _all())
    assert sum(m["dropped"].values()) + m["documents"] == N_FILES * DOCS and not m["bad_records"]
    with pytest.raises(SystemExit, match="other selection"):   # another selection, the same --out
        convert(os.path.join(str(corpus), "documents", "*", "*", "en_head.json.gz"), out, "--quality", "c4")


def test_converter_fuzzy_dedup_on_known_band_collisions(tmp_path):
    """Band hashes collide at the same position -> the larger id_int goes; the same hash at
    another position, or another threshold's column, is no collision."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests.data_helpers import convert, expected_tokens
    write_rpv2(tmp_path, n_files=2, docs=4)
    h = [bytes([k]) * 8 for k in range(40)]
    bands = {   # (file, row): (id_int, sim0.8 bands, sim0.7 bands)
        (0, 0): (5, [h[1], h[2]], [h[30]]), (0, 1): (9, [h[3], h[2]], [h[31]]),    # 9 shares band 1 with 5
        (0, 2): (2, [h[4], h[1]], [h[32]]), (0, 3): (7, [h[5], h[6]], [h[30]]),    # h1 at another position; 0.7 only
        (1, 0): (1, [h[5], h[7]], [h[33]]), (1, 1): (8, [h[8], h[9]], [h[34]]),    # 1 < 7: (0, 3) goes
        (1, 2): (3, [h[10], h[11]], [h[35]]), (1, 3): (4, [h[10], h[12]], [h[36]]),  # 3 < 4: (1, 3) goes
    }
    for f in range(2):
        doc = os.path.join(str(tmp_path), "documents", "2023-06", f"{f:04d}", "en_head.json.gz")
        mp = companions.companion_path(doc, "minhash")
        os.makedirs(os.path.dirname(mp), exist_ok=True)
        rows = [bands[(f, i)] for i in range(4)]
        pq.write_table(pa.table({
            "id": [f"2023-06/{f:04d}/en_head.json.gz/{i}" for i in range(4)],
            "id_int": pa.array([r[0] for r in rows], pa.int64()),
            "signature_sim0.8": pa.array([r[1] for r in rows], pa.list_(pa.binary())),
            "signature_sim0.7": pa.array([r[2] for r in rows], pa.list_(pa.binary()))}), mp)
    out = str(tmp_path / "tok")
    convert(os.path.join(str(tmp_path), "documents", "*", "*", "en_head.json.gz"), out, "--dedup", "fuzzy")
    want = {0: [0, 2], 1: [0, 1, 2]}
    for f, docs in enumerate(_parts(out)):
        assert docs == [expected_tokens(t)[:-1] for t in _texts(tmp_path, f, want[f])], f"file {f}"
    m = json.load(open(os.path.join(out, "manifest.json")))
    assert m["dropped"] == {"dedup: fuzzy": 3} and m["selection"]["dedup_threshold"] == "0.8"
    out7 = str(tmp_path / "tok7")   # at 0.7 only (0, 0) and (0, 3) share a band: 7 > 5 goes
    convert(os.path.join(str(tmp_path), "documents", "*", "*", "en_head.json.gz"), out7, "--dedup", "fuzzy",
            "--dedup-threshold", "0.7")
    assert json.load(open(os.path.join(out7, "manifest.json")))["dropped"] == {"dedup: fuzzy": 1}
    assert [len(d) for d in _parts(out7)] == [3, 4]
    # the lists beside the parts: JSON, threshold and source recorded, the stream drops the same rows
    docs = [os.path.join(str(tmp_path), "documents", "2023-06", f"{f:04d}", "en_head.json.gz") for f in range(2)]
    lists = [companions.companion_path(d, "fuzzy", out) for d in docs]
    assert [json.load(open(p)) for p in lists] == [
        {"rows": [1, 3], "source": "0000/en_head.json.gz", "threshold": "0.8"},
        {"rows": [3], "source": "0001/en_head.json.gz", "threshold": "0.8"}]
    assert json.load(open(companions.companion_path(docs[0], "fuzzy", out7)))["rows"] == [3]
    got, counts, _ = read_files(docs, companions.Selection((), "fuzzy", None, out, "0.8"))
    assert got == {(f, r) for f in range(2) for r in want[f]} and counts == {"dropped: dedup: fuzzy": 3}
    before = {p: open(p, "rb").read() for p in lists}   # idempotent: a re-run leaves the same bytes
    os.remove(os.path.join(out, "done", "part-000001.json"))
    os.remove(lists[1])
    convert(os.path.join(str(tmp_path), "documents", "*", "*", "en_head.json.gz"), out, "--dedup", "fuzzy")
    assert {p: open(p, "rb").read() for p in lists} == before


# ---------------------------------------------------------------- fuzzy dedup's lists in the stream
SAMPLE_DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "sample",
                           "*", "en_head.json.gz")


@pytest.fixture(scope="module")
def sample_lists(tmp_path_factory):
    """The fuzzy lists of the bundled sample at 0.8, as scripts/prepare_data.py --dedup fuzzy writes
    them beside its parts (the converter's own naming and bytes, without tokenizing: that part is
    test_converter_fuzzy_dedup_on_known_band_collisions') -> (--out, files, fuzzy_dropped's result)."""
    import glob

    from data.convert.fuzzy import fuzzy_dropped
    out = tmp_path_factory.mktemp("fuzzy_out")
    files = sorted(glob.glob(SAMPLE_DOCS))
    mem = fuzzy_dropped(files, "0.8")
    assert None not in mem and sum(map(len, mem.values())) == 3   # the sample's 3 near-duplicates
    for f in files:
        p = out / companions.rel_name(f, "fuzzy")
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(companions.fuzzy_list_text(os.path.relpath(f, os.path.dirname(os.path.dirname(f))),
                                                "0.8", mem[f]))
    (out / "job.json").write_text(json.dumps({"selection": {"dedup": "fuzzy", "dedup_threshold": "0.8"}}))
    return str(out), files, mem


def read_files(paths, select, strict=False):
    """One epoch of one virtual shard of `paths` (every file's row 0 kept) -> ({(file, row)}, counts, examples)."""
    bad = BadRecords(strict)
    r = ShardReader(paths, list(range(len(paths))), len(paths), 0, 0, 2, "raw_content", bad, select=select)
    got = set()
    while True:
        _, did, _, _ = r.next_piece()
        e, f, line = decode_doc_id(did, len(paths))
        if e:
            break
        got.add((f, line))
    r.close()
    return got, bad.counts, bad.examples


def _rows(path):
    with gzip.open(path) as fh:
        return sum(1 for _ in fh)


def test_stream_fuzzy_drops_the_conversions_rows_and_counts_them(sample_lists):
    out, files, mem = sample_lists
    cfg = qcfg("/x", paths=(SAMPLE_DOCS,), quality=None, dedup="exact,fuzzy", fuzzy_lists=out)
    data.config.check_fuzzy_lists(cfg)
    from data.pipeline import stream_spec
    from data.tokenizer import load_tokenizer
    spec = stream_spec(cfg, 0, 1, files, load_tokenizer(TOKENIZER))   # what each shard's reader gets
    assert (spec.dedup, spec.fuzzy_lists, spec.dedup_threshold) == ("exact,fuzzy", out, "0.8")
    got, counts, examples = read_files(files, companions.Selection(
        spec.quality, spec.dedup, spec.companions or None, spec.fuzzy_lists, spec.dedup_threshold))
    want = {(k, r) for k, f in enumerate(files) for r in range(_rows(f)) if r not in mem[f]}
    assert got == want and not examples   # the sample has no exact duplicates
    assert counts == {"dropped: dedup: fuzzy": 3}
    # in the fingerprint, only with fuzzy
    fp = data.fingerprint(cfg)
    assert fp["dedup"] == "exact,fuzzy" and fp["fuzzy_lists"] == out and fp["dedup_threshold"] == "0.8"
    assert "fuzzy_lists" not in data.fingerprint(qcfg("/x", paths=(SAMPLE_DOCS,), quality=None))


def test_fuzzy_without_its_lists_or_at_another_threshold_is_one_line(sample_lists, tmp_path):
    out = sample_lists[0]
    with pytest.raises(ValueError, match=r"data.dedup='fuzzy' .*prepare_data.py .*--dedup fuzzy.*"
                                         r"data.fuzzy_lists=DIR$"):
        qcfg("/x", dedup="fuzzy")
    for t in (0.9, "0.9"):
        with pytest.raises(ValueError, match=r"^data.dedup_threshold=0.9 but data.fuzzy_lists=.* "
                                             r"--dedup-threshold 0.8: [^\n]*$"):
            data.config.check_fuzzy_lists(qcfg("/x", dedup="fuzzy", fuzzy_lists=out, dedup_threshold=t))
    with pytest.raises(ValueError, match=r"^data.fuzzy_lists=.* holds no conversion with --dedup fuzzy"):
        data.config.check_fuzzy_lists(qcfg("/x", dedup="fuzzy", fuzzy_lists=str(tmp_path)))
    with pytest.raises(ValueError, match=r"data.dedup_threshold=0.75: must be one of"):
        qcfg("/x", dedup="fuzzy", fuzzy_lists=out, dedup_threshold=0.75)
    # a list at another threshold (job.json says the run's): its file is refused naming both
    files = sample_lists[1][:1]
    with pytest.raises(ValueError, match=r"data.dedup_threshold=0.9 but .*en_head.fuzzy.json was written at "
                                         r"--dedup-threshold 0.8"):
        read_files(files, companions.Selection((), "fuzzy", None, out, "0.9"))


def test_a_missing_fuzzy_list_is_lenient_or_strict(sample_lists, tmp_path):
    import shutil
    src, files, mem = sample_lists
    out = str(tmp_path / "out")
    shutil.copytree(src, out)
    files = files[:2]
    gone = companions.companion_path(files[1], "fuzzy", out)
    os.remove(gone)
    sel = companions.Selection((), "fuzzy", None, out, "0.8")
    got, counts, examples = read_files(files, sel)
    assert got == {(0, r) for r in range(_rows(files[0])) if r not in mem[files[0]]}
    assert counts == {"missing_companion": _rows(files[1])}   # each of its documents, named once
    assert examples == [f"{gone}:0: missing_companion (no fuzzy dedup list)"]
    with pytest.raises(BadDataError, match=f"{gone}:0: missing_companion"):
        read_files(files, sel, strict=True)


@pytest.mark.slow
def test_a_process_that_read_the_parquet_companions_exits_zero():
    """pyarrow 25 reading a Parquet file through a Python file object sometimes aborted the
    interpreter at exit ("terminate called without an active exception", exit 134: 4 of 4 runs of
    this snippet before data/readers/formats.py read_parquet_columns): a finished conversion or
    run must not end as a crash its launcher restarts."""
    import subprocess
    import sys

    snippet = ("import glob; from data.convert.fuzzy import fuzzy_dropped; from data.readers import companions\n"
               "files = sorted(glob.glob('data/sample/*/en_head.json.gz'))\n"
               "assert sum(map(len, fuzzy_dropped(files, '0.8').values())) == 3\n"
               "companions.duplicate_rows(companions.companion_path(files[0], 'duplicates'))\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    codes = [subprocess.run([sys.executable, "-c", snippet], cwd=root, capture_output=True, text=True,
                            timeout=120) for _ in range(3)]
    assert [r.returncode for r in codes] == [0, 0, 0], [r.stderr[-500:] for r in codes]


@pytest.mark.slow
def test_train_py_drops_the_fuzzy_duplicates_as_the_docs_write_the_command(sample_lists, tmp_path):
    """`python train.py ... 'data.dedup=[exact,fuzzy]' data.fuzzy_lists=DIR` (docs/data.md,
    docs/tokenize-at-scale.md; unquoted `exact,fuzzy` is a Hydra sweep, tests/test_docs.py) end to
    end: the sample file whose row 42 is a near-duplicate drops it within 6 steps, counted."""
    import sys

    from tests import forked
    from tests.run_helpers import MICRO, ROOT, env_for, read_metrics

    out = sample_lists[0]
    r = forked.run([sys.executable, str(ROOT / "train.py"), f"hydra.run.dir={tmp_path}", *MICRO, "train.steps=6",
                    "train.log_every=3", "data.num_workers=0", "logger.wandb.mode=disabled",
                    "logger.progress_bar=false", "data.eval.holdout_files=0", "train.eval_every=0",
                    "data.paths=[${project_root:}/data/sample/0007/en_head.json.gz]",
                    "data.dedup=[exact,fuzzy]", f"data.fuzzy_lists={out}"],
                   cwd=tmp_path, env=env_for(0), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "Dropped 1 document(s) in this start (data.quality / data.dedup): dedup: fuzzy 1" in r.stdout
    rows = read_metrics(tmp_path)
    assert [row["data/dropped/dedup: fuzzy"] for row in rows if "loss" in row][-1] == 1   # a running count
    assert 42 in sample_lists[2][next(f for f in sample_lists[2] if f and "0007" in f)]

"""Exactly-once per epoch, packing layout, determinism, configuration errors."""
import os
import time

import numpy as np
import pytest

import data
from data.tokenizer import load_tokenizer
from tests.data_helpers import TOKENIZER, cfg, decode_doc_id, doc_tokens, rows_of, take, write_corpus

TOK = load_tokenizer(TOKENIZER)
EOS = TOK.token_to_id("</s>")
BOS = TOK.token_to_id("<s>")


def expected_tokens(text, bos=False):
    ids = TOK.encode(text, add_special_tokens=False).ids
    return ([BOS] if bos else []) + ids + [EOS]


def run_hosts(c, P, n_batches):
    rows = []
    for h in range(P):
        it = data.make_host_iterator(c, h, P, debug=True)
        rows += rows_of(take(it, n_batches))
    return rows


@pytest.mark.slow
@pytest.mark.parametrize("P", [1, 2, 4])
@pytest.mark.parametrize("packing", ["concat", "first_fit"])
def test_exactly_once_per_epoch(tmp_path, P, packing):
    texts = write_corpus(tmp_path, n_files=8, docs_per_file=10,
                         long_doc_chars=110_000 if P == 1 else 0)
    files = sorted({p for p, _ in texts})
    c = cfg(tmp_path, num_shards=8, packing=packing, global_batch_size=8)
    per_shard = [0] * 8
    for (path, _), t in texts.items():
        per_shard[files.index(path) % 8] += len(expected_tokens(t))
    # Enough rows for every shard (the biggest holds the long document) to pass epoch 1:
    # every global batch takes 1 row of each of the 8 shards (global_batch_size / num_shards).
    n_epochs = 2
    rows_needed = int((n_epochs + 0.6) * max(per_shard) / 33) + 2 * 8 + 16
    n_batches = rows_needed + 1
    rows = run_hosts(c, P, n_batches)
    docs = doc_tokens(rows, len(files))
    epochs = {}
    for (e, f, line), toks in docs.items():
        epochs.setdefault(e, {})[(files[f], line + 1)] = toks
    assert max(epochs) >= n_epochs
    for e in range(n_epochs):
        got = epochs[e]
        assert set(got) == set(texts), f"epoch {e}: documents missing or extra"
        for key, toks in got.items():
            exp = expected_tokens(texts[key])
            if len(texts[key]) > 100_000:   # tokenized in pieces: lengths may differ a bit
                assert abs(len(toks) - len(exp)) < 50 and toks[-1] == EOS or EOS in toks
                continue
            assert sorted(toks) == sorted(exp), f"epoch {e} doc {key}: read != once"


@pytest.mark.parametrize("packing", ["concat", "first_fit"])
def test_segments_positions_loss_mask(tmp_path, packing):
    texts = write_corpus(tmp_path, n_files=4, docs_per_file=10)
    files = sorted({p for p, _ in texts})
    c = cfg(tmp_path, num_shards=4, packing=packing, shuffle_window=0, seq_len=48)
    batches = take(data.make_host_iterator(c, 0, 1, debug=True), 30)
    for b in batches:
        for k in ("inputs", "targets", "segment_ids", "positions", "loss_mask"):
            assert b[k].dtype == np.int32 and b[k].shape == (4, 48)
        np.testing.assert_array_equal(b["inputs"][:, 1:], b["targets"][:, :-1])
        did = b["doc_ids"]
        for r in range(4):
            seg, pos, lm = b["segment_ids"][r], b["positions"][r], b["loss_mask"][r]
            d = did[r, :-1]
            real = d >= 0
            if packing == "concat":
                assert real.all(), "concat never pads"
            else:
                # padding only at the end of the row
                assert not (np.diff(real.astype(int)) > 0).any()
            assert (seg[~real] == 0).all() and (pos[~real] == 0).all()
            # a new segment exactly where the document changes; positions restart there
            starts = np.r_[True, d[1:] != d[:-1]] & real
            np.testing.assert_array_equal(seg[real], np.cumsum(starts)[real])
            expect_pos = np.zeros_like(pos)
            for t in range(1, len(d)):
                expect_pos[t] = 0 if starts[t] else expect_pos[t - 1] + 1
            np.testing.assert_array_equal(pos[real], expect_pos[real])
            # loss only where the target continues the same document
            same = (did[r, 1:] == did[r, :-1]) & real
            np.testing.assert_array_equal(lm, same.astype(np.int32))
    # no shuffle: per shard, the concatenated rows spell each document exactly (+EOS)
    rows = rows_of(batches)
    per_doc = doc_tokens(rows, len(files))
    complete = 0
    for (_e, f, line), toks in per_doc.items():
        exp = expected_tokens(texts[(files[f], line + 1)])
        if packing == "first_fit" and len(exp) <= 49:
            assert toks == exp, "short documents stay whole in first_fit"
        if toks == exp:
            complete += 1
        else:
            assert exp[:len(toks)] == toks or exp[-len(toks):] == toks
    assert complete >= 5


def test_bos_option(tmp_path):
    write_corpus(tmp_path, n_files=2, docs_per_file=5)
    c = cfg(tmp_path, num_shards=2, shuffle_window=0, add_bos=True)
    b = next(data.make_host_iterator(c, 0, 1, debug=True))
    starts = (b["positions"] == 0) & (b["segment_ids"] > 0)
    # every document start that is a real document start carries BOS
    first_col = b["inputs"][:, 0]
    assert first_col[0] == BOS
    assert (b["inputs"][starts] == BOS).sum() >= 1


def test_determinism_by_seed(tmp_path):
    write_corpus(tmp_path, n_files=4, docs_per_file=10)
    a = take(data.make_host_iterator(cfg(tmp_path, seed=3), 0, 1), 12)
    b = take(data.make_host_iterator(cfg(tmp_path, seed=3), 0, 1), 12)
    d = take(data.make_host_iterator(cfg(tmp_path, seed=4), 0, 1), 12)
    for x, y in zip(a, b, strict=False):
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])
    assert any(not np.array_equal(x["inputs"], y["inputs"]) for x, y in zip(a, d, strict=False))


def test_epochs_change_file_order(tmp_path):
    from data.readers.sources import epoch_file_order
    orders = {tuple(epoch_file_order(20, 0, 1, e)) for e in range(5)}
    assert len(orders) > 1


def test_file_formats(tmp_path):
    import json

    from tests.data_helpers import write_lines
    os.makedirs(tmp_path / "a")
    recs = [json.dumps({"text": f"unique document {i} " + "word " * i}).encode()
            for i in range(1, 7)]
    write_lines(str(tmp_path / "a" / "x.jsonl"), recs[:2])
    write_lines(str(tmp_path / "a" / "y.jsonl.zst"), recs[2:4])
    write_lines(str(tmp_path / "a" / "z.json.gz"), recs[4:])
    c = cfg(tmp_path, paths=(str(tmp_path / "a" / "*"),), num_shards=3, text_key="text",
            shuffle_window=0, global_batch_size=3)
    files = data.list_files(c)
    assert [os.path.basename(f) for f in files] == ["x.jsonl", "y.jsonl.zst", "z.json.gz"]
    rows = rows_of(take(data.make_host_iterator(c, 0, 1, debug=True), 20))
    docs = doc_tokens(rows, 3)
    seen = {(f, line) for (e, f, line) in docs if e == 0}
    assert seen == {(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)}


@pytest.mark.slow
def test_validate_errors(tmp_path):
    write_corpus(tmp_path, n_files=4, docs_per_file=2)
    c = cfg(tmp_path)
    data.validate(c, 1, 8)
    with pytest.raises(ValueError, match="data.paths"):
        data.validate(cfg(tmp_path, paths=(str(tmp_path / "nope*.gz"),)), 1, 1)
    with pytest.raises(ValueError, match="tokenizer.path"):
        data.validate(cfg(tmp_path, tokenizer=str(tmp_path / "missing.json")), 1, 1)
    with pytest.raises(ValueError, match="global_batch_size"):
        data.validate(cfg(tmp_path, global_batch_size=6), 4, 1)
    with pytest.raises(ValueError, match="data.packing"):
        data.validate(cfg(tmp_path, packing="best"), 1, 1)
    with pytest.raises(ValueError, match="data.num_shards=4 is smaller"):
        data.validate(cfg(tmp_path, num_workers=2, global_batch_size=8), 4, 1)
    data.validate(cfg(tmp_path, num_shards=8, global_batch_size=8), 1, 1)  # files split
    with pytest.raises(ValueError, match="must divide data.global_batch_size"):
        data.validate(cfg(tmp_path, num_shards=3), 1, 1)
    with pytest.raises(ValueError, match="split evenly over 3 hosts"):
        data.validate(cfg(tmp_path, num_shards=4, global_batch_size=12), 3, 1)
    with pytest.raises(FileNotFoundError, match="tokenizer.path"):
        data.load_tokenizer(str(tmp_path / "nothing" / "tokenizer.json"))
    with pytest.raises(ValueError, match="data.worker_nice=25: must be an integer from 0 to 19"):
        data.validate(cfg(tmp_path, worker_nice=25), 1, 1)


def test_from_mapping_and_fingerprint(tmp_path):
    write_corpus(tmp_path, n_files=4, docs_per_file=2)
    c = cfg(tmp_path)
    m = {"paths": list(c.paths), "tokenizer": c.tokenizer, "seq_len": 32,
         "global_batch_size": 4, "num_shards": 4}
    c2 = data.DataConfig.from_mapping(m)
    assert c2.paths == c.paths and c2.num_shards == 4
    with pytest.raises(ValueError, match="bogus"):
        data.DataConfig.from_mapping({**m, "bogus": 1})
    fp = data.fingerprint(c)
    assert fp == data.fingerprint(c)
    assert fp["seq_len"] == 32 and len(fp["tokenizer"]) == 16
    assert data.fingerprint(cfg(tmp_path, seed=9)) != fp


def test_first_fit_reports_padding(tmp_path):
    write_corpus(tmp_path, n_files=4, docs_per_file=10)
    it = data.make_host_iterator(cfg(tmp_path, packing="first_fit"), 0, 1)
    for _ in range(5):
        next(it)
    from data.pipeline import state_counters
    c = state_counters(it.get_state())
    assert c["rows"] == 20 and c["pad"] > 0
    assert c["pad"] + c["tokens"] == 20 * 33


def test_files_interleaved_inside_a_shard(tmp_path):
    write_corpus(tmp_path, n_files=4, docs_per_file=10, min_words=5, max_words=10)
    c = cfg(tmp_path, num_shards=1, shuffle_window=0, files_per_stream=2, seq_len=64)
    rows = rows_of(take(data.make_host_iterator(c, 0, 1, debug=True), 2))
    seq = []
    for _, did, _ in rows:
        for d in did.tolist():
            f = decode_doc_id(d, 4)[1]
            if not seq or seq[-1] != f:
                seq.append(f)
    # documents alternate between the two open files
    assert len(set(seq[:6])) == 2 and all(a != b for a, b in zip(seq, seq[1:], strict=False))


@pytest.mark.slow
def test_input_workers_start_together(tmp_path):
    """Each worker process takes ~1 s to start (spawn, importing Grain and JAX) before its
    first row. Started one after another (what one mp_prefetch with N workers does: its
    interleave starts worker i + 1 once worker i has sent an element), N workers would take
    N such starts to their first rows. The worker processes must be created at about the same
    moment: a small fraction of the time until their first rows reach this process apart.
    (The first batch itself is made in this process while the workers start, so it is not
    the reference.)"""
    import time

    import psutil
    write_corpus(tmp_path, n_files=4, docs_per_file=6, max_words=80)
    c = cfg(tmp_path, num_shards=4, num_workers=2, seq_len=16, global_batch_size=4)
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    t0 = time.time()
    it = data.make_host_iterator(c, 0, 1)
    next(it)
    for _ in range(10_000):
        if it.worker_stage_times():
            break
        next(it)
    workers_first_rows_s = time.time() - t0
    assert len(it.worker_stage_times()) == 2, "the workers' first rows never arrived"
    workers = []
    for p in me.children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
            if p.pid not in before and "spawn_main" in cmd:
                workers.append(p.create_time())
        except psutil.Error:
            pass
    it.close()
    assert len(workers) == 2, f"expected 2 input worker processes, found {len(workers)}"
    gap = max(workers) - min(workers)
    assert gap < 0.25 * workers_first_rows_s, (
        f"workers created {gap:.2f} s apart; their first rows after {workers_first_rows_s:.2f} s")


@pytest.mark.slow
def test_input_workers_exit_on_their_own_when_closed(tmp_path):
    """A worker whose queue is full has slabs waiting in its queue's feeder thread (a pipe holds
    less than one); it can exit only once they are read. Closed without reading them, Grain
    SIGKILLs it after 25 s: the run's end (and every worker-count switch) waited that long.
    Closing must read them: every worker process exits by itself (exit code 0)."""
    import time

    from data.workers import worker_process_iterators
    write_corpus(tmp_path, n_files=4, docs_per_file=40, max_words=400)
    c = cfg(tmp_path, num_shards=4, num_workers=2, seq_len=256, global_batch_size=8)
    it = data.make_host_iterator(c, 0, 1)
    next(it)
    inner = worker_process_iterators(it)
    assert len(inner) == 2, "the worker processes' iterators were not found"
    for _ in range(600):        # until both queues are full: each worker is then blocked sending
        if all(w._buffer.full() for w in inner):
            break
        time.sleep(0.05)
    assert all(w._buffer.full() for w in inner), "the workers never filled their queues"
    time.sleep(0.5)             # and the next slab sits in the feeder thread
    procs = [w._prefetch_process for w in inner]
    it.close()
    assert [p.exitcode for p in procs] == [0, 0], "a worker was killed rather than let exit"


def test_assemble_and_segments_match_a_per_token_reference():
    """The vectorized packing helpers against a plain loop, on random pieces: BOS only before a
    document's first piece, EOS only after its last, any input dtype (uint16 records), empty
    pieces, and rows with padding at the end."""
    from data.streams import packing
    rng = np.random.default_rng(7)
    for trial in range(300):
        n = int(rng.integers(0, 12))
        lens = rng.integers(0, 9, n)
        flat = rng.integers(3, 60000, int(lens.sum())).astype(np.uint16 if trial % 2 else np.int32)
        dids = rng.integers(0, 1 << 40, n)
        firsts, lasts = rng.random(n) < 0.7, rng.random(n) < 0.7
        bos = 1 if trial % 3 else None
        tok, did, first = packing.assemble(flat, lens, dids, firsts, lasts, 2, bos)
        exp_tok, exp_did, exp_first, off = [], [], [], 0
        for i in range(n):
            piece = ([bos] if bos is not None and firsts[i] else []) + \
                [int(t) for t in flat[off:off + lens[i]]] + ([2] if lasts[i] else [])
            off += lens[i]
            exp_tok += piece
            exp_did += [int(dids[i])] * len(piece)
            exp_first += [bool(firsts[i]) and j == 0 for j in range(len(piece))]
        assert tok.dtype == np.int32 and tok.tolist() == exp_tok
        assert did.tolist() == exp_did and first.tolist() == exp_first
        R = int(rng.integers(1, 7))
        rows = len(did) // R
        d = did[:rows * R].reshape(rows, R).copy()
        if rows and trial % 4 == 0:
            d[:, R - int(rng.integers(1, R + 1)):] = -1      # padding at the end of every row
        seg, pos = packing.segments_positions(d)
        for r in range(rows):
            s = p = 0
            for t in range(R):
                if d[r, t] < 0:
                    assert seg[r, t] == 0 and pos[r, t] == 0
                    continue
                if t == 0 or d[r, t] != d[r, t - 1]:
                    s, p = s + 1, 0
                else:
                    p += 1
                assert (seg[r, t], pos[r, t]) == (s, p), (trial, r, t)


@pytest.mark.slow
def test_prefetch_handoff_keeps_order_and_stops_when_full():
    """The prefetcher's lock-free buffer: every item once and in order through producer and
    consumer racing at either side's pace (both sides wait in turn), never more than its size
    ahead, and a producer blocked on a full buffer returns when stopped."""
    import random
    import threading
    import time

    from data.pipeline import _Handoff
    for size, producer_naps, consumer_naps in [(1, True, False), (2, False, True), (3, True, True)]:
        h, stop, n = _Handoff(size), threading.Event(), 3000
        rnd = random.Random(size)
        peak = []

        def produce(h, stop, n, rnd, naps, peak):
            for i in range(n):
                if naps and rnd.random() < 0.01:
                    time.sleep(0.001)
                assert h.put(i, stop)
                peak.append(len(h._items))   # right after its own put

        t = threading.Thread(target=produce, args=(h, stop, n, rnd, producer_naps, peak))
        t.start()
        got = []
        for _ in range(n):
            if consumer_naps and rnd.random() < 0.01:
                time.sleep(0.001)
            got.append(h.get())
        t.join(timeout=10)
        assert got == list(range(n)) and max(peak) <= size
    h, stop = _Handoff(1), threading.Event()
    assert h.put("a", stop)
    done = []
    t = threading.Thread(target=lambda: done.append(h.put("b", stop)))
    t.start()
    time.sleep(0.2)
    assert not done, "a full buffer must block the producer"
    stop.set()
    t.join(timeout=5)
    assert done == [False]


def test_in_process_input_is_read_ahead_on_a_host_thread_with_the_same_batches_and_states(tmp_path):
    """Without worker processes the prefetcher reads host batches ahead on a thread of its own
    (DevicePrefetcher.IN_PROCESS_HOST_PREFETCH): the same batches as without it, each with the
    consumed state it came with, so a restore from any consumed state continues exactly."""
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    write_corpus(tmp_path, n_files=6, docs_per_file=20)
    c = cfg(tmp_path, num_workers=0)
    sh = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("data",)), P("data"))

    def run(host_prefetch, state=None, n=12):
        it = data.restore_host_iterator(c, 0, 1, [state] if state else None)
        pf = data.DevicePrefetcher(it, sh, prefetch=2, host_prefetch=host_prefetch)
        try:
            out = []
            for _ in range(n):
                b = next(pf)
                out.append(({k: np.asarray(v) for k, v in b.items()}, pf.consumed_state()))
            return out, pf
        finally:
            pf.close()

    ahead, pf = run(None)
    assert pf._host_q is not None and pf._host_thread is not None and not pf._host_thread.is_alive()
    plain, pf = run(0)
    assert pf._host_q is None
    for i, ((a, sa), (b, sb)) in enumerate(zip(ahead, plain, strict=True)):
        assert a.keys() == b.keys()
        for k in a:
            np.testing.assert_array_equal(a[k], b[k], err_msg=f"batch {i} {k}")
        assert sa == sb, f"batch {i}: consumed state"
    # The state consumed after batch 5 (of a read-ahead run) gives batches 6.. again.
    again, _ = run(None, state=ahead[4][1], n=7)
    for (a, _), (b, _) in zip(again, ahead[5:], strict=True):
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])


def test_in_process_read_ahead_holds_a_byte_budget_of_batches(tmp_path, monkeypatch):
    """The in-process read-ahead is sized in bytes (DevicePrefetcher.HOST_PREFETCH_BYTES), between
    MIN_HOST_PREFETCH and IN_PROCESS_HOST_PREFETCH batches: small batches get the deep buffer that
    covers seconds of a slow tokenizer spell, large ones no more host RAM than the budget."""
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    write_corpus(tmp_path, n_files=6, docs_per_file=20)
    c = cfg(tmp_path, num_workers=0)
    sh = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("data",)), P("data"))

    def filled(budget):
        monkeypatch.setattr(data.DevicePrefetcher, "HOST_PREFETCH_BYTES", budget)
        pf = data.DevicePrefetcher(data.make_host_iterator(c, 0, 1), sh, prefetch=2)
        try:
            batch_bytes = sum(np.asarray(v).nbytes for v in next(pf).values())
            deadline = time.time() + 60     # nothing consumes: the host thread fills its buffer
            while len(pf._host_q._items) < pf._host_q._max and time.time() < deadline:
                time.sleep(0.05)
            time.sleep(0.2)
            return len(pf._host_q._items), batch_bytes
        finally:
            pf.close()

    held, batch_bytes = filled(data.DevicePrefetcher.HOST_PREFETCH_BYTES)
    assert held == data.DevicePrefetcher.IN_PROCESS_HOST_PREFETCH == 64
    held, _ = filled(20 * batch_bytes)
    assert held == 20
    held, _ = filled(1)
    assert held == data.DevicePrefetcher.MIN_HOST_PREFETCH == 16

"""Exact restore at every point (0 and 2 workers, JSON round trip) and elastic restore."""
import numpy as np
import pytest

import data
from tests.data_helpers import assert_batches_equal, cfg, jround, rows_of, take, write_corpus

N_BATCHES = 40


def reference(c, n, P=1, h=0, debug=False):
    it = data.make_host_iterator(c, h, P, debug=debug)
    states, batches = [jround(it.get_state())], []
    for _ in range(n):
        batches.append(next(it))
        states.append(jround(it.get_state()))
    if hasattr(it, "close"):
        it.close()
    return batches, states


@pytest.mark.slow
@pytest.mark.parametrize("workers,packing", [(0, "concat"), (0, "first_fit"),
                                             (2, "concat"), (2, "first_fit")])
def test_restore_sweep(tmp_path, workers, packing):
    # Small corpus and windows: the sweep crosses window, file and epoch boundaries.
    write_corpus(tmp_path, n_files=4, docs_per_file=4, max_words=60, long_doc_chars=0)
    c = cfg(tmp_path, num_shards=4, num_workers=workers, packing=packing, shuffle_window=5,
            seq_len=16, global_batch_size=4)
    ref, states = reference(c, N_BATCHES)
    assert any(s["epoch"] > 0 for st in states[-1:] for s in
               _reader_states(st)), "sweep must cross an epoch boundary"
    # One live iterator restored at every point (set_state on a running pipeline) ...
    it = data.make_host_iterator(c, 0, 1)
    next(it)
    for k in range(N_BATCHES):
        it.set_state(jround(states[k]))
        for j in range(k, min(k + 3, N_BATCHES)):
            assert_batches_equal(next(it), ref[j], f"restore at {k}, batch {j}")
    # ... and fresh iterators restored cold at a few points.
    for k in (1, N_BATCHES // 2 + 1):
        it2 = data.make_host_iterator(c, 0, 1)
        it2.set_state(jround(states[k]))
        for j in range(k, k + 2):
            assert_batches_equal(next(it2), ref[j], f"cold restore at {k}")
        if hasattr(it2, "close"):
            it2.close()
    if hasattr(it, "close"):
        it.close()


def _reader_states(state):
    from data.host import find_shard_states
    return [st["start"]["reader"] for st in find_shard_states(state).values()]


def _per_shard(rows):
    out = {}
    for shard, did, tok in rows:
        out.setdefault(shard, []).append((did.tobytes(), tok.tobytes()))
    return out


def _canonical(c, n_rows_per_shard):
    """Each virtual shard's row sequence, from a 1-host, in-process run."""
    c1 = cfg_replace(c, num_workers=0, global_batch_size=c.num_shards)
    it = data.make_host_iterator(c1, 0, 1, debug=True)
    return _per_shard(rows_of(take(it, n_rows_per_shard)))


def cfg_replace(c, **kw):
    import dataclasses
    return dataclasses.replace(c, **kw)


def _check_prefix(per_shard_rows, canonical):
    for shard, rows in per_shard_rows.items():
        assert rows == canonical[shard][:len(rows)], f"shard {shard}: lost/repeated rows"


@pytest.mark.slow
@pytest.mark.parametrize("P1,N1,P2,N2,k1", [
    (2, 0, 1, 0, 7),      # 2 hosts -> 1
    (1, 0, 2, 0, 9),      # 1 host -> 2
    (2, 2, 1, 1, 5),      # 2 hosts x 2 workers -> 1 host x 1 worker (Grain-nested states)
    (1, 2, 2, 0, 1),      # one batch only: one worker had not produced yet
])
def test_elastic_restore(tmp_path, P1, N1, P2, N2, k1):
    write_corpus(tmp_path, n_files=8, docs_per_file=6, max_words=80)
    base = cfg(tmp_path, num_shards=8, shuffle_window=6, seq_len=16, global_batch_size=8)
    c1 = cfg_replace(base, num_workers=N1)
    c2 = cfg_replace(base, num_workers=N2)
    consumed = []
    host_states = []
    before = [[] for _ in range(P1)]
    for h in range(P1):
        it = data.make_host_iterator(c1, h, P1, debug=True)
        before[h] = take(it, k1)
        consumed += rows_of(before[h])
        host_states.append(jround(it.get_state()))
        if hasattr(it, "close"):
            it.close()
    merged = jround(data.merge_host_states(host_states))
    assert sorted(merged["shards"], key=int) == [str(v) for v in range(8)]
    k2 = 12
    after = [[] for _ in range(P2)]
    for h in range(P2):
        it = data.make_host_iterator(c2, h, P2, shard_states=merged, debug=True)
        after[h] = take(it, k2)
        consumed += rows_of(after[h])
        if hasattr(it, "close"):
            it.close()
    per_shard = _per_shard(consumed)
    canonical = _canonical(base, 60)
    _check_prefix(per_shard, canonical)
    # and every shard progressed in both phases: nothing skipped at the seam
    assert sum(len(v) for v in per_shard.values()) == 8 * k1 + 8 * k2
    # Stronger: the global batches (hosts' batches side by side) are exactly those of an
    # uninterrupted single-host run, before and after the change of topology.
    straight = take(data.make_host_iterator(cfg_replace(base, num_workers=0), 0, 1, debug=True), k1 + k2)
    for step in range(k1 + k2):
        hosts = [before[h][step] for h in range(P1)] if step < k1 else [after[h][step - k1] for h in range(P2)]
        for key in ("inputs", "targets", "segment_ids", "positions", "loss_mask", "doc_ids", "row_shard"):
            np.testing.assert_array_equal(np.concatenate([b[key] for b in hosts]), straight[step][key],
                                          err_msg=f"step {step} {key}")


def test_same_topology_state_rejects_other_topology(tmp_path):
    write_corpus(tmp_path, n_files=4, docs_per_file=4)
    c = cfg(tmp_path, num_shards=4)
    it = data.make_host_iterator(c, 0, 2, debug=False)
    next(it)
    st = jround(it.get_state())
    other = data.make_host_iterator(c, 1, 2)
    with pytest.raises(ValueError, match="merge_host_states"):
        other.set_state(st)
    with pytest.raises(ValueError, match="lack virtual shards"):
        data.merge_host_states([st])


def test_device_prefetcher(tmp_path):
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P
    write_corpus(tmp_path, n_files=4, docs_per_file=6)
    c = cfg(tmp_path, num_shards=4, global_batch_size=8)
    ref, states = reference(c, 6)
    mesh = Mesh(np.array(jax.devices()), ("data",))
    sh = NamedSharding(mesh, P("data"))
    pf = data.DevicePrefetcher(data.make_host_iterator(c, 0, 1), sh, prefetch=2)
    for k in range(4):
        b = next(pf)
        assert b["inputs"].shape == (8, 32) and b["inputs"].sharding == sh
        for key in ref[k]:
            np.testing.assert_array_equal(np.asarray(b[key]), ref[k][key])
        # the state of consumed batches only, not of the prefetched ones
        assert jround(pf.consumed_state()) == states[k + 1]
    s = pf.stats()
    assert s["rows"] == 32 and s["tokens"] == 32 * 33 and s["padding_frac"] == 0.0
    assert s["documents"] > 0 and s["docs_per_row"] >= 1 and s["wait_s"] >= 0
    assert s["bad_records"] == {}
    pf.close()


def test_restore_host_iterator_picks_the_path(tmp_path):
    write_corpus(tmp_path, n_files=8, docs_per_file=6, max_words=80)
    c2 = cfg(tmp_path, num_shards=8, global_batch_size=8, shuffle_window=6, seq_len=16)
    its = [data.make_host_iterator(c2, h, 2, debug=True) for h in range(2)]
    for it in its:
        take(it, 3)
    saved = [jround(it.get_state()) for it in its]
    ref = [take(it, 4) for it in its]
    # same topology: exact continuation on every host
    for h in range(2):
        it = data.restore_host_iterator(c2, h, 2, saved, debug=True)
        for a, b in zip(take(it, 4), ref[h], strict=False):
            assert_batches_equal(a, b)
    # other topology (1 host): the shards continue where they were, none lost or repeated
    it = data.restore_host_iterator(c2, 0, 1, saved, debug=True)
    got = _per_shard(rows_of(take(it, 8)))
    canon = _canonical(c2, 20)
    assert sorted(got) == list(range(8))
    for shard, rows in got.items():
        # 3 global batches of 8 rows from 8 shards: 3 rows per shard consumed
        assert canon[shard][3:3 + len(rows)] == rows


@pytest.mark.slow
def test_worker_states_are_the_in_process_states(tmp_path):
    """With workers, a batch's state (sent G batches at a time) holds, for every virtual shard,
    exactly the state the in-process pipeline has after the same batch: what resuming on any
    topology starts from. Checked after every batch, across group boundaries."""
    write_corpus(tmp_path, n_files=8, docs_per_file=6, max_words=80)
    base = cfg(tmp_path, num_shards=8, shuffle_window=6, seq_len=16, global_batch_size=8)
    w0 = data.make_host_iterator(cfg_replace(base, num_workers=0), 0, 1)
    w2 = data.make_host_iterator(cfg_replace(base, num_workers=2), 0, 1)
    from data.pipeline import worker_group
    group = worker_group(cfg_replace(base, num_workers=2), 1)
    assert group > 1, "the test must cross group boundaries"
    # element sizes ramp 1, 2, 4, ... up to the group size; go one group past the ramp
    sizes = [min(group, 1 << e) for e in range(group.bit_length() + 2)]
    skips = [i + 1 for n in sizes for i in range(n)]
    for k, skip in enumerate(skips):
        assert_batches_equal(next(w2), next(w0), f"batch {k}")
        s0, s2 = jround(w0.get_state()), jround(w2.get_state())
        assert s2["shards"] == s0["shards"], f"after batch {k}"
        assert s2["grain"]["skip"] == skip, f"after batch {k}"
    w2.close()


def test_encoder_threads_do_not_change_the_data(tmp_path, monkeypatch):
    """Tokenizer calls run ahead on a thread pool sized from the cores; the chunks, windows
    and batches must not depend on how many threads there are."""
    import data.host as stream
    import data.tokenizer as tokenizer
    write_corpus(tmp_path, n_files=4, docs_per_file=8, max_words=100, long_doc_chars=3000)
    c = cfg(tmp_path, num_shards=4, shuffle_window=5, seq_len=16, global_batch_size=4)
    runs = []
    for threads in (1, 3):
        monkeypatch.setattr(tokenizer, "MAX_ENCODE_THREADS", threads)
        monkeypatch.setattr(stream, "available_cores", lambda: 8)
        it = data.make_host_iterator(c, 0, 1, debug=True)
        batches = take(it, 30)
        host = it._parent   # the HostIterator under Grain's map
        assert host.enc.threads == threads
        assert all(len(s._ahead) == threads for s in host.streams)
        runs.append((batches, jround(it.get_state())))
    for a, b in zip(runs[0][0], runs[1][0], strict=False):
        assert_batches_equal(a, b)
    assert runs[0][1] == runs[1][1]


class _HeldBack:
    """A host iterator whose first batch waits for `gate`: a new pipeline's workers starting."""

    def __init__(self, it, gate):
        self.it, self.gate = it, gate

    def __next__(self):
        assert self.gate.wait(timeout=60)
        return next(self.it)

    def get_state(self):
        return self.it.get_state()

    def close(self):
        self.it.close()


def test_a_worker_switch_serves_from_the_old_pipeline_until_the_new_one_catches_up(tmp_path, monkeypatch):
    """data/feed.py Handover (data.num_workers=auto's switch): while the new pipeline starts, the
    old one goes on serving, with its consumed states; the new one's batches of those already
    served are dropped; the loop sees the one batch sequence, without a gap or a repeat. A new
    pipeline that makes other batches is named."""
    import threading
    import time

    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from data.feed import Handover
    from data.host import find_shard_states
    write_corpus(tmp_path, n_files=4, docs_per_file=6)
    c = cfg(tmp_path, num_shards=4, global_batch_size=8)
    ref, states = reference(c, 40)
    sh = NamedSharding(Mesh(np.array(jax.devices()), ("data",)), P("data"))

    def switch_after(k, start_state):
        old = data.DevicePrefetcher(data.make_host_iterator(c, 0, 1), sh, prefetch=2)
        got = [next(old) for _ in range(k)]
        gate = threading.Event()
        new_it = data.make_host_iterator(c, 0, 1, find_shard_states(start_state(old)))
        new = data.DevicePrefetcher(_HeldBack(new_it, gate), sh, prefetch=2, follows=old)
        return old, new, Handover(old, new), gate, got

    old, new, h, gate, got = switch_after(3, lambda old: old.consumed_state())
    for _ in range(4):                    # the new pipeline is held back: the old one serves, no wait
        batch, over = h.next()
        assert not over
        got.append(batch)
        assert jround(old.consumed_state()) == states[len(got)]
    gate.set()
    while True:                           # a loop whose steps take 20 ms: the new one catches up
        batch, over = h.next()
        if over:
            break
        got.append(batch)
        time.sleep(0.02)
    assert len(got) < 7 + Handover.MAX_SERVED   # caught up, not forced
    n_old = len(got)
    got += [next(new) for _ in range(4)]
    assert jround(find_shard_states(new.consumed_state())) == jround(find_shard_states(states[len(got)]))
    assert new.stats()["batches"] == len(got)
    for i, b in enumerate(got):
        for key in ref[i]:
            np.testing.assert_array_equal(np.asarray(b[key]), ref[i][key], err_msg=f"batch {i} ({n_old} from old)")
    new.close()
    old.close()

    # a loop as fast as both pipelines: after MAX_SERVED batches the handover waits for the new one
    monkeypatch.setattr(Handover, "MAX_SERVED", 3)
    old, new, h, gate, got = switch_after(2, lambda old: old.consumed_state())
    gate.set()
    while True:
        batch, over = h.next()
        if over:
            break
        got.append(batch)
    assert len(got) <= 2 + 3              # at most MAX_SERVED from the old one
    got += [next(new) for _ in range(3)]
    for i, b in enumerate(got):
        np.testing.assert_array_equal(np.asarray(b["inputs"]), ref[i]["inputs"], err_msg=f"batch {i}")
    new.close()
    old.close()
    monkeypatch.undo()

    # a new pipeline started one batch off: its first batch is not the one the old one served
    old, new, h, gate, got = switch_after(3, lambda old: states[4])
    h.next()
    gate.set()
    with pytest.raises(RuntimeError, match="made other batches than the one it replaces"):
        for _ in range(Handover.MAX_SERVED + 1):
            h.next()
    new.close()
    old.close()

"""data.carry_next_batch (data/carried.py): a checkpoint carries each host's next batch, and a
restore hands it out first, tokenizing nothing before it; the batches after it are the straight
run's. Used only where it is this host's batch under the same data: another host count, another
digest or a missing file restore as before, exactly.

    pytest tests/test_carried_batch.py -q
"""
import dataclasses
import json
import time

import numpy as np
import pytest
from etils import epath

import data
from data import carried
from model.runtime.checkpoint import DataStateHandler, DataStateSave
from tests.data_helpers import assert_batches_equal, cfg, write_corpus

K = 5          # batches consumed before the save


def _sharding():
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P
    return NamedSharding(Mesh(np.array(jax.devices()[:1]), ("data",)), P("data"))


def _feed(c, states, *, process_index=0, process_count=1, debug=False):
    return data.Feed(c, process_index, process_count, states, files=None, tokenizer=None,
                     sharding=_sharding(), debug=debug, saved_workers=None, agree=max, announce=False)


def _host(batch) -> dict:
    return {k: np.asarray(v) for k, v in batch.items()}


def _saved_after(c, k: int) -> dict:
    """The state a checkpoint saves after k batches, its next batch made already."""
    feed = _feed(c, None)
    try:
        for _ in range(k):
            next(feed)
        deadline = time.monotonic() + 60
        while feed.prefetcher.ready_next() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        return feed.saved_state()
    finally:
        feed.close()


def _through_checkpoint(state: dict, directory) -> list:
    """Saved and restored by the checkpoint's data item (one JSON file and the .npz per host)."""
    d = epath.Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    DataStateHandler().save(d, DataStateSave(state))
    return DataStateHandler().restore(d)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("carried")
    write_corpus(root, n_files=4, docs_per_file=10)
    return root


@pytest.fixture(scope="module")
def straight(corpus):
    """Batches 1..K+3 of an uninterrupted run (host arrays)."""
    feed = _feed(cfg(corpus, global_batch_size=8), None)
    try:
        return [_host(next(feed)) for _ in range(K + 3)]
    finally:
        feed.close()


@pytest.mark.parametrize("workers", [0, pytest.param(1, marks=pytest.mark.slow)])   # 1: worker processes
def test_a_restore_hands_out_the_carried_batch_then_goes_on_exactly(corpus, straight, workers, tmp_path):
    c = cfg(corpus, global_batch_size=8, num_workers=workers)
    state = _saved_after(c, K)
    assert carried.NEXT in state, "the next batch was made and not carried"
    states = _through_checkpoint(state, tmp_path / "data")
    # the arrays live beside the JSON, never inside it
    saved_json = json.loads((tmp_path / "data" / "process_0-of-1.json").read_text())
    assert carried.ARRAYS not in saved_json[carried.NEXT]
    assert (tmp_path / "data" / f"process_0-of-1{carried.FILE_SUFFIX}").is_file()
    np.testing.assert_array_equal(states[0][carried.NEXT][carried.ARRAYS]["inputs"], straight[K]["inputs"])

    feed = _feed(c, states)
    try:
        assert feed.carried
        # before its first batch the feed stands where the checkpoint's run stood
        assert feed.consumed_state()["shards"] == state["shards"]
        got = [_host(next(feed)) for _ in range(3)]
        after = feed.consumed_state()
    finally:
        feed.close()
    for i, (a, b) in enumerate(zip(got, straight[K:K + 3], strict=True)):
        assert_batches_equal(a, b, f"batch {K + 1 + i}")
    # the states after them are the straight run's too (a later save resumes the same way)
    ref = _feed(c, None)
    try:
        for _ in range(K + 3):
            next(ref)
        assert after["shards"] == ref.consumed_state()["shards"]
    finally:
        ref.close()


def test_what_does_not_fit_the_carried_batch_restores_as_before(corpus, straight, tmp_path):
    """Another host count, another digest (what the batches depend on), or the arrays' file
    missing: the pipeline makes the batch from the saved states, the same rows."""
    c = cfg(corpus, global_batch_size=8)
    state = _saved_after(c, K)
    states = _through_checkpoint(state, tmp_path / "data")

    # two hosts now: host 1's rows of batch K+1 are the straight run's second half
    feed = _feed(c, states, process_index=1, process_count=2)
    try:
        assert not feed.carried
        assert_batches_equal(_host(next(feed)), {k: v[4:] for k, v in straight[K].items()})
    finally:
        feed.close()

    other = json.loads(json.dumps(states[0][carried.NEXT]["digest"]))[::-1]
    changed = [{**states[0], carried.NEXT: {**states[0][carried.NEXT], "digest": other}}]
    (tmp_path / "data" / f"process_0-of-1{carried.FILE_SUFFIX}").unlink()
    for case, restored in [("digest", changed), ("file", DataStateHandler().restore(epath.Path(tmp_path / "data")))]:
        assert carried.NEXT not in restored[0] or case == "digest"
        feed = _feed(c, restored)
        try:
            assert not feed.carried, case
            assert_batches_equal(_host(next(feed)), straight[K], case)
        finally:
            feed.close()

    # another data setting the batches depend on: the digest differs
    c2 = dataclasses.replace(c, add_bos=True)
    assert carried.batch_digest(data.fingerprint(c2), 8, 0, 1, False) != state[carried.NEXT]["digest"]


def test_carry_next_batch_false_saves_the_consumed_state_only(corpus):
    c = cfg(corpus, global_batch_size=8, carry_next_batch=False)
    state = _saved_after(c, 2)
    assert carried.NEXT not in state and "shards" in state

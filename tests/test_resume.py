"""Exact resume with real processes: kills, preemption, partial saves, other process counts.

    pytest tests/test_resume.py -q        (~4 min on 2 cores)

Every run is `python train.py` in a subprocess with `train.debug_batches=true`, so each process
writes `debug_batches.p<i>.jsonl` (per step: a hash of its host batch; per row: virtual shard,
first/last document id, a hash of the row) and, with `train.log_every=1`, metrics.jsonl holds
every step's loss. "Identical" below means bit-identical: the same float in the JSON.

The reference is one straight run of N steps; the others are cut (SIGKILL right after a
checkpoint, SIGKILL during an asynchronous save, SIGTERM) and restarted with the same command.
A run that changes the process count is checked per virtual shard: the rows each shard
delivered, across the save and the restore, are exactly that shard's rows in the straight run:
no row (hence no document or token) lost or repeated.
"""
import json
import signal
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from tests.run_helpers import (
    COMMON,
    MICRO,
    TRAIN,
    K,
    N,
    assert_every_shard_continues_exactly,
    assert_same_run,
    complete_steps,
    logs,
    read_jsonl,
    resumed_at,
    rows_by_step,
    run,
    run_until,
)

# Module fixtures train real runs: the whole file belongs to the slow tier.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
# The helpers (start, run, run_until, per_step, ...), COMMON, N, K and TRAIN live in run_helpers.py;
# the `straight` reference run (a module fixture) in conftest.py.


# ---------------------------------------------------------------- SIGKILL right after a checkpoint
@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_kill_after_checkpoint_resumes_bit_identically(workers, straight, tmp_path):
    ref = straight
    if workers:
        ref = tmp_path / "straight"
        run(ref, f"data.num_workers={workers}", "checkpoint.every=0")
    run_dir = tmp_path / "run"
    ckpt = run_dir / "checkpoints"
    run_until(run_dir, lambda: (ckpt / str(K)).is_dir(), signal.SIGKILL,
              f"data.num_workers={workers}", f"checkpoint.every={K}")
    assert complete_steps(ckpt)[-1] < N, "the kill came too late"
    # the checkpoint carries the host's next batch (data/carried.py); the resume starts with it
    assert (ckpt / str(K) / "data" / "process_0-of-1.next_batch.npz").is_file()
    run(run_dir, f"data.num_workers={workers}", f"checkpoint.every={K}")
    assert resumed_at(run_dir) == K
    assert "the checkpoint carried the next batch" in logs(run_dir)
    assert_same_run(run_dir, ref)

    # The cut falls inside documents: some document has rows before and after step K.
    rows = rows_by_step(ref)
    before = {d for s in range(1, K + 1) for _, first, last, _ in rows[s] for d in (first, last)}
    after = {d for s in range(K + 1, N + 1) for _, first, last, _ in rows[s] for d in (first, last)}
    assert (before & after) - {-1}


# ---------------------------------------------------------------- SIGTERM: save, exit 0, resume
@pytest.mark.slow
def test_sigterm_saves_exits_zero_and_resumes(straight, tmp_path):
    run_dir = tmp_path / "run"
    metrics = run_dir / "metrics.jsonl"
    rc = run_until(run_dir, lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 3,
                   signal.SIGTERM, "data.num_workers=0", "checkpoint.every=0", group=False)
    assert rc == 0, logs(run_dir)
    saved = complete_steps(run_dir / "checkpoints")
    assert len(saved) == 1 and 3 <= saved[0] < N, (saved, logs(run_dir))
    assert f"Preempted: saved step {saved[0]}" in logs(run_dir)
    run(run_dir, "data.num_workers=0", "checkpoint.every=0")
    assert resumed_at(run_dir) == saved[0]
    assert_same_run(run_dir, straight)


@pytest.mark.slow
def test_sigterm_to_every_process_with_input_workers_saves_and_exits_zero(straight, tmp_path):
    """A preempted VM signals every process, the input workers too: the trainer still saves,
    stops its workers and exits 0 (a worker killed by the SIGTERM used to leave the trainer's
    shutdown hanging until a SIGKILL), and the next start resumes exactly."""
    run_dir = tmp_path / "run"
    metrics = run_dir / "metrics.jsonl"
    rc = run_until(run_dir, lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 3,
                   signal.SIGTERM, "data.num_workers=1", "checkpoint.every=0", group=True)
    assert rc == 0, logs(run_dir)
    saved = complete_steps(run_dir / "checkpoints")
    assert len(saved) == 1 and 3 <= saved[0] < N, (saved, logs(run_dir))
    run(run_dir, "data.num_workers=1", "checkpoint.every=0")
    assert resumed_at(run_dir) == saved[0]
    assert_same_run(run_dir, straight)


# ---------------------------------------------------------------- SIGKILL during an async save
@pytest.mark.slow
def test_kill_during_async_save_uses_last_complete_checkpoint(straight, tmp_path):
    run_dir = tmp_path / "run"
    ckpt = run_dir / "checkpoints"

    def saving_after_first():      # step 2 is complete and a later step is being written
        if not ckpt.exists():
            return False
        names = [p.name for p in ckpt.iterdir()]
        return "2" in names and any(".orbax-checkpoint-tmp" in n for n in names)

    run_until(run_dir, saving_after_first, signal.SIGKILL, "data.num_workers=0", "checkpoint.every=2")
    partial = [p.name for p in ckpt.iterdir() if ".orbax-checkpoint-tmp" in p.name]
    assert partial, f"no partial step left by the kill: {sorted(p.name for p in ckpt.iterdir())}"
    last_complete = complete_steps(ckpt)[-1]
    assert last_complete < N
    run(run_dir, "data.num_workers=0", "checkpoint.every=2")
    assert resumed_at(run_dir) == last_complete
    assert not [p for p in ckpt.iterdir() if ".orbax-checkpoint-tmp" in p.name]
    assert_same_run(run_dir, straight)


# ---------------------------------------------------------------- another process count
@pytest.mark.slow
def test_two_processes_save_one_restores(straight, tmp_path):
    two, one = tmp_path / "two", tmp_path / "one"
    run(two, "data.num_workers=0", f"checkpoint.every={K}", f"train.steps={K}", processes=2)
    assert complete_steps(two / "checkpoints") == [K]
    data_files = sorted(p.name for p in (two / "checkpoints" / str(K) / "data").glob("process_*"))
    # each host's state, and its next batch (data/carried.py), which only the same two hosts would use
    assert data_files == ["process_0-of-2.json", "process_0-of-2.next_batch.npz",
                          "process_1-of-2.json", "process_1-of-2.next_batch.npz"]
    # One process, 2 devices, continues the two-process run.
    run(one, "data.num_workers=0", f"checkpoint.resume_from={two / 'checkpoints'}",
        "distributed.local_device_count=2")
    assert resumed_at(one) == K
    assert_every_shard_continues_exactly([(two, range(1, K + 1)), (one, range(K + 1, N + 1))], straight)
    # Same global batch, same rows per shard and step, other interleaving: the loss stays sane.
    losses = [r["loss"] for r in read_jsonl(one / "metrics.jsonl")]
    straight_losses = [r["loss"] for r in read_jsonl(straight / "metrics.jsonl")]
    assert abs(losses[-1] - straight_losses[-1]) < 0.5, (losses, straight_losses)


@pytest.mark.slow
def test_one_process_saves_two_restore(straight, tmp_path):
    two = tmp_path / "two"
    # The straight run's step-K checkpoint (1 process, 8 devices) continued by 2 x 2 devices.
    run(two, "data.num_workers=0", f"checkpoint.resume_from={straight / 'checkpoints' / str(K)}",
        "checkpoint.every=0", processes=2)
    assert resumed_at(two) == K
    assert_every_shard_continues_exactly([(straight, range(1, K + 1)), (two, range(K + 1, N + 1))], straight)


# ---------------------------------------------------------------- fingerprint
def make_cfg(run_dir, *overrides):
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose("train", overrides=[f"paths.run_dir={run_dir}", *COMMON, *overrides])


def load_train_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_under_test", TRAIN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_fingerprint_mismatch_stops_with_the_differences(straight, tmp_path):
    train_mod = load_train_module()

    src = f"checkpoint.resume_from={straight / 'checkpoints'}"
    with pytest.raises(train_mod.ConfigError) as e:
        train_mod.train(make_cfg(tmp_path / "a", *MICRO, src, "data.seq_len=128", "data.seed=7"))
    msg = str(e.value)
    assert "data.seq_len: checkpoint=64 now=128" in msg and "data.seed: checkpoint=0 now=7" in msg, msg
    assert "allow_data_change=true" in msg
    assert not (tmp_path / "a" / "checkpoints" / str(N)).exists()

    with pytest.raises(train_mod.ConfigError, match="model.n_layers: checkpoint=2 now=3"):
        train_mod.train(make_cfg(tmp_path / "b", *MICRO, src, "model.n_layers=3", "checkpoint.allow_data_change=true"))

    # On purpose: a new data layout continues the model (and reads the new data from its start).
    summary = train_mod.train(make_cfg(tmp_path / "c", *MICRO, src, "data.seq_len=128",
                                       "checkpoint.allow_data_change=true", f"train.steps={N + 1}",
                                       "checkpoint.every=0", "data.num_workers=0"))
    assert (summary["start_step"], summary["steps"]) == (N, N + 1)


# ---------------------------------------------------------------- every input format, and gs://
def _format_mixture(root, bucket_url, fs):
    """One source per input format other than the default .json.gz, 2 files each (fewer files than
    shards: each file is split among shards), text under `story`: Parquet (row groups of 4, split
    by group), JSON arrays (.json), a save_to_disk directory (Arrow), .jsonl.zstd (DCLM's ending)
    and .json.gz lines on the GCS emulator. -> the data.sources override."""
    import random

    from tests.data_helpers import doc_text, write_corpus, write_docs, write_save_to_disk

    kw = dict(n_files=2, docs_per_file=30)
    write_docs(root / "parquet", "parquet", seed=1, **kw)
    write_docs(root / "array", "array.json", seed=2, **kw)
    write_docs(root / "zstd", "lines.jsonl.zstd", seed=3, **kw)
    rng = random.Random(4)
    write_save_to_disk(root / "arrow", [[doc_text(rng, f"{f}-{i}", rng.randint(3, 60)) for i in range(30)]
                                        for f in range(2)])
    write_corpus(root / "gs", seed=5, max_words=60, text_key="story", **kw)
    fs.put(str(root / "gs"), bucket_url.removeprefix("gs://"), recursive=True)
    paths = {"parquet": f"{root}/parquet/*/part.parquet", "array": f"{root}/array/*/part.json",
             "arrow": f"{root}/arrow", "zstd": f"{root}/zstd/*/part.jsonl.zstd",
             "gs": f"{bucket_url}/*/en_head.json.gz"}
    return "data.sources=[" + ",".join(f"{{name:{n},paths:['{p}'],weight:1}}" for n, p in paths.items()) + "]"


@pytest.mark.slow
def test_kill_and_resume_on_another_host_count_for_every_format_and_gs(tmp_path, monkeypatch):
    """A mixture with one source per input format (Parquet, JSON array, Arrow, .jsonl.zstd, a
    gs:// object on the GCS emulator), SIGKILLed after its step-K checkpoint on 2 processes and
    resumed on 1 (with an input worker): every step's rows are those of one straight run, and
    the resumed steps' batches hash the same. The cut falls inside files of every source."""
    pytest.importorskip("pyarrow")
    pytest.importorskip("zstandard")
    pytest.importorskip("gcp_storage_emulator.server")
    from tests.gcs_emulator import BUCKET, Emulator
    gcsfs = pytest.importorskip("gcsfs")

    em = Emulator()
    try:
        for k, v in em.env().items():      # train.py and its input workers read gs:// from it
            monkeypatch.setenv(k, v)
        fs = gcsfs.GCSFileSystem(token="anon", project="test", endpoint_url=f"http://localhost:{em.port}",
                                 skip_instance_cache=True)
        mix = [_format_mixture(tmp_path / "corpus", f"gs://{BUCKET}/fmt", fs), "data.paths=[]",
               "data.text_key=story", "data.eval.holdout_files=0",
               "data.shuffle_window=2"]     # small windows: the checkpoint's window starts inside files
        straight = tmp_path / "straight"
        run(straight, *mix, "data.num_workers=0", "checkpoint.every=0")

        run_dir = tmp_path / "run"
        ckpt = run_dir / "checkpoints"
        run_until(run_dir, lambda: (ckpt / str(K)).is_dir(), signal.SIGKILL, *mix, "data.num_workers=0",
                  f"checkpoint.every={K}", processes=2)
        assert complete_steps(ckpt) == [K], "the kill came too late"
        killed = run_dir / "killed"          # the killed run's batch logs, apart from the resumed run's
        killed.mkdir()
        for f in run_dir.glob("debug_batches.p*.jsonl"):
            f.rename(killed / f.name)
        run(run_dir, *mix, "data.num_workers=1", f"checkpoint.every={K}")
        assert resumed_at(run_dir) == K
    finally:
        em.stop()

    # The checkpoint stands inside a file of every source, past its first record.
    from data.host import find_shard_states
    saved = [json.loads(p.read_text()) for p in sorted((ckpt / str(K) / "data").glob("process_*.json"))]
    assert len(saved) == 2
    inside = set()
    for state in saved:
        for shard in find_shard_states(state).values():
            for name, src in shard["sources"].items():
                if any(slot[3] > 0 for slot in src["start"]["reader"]["slots"]):
                    inside.add(name)
    assert inside == {"parquet", "array", "arrow", "zstd", "gs"}, inside

    want = rows_by_step(straight)
    before, after = rows_by_step(killed), rows_by_step(run_dir)
    assert sorted(want) == list(range(1, N + 1))
    for s in range(1, K + 1):
        assert before[s] == want[s], f"step {s} (2 processes) differs from the straight run"
    for s in range(K + 1, N + 1):
        assert after[s] == want[s], f"step {s} after the resume on 1 process differs from the straight run"
    hashes = {r["step"]: r["batch_hash"] for r in read_jsonl(run_dir / "debug_batches.p0.jsonl")}
    straight_hashes = {r["step"]: r["batch_hash"] for r in read_jsonl(straight / "debug_batches.p0.jsonl")}
    assert sorted(hashes) == list(range(K + 1, N + 1))
    assert all(hashes[s] == straight_hashes[s] for s in hashes), (hashes, straight_hashes)
    last = read_jsonl(run_dir / "metrics.jsonl")[-1]
    for name in ("parquet", "array", "arrow", "zstd", "gs"):
        assert last[f"data/source/{name}/rows"] > 0 and last[f"data/source/{name}/bad_records"] == 0, name

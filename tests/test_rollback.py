"""train.on_divergence=rollback (model/runtime/rollback.py, issue #22): a planted divergence rolls every
host back to the newest checkpoint before it, the data goes on past the batches that led there,
their documents are written, the same divergence twice stops the run in one line, and a later
resume does not replay the skipped batches.

Batches are compared by the hashes `train.debug_batches=true` logs: an uninterrupted reference
run's step k consumed the k-th batch of the data order.
"""
import importlib.util
import json
import math
import sys

import numpy as np
import pytest

from model.runtime.rollback import find_divergence, rollbacks_of
from tests.run_helpers import MICRO, ONE_SCHEDULE, ROOT, run_cli
from tests.step_hooks import planted

# The suite's shape and schedule (run_helpers.COMMON's): the 12- and 18-step runs share its compiled step.
COMMON = [*MICRO, *ONE_SCHEDULE, "data.seq_len=64", "train.log_every=2", "checkpoint.every=4", "data.num_workers=0",
          "train.debug_batches=true", "train.eval_every=0", "logger.progress_bar=false"]


def _plant(monkeypatch, diverge_at: str):
    """NaN parameters after the listed batches of each start (tests/step_hooks.py, through the seam)."""
    for k, v in planted(diverge_at=diverge_at).items():
        monkeypatch.setenv(k, v)


def m(loss=1.0, norm=1.0, skipped=None, run=0):
    out = {"loss": np.float32(loss), "param_norm": np.float32(norm)}
    if skipped is not None:
        out.update(skipped=np.float32(skipped), skipped_in_a_row=np.int32(run))
    return out


def test_what_counts_as_a_divergence():
    assert find_divergence([m(), m(), m()], 12) is None
    d = find_divergence([m(), m(float("nan")), m(float("inf"))], 12)
    assert (d.first_step, d.seen_step) == (11, 12) and "loss nan at step 11" in d.reason
    # An update that leaves non-finite parameters, though its own loss was finite.
    d = find_divergence([m(), m(norm=float("inf")), m()], 12)
    assert d.first_step == 11 and "parameters are not finite after step 11" in d.reason
    # A skipped update keeps the old parameters: its candidate's norm does not count.
    assert find_divergence([m(norm=float("nan"), skipped=1, run=1), m(skipped=0)], 12) is None
    # n skipped in a row: the run started before this interval.
    run = [m(skipped=1, run=r) for r in (3, 4, 5)]
    assert find_divergence(run, 12, skips_in_a_row=6) is None
    d = find_divergence(run, 12, skips_in_a_row=5)
    assert d.first_step == 8 and "5 updates in a row skipped" in d.reason
    assert find_divergence(run, 12, skips_in_a_row=0) is None


@pytest.mark.slow
def test_a_bad_setting_fails_in_one_line(tmp_path):
    r = run_cli(tmp_path, "train.on_divergence=restart", *COMMON)
    assert r.returncode == 2            # config errors exit 2, before anything starts
    assert r.stderr.strip() == "config error: train.on_divergence='restart': one of stop, rollback"


def hashes(run_dir) -> list[tuple[int, str]]:
    lines = (run_dir / "debug_batches.p0.jsonl").read_text().splitlines()
    return [(d["step"], d["batch_hash"]) for d in map(json.loads, lines)]


def row_hashes(run_dir) -> list[tuple[int, list[str]]]:
    lines = (run_dir / "debug_batches.p0.jsonl").read_text().splitlines()
    return [(d["step"], [r[3] for r in d["rows"]]) for d in map(json.loads, lines)]


@pytest.fixture(scope="module")
def show():
    spec = importlib.util.spec_from_file_location("show_step", ROOT / "scripts" / "show_step.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["show_step"] = module      # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_rollback_skips_the_batches_twice_stops_and_a_resume_goes_on_past_them(tmp_path, monkeypatch, show):
    ref_dir, run_dir = tmp_path / "ref" / "run", tmp_path / "rb" / "run"
    (tmp_path / "ref").mkdir()
    (tmp_path / "rb").mkdir()
    r = run_cli(tmp_path / "ref", "train.steps=18", *COMMON)
    assert r.returncode == 0, r.stderr[-3000:]
    ref = dict(hashes(ref_dir))
    batch = {i: ref[i] for i in ref}            # the i-th batch of the data order

    # Planted: NaN parameters after the 6th and the 8th batch drawn. Found at step 6 (a log row):
    # back to checkpoint 4, steps 5 and 6 take batches 7 and 8; the second is found at step 6
    # again, back to checkpoint 4 again: twice in a row, the run stops.
    _plant(monkeypatch, "6,8")
    r = run_cli(tmp_path / "rb", "train.steps=12", "train.on_divergence=rollback", *COMMON)
    assert r.returncode == 1, r.stderr[-3000:]
    assert "rolled back to step 4 from step 6" in r.stdout, r.stdout[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("diverged: twice in a row: the parameters are not finite after step 6"), r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    steps = hashes(run_dir)
    assert steps == [(1, batch[1]), (2, batch[2]), (3, batch[3]), (4, batch[4]), (5, batch[5]), (6, batch[6]),
                     (5, batch[7]), (6, batch[8])]
    records = rollbacks_of(str(run_dir / "checkpoints"), 4)
    assert [(x["to_step"], x["first_bad_step"], x["rolled_back_steps"], x["stopped"]) for x in records] == [
        (4, 6, [5, 6], False), (4, 6, [5, 6], True)]
    assert not (run_dir / "checkpoints" / "8").exists()      # the run never got there

    # The documents of the rolled-back steps, as show_step prints them, from where each started.
    first_rows = dict(row_hashes(run_dir)[4:6])
    second_rows = dict(row_hashes(run_dir)[6:8])
    for n, rows in ((0, first_rows), (1, second_rows)):
        replay = show.show_rollback(run_dir, f"4/{n}")
        assert {res["step"]: [row["hash"] for row in res["rows"]] for res in replay} == rows
        text = (run_dir / f"rollback-4-{n}.txt").read_text()
        assert text.count("step 5 of ") == 1 and text.count("step 6 of ") == 1, text[:2000]
        assert "en_head.json.gz:" in text

    # A resume (nothing planted) starts past both: step 5 takes batch 9. A divergence planted at
    # its 6th batch (step 10, after checkpoint 8) rolls back to 8 and the run goes on to the end.
    _plant(monkeypatch, "6")
    r = run_cli(tmp_path / "rb", "train.steps=12", "train.on_divergence=rollback", *COMMON)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Its data goes on past the steps rolled back at step 6" in r.stdout
    assert "rolled back to step 8 from step 10" in r.stdout, r.stdout[-3000:]
    resumed = hashes(run_dir)[8:]
    assert resumed == [(5, batch[9]), (6, batch[10]), (7, batch[11]), (8, batch[12]), (9, batch[13]),
                       (10, batch[14]), (9, batch[15]), (10, batch[16]), (11, batch[17]), (12, batch[18])]
    # show_step follows the new timeline: step 9 of the run is now batch 15's rows.
    rows = dict(row_hashes(run_dir)[14:])
    assert [row["hash"] for row in show.show_step(run_dir, 9)["rows"]] == rows[9]
    meta = json.loads((run_dir / "checkpoints" / "12" / "meta" / "metadata").read_text())
    assert [(x["to_step"], x["seen_at_step"]) for x in meta["rollbacks"]] == [(4, 6), (4, 6), (8, 10)]
    losses = [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(math.isfinite(x) for x in losses)


@pytest.mark.slow
def test_two_processes_roll_back_together_and_every_shard_skips_the_same_batches(tmp_path, monkeypatch):
    """Two jax.distributed processes find the divergence at the same step, agree, roll back to
    the same checkpoint and go on: every virtual shard's rows after the rollback are the rows
    that followed the skipped batches in an uninterrupted run."""
    from tests.run_helpers import rows_by_step, run, shard_streams

    ref, two = tmp_path / "ref", tmp_path / "two"
    run(ref, "data.num_workers=0", "checkpoint.every=0", "train.steps=12")
    _plant(monkeypatch, "6")
    run(two, "data.num_workers=0", "checkpoint.every=4", "train.on_divergence=rollback", processes=2)
    logs = "".join(p.read_text() for p in sorted(two.glob("log_*_p*.txt")))
    assert logs.count("rolled back to step 4 from step 6") == 1, logs[-3000:]      # printed by process 0
    want = shard_streams(rows_by_step(ref), [1, 2, 3, 4, *range(7, 13)])
    got = shard_streams(rows_by_step(two), range(1, 11))       # a step's last record: the new timeline
    assert got == want
    assert [(x["to_step"], x["rolled_back_steps"]) for x in rollbacks_of(str(two / "checkpoints"), 4)] == [
        (4, [5, 6])]
    assert sorted(p.name for p in (two / "checkpoints" / "rollbacks" / "4" / "0").iterdir()) == [
        "process_0-of-2.json", "process_1-of-2.json", "rollback.json"]

"""What a run shows: metrics.jsonl and wandb (offline), evaluation, profiling, determinism, where
the input time goes.

    pytest tests/test_monitoring.py -q
"""
import glob
import json
from pathlib import Path

import pytest
from run_helpers import MICRO, ONE_SCHEDULE, make_cfg, read_metrics

import train as train_mod
from data.timing import STAGES, THREADS

# The smallest Llama and the suite's one schedule (run_helpers): what a run shows does not depend
# on the network's size, and runs of 4 and 6 steps share one compiled step.
RUN = [*MICRO, *ONE_SCHEDULE, "data.seq_len=64", "train.log_every=2", "train.eval_every=2", "train.eval_batches=2",
       "checkpoint.every=0", "data.num_workers=0", "logger.wandb.mode=offline"]
REQUIRED = ("step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "data_wait_frac")


def wandb_runs(run_dir):
    return sorted(Path(run_dir, "wandb").glob("offline-run-*"))


@pytest.mark.slow
def test_metrics_wandb_profile_and_resume_keep_the_run(tmp_path):
    run_dir = tmp_path / "run"
    train_mod.train(make_cfg(run_dir, *RUN, "train.steps=4", "profile.steps=[3,4]"))

    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [2, 4]
    for row in rows:
        for key in REQUIRED + ("eval_loss", "perplexity", "param_norm", "tokens_per_s_per_device", "step_time_s",
                               "checkpoint_save_s", "documents_per_s", "data/documents", "data/padding_frac",
                               "data/truncated_tokens", "data/dropped_tokens"):
            assert key in row, key
        # The per-stage input time table of the interval (in-process input: no IPC, no merge; an
        # interval may read nothing when the shards' windows were filled before it).
        assert all(row[f"input/{k}_s"] >= 0 for k in STAGES)
        assert row["input/h2d_s"] > 0 and row["input/ipc_s"] == row["input/merge_s"] == 0
        assert abs(sum(row[f"input/{k}_share"] for k in STAGES) - 1) < 1e-6
        assert row["input/bound"] in STAGES and "input/busy_tokenizer" in row

    # The offline wandb run holds the same metrics and the resolved config.
    [first_run] = wandb_runs(run_dir)
    record = next(first_run.glob("run-*.wandb")).read_bytes()
    for needle in (b"tokens_per_s", b"data_wait_frac", b"eval_loss", b"input/tokenize_s", b"input/bound",
                   b"global_batch_size", b"raw_content",
                   json.dumps(rows[-1]["loss"]).encode()):
        assert needle in record, needle

    # profile.steps=[3,4] wrote a trace.
    assert glob.glob(str(run_dir / "profile" / "**" / "*.xplane.pb"), recursive=True)

    # Resuming continues the same wandb run (the id travels in the checkpoint).
    train_mod.train(make_cfg(run_dir, *RUN, "train.steps=6"))
    runs = wandb_runs(run_dir)
    assert len(runs) == 2
    run_id = first_run.name.rsplit("-", 1)[1]
    assert all(r.name.endswith("-" + run_id) for r in runs), runs
    assert [r["step"] for r in read_metrics(run_dir)] == [2, 4, 6]


@pytest.mark.slow
def test_same_seed_same_losses_and_eval_losses(tmp_path):
    a = tmp_path / "a"
    b = tmp_path / "b"
    # Evaluation every 3 steps, logging every 2: step 3 gets an evaluation-only row.
    for run_dir in (a, b):
        train_mod.train(make_cfg(run_dir, *RUN, "train.steps=6", "train.eval_every=3", "logger.wandb.mode=disabled"))
    rows_a, rows_b = read_metrics(a), read_metrics(b)
    assert [r["step"] for r in rows_a] == [2, 3, 4, 6]
    # an evaluation-only row: the eval and its time (and the goodput figures), no training figures
    assert "eval_loss" in rows_a[1] and not {"loss", "tokens_per_s", "grad_norm"} & rows_a[1].keys()
    assert [r.get("loss") for r in rows_a] == [r.get("loss") for r in rows_b]
    evals_a = [r["eval_loss"] for r in rows_a if "eval_loss" in r]
    assert len(evals_a) == 2 and evals_a == [r["eval_loss"] for r in rows_b if "eval_loss" in r]
    # Evaluation is on held-out data: a fixed set, so its loss moves only with the parameters.
    assert evals_a[0] != evals_a[1]


@pytest.mark.slow
def test_stage_times_cross_from_input_workers_and_stay_out_of_the_state(tmp_path):
    """Real Grain workers: their timers reach the host process with their slabs; the table names a
    bound stage; the times are not part of the saved state (statistics, not data)."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import data
    from data import timing
    from tests.data_helpers import cfg, write_corpus

    write_corpus(tmp_path, n_files=8, docs_per_file=40)
    sharding = NamedSharding(Mesh(np.array(jax.devices()[:4]), ("data",)), P("data"))
    pf = data.DevicePrefetcher(data.make_host_iterator(cfg(tmp_path, num_workers=2), 0, 1), sharding)
    for _ in range(30):
        next(pf)
    stats = pf.stats()
    state = pf.consumed_state()
    pf.close()
    t = stats["stage_s"]
    for stage in ("read", "parse", "tokenize", "pack", "merge", "h2d"):
        assert t[stage] > 0, stage
    assert t["reader_threads"] == 2 and t["tokenizer_threads"] >= 2 and not t["in_host"]
    summary = timing.summarize(t, wall_s=1.0)
    assert set(summary["busy"]) == set(THREADS) and summary["bound"] in STAGES
    table = timing.format_table(summary, batches=30)
    # (a note may follow the bound line when no thread was busy over that wall time: timing-dependent)
    assert any(line.startswith("bound: ") for line in table.splitlines()) and "tokenize" in table
    text = json.dumps(state)
    assert all(f'"{k}"' not in text for k in STAGES + timing.WAITS)


def test_stage_table_names_the_busiest_threads_largest_stage():
    from data import timing

    # 2 workers (2 reader threads), 4 tokenizer threads, 10 s: the tokenizer threads are 50% busy,
    # the reader threads 60% (read 8 s + parse 2 s + pack 2 s over 2 x 10 s): reading bounds.
    t = timing.zero_times(reader_threads=2, tokenizer_threads=4)
    t.update(read=8.0, parse=2.0, tokenize=20.0, pack=2.0, merge=0.5, h2d=0.5)
    s = timing.summarize(t, wall_s=10.0)
    assert s["busy"] == {"reader": 0.6, "tokenizer": 0.5, "host": 0.1}
    assert s["bound"] == "read" and s["share"]["tokenize"] == 20.0 / 33.0
    # In-process, the reader thread also feeds the device: its h2d counts against it.
    t = timing.zero_times(reader_threads=1, tokenizer_threads=2, in_host=True)
    t.update(read=1.0, tokenize=12.0, pack=1.0, h2d=7.0)
    s = timing.summarize(t, wall_s=10.0)
    assert s["busy"] == {"reader": 0.9, "tokenizer": 0.6} and s["bound"] == "h2d"
    assert timing.format_table(s, batches=10).splitlines()[-1].startswith("bound: host -> device")

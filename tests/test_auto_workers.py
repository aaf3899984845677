"""data.num_workers=auto: the choice rule (pure) and real train() runs that choose, switch the
live pipeline and keep the batches bit-identical.

    pytest tests/test_auto_workers.py -q        (~2.5 min on 2 cores, shared)

The runs compare `train.debug_batches` hashes (one per step: the host batch) with a run on a
fixed worker count. The switch is forced where a test needs it by a RAM budget that holds no
worker (the choice is then 0 workers whatever the measured rates), so no assertion depends on
how fast this machine is.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest

import data as data_lib
import train as train_mod
from data import autoworkers as aw
from model.runtime.checkpoint import find_resume, restore_meta_and_data
from tests import forked
from tests.data_helpers import convert
from tests.run_helpers import (
    COMMON,
    MICRO,
    ONE_SCHEDULE,
    TRAIN,
    assert_every_shard_continues_exactly,
    env_for,
    finish,
    free_port,
    make_cfg,
    read_metrics,
)

GB = 1 << 30
MB = 1 << 20


# ---------------------------------------------------------------- the rule
def choose(worker, need, *, shards=8, cores=16, rss=300 * MB, main=2 * GB, budget=16 * GB, in_process=False):
    return aw.choose_workers(worker, need, shards_per_host=shards, cores=cores, worker_rss_bytes=rss,
                             main_rss_bytes=main, budget_bytes=budget, in_process_ok=in_process)


@pytest.mark.parametrize("worker, need, kw, expect", [
    # the fewest n with n x rate >= 1.3 x need: 1.3 x 2.9 / 1.2 = 3.14 -> 4
    (1.2e6, 2.9e6, {}, (4, "rate")),
    # exactly at the headroom: 1.3 x 1.0 / 1.3 = 1 worker
    (1.3e6, 1.0e6, {}, (1, "rate")),
    # a fast step needs more than the shards allow
    (1.0e5, 5.0e6, {"shards": 8}, (8, "shards")),
    # ... or the cores
    (1.0e5, 5.0e6, {"shards": 64, "cores": 6}, (6, "cores")),
    # RAM: (4 GB - 2 GB) / 600 MB = 3 workers fit, 10 would be needed
    (1.0e5, 7.0e5, {"rss": 600 * MB, "budget": 4 * GB}, (3, "RAM")),
    # a budget below the trainer's own memory: in-process rather than over budget
    (1.0e5, 7.0e5, {"budget": 1 * GB}, (0, "RAM")),
    # a converted corpus whose one worker covers the need runs in-process
    (5.0e6, 1.0e6, {"in_process": True}, (0, "in-process")),
    # ... but not when it does not
    (1.0e6, 1.0e6, {"in_process": True}, (2, "rate")),
    # text never goes in-process on its own: one worker at least
    (5.0e6, 1.0e6, {}, (1, "rate")),
])
def test_choose_workers(worker, need, kw, expect):
    got = choose(worker, need, **kw)
    assert (got.num_workers, got.reason) == expect


def test_provisional_workers():
    # cores - 1, capped by PROVISIONAL_MAX, the host's shards and the assumed memory per worker
    assert aw.provisional_workers(shards_per_host=64, cores=2, budget_bytes=16 * GB) == 1
    assert aw.provisional_workers(shards_per_host=64, cores=240, budget_bytes=400 * GB) == aw.PROVISIONAL_MAX
    assert aw.provisional_workers(shards_per_host=3, cores=16, budget_bytes=400 * GB) == 3
    assert aw.provisional_workers(shards_per_host=64, cores=16, budget_bytes=2 * GB) == 2
    assert aw.provisional_workers(shards_per_host=64, cores=16, budget_bytes=1) == 1   # one, to measure
    # a resumed run starts from its last choice, within the shards and the cores
    assert aw.provisional_workers(shards_per_host=64, cores=16, budget_bytes=400 * GB, saved=5) == 5
    assert aw.provisional_workers(shards_per_host=4, cores=16, budget_bytes=400 * GB, saved=6) == 4


def test_the_workers_threads_outnumber_the_cores():
    # 8 workers on 14 cores: 2 threads each (16 on 14 cores), not 1 each (8 of the 14 cores idle);
    # 14 workers: 2 each, not 1 each (a worker waiting with its buffer full left its core idle)
    from data.tokenizer import MAX_ENCODE_THREADS, core_share, encode_threads
    assert [encode_threads(14, n) for n in (1, 4, 8, 14, 16)] == [MAX_ENCODE_THREADS, 4, 2, 2, 1]
    assert encode_threads(16, 8) == 3 and encode_threads(2, 8) == 1 and encode_threads(2, 2) == 2
    assert core_share(14, 8) == 1.75 and core_share(16, 8) == 2 and core_share(2, 8) == 0.25
    # the threads a host's workers run outnumber its cores, but where the cap stops them
    assert all(n * encode_threads(c, n) > c or encode_threads(c, n) == MAX_ENCODE_THREADS
               for c in range(1, 65) for n in range(1, 65))


def test_rates_by_lane_follow_the_tokenizer_threads():
    # 16 cores: up to 4 workers get 4 tokenizer threads each (data/tokenizer.py encode_threads), then
    # fewer. A thread tokenizes 0.5 M tok/s, the reader 3 M tok/s: 2 M tok/s per worker up to 4
    # workers; 5 workers run 4 threads each on 3.2 cores each (20 threads share 16 cores).
    rates = aw.WorkerRates(reader_tok_s=3e6, tokenizer_tok_s=0.5e6)
    assert [rates.at(n, 16) for n in (1, 4, 5, 16)] == [2e6, 2e6, 1.6e6, 0.5e6]
    got = choose(rates, 5e6, cores=16, shards=64)           # 1.3 x 5 = 6.5: 3 x 2 = 6 < 6.5 <= 8
    assert (got.num_workers, got.reason) == (4, "rate")
    # 4 cores and the tokenizer the bound: more workers share the same 4 threads, never more than
    # 4 M tok/s in all, so 4.55 M tok/s is out of reach: as many as the cores allow
    got = choose(aw.WorkerRates(reader_tok_s=10e6, tokenizer_tok_s=1e6), 3.5e6, cores=4, shards=64)
    assert (got.num_workers, got.reason) == (4, "cores")
    # a converted corpus has no tokenizer lane: the reader's rate, whatever the count
    assert aw.WorkerRates(reader_tok_s=7e6, tokenizer_tok_s=float("inf")).at(3, 16) == 7e6


def test_worker_rates_from_the_timers():
    # 2 workers, each 1000 rows of 256 tokens; the reader lane: seconds making slabs less the
    # waits for the tokenizer, 2 + 1.5; the tokenizer's thread-seconds 2 + 6
    w1 = {"make_s": 2.5, "tokenize_wait": 0.5, "tokenize": 2.0, "tokenizer_threads": 2, "rows_out": 1000}
    w2 = {"make_s": 4.0, "tokenize_wait": 2.5, "tokenize": 6.0, "tokenizer_threads": 2, "rows_out": 1000}
    rates = aw.worker_rates([w1, w2], 256)
    assert rates.reader_tok_s == pytest.approx(2000 * 256 / 3.5)
    assert rates.tokenizer_tok_s == pytest.approx(2000 * 256 / 8.0)
    # in-process, the reader thread also feeds the device (the host stages count on its lane);
    # a converted corpus has no tokenizer lane
    solo = {"make_s": 1.0, "h2d": 1.0, "in_host": 1, "rows_out": 100}
    assert aw.worker_rates([solo], 10).reader_tok_s == pytest.approx(500)
    assert aw.worker_rates([solo], 10).tokenizer_tok_s == float("inf")


@pytest.mark.parametrize("setting, needle", [
    ({"num_workers": "many"}, "data.num_workers='many': must be an integer >= 0 or auto"),
    ({"num_workers": -1}, "data.num_workers=-1: must be >= 0"),
    ({"num_workers": 1.5}, "data.num_workers=1.5"),
    ({"num_workers": "auto", "ram_budget_gb": 0}, "data.ram_budget_gb=0: must be a number of GB > 0"),
    ({"num_workers": "auto", "ram_budget_gb": "lots"}, "data.ram_budget_gb='lots'"),
    ({"num_workers": "auto", "auto_measure_steps": 0}, "data.auto_measure_steps=0: must be an integer >= 1"),
])
def test_bad_values_fail_in_one_line(setting, needle):
    sample = str(Path(train_mod.PROJECT_ROOT) / "data/sample/*/en_head.json.gz")
    tokenizer = str(train_mod.PROJECT_ROOT / "data/sample/tokenizer.json")
    cfg = data_lib.DataConfig(paths=sample, tokenizer=tokenizer, seq_len=64, global_batch_size=16,
                              num_shards=4, **setting)
    with pytest.raises(ValueError) as e:
        data_lib.validate_settings(cfg, 1)
    assert needle in str(e.value) and "\n" not in str(e.value)


# ---------------------------------------------------------------- real runs
N = 8           # steps of every run
RUN = [*MICRO, *ONE_SCHEDULE, "train.steps=8", "train.log_every=4", "checkpoint.every=4", "logger.wandb.mode=disabled",
       "train.eval_every=0", "data.seq_len=64", "data.num_shards=4",
       "train.debug_batches=true", "data.auto_measure_steps=2"]


def batch_hashes(run_dir):
    with open(Path(run_dir) / "debug_batches.p0.jsonl") as f:
        last = {r["step"]: r["batch_hash"] for r in map(json.loads, f)}
    assert sorted(last) == list(range(1, N + 1))
    return last


@pytest.fixture(scope="module")
def fixed_run(tmp_path_factory):
    """The reference: one worker throughout."""
    run_dir = tmp_path_factory.mktemp("fixed")
    train_mod.train(make_cfg(run_dir, *RUN, "data.num_workers=1"))
    return batch_hashes(run_dir)


def auto_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("data.num_workers=auto: ")]


@pytest.mark.slow
def test_auto_under_a_small_ram_budget_switches_to_in_process_same_batches(fixed_run, tmp_path, capsys):
    train_mod.train(make_cfg(tmp_path, *RUN, "data.num_workers=auto", "data.ram_budget_gb=0.001"))
    start, chosen = auto_lines(capsys.readouterr().out)
    assert "starting with 1 worker(s)" in start
    # chosen after step 1 (compile) + 2 measured steps
    assert chosen.startswith("data.num_workers=auto: 0 workers (one worker ")
    assert "M tok/s, step needs" in chosen
    assert "capped by RAM at 0" in chosen and "switched from 1 after step 3" in chosen
    [row] = [r for r in read_metrics(tmp_path) if "data/auto_num_workers" in r]
    assert row["step"] == 4 and row["data/auto_num_workers"] == 0 and row["data/auto_reason"] == "RAM"
    assert row["data/auto_provisional_workers"] == 1 and row["data/auto_worker_tok_s"] > 0
    assert row["data/auto_need_tok_s"] > 0 and row["data/auto_worker_rss_mb"] > 0
    assert row["data/auto_ram_budget_gb"] == pytest.approx(0.001)
    # the stats go on across the switch (one pipeline as far as the metrics are concerned)
    assert [r["data/batches"] for r in read_metrics(tmp_path)] == [4, 8]
    assert batch_hashes(tmp_path) == fixed_run
    # the checkpoint records the count in use: a resume starts from it
    meta, _ = restore_meta_and_data(find_resume({"dir": str(tmp_path / "checkpoints"), "resume_from": None}))
    assert meta["num_workers"] == 0


@pytest.mark.slow
def test_auto_resume_chooses_again_and_stays_exact(fixed_run, tmp_path, capsys):
    # 4 steps on 2 fixed workers, then a resume with auto: it starts from the saved count and
    # chooses again (whatever it chooses here, the batches are those of the fixed run)
    train_mod.train(make_cfg(tmp_path, *RUN, "data.num_workers=2", "train.steps=4"))
    capsys.readouterr()
    summary = train_mod.train(make_cfg(tmp_path, *RUN, "data.num_workers=auto"))
    assert summary["start_step"] == 4 and summary["steps"] == N
    start, chosen = auto_lines(capsys.readouterr().out)
    assert "starting with 2 worker(s)" in start
    [row] = [r for r in read_metrics(tmp_path) if "data/auto_num_workers" in r]
    n = row["data/auto_num_workers"]
    assert row["step"] == 8 and row["data/auto_provisional_workers"] == 2 and 1 <= n <= 2
    assert chosen.startswith(f"data.num_workers=auto: {n} worker")
    assert ("kept the provisional 2" in chosen) == (n == 2)
    assert batch_hashes(tmp_path) == fixed_run


# ---------------------------------------------------------------- several hosts
@pytest.mark.slow
def test_hosts_agree_on_the_most_any_needs(straight, tmp_path):
    # Two processes with different budgets: process 0's holds no worker (alone it would go
    # in-process), process 1's holds plenty (one worker: text never goes in-process on its own
    # and the tiny model needs far less than one worker's rate). Both run the larger count.
    # `straight`: the one-process reference run (conftest.py).
    port, procs = free_port(), []
    for i, budget in enumerate(["0.001", "null"]):
        log = open(tmp_path / f"log_p{i}.txt", "w")
        procs.append(forked.Popen(
            [sys.executable, str(TRAIN), f"hydra.run.dir={tmp_path}", *COMMON, "data.num_workers=auto",
             "data.auto_measure_steps=2", f"data.ram_budget_gb={budget}",
             f"distributed.coordinator_address=localhost:{port}", "distributed.num_processes=2",
             f"distributed.process_id={i}", "distributed.local_device_count=2"],
            cwd=tmp_path, env=env_for(2), stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    finish(procs, tmp_path)
    [chosen] = auto_lines((tmp_path / "log_p0.txt").read_text())[1:]
    assert chosen.startswith("data.num_workers=auto: 1 worker (") and "capped by RAM at 0" in chosen
    assert "this host alone needs 0, every host runs the most any needs" in chosen
    assert "kept the provisional 1" in chosen
    [row] = [r for r in read_metrics(tmp_path) if "data/auto_num_workers" in r]
    assert row["data/auto_num_workers"] == 1
    # every virtual shard delivered exactly the rows of the one-process run
    assert_every_shard_continues_exactly([(tmp_path, range(1, 11))], straight)


@pytest.mark.slow
def test_a_converted_corpus_goes_in_process_with_the_same_batches(tmp_path, capsys):
    # Nothing to tokenize and the tiny model's need far below one reader's rate: 0 workers,
    # switched to from the provisional 1, with the batches of a run that had none throughout.
    converted = tmp_path / "tok"
    assert convert(str(train_mod.PROJECT_ROOT / "data/sample/000[0-1]/en_head.json.gz"), converted) == 0
    on_records = [*RUN, f"data.paths={converted}", "data.eval.holdout_files=0"]
    train_mod.train(make_cfg(tmp_path / "fixed", *on_records, "data.num_workers=0"))
    capsys.readouterr()
    train_mod.train(make_cfg(tmp_path / "auto", *on_records, "data.num_workers=auto"))
    [chosen] = auto_lines(capsys.readouterr().out)[1:]
    assert chosen.startswith("data.num_workers=auto: 0 workers (")
    assert "in-process: no tokenizer" in chosen and "switched from 1 after step 3" in chosen
    [row] = [r for r in read_metrics(tmp_path / "auto") if "data/auto_num_workers" in r]
    assert row["data/auto_reason"] == "in-process" and row["data/auto_tokenizer_thread_tok_s"] is None
    assert batch_hashes(tmp_path / "auto") == batch_hashes(tmp_path / "fixed")

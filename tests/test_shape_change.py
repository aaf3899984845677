"""Context extension as one step of a run (data.shape_change=continue), through train.py: a run of
2 processes at seq_len 128 x batch 16 resumes on 1 process (8 devices) at 512 x 8 with model.rope_theta raised.

    pytest -n0 tests/test_shape_change.py -q        (~4 min on 2 shared cores)

Every run writes train.debug_batches lines (data/batch_log.py), whose "docs" give each row's
documents and their tokens: summed over both phases, every document of the first epoch has exactly
its tokens (text + EOS), none missing, none twice. A SIGKILL of the switched run and its restart
give the losses and batches of the uninterrupted switched run, step for step.
"""
import gzip
import json
import shutil
import signal
from collections import Counter
from pathlib import Path

import pytest

from tests.data_helpers import decode_doc_id, expected_tokens, write_corpus
from tests.run_helpers import MICRO, logs, main_in_process, read_jsonl, run, run_until

pytestmark = pytest.mark.slow

K, N = 3, 11          # the switch after step K; the switched run's last step
DATA = ["data.eval.holdout_files=0", "data.shuffle_window=4", "checkpoint.every=3"]
BEFORE = ["data.seq_len=128", "data.global_batch_size=16", f"train.steps={K}"]     # model.max_seq_len 256
AFTER = ["data.seq_len=512", "data.global_batch_size=8", "model.max_seq_len=512", "model.rope_theta=40000",
         "data.shape_change=continue", f"train.steps={N}"]


def last_records(run_dir: Path, name: str) -> dict:
    """{(file, step): record} of every process's `name`.p*.jsonl (a step run twice keeps its last)."""
    return {(f.name, r["step"]): r for f in sorted(run_dir.glob(f"{name}.p*.jsonl")) for r in read_jsonl(f)}


def losses(run_dir: Path) -> dict:
    return {r["step"]: r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl")}


@pytest.fixture(scope="module")
def switched(tmp_path_factory):
    """(corpus files, the run at 128 x 16 on 2 processes to step K, the same continued at 512 x 8 on
    1 process to step N)."""
    root = tmp_path_factory.mktemp("shape")
    # ~24k tokens: the run (3 x 2,048 then 8 x 4,096 tokens) reads past its first epoch
    write_corpus(root / "corpus", n_files=8, docs_per_file=12, min_words=40, max_words=160)
    files = sorted(str(p) for p in (root / "corpus").glob("*/en_head.json.gz"))
    data = [f"data.paths=[{root / 'corpus'}/*/en_head.json.gz]", *DATA]
    before = root / "before"
    run(before, *data, *BEFORE, processes=2)
    straight = root / "straight"
    shutil.copytree(before, straight)
    run(straight, *data, *AFTER)
    return files, data, before, straight


def test_every_document_once_across_the_switch(switched):
    files, _, before, straight = switched
    want = {}
    for f, path in enumerate(files):
        with gzip.open(path, "rt") as fh:
            for line, text in enumerate(fh):
                want[(f, line)] = len(expected_tokens(json.loads(text)["raw_content"]))
    got = Counter()
    for r in last_records(straight, "debug_batches").values():   # the copy holds the first phase's lines
        for row in r["docs"]:
            for d, n in row:
                epoch, f, line = decode_doc_id(d, len(files))
                got[(epoch, f, line)] += n
    first_epoch = {(f, line): n for (epoch, f, line), n in got.items() if epoch == 0}
    assert first_epoch == want, {k: (first_epoch.get(k), n) for k, n in want.items() if first_epoch.get(k) != n}
    assert len(want) == 96 and any(epoch == 1 for epoch, _, _ in got)     # the epoch ended inside the run
    steps = {step for _, step in last_records(straight, "debug_batches")}
    assert steps == set(range(1, N + 1))
    text = logs(straight)
    assert ("data.seq_len 128 -> 512, data.global_batch_size 16 -> 8, model.max_seq_len 256 -> 512, "
            "model.rope_theta 10000.0 -> 40000: continuing the data (data.shape_change=continue)") in text


def test_sigkill_after_the_switch_resumes_bit_identically(switched, tmp_path):
    _, data, before, straight = switched
    killed = tmp_path / "killed"
    shutil.copytree(before, killed)
    ckpt = killed / "checkpoints"
    rc = run_until(killed, lambda: (ckpt / "6").is_dir(), signal.SIGKILL, *data, *AFTER)
    assert rc == -signal.SIGKILL
    run(killed, *data, *AFTER)
    want, got = losses(straight), losses(killed)
    assert {s: got[s] for s in range(K + 1, N + 1)} == {s: want[s] for s in range(K + 1, N + 1)}
    hashes = {s: r["batch_hash"] for (_, s), r in last_records(straight, "debug_batches").items() if s > K}
    assert {s: r["batch_hash"] for (_, s), r in last_records(killed, "debug_batches").items() if s > K} == hashes


def test_refusals_name_the_setting_in_one_line(switched, tmp_path, capsys):
    """Without the flag the new shape is refused naming it; with it, num_shards or another model
    field are still refused."""
    _, data, before, _ = switched
    for i, (extra, message) in enumerate([
        (["data.seq_len=512", "data.global_batch_size=8", "model.max_seq_len=512"],
         "data.seq_len 128 -> 512, data.global_batch_size 16 -> 8, model.max_seq_len 256 -> 512): set "
         "data.shape_change=continue"),
        (["data.global_batch_size=8"], "data.global_batch_size 16 -> 8): set data.shape_change=continue"),
        (["data.seq_len=512", "model.max_seq_len=512", "data.shape_change=continue", "data.num_shards=8",
          "data.global_batch_size=8"], "data.shape_change=continue: data.num_shards changed (4 -> 8)"),
        (["data.seq_len=512", "model.max_seq_len=512", "data.shape_change=continue", "model.norm_eps=1e-6",
          "data.global_batch_size=8"], "model.norm_eps: checkpoint=1e-05 now=1e-06"),
    ]):
        run_dir = tmp_path / f"r{i}"
        shutil.copytree(before, run_dir)
        code, err = main_in_process(capsys, run_dir, *MICRO, *[d for d in data if not d.startswith("checkpoint.")],
                                    f"checkpoint.dir={run_dir}/checkpoints", "data.num_workers=0", *extra)
        assert code != 0 and any(message in line for line in err), err

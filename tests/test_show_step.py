"""scripts/show_step.py: the documents behind a training step, checked against real runs.

    pytest tests/test_show_step.py -q        (~2-3 min on 2 shared cores)

Every run is a real `python train.py` (tiny model, seq 64, 16 rows in 4 virtual shards) with
`train.debug_batches=true`, which logs per step and row [virtual shard, first doc id, last doc
id, hash of the row]. show_step replays the step from the run's checkpoints alone and must give
the very same rows, at every step of each run:
  text     2 processes for steps 1-4, then resumed by 1 process with an input worker to step 8
           (steps before a resume, after a resume and after a host-count change; the default
           keep=3 deletes checkpoint 2, so steps 1-3 replay from the start of the data);
  records  a converted (ArrayRecord) corpus, steps 1-4, then forked by another run directory
           with checkpoint.resume_from (steps 5 and 6 replay from the first run's checkpoint),
           and forked once more onto changed data (checkpoint.allow_data_change: the new data
           from its start);
  mixture  a text source (part of the sample as Parquet and JSON-array files) and the converted
           one, steps 1-3, then resumed re-weighted (data.mixture_change=continue) to step 6; the
           text source's documents are checked against their Parquet rows / array elements.
Mistakes fail in one line: no config, a step outside the run, a step before any known data
position, files changed since the run.
"""
import gzip
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.data_helpers import write_records
from tests.run_helpers import complete_steps, read_jsonl, rows_by_step, run

# Module fixtures train real runs: the whole file belongs to the slow tier.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "show_step.py"
SAMPLE = ROOT / "data" / "sample"
TOKENIZER = SAMPLE / "tokenizer.json"
WEB_FORMATS = (".parquet", ".parquet", ".json", ".json.gz")   # the mixture's text source, file by file


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod      # dataclasses look their module up while the file runs
    spec.loader.exec_module(mod)
    return mod


show = _load("show_step", SCRIPT)


def replayed_rows(run_dir, step):
    """show_step's rows of `step` in the debug_batches format."""
    res = show.show_step(run_dir, step)
    return [[r["shard"], r["first_doc_id"], r["last_doc_id"], r["hash"]] for r in res["rows"]], res


def assert_replays(run_dir, steps, debug_dir=None):
    """Every row of every step equals what the run logged (debug_dir: where it was logged)."""
    logged = rows_by_step(debug_dir or run_dir)
    bases = {}
    for s in steps:
        rows, res = replayed_rows(run_dir, s)
        assert len(rows) == 16
        assert rows == logged[s], f"step {s} (replayed from step {res['from_step']}) differs from the run"
        bases[s] = res["from_step"]
    return bases


def cli(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=120)


def in_process(capsys, *args):
    """`show_step.py ARGS` through its main() in this process (a start-up of the script costs
    ~3 s a call; test_mistakes_fail_in_one_line keeps one on the real command line)."""
    capsys.readouterr()
    code = show.main([str(a) for a in args])
    out = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out.out, out.err)


def assert_one_line_error(res, *needles):
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    for n in needles:
        assert n in lines[0], lines[0]


# ---------------------------------------------------------------- runs
@pytest.fixture(scope="module")
def text_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("text")
    run(run_dir, "data.num_workers=0", "checkpoint.every=2", "train.steps=4", processes=2)
    run(run_dir, "data.num_workers=1", "checkpoint.every=3", "train.steps=8")
    assert complete_steps(run_dir / "checkpoints") == [4, 6, 8]      # keep=3 deleted step 2
    return run_dir


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """The sample's 7 training files converted to ArrayRecord, and a text copy of 4 of them."""
    prepare = _load("prepare_data", ROOT / "scripts" / "prepare_data.py")
    out = tmp_path_factory.mktemp("conv") / "tok"
    assert prepare.main(["--paths", str(SAMPLE / "000[0-6]" / "en_head.json.gz"),
                         "--tokenizer", str(TOKENIZER), "--out", str(out), "--no-progress"]) == 0
    web = tmp_path_factory.mktemp("web")
    # the text source in the other formats show_step reads documents from (formats.open_records):
    # Parquet (2 rows per row group: a document's row is found across group boundaries) and JSON
    # arrays, plain and gzip'd, so that the replayed rows and texts cover them
    for i, ext in enumerate(WEB_FORMATS):
        with gzip.open(SAMPLE / f"{i:04d}" / "en_head.json.gz", "rt", encoding="utf-8") as f:
            recs = [{"raw_content": json.loads(line)["raw_content"]} for line in f]
        (web / f"{i:04d}").mkdir()
        write_records(str(web / f"{i:04d}" / f"en_head{ext}"), "parquet" if ext == ".parquet" else "array",
                      recs, row_group=2)
    return out, web


@pytest.fixture(scope="module")
def records_runs(converted, tmp_path_factory):
    out, _ = converted
    first, fork = tmp_path_factory.mktemp("records"), tmp_path_factory.mktemp("fork")
    common = [f"data.paths=[{out}]", "data.eval.holdout_files=0", "data.num_workers=0"]
    run(first, *common, "checkpoint.every=2", "train.steps=4")
    run(fork, *common, f"checkpoint.resume_from={first / 'checkpoints'}", "checkpoint.every=3",
        "train.steps=7")
    assert complete_steps(fork / "checkpoints") == [6, 7]
    return first, fork


@pytest.fixture(scope="module")
def changed_fork(converted, records_runs, tmp_path_factory):
    """The records run forked at step 4 onto changed data (another data seed), on purpose."""
    out, _ = converted
    first, _ = records_runs
    run_dir = tmp_path_factory.mktemp("changed")
    run(run_dir, f"data.paths=[{out}]", "data.eval.holdout_files=0", "data.num_workers=0", "data.seed=1",
        f"checkpoint.resume_from={first / 'checkpoints'}", "checkpoint.allow_data_change=true",
        "checkpoint.every=0", "train.steps=6")
    return run_dir


@pytest.fixture(scope="module")
def mix_run(converted, tmp_path_factory):
    out, web = converted
    run_dir = tmp_path_factory.mktemp("mix")

    def sources(conv_weight):
        return (f"data.sources=[{{name:web,paths:['{web}/*/en_head.*'],weight:1}},"
                f"{{name:conv,paths:['{out}'],weight:{conv_weight}}}]")

    common = ["data.paths=[]", "data.eval.holdout_files=0", "data.num_workers=1", "checkpoint.every=3"]
    run(run_dir, *common, sources(1), "train.steps=3")
    # resumed re-weighted: every source continues from its position, the rows follow new shares
    run(run_dir, *common, sources(3), "data.mixture_change=continue", "train.steps=6")
    return run_dir


# ---------------------------------------------------------------- rows equal the run's rows
@pytest.mark.slow
def test_text_steps_before_and_after_a_resume_on_another_host_count(text_run):
    bases = assert_replays(text_run, range(1, 9))
    # checkpoint c holds the position after batch c: step c replays from the checkpoint before it
    assert bases == {1: 0, 2: 0, 3: 0, 4: 0, 5: 4, 6: 4, 7: 6, 8: 6}


@pytest.mark.slow
def test_records_steps_and_a_forked_run(records_runs):
    first, fork = records_runs
    assert assert_replays(first, range(1, 5)) == {1: 0, 2: 0, 3: 2, 4: 2}
    # the fork's first steps come from the checkpoint it was forked from
    assert assert_replays(fork, range(5, 8)) == {5: 4, 6: 4, 7: 6}


@pytest.mark.slow
def test_a_run_resumed_on_changed_data_replays_the_new_data_from_its_start(changed_fork):
    # checkpoint 4 holds the old data's position; the fork read the new data from its start
    assert assert_replays(changed_fork, [5, 6]) == {5: 4, 6: 4}
    assert "changed at step 4" in show.show_step(changed_fork, 6, 0)["from"]


@pytest.mark.slow
def test_mixture_steps_before_and_after_a_reweighted_resume(mix_run):
    assert assert_replays(mix_run, range(1, 7)) == {1: 0, 2: 0, 3: 0, 4: 3, 5: 3, 6: 3}
    assert "mixture changed" in show.show_step(mix_run, 4, 0)["from"]
    res = show.show_step(mix_run, 5)
    sources = {r["source"] for r in res["rows"]}
    assert sources == {"web", "conv"}, sources
    for r in res["rows"]:
        assert all(d["source"] == r["source"] for d in r["documents"])
    # the text source's documents are the Parquet / JSON-array records they name: show_step's
    # text is that record's, and the row's tokens of it are a piece of it
    web = [d for s in (2, 5) for r in show.show_step(mix_run, s, tokens=True)["rows"] for d in r["documents"]
           if d["source"] == "web"]
    assert {Path(d["file"]).name for d in web} >= {"en_head.parquet", "en_head.json", "en_head.json.gz"}
    for d in web:
        full = _record_text(d["file"], d["line"])
        assert d["text"] == full[:60] and d["more"] == (len(full) > 60), (d["file"], d["line"])
        piece = d["decoded"].replace("</s>", "").strip()
        assert piece[:30] in full, (piece[:30], d["file"], d["line"])


# ---------------------------------------------------------------- what a row says
def _line_text(path, line, key="raw_content"):
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for i, raw in enumerate(f, 1):
            if i == line:
                return json.loads(raw)[key]
    raise AssertionError(f"{path} has no line {line}")


def _record_text(path, row, key="raw_content"):
    """Record `row` (from 1) of a Parquet or JSON-array file, read whole by pyarrow / json."""
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq
        return pq.read_table(path, columns=[key]).column(key)[row - 1].as_py()
    with (gzip.open if path.endswith(".gz") else open)(path, "rt", encoding="utf-8") as f:
        return json.load(f)[row - 1][key]


@pytest.mark.slow
def test_documents_name_their_file_line_or_record_and_text(text_run, mix_run):
    import tokenizers

    tok = tokenizers.Tokenizer.from_file(str(TOKENIZER))
    res = show.show_step(text_run, 6, tokens=True)
    docs = [d for r in res["rows"] for d in r["documents"]]
    assert len(docs) >= 16
    for d in docs:
        full = _line_text(d["file"], d["line"])
        assert d["text"] == full[:60] and d["more"] == (len(full) > 60)
        # the row's tokens of the document are a piece of that document (EOS aside)
        piece = d["decoded"].replace("</s>", "").strip()
        assert piece[:30] in full, (piece[:30], d["file"], d["line"])
    for r in res["rows"]:
        spans = [d["span"] for d in r["documents"]]
        # the documents tile the row (concat packing: no padding)
        assert spans[0][0] == 0 and spans[-1][1] == 65
        assert all(a[1] == b[0] for a, b in zip(spans[:-1], spans[1:], strict=True))
        assert len(r["tokens"]) == 65

    conv = [d for r in show.show_step(mix_run, 4)["rows"] for d in r["documents"] if d["source"] == "conv"]
    assert conv
    for d in conv:
        # part-00000i holds input i's documents in file order (the sample has no bad record)
        src = SAMPLE / f"{int(Path(d['file']).stem.split('-')[1]):04d}" / "en_head.json.gz"
        full = _line_text(src, d["index_in_file"] + 1)
        assert full.startswith(d["text"][:40]), (d["text"][:40], full[:40])
        assert tok.decode(tok.encode(full).ids[:8]).strip()[:10] in d["text"]


@pytest.mark.slow
def test_cli_text_and_json(text_run, mix_run):
    res = cli(text_run, "--step", 7, "--row", 6, "--tokens")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].startswith(f"step 7 of {text_run}: data position from {text_run}/checkpoints/6 (step 6)")
    assert lines[1].startswith("row 6  shard 1  source data.paths")
    assert ".json.gz:" in lines[2] and "  tokens [0, " in lines[2]
    assert any(line.startswith("    | ") for line in lines[3:])
    one = json.loads(cli(text_run, "--step", 7, "--row", 6, "--json").stdout)
    assert [r["row"] for r in one["rows"]] == [6]
    assert [one["rows"][0]["shard"], one["rows"][0]["first_doc_id"], one["rows"][0]["last_doc_id"],
            one["rows"][0]["hash"]] == rows_by_step(text_run)[7][6]
    mixed = cli(mix_run, "--step", 4).stdout.splitlines()
    assert any(line.startswith("row ") and line.endswith("source conv") for line in mixed), mixed
    assert any(line.startswith("  record ") and ".array_record#" in line for line in mixed), mixed
    assert any(line.startswith("row ") and line.endswith("source web") for line in mixed), mixed


# ---------------------------------------------------------------- mistakes, in one line
@pytest.mark.slow
def test_mistakes_fail_in_one_line(text_run, records_runs, tmp_path, capsys):
    assert_one_line_error(cli(tmp_path, "--step", 1), "no config.yaml")
    assert_one_line_error(in_process(capsys, text_run, "--step", 9), "step 9 is outside", "steps 1..8 exist")
    assert_one_line_error(in_process(capsys, text_run, "--step", 0), "step 0 is outside", "steps 1..8 exist")
    assert_one_line_error(in_process(capsys, text_run, "--step", 2, "--row", 16), "--row 16", "rows 0..15")
    _, fork = records_runs
    assert_one_line_error(in_process(capsys, fork, "--step", 4), "step 4 is before the first data position",
                          "steps 5..7 can be shown")


@pytest.mark.slow
def test_changed_files_fail_in_one_line(converted, mix_run, capsys):
    out, web = converted
    extra = web / "0099"
    shutil.copytree(web / "0000", extra)
    try:
        assert_one_line_error(in_process(capsys, mix_run, "--step", 2), "changed since it was trained",
                              "data.source.web.num_files: checkpoint=4 now=5")
    finally:
        shutil.rmtree(extra)
    part = out / "part-000003.array_record"
    saved = part.read_bytes()
    try:
        part.write_bytes(saved[:-10])
        assert_one_line_error(in_process(capsys, mix_run, "--step", 2), "part-000003.array_record has")
    finally:
        part.write_bytes(saved)
    assert in_process(capsys, mix_run, "--step", 2).returncode == 0
    assert read_jsonl(mix_run / "metrics.jsonl")[-1]["step"] == 6

"""The conversion on Apache Beam (scripts/prepare_data.py --runner DirectRunner, data/convert/beam.py):
its parts equal the in-process converter's byte for byte on the bundled sample with gopher and
exact + fuzzy dedup; fuzzy dedup as a GroupByKey over band buckets equals the in-memory result on
known band collisions (a missing minhash file included), and a minhash row naming no document
stops naming its file and row on both; both write the same fuzzy lists for the stream; a re-run
over existing parts redoes only what a killed attempt left, to the same bytes; the options built for Dataflow, offline.

Real Beam (DirectRunner), real ArrayRecord files; skipped without the [beam] extra. 26-47 s on 2
shared cores, most of it the sample's two conversions (those tests are marked slow); the fast tier's
part (fuzzy on known collisions, Dataflow's options) ~3-6 s.

    pytest -n0 -q tests/test_prepare_beam.py
"""
from __future__ import annotations

import glob
import gzip
import importlib.util
import json
import os
import shutil

import pytest

from data.readers import companions
from tests.data_helpers import REPO, SCRIPT, TOKENIZER, convert

# Looked up, not imported: every test worker collects this file, and apache_beam takes ~1.4 CPU-s to import.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("apache_beam") is None,
                                reason="the [beam] extra: pip install -e '.[beam]'")

SAMPLE = os.path.join(REPO, "data", "sample", "*", "en_head.json.gz")
SELECT = ("--quality", "gopher", "--dedup", "exact,fuzzy")
DIRECT = ("--runner", "DirectRunner")


def script():
    spec = importlib.util.spec_from_file_location("prepare_data", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def tree(root) -> dict[str, bytes]:
    """Every file under root (relative name -> bytes)."""
    out = {}
    for d, _, names in os.walk(root):
        for n in names:
            p = os.path.join(d, n)
            out[os.path.relpath(p, root)] = open(p, "rb").read()
    return out


@pytest.fixture(scope="module")
def sample_outs(tmp_path_factory):
    """The sample converted in this process and on DirectRunner, the same selection."""
    root = tmp_path_factory.mktemp("conv")
    local, direct = str(root / "local"), str(root / "direct")
    assert convert(SAMPLE, local, *SELECT) == 0
    assert convert(SAMPLE, direct, *SELECT, *DIRECT) == 0
    return local, direct


@pytest.mark.slow   # the sample converted twice (~20 s on 2 cores), shared with the next test
def test_direct_runner_parts_equal_the_in_process_converters(sample_outs):
    local, direct = sample_outs
    a, b = tree(local), tree(direct)
    assert sorted(a) == sorted(b) and len([n for n in a if n.endswith(".array_record")]) == 8
    assert [n for n in a if a[n] != b[n]] == []      # parts, done markers, job.json, manifest
    m = json.loads(a["manifest.json"])
    # --runner local runs fuzzy in memory (docs/data.md): the sample's 3 near-duplicates go there too
    assert m["dropped"]["dedup: fuzzy"] == 3 and m["selection"]["dedup"] == "exact,fuzzy"
    assert m["documents"] + sum(m["dropped"].values()) == 960


@pytest.mark.slow
def test_a_rerun_redoes_only_an_unfinished_part_to_the_same_bytes(sample_outs, tmp_path):
    _, direct = sample_outs
    out = str(tmp_path / "again")
    shutil.copytree(direct, out)
    before = tree(out)
    # part 3 as a killed attempt leaves it: committed, its marker not yet written, a temp file about
    os.remove(os.path.join(out, "done", "part-000003.json"))
    planted = os.path.join(out, "part-000003.array_record.tmp-hbeam-killed")
    open(planted, "wb").write(b"half a part")
    stamps = {n: os.stat(os.path.join(out, n)).st_mtime_ns for n in before if n.startswith("part-")}
    assert convert(SAMPLE, out, *SELECT, *DIRECT) == 0
    assert tree(out) == before and not os.path.exists(planted)
    redone = [n for n in stamps if os.stat(os.path.join(out, n)).st_mtime_ns != stamps[n]]
    assert redone == ["part-000003.array_record"]


# ---------------------------------------------------------------- fuzzy: known band collisions
def _corpus(root) -> str:
    """3 files of 4 documents; files 0 and 1 have minhash files with planted collisions, file 2 none."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    h = [bytes([k]) * 8 for k in range(40)]
    bands = {   # (file, row): (id_int, sim0.8 bands)
        (0, 0): (5, [h[1], h[2]]), (0, 1): (9, [h[3], h[2]]),      # 9 shares position 1 with 5: goes
        (0, 2): (2, [h[4], h[1]]), (0, 3): (7, [h[5], h[6]]),      # h1 at another position: no collision
        (1, 0): (1, [h[5], h[7]]), (1, 1): (8, [h[8], h[9]]),      # 1 < 7 at position 0: (0, 3) goes
        (1, 2): (3, [h[10], h[11]]), (1, 3): (4, [h[10], h[11]]),  # two buckets, one drop: (1, 3)
    }
    for f in range(3):
        rel = f"2023-06/{f:04d}/en_head"
        doc = os.path.join(str(root), "documents", rel + ".json.gz")
        os.makedirs(os.path.dirname(doc), exist_ok=True)
        with gzip.open(doc, "wb") as fh:
            fh.write(b"".join(json.dumps({"raw_content": f"doc {f}-{i} text"}).encode() + b"\n" for i in range(4)))
        if f == 2:
            continue
        mp = companions.companion_path(doc, "minhash")
        os.makedirs(os.path.dirname(mp), exist_ok=True)
        rows = [bands[(f, i)] for i in range(4)]
        pq.write_table(pa.table({
            "id": [f"{rel}.json.gz/{i}" for i in range(4)],
            "id_int": pa.array([r[0] for r in rows], pa.int64()),
            "signature_sim0.8": pa.array([r[1] for r in rows], pa.list_(pa.binary()))}), mp)
    return os.path.join(str(root), "documents", "*", "*", "en_head.json.gz")


@pytest.mark.slow   # a Beam pipeline start, 3-6 s
def test_fuzzy_group_by_key_equals_the_in_memory_result(tmp_path):
    from data.convert.fuzzy import fuzzy_dropped
    docs = _corpus(tmp_path)
    local, direct = str(tmp_path / "local"), str(tmp_path / "direct")
    assert convert(docs, local, "--dedup", "fuzzy") == 0
    assert convert(docs, direct, "--dedup", "fuzzy", *DIRECT) == 0
    a, b = tree(local), tree(direct)
    assert sorted(a) == sorted(b) and [n for n in a if a[n] != b[n]] == []
    files = sorted(p for p in a if p.startswith("done/"))
    kept = [json.loads(a[n])["documents"] for n in files]
    assert kept == [2, 3, 0]          # rows 1 and 3 of file 0, row 3 of file 1; file 2: no minhash file
    mem = fuzzy_dropped(sorted(glob.glob(docs)), "0.8")
    assert [sorted(v) for k, v in sorted(mem.items(), key=lambda kv: str(kv[0])) if k] == [[1, 3], [3]]
    # the lists the stream reads (data.fuzzy_lists): the same bytes from both runners (above), the
    # in-memory rows; none for the file without a minhash file
    lists = sorted(n for n in a if n.startswith("fuzzy/"))
    assert lists == [f"fuzzy/2023-06/{f:04d}/en_head.fuzzy.json" for f in (0, 1)]
    assert [json.loads(a[n])["rows"] for n in lists] == [[1, 3], [3]]
    assert {json.loads(a[n])["threshold"] for n in lists} == {"0.8"}
    m = json.loads(a["manifest.json"])
    assert m["dropped"] == {"dedup: fuzzy": 3} and m["bad_records"] == {"missing_companion": 1}
    assert m["bad_examples"][0].startswith(os.path.join(str(tmp_path), "minhash", "2023-06", "0002"))


# ---------------------------------------------------------------- Dataflow's options, offline
def _script_args(*extra):
    return script().parse_args(["--paths", "gs://b/rp/documents/*/*/en_head.json.gz", "--tokenizer",
                                    TOKENIZER, "--out", "gs://b/rp_tok", "--runner", "DataflowRunner", *extra])


def test_dataflow_options_built_by_the_script():
    from apache_beam.options.pipeline_options import GoogleCloudOptions, SetupOptions, WorkerOptions

    from data.convert.beam import pipeline_options
    args = _script_args("--project", "my-proj", "--region=us-central1", "--temp_location", "gs://b/tmp",
                        "--max_num_workers=50")
    assert args.beam_args == ["--project", "my-proj", "--region=us-central1", "--temp_location", "gs://b/tmp",
                              "--max_num_workers=50"]
    opts = pipeline_options(args.runner, args.beam_args, args)
    gcp = opts.view_as(GoogleCloudOptions)
    assert (gcp.project, gcp.region, gcp.temp_location) == ("my-proj", "us-central1", "gs://b/tmp")
    assert opts.get_all_options()["runner"] == "DataflowRunner"
    assert opts.view_as(WorkerOptions).max_num_workers == 50
    # the workers install this project from its pyproject.toml unless told another way
    assert opts.view_as(SetupOptions).setup_file == os.path.join(REPO, "pyproject.toml")
    image = pipeline_options(args.runner, [*args.beam_args, "--sdk_container_image=gcr.io/p/jaxpt:1"], args)
    assert image.view_as(SetupOptions).setup_file is None
    assert image.view_as(WorkerOptions).sdk_container_image == "gcr.io/p/jaxpt:1"
    # `--` may start Beam's options explicitly
    assert _script_args("--", "--project=p").beam_args == ["--project=p"]
    with pytest.raises(ValueError, match="needs --region, --temp_location"):
        pipeline_options(args.runner, ["--project=p"], args)
    args.out = "/mnt/local/tok"
    with pytest.raises(ValueError, match="--out=/mnt/local/tok must be a URL"):
        pipeline_options(args.runner, args.beam_args, args)


def test_beam_options_are_refused_with_the_local_runner():
    with pytest.raises(SystemExit):
        script().parse_args(["--paths", SAMPLE, "--tokenizer", TOKENIZER, "--out", "x", "--project=p"])


@pytest.mark.slow   # two conversions, Beam's start (~4 s)
def test_a_minhash_row_naming_no_document_stops_naming_file_and_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    docs = _corpus(tmp_path)
    mp = companions.companion_path(sorted(glob.glob(docs))[1], "minhash")
    t = pq.read_table(mp)
    pq.write_table(t.set_column(0, "id", pa.array(["x/0", "x/1", "no-row", "x/3"])), mp)
    with pytest.raises(SystemExit, match=f"{mp}: row 2 \\(id 'no-row'"):
        convert(docs, str(tmp_path / "local"), "--dedup", "fuzzy")
    with pytest.raises(SystemExit, match=f"{mp}: row 2 \\(id 'no-row'"):   # raised on a Beam worker
        convert(docs, str(tmp_path / "direct"), "--dedup", "fuzzy", *DIRECT)

"""scripts/prepare_data.py with URLs: input listed and read through fsspec (gs:// on a local GCS
emulator, Parquet on memory://), --out on gs:// / memory:// (parts written locally, uploaded, the
manifest last; a restart lists --out once and redoes only unfinished parts), each checked against
the same conversion on local disk; the same on Apache Beam (DirectRunner, two worker processes),
gs:// in and out. And training from a converted corpus named by URL: one line.

    pytest tests/test_prepare_urls.py -q
"""
import json
import os

import numpy as np
import pytest

import data
from data.streams import records
from tests import forked
from tests.data_helpers import convert, write_corpus, write_docs

pytest.importorskip("gcp_storage_emulator.server")
from tests.gcs_emulator import BUCKET, Emulator  # noqa: E402  (sets gcsfs's env before it loads)

gcsfs = pytest.importorskip("gcsfs")
pytest.importorskip("pyarrow")
N_FILES = 3


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    """The emulator, gcsfs pointed at it (anonymous), a .json.gz corpus on local disk and on the
    bucket, and its local conversion: (emulator, fs, local text root, gs:// text root, local out)."""
    em = Emulator()
    mp = pytest.MonkeyPatch()
    em.connect(mp)     # env and fsspec's gcs defaults, undone with mp
    root = tmp_path_factory.mktemp("text")
    write_corpus(root, n_files=N_FILES, docs_per_file=25, max_words=80)
    fs = gcsfs.GCSFileSystem(token="anon", project="test")
    fs.put(str(root), f"{BUCKET}/text", recursive=True)
    out = tmp_path_factory.mktemp("conv") / "local"
    assert convert(os.path.join(str(root), "*", "en_head.json.gz"), out) == 0
    yield em, fs, root, f"gs://{BUCKET}/text", out
    gcsfs.GCSFileSystem.clear_instance_cache()
    mp.undo()
    em.stop()


def tree(d) -> dict[str, bytes]:
    return {os.path.relpath(os.path.join(r, f), d): open(os.path.join(r, f), "rb").read()
            for r, _, fs in os.walk(d) for f in fs}


def token_arrays(out) -> list[list[np.ndarray]]:
    """Every part's documents, decoded: token ids per document, per part."""
    from array_record.python.array_record_module import ArrayRecordReader
    m = records.load_manifest(str(out))
    got = []
    for part in records.part_files(str(out)):
        r = ArrayRecordReader(part, "readahead_buffer_size:0")
        got.append([np.frombuffer(b, m["dtype"]) for b in r.read(list(range(r.num_records())))])
        r.close()
    return got


def without_sources(meta: dict) -> dict:
    meta = json.loads(json.dumps(meta))
    for p in meta.get("files", []):
        p.pop("source")
    meta.pop("source", None)
    meta.pop("sources", None)
    return meta


def assert_same_conversion(a, b, sources_b=None):
    """Two converted directories hold the same documents and metadata (sources apart: compared
    with `sources_b` when given)."""
    ta, tb = token_arrays(a), token_arrays(b)
    assert len(ta) == len(tb) == N_FILES
    for k, (x, y) in enumerate(zip(ta, tb, strict=True)):
        assert len(x) == len(y) > 0, k
        for d, (u, v) in enumerate(zip(x, y, strict=True)):
            np.testing.assert_array_equal(u, v, err_msg=f"part {k} document {d}")
    fa, fb = tree(a), tree(b)
    assert sorted(fa) == sorted(fb)
    for name in fa:
        if name.endswith(records.PART_SUFFIX):
            assert fa[name] == fb[name], name
        else:
            assert without_sources(json.loads(fa[name])) == without_sources(json.loads(fb[name])), name
    if sources_b is not None:
        assert json.loads(fb["job.json"])["sources"] == sources_b
        assert [p["source"] for p in records.load_manifest(str(b))["files"]] == sources_b


def test_gs_json_gz_converts_to_the_records_of_the_local_files(gcs, tmp_path):
    """The same .json.gz files read from gs:// give the same token arrays, parts and metadata as
    from local disk; the sources are recorded as the URLs; sizes come from the one listing."""
    em, _, root, url, local_out = gcs
    gcsfs.GCSFileSystem.clear_instance_cache()
    n0, m0 = len(em.lists()), len(em.per_object())
    assert convert(f"{url}/*/en_head.json.gz", tmp_path / "out") == 0
    want = [f"{url}/{i:04d}/en_head.json.gz" for i in range(N_FILES)]
    assert_same_conversion(local_out, tmp_path / "out", sources_b=want)
    assert len(em.lists()) - n0 == 1
    # no metadata request per file beyond opening it to read it (a size request would add one each)
    # no metadata request per object: sizes and opens go by the listing
    assert len(em.per_object()) - m0 == 0, em.per_object()[m0:]
    listing = data.listing.list_paths(f"{url}/*/en_head.json.gz")
    assert listing.sizes == {u: os.path.getsize(os.path.join(root, *u.split("/")[-2:])) for u in want}


def test_out_on_gs_is_the_local_out_and_a_restart_redoes_only_unfinished_parts(gcs, tmp_path, capsys):
    """--out gs://...: downloaded, every file is byte-identical to a local --out run's (local
    input); the staging directory is gone; nothing is left under a temporary name on the bucket.
    A restart finds the finished parts with one listing; a part without its done marker (a run
    killed between the two uploads) is converted again, and the corpus is unchanged."""
    em, fs, root, _, local_out = gcs
    src = os.path.join(str(root), "*", "en_head.json.gz")
    dest = f"gs://{BUCKET}/tok"
    stage = tmp_path / "stage"
    assert convert(src, dest, "--tmp", str(stage)) == 0
    assert "Training reads converted corpora from local or mounted storage: gcloud storage cp -r " \
           f"{dest} DIR" in capsys.readouterr().out
    assert os.listdir(stage) == []
    fs.invalidate_cache()
    assert not [p for p in fs.find(f"{BUCKET}/tok") if ".tmp" in p]
    fs.get(f"{BUCKET}/tok", str(tmp_path / "got"), recursive=True)
    assert tree(tmp_path / "got") == tree(local_out)

    fs.rm(f"{BUCKET}/tok/done/part-000001.json")
    fs.rm(f"{BUCKET}/tok/{records.MANIFEST}")
    n0 = len(em.lists())
    assert convert(src, dest, "--tmp", str(stage)) == 0
    assert "converted 1 of its 3 files (2 were already done)" in capsys.readouterr().out
    # the restart's listing of --out, and the listing of done/ that finds every part finished
    assert len(em.lists()) - n0 == 2
    fs.invalidate_cache()
    fs.get(f"{BUCKET}/tok", str(tmp_path / "again"), recursive=True)
    assert tree(tmp_path / "again") == tree(local_out)


@pytest.mark.slow      # Beam's DirectRunner start and the corpus converted once more: ~15-30 s on 2 cores
def test_beam_direct_runner_reads_and_writes_gs_as_the_local_converter(gcs, tmp_path):
    """The conversion on Apache Beam (--runner DirectRunner, its workers in their own processes) with
    --paths and --out on gs://, the emulator standing for a bucket: the parts and metadata are the
    local conversion's, the sources the URLs; nothing is left under a temporary name on the bucket."""
    pytest.importorskip("apache_beam", reason="the [beam] extra: pip install -e '.[beam]'")
    _, fs, _, url, local_out = gcs
    gcsfs.GCSFileSystem.clear_instance_cache()
    dest = f"gs://{BUCKET}/beam_tok"
    assert convert(f"{url}/*/en_head.json.gz", dest, "--runner", "DirectRunner", "--tmp", str(tmp_path / "stage"),
                   "--direct_running_mode=multi_processing", "--direct_num_workers=2") == 0     # Beam's own options
    fs.invalidate_cache()
    assert not [p for p in fs.find(f"{BUCKET}/beam_tok") if ".tmp" in p]
    fs.get(f"{BUCKET}/beam_tok", str(tmp_path / "got"), recursive=True)
    assert_same_conversion(local_out, tmp_path / "got",
                           sources_b=[f"{url}/{i:04d}/en_head.json.gz" for i in range(N_FILES)])


def test_parquet_on_memory_converts_and_writes_to_memory(tmp_path):
    """Parquet read through fsspec (memory:// stands in for s3:// and hf://) into a memory://
    --out: the documents and metadata of the same files converted locally."""
    import fsspec
    write_docs(tmp_path / "in", "parquet", n_files=N_FILES, docs_per_file=12)
    mem = fsspec.filesystem("memory")
    base = f"memory://prep_{os.getpid()}"
    mem.put(str(tmp_path / "in"), f"{base}/in", recursive=True)
    src = os.path.join(str(tmp_path / "in"), "*", "part.parquet")
    assert convert(src, tmp_path / "local", "--text-key", "story") == 0
    assert convert(f"{base}/in/*/part.parquet", f"{base}/out", "--text-key", "story",
                   "--tmp", str(tmp_path / "stage")) == 0
    mem.get(f"{base}/out", str(tmp_path / "got"), recursive=True)
    # the URLs as listed (fsspec's memory:// names them memory:///...)
    listed = data.listing.list_paths(f"{base}/in/*/part.parquet").files
    assert [u.replace(":///", "://") for u in listed] == [f"{base}/in/{i:04d}/part.parquet" for i in range(N_FILES)]
    assert_same_conversion(tmp_path / "local", tmp_path / "got", sources_b=listed)
    mem.rm(base, recursive=True)


def test_a_converted_corpus_on_a_url_fails_in_one_line(gcs, tmp_path):
    """data.paths naming a converted directory (or its parts, also through an @list file) by
    URL: one line saying where converted corpora are read from and how to get them there."""
    from tests.data_helpers import cfg
    _, fs, root, _, local_out = gcs
    fs.put(str(local_out), f"{BUCKET}/conv", recursive=True)
    url = f"gs://{BUCKET}/conv"
    line = (f"data.paths: {url} is a converted corpus on an object store; training reads converted "
            f"corpora from local or mounted storage: gcloud storage cp -r {url} DIR, or mount the "
            "bucket with gcsfuse, then data.paths=DIR")
    for paths in ([url], [f"{url}/*.array_record"]):
        with pytest.raises(ValueError) as e:
            data.list_files(cfg(root, paths=paths))
        assert str(e.value) == line
    listed = tmp_path / "parts.txt"
    listed.write_text(f"{url}/part-000000.array_record\n")
    files = data.list_files(cfg(root, paths=[f"@{listed}"]))
    with pytest.raises(ValueError) as e:
        records.stream_fields(files)
    assert str(e.value) == line


@pytest.mark.slow
def test_train_py_on_a_converted_url_stops_in_one_line_before_compile(gcs, tmp_path):
    import sys

    from tests.run_helpers import ROOT
    em, fs, _, _, local_out = gcs
    fs.put(str(local_out), f"{BUCKET}/conv_cli", recursive=True)
    url = f"gs://{BUCKET}/conv_cli"
    env = {**os.environ, **em.env(), "JAX_PLATFORMS": "cpu"}
    r = forked.run([sys.executable, str(ROOT / "train.py"), f"hydra.run.dir={tmp_path}/run",
                        "logger.wandb.mode=disabled", f"data.paths=[{url}]"],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert r.returncode != 0
    err = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert err and f"{url} is a converted corpus on an object store" in err[-1], r.stderr[-3000:]
    assert "gcloud storage cp -r" in err[-1] and "gcsfuse" in err[-1]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()

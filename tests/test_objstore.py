"""Training text read from an object store (data/readers/objstore.py) through fsspec: gs:// against a real
local GCS emulator (gcp-storage-emulator, started here in this process), checked against the same
files on local disk: the same batches on 1 and 2 hosts, exact restore mid-file, every document once
per epoch, a 2-host state restored on 1 host, requests counted at the emulator (one list request
per pattern; none per object, in input workers and in a resumed fresh process either), a missing
URL and a vanished object named in one line. And checkpoint.dir
on gs:// (Orbax: etils.epath through gcsfs, arrays through TensorStore's gcs driver) against the
same emulator: a train.py run saves there and a second one resumes from it, losses unchanged.

    pytest tests/test_objstore.py -q
"""
import dataclasses
import json
import os
import subprocess
import sys

import pytest

import data
from data.pipeline import state_counters
from tests import forked
from tests.data_helpers import (
    assert_batches_equal,
    cfg,
    doc_tokens,
    expected_tokens,
    jround,
    rows_of,
    take,
    write_corpus,
)

pytest.importorskip("gcp_storage_emulator.server")
from tests.gcs_emulator import BUCKET, Emulator  # noqa: E402  (sets gcsfs's env before it loads)

gcsfs = pytest.importorskip("gcsfs")


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    """The emulator, gcsfs pointed at it with anonymous credentials, and a corpus uploaded:
    returns (emulator, local root, gs:// root)."""
    em = Emulator(generations=True)     # as real GCS: what TensorStore (checkpoints) needs
    mp = pytest.MonkeyPatch()
    em.connect(mp)     # env and fsspec's gcs defaults, undone with mp
    root = tmp_path_factory.mktemp("objstore")
    write_corpus(root, n_files=4, docs_per_file=40)
    fs = gcsfs.GCSFileSystem(token="anon", project="test")
    fs.put(str(root), f"{BUCKET}/rp", recursive=True)
    yield em, root, f"gs://{BUCKET}/rp"
    gcsfs.GCSFileSystem.clear_instance_cache()
    mp.undo()
    em.stop()


def _pair(gcs, **kw):
    em, root, url = gcs
    local = cfg(root, **kw)
    remote = cfg(root, paths=(f"{url}/*/en_head.*",), **kw)
    return local, remote


@pytest.mark.parametrize("P", [1, 2])
def test_gs_gives_the_batches_of_the_same_local_files(gcs, P):
    local, remote = _pair(gcs)
    lf, rf = data.list_files(local), data.list_files(remote)
    assert len(rf) == len(lf) == 4 and all(f.startswith("gs://") for f in rf)
    for h in range(P):
        la, ra = data.make_host_iterator(local, h, P), data.make_host_iterator(remote, h, P)
        a, b = take(la, 25), take(ra, 25)
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_batches_equal(x, y, f"host {h} of {P}, batch {i}")
        # the object-store wait is its own stage of the per-stage table (data/timing.py)
        assert ra.stage_times()["fetch"] > 0 and la.stage_times()["fetch"] == 0


@pytest.mark.slow
def test_gs_through_input_worker_processes(gcs):
    """Spawned input workers open gs:// themselves (credentials and emulator from the environment),
    with the listing's sizes handed over in their StreamSpec: no request per object, no listing."""
    em, _, _ = gcs
    local, remote = _pair(gcs, num_workers=1)
    a = take(data.make_host_iterator(local, 0, 1), 6)
    files = data.list_files(remote)
    n0, m0, g0 = len(em.lists()), len(em.per_object()), len(_media(em))
    it = data.make_host_iterator(remote, 0, 1, files=files)
    b = take(it, 6)
    it.close()
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert_batches_equal(x, y, f"batch {i} through a worker")
    assert len(_media(em)) > g0, "the worker read nothing from the bucket"
    assert em.per_object()[m0:] == [], "an input worker asked for an object's metadata"
    assert len(em.lists()) == n0, "an input worker listed the bucket"


def _media(em) -> list[str]:
    """Object reads (media downloads) the emulator answered."""
    return [p for m, p in em.requests if m == "GET" and "alt=media" in p]


def test_gs_restore_mid_file_is_exact_and_lists_nothing(gcs):
    em, _, _ = gcs
    _, remote = _pair(gcs)
    files = data.list_files(remote)   # saved with the checkpoint: a resume lists nothing
    it = data.make_host_iterator(remote, 0, 1, files=files)
    states, batches = [], []
    for _ in range(30):
        states.append(jround(it.get_state()))
        batches.append(next(it))
    offs = [s[3] for st in states for sh in st["shards"].values() for s in sh["start"]["reader"]["slots"]]
    assert max(offs) > 0   # restores below start inside a file
    before = len(em.lists())
    for k in (5, 17, 29):
        r = data.make_host_iterator(remote, 0, 1, files=files)
        r.set_state(states[k])
        assert_batches_equal(next(r), batches[k], f"restore at {k}")
    assert len(em.lists()) == before, "a restore listed the bucket"


# A resumed run's data path as train.py takes it, in a process of its own (no gcsfs cache, no size
# known but the saved listing's): the listing saved with the checkpoint, the shard states, batches.
_RESUME = r"""
import json, sys
import numpy as np
import data
from tests.data_helpers import cfg

a = json.load(open(sys.argv[1]))
c = cfg(a["root"], paths=tuple(a["paths"]))
listing = data.run_listing(c.patterns(), [], a["saved"])
c, _, files, _ = data.split_eval(c, listing, 0)
data.check_files(c, 1, files)
it = data.make_host_iterator(c, 0, 1, files=files)
it.set_state(a["state"])
out = {}
for i in range(a["n"]):
    out.update({f"{i}.{k}": np.asarray(v) for k, v in next(it).items()})
np.savez(a["out"], **out)
"""


@pytest.mark.slow
@pytest.mark.parametrize("with_sizes", [True, False], ids=["sizes_saved", "old_checkpoint"])
def test_a_resume_in_a_fresh_process_asks_the_bucket_nothing(gcs, tmp_path, with_sizes):
    """A resume in a fresh process from the listing saved with the checkpoint: no list request, no
    request for an object's metadata (the sizes were saved with the listing), and the batches of
    the run it resumes. A checkpoint saved before sizes were kept still resumes: each object it
    opens costs a metadata request, as before."""
    import numpy as np

    from tests.run_helpers import ROOT
    em, root, _ = gcs
    _, remote = _pair(gcs)
    listing = data.run_listing(list(remote.paths), [], None, log=lambda _line: None)
    fs = gcsfs.GCSFileSystem(token="anon", project="test")
    assert listing["sizes"] == {f: fs.size(f) for f in listing["train"]}
    it = data.make_host_iterator(remote, 0, 1, files=listing["train"])
    take(it, 29)
    state = jround(it.get_state())
    assert max(s[3] for sh in state["shards"].values() for s in sh["start"]["reader"]["slots"]) > 0
    want = take(it, 4)
    saved = jround(listing)            # as in the checkpoint's meta "files" (JSON)
    if not with_sizes:
        del saved["sizes"]
    args = tmp_path / "args.json"
    args.write_text(json.dumps({"root": str(root), "paths": list(remote.paths), "saved": saved,
                                "state": state, "n": len(want), "out": str(tmp_path / "got.npz")}))
    n0, m0, g0 = len(em.lists()), len(em.per_object()), len(_media(em))
    r = subprocess.run([sys.executable, "-c", _RESUME, str(args)], capture_output=True, text=True,
                       timeout=300, cwd=ROOT, env={**os.environ, **em.env(), "JAX_PLATFORMS": "cpu"})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "from the checkpoint's list (no new listing)" in r.stdout, r.stdout
    assert len(_media(em)) > g0, "the resumed process read nothing from the bucket"
    got = np.load(tmp_path / "got.npz")
    for i, b in enumerate(want):
        assert_batches_equal({k: got[f"{i}.{k}"] for k in b}, b, f"batch {i} after the resume")
    if with_sizes:
        assert em.per_object()[m0:] == [], "the resumed process asked for an object's metadata"
        assert len(em.lists()) == n0, "the resumed process listed the bucket"
    else:
        assert em.per_object()[m0:], "an old checkpoint's objects were opened without their sizes?"


@pytest.mark.parametrize("P", [1, 2])
def test_gs_reads_every_document_exactly_once_per_epoch(gcs, tmp_path, P):
    """As tests/test_data_formats.py test_exactly_once_per_epoch, from gs://: 3 objects over 4
    shards (each object read by two shards from its own offsets), two epochs, 1 and 2 hosts."""
    prefix = f"{BUCKET}/once{P}"
    local = write_corpus(tmp_path, n_files=3, docs_per_file=10, max_words=40)
    gcsfs.GCSFileSystem(token="anon", project="test").put(str(tmp_path), prefix, recursive=True)
    texts = {(f"gs://{prefix}/{os.path.relpath(p, tmp_path)}", line): t for (p, line), t in local.items()}
    files = sorted({p for p, _ in texts})
    c = cfg(tmp_path, paths=(f"gs://{prefix}/*/en_head.*",), num_shards=4, global_batch_size=4,
            shuffle_window=4)
    assert data.list_files(c) == files
    # every batch takes one row (33 tokens) of each shard; the biggest shard (two of the six parts)
    # must pass two epochs
    n_batches = int(2.6 * sum(len(expected_tokens(t)) for t in texts.values()) / 3 / 33) + 24
    rows = []
    for h in range(P):
        it = data.make_host_iterator(c, h, P, debug=True, files=files)
        rows += rows_of(take(it, n_batches))
    epochs = {}
    for (e, f, rec), toks in doc_tokens(rows, len(files)).items():
        epochs.setdefault(e, {})[(files[f], rec + 1)] = toks
    assert max(epochs) >= 2
    for e in (0, 1):
        assert set(epochs[e]) == set(texts), f"epoch {e} on {P} hosts: documents missing or extra"
        for key, toks in epochs[e].items():
            assert sorted(toks) == sorted(expected_tokens(texts[key])), f"{key} on {P} hosts"
    assert not state_counters(it.get_state())["bad"]


def test_gs_state_of_2_hosts_restored_on_1_host(gcs):
    """As tests/test_data_formats.py test_elastic_restore_2_hosts_to_1, from gs://: the states of 2
    hosts merged and restored on 1 give the batches of the run that was on 1 host throughout,
    listing nothing."""
    from data.state import merge_host_states
    em, _, _ = gcs
    _, remote = _pair(gcs, shuffle_window=4, seq_len=16)
    files = data.list_files(remote)
    ref = take(data.make_host_iterator(remote, 0, 1, debug=True, files=files), 14)
    states = []
    for h in range(2):
        it = data.make_host_iterator(remote, h, 2, debug=True, files=files)
        take(it, 5)
        states.append(jround(it.get_state()))
    n0 = len(em.lists())
    it1 = data.make_host_iterator(remote, 0, 1, shard_states=merge_host_states(states), debug=True, files=files)
    for j in range(5, 14):
        assert_batches_equal(next(it1), ref[j], f"batch {j} after 2 hosts -> 1")
    assert len(em.lists()) == n0


def test_listing_is_one_request_per_pattern_and_none_per_file(gcs):
    em, _, url = gcs
    gcsfs.GCSFileSystem.clear_instance_cache()   # no listing cached from another test
    _, remote = _pair(gcs)
    n0, m0 = len(em.lists()), len(em.per_object())
    files = data.list_files(remote)
    assert len(files) == 4
    assert len(em.lists()) - n0 == 1
    assert len(em.per_object()) - m0 == 0


@pytest.mark.parametrize("rel", ["documents/*/*/en_head.json.gz", "documents/**/en_head.json.gz"])
def test_redpajama_v2_layout_on_gs_is_one_listing(gcs, rel):
    """RedPajama-v2's own layout (documents/<snapshot>/<shard>/<lang>_<part>.json.gz) at a gs:// URL:
    both globs find the English head files, in one list request (the objects under documents/) and
    none per object."""
    em, _, _ = gcs
    fs = gcsfs.GCSFileSystem(token="anon", project="test")
    want = []
    for snap in ("2023-06", "2023-14"):
        for shard in ("0000", "0001"):
            for name in ("en_head", "en_middle", "de_head"):
                key = f"{BUCKET}/redpajama-v2/documents/{snap}/{shard}/{name}.json.gz"
                fs.pipe(key, b"")
                if name == "en_head":
                    want.append(f"gs://{key}")
    fs.pipe(f"{BUCKET}/redpajama-v2/quality_signals/2023-06/0000/en_head.signals.json.gz", b"")
    gcsfs.GCSFileSystem.clear_instance_cache()   # no listing cached from the uploads
    n0, m0 = len(em.lists()), len(em.per_object())
    listing = data.list_paths([f"gs://{BUCKET}/redpajama-v2/{rel}"])
    assert listing.files == sorted(want)
    assert len(em.lists()) - n0 == 1
    assert len(em.per_object()) - m0 == 0


def test_list_files_name_urls_and_live_on_the_bucket(gcs, tmp_path):
    """An @list file may name URLs (a local list) or live on the bucket itself, its relative
    entries relative to its place there; the files and batches are those of the pattern, and the
    entries cost no request per object."""
    em, _, url = gcs
    _, remote = _pair(gcs)
    files = data.list_files(remote)
    local_list = tmp_path / "train_files.txt"
    local_list.write_text("# the corpus on the bucket\n" + "\n".join(files) + "\n")
    names = [f[len(url) + 1:] for f in files]               # e.g. 0000/en_head.json.gz
    fs = gcsfs.GCSFileSystem(token="anon", project="test")
    fs.pipe(f"{BUCKET}/rp/train_files.txt", ("\n".join(names) + "\n").encode())
    m0 = len(em.per_object())
    for entry in (f"@{local_list}", f"@{url}/train_files.txt"):
        listed = dataclasses.replace(remote, paths=(entry,))
        assert data.list_files(listed) == files, entry
        a, b = take(data.make_host_iterator(remote, 0, 1), 3), take(data.make_host_iterator(listed, 0, 1), 3)
        for x, y in zip(a, b, strict=True):
            assert_batches_equal(x, y, entry)
    assert len(em.per_object()) - m0 <= 1       # reading the list file on the bucket; none per entry
    with pytest.raises(ValueError, match=r"cannot read the file list @gs://corpus/rp/nope.txt"):
        data.list_files(dataclasses.replace(remote, paths=(f"@{url}/nope.txt",)))


def test_a_missing_url_fails_in_one_line(gcs):
    _, root, url = gcs
    with pytest.raises(ValueError, match=r"^data.paths: 'gs://corpus/nope/\*.json.gz' matches no file$"):
        data.list_files(cfg(root, paths=(f"gs://{BUCKET}/nope/*.json.gz",)))


def test_a_scheme_without_its_backend_names_the_extra(tmp_path):
    pytest.importorskip("fsspec")
    try:
        import s3fs  # noqa: F401
        pytest.skip("s3fs is installed")
    except ImportError:
        pass
    with pytest.raises(ValueError, match=r"s3fs: pip install -e '\.\[s3\]'"):
        data.list_files(cfg(tmp_path, paths=("s3://bucket/x/*.json.gz",)))


@pytest.mark.parametrize("strict", [False, True])
def test_an_object_deleted_mid_run_is_a_named_bad_file(gcs, strict):
    em, root, _ = gcs
    fs = gcsfs.GCSFileSystem(token="anon", project="test")
    prefix = f"{BUCKET}/gone{int(strict)}"
    fs.put(str(root), prefix, recursive=True)
    remote = cfg(root, paths=(f"gs://{prefix}/*/en_head.*",), num_shards=1, files_per_stream=1,
                 strict=strict)
    files = data.list_files(remote)
    it = data.make_host_iterator(remote, 0, 1, files=files)
    next(it)
    victim = files[-1]   # one stream reading one file at a time: the last is still to come
    fs.rm(victim)
    fs.invalidate_cache()
    if strict:
        with pytest.raises(data.BadDataError) as e:
            take(it, 300)
        assert "\n" not in str(e.value) and f"{victim}:" in str(e.value), str(e.value)
        assert "unreadable_file" in str(e.value), str(e.value)
        return
    for _ in range(300):
        next(it)
        bad = state_counters(it.get_state())
        if bad["bad"]:
            break
    assert bad["bad"] == {"unreadable_file": 1}, bad
    assert bad["badex"][0].startswith(f"{victim}:") and "unreadable_file" in bad["badex"][0], bad


# ---------------------------------------------------------------- transient errors
@pytest.mark.parametrize("strict", [False, True], ids=["lenient", "strict"])
@pytest.mark.parametrize("sizes_known", [True, False], ids=["ranged_reads", "opened_files"])
def test_a_transient_read_error_is_retried_then_a_bad_file(tmp_path, monkeypatch, sizes_known, strict):
    """Both ways an object is read: ranged reads (its size known from the listing) and an fsspec
    file (size unknown: an old checkpoint's listing, an @list entry). Reads that fail a few times
    are retried (strict too: nothing raised); a URL whose reads keep failing is an unreadable
    file, named with its tries, or one line in strict mode."""
    import fsspec
    from fsspec.implementations.memory import MemoryFileSystem

    from data.readers import objstore
    monkeypatch.setattr(objstore, "BACKOFF_S", 0.01)
    if not sizes_known:
        monkeypatch.setattr(objstore, "SIZES", {})
        monkeypatch.setattr(objstore, "remember_sizes", lambda sizes: None)
    state = {"fails": 2, "reads": 0, "dead": None}

    class FlakyFS(MemoryFileSystem):
        protocol = "flaky"

        @classmethod
        def _strip_protocol(cls, path):
            return super()._strip_protocol(path.removeprefix("flaky://"))

        @staticmethod
        def _flaky(path):
            state["reads"] += 1
            if state["dead"] and state["dead"] in path:
                raise ConnectionError("connection reset")
            if state["fails"] > 0:
                state["fails"] -= 1
                raise ConnectionError("connection reset")

        def cat_file(self, path, start=None, end=None, **kw):
            self._flaky(path)
            return super().cat_file(path, start, end, **kw)

        def _open(self, path, mode="rb", **kw):
            assert not (sizes_known and mode == "rb"), "an object of known size was opened as a file"
            f = super()._open(path, mode, **kw)
            read = f.read

            def flaky_read(n=-1):
                self._flaky(path)
                return read(n)
            f.read = flaky_read
            return f

    fsspec.register_implementation("flaky", FlakyFS, clobber=True)
    write_corpus(tmp_path, n_files=2, docs_per_file=10)
    fs = fsspec.filesystem("flaky")
    # a folder of its own: the in-memory store (and the reads patched into its files) outlives the test
    corpus = f"flaky_corpus_{int(strict)}_{int(sizes_known)}_{os.getpid()}"
    fs.put(str(tmp_path), f"/{corpus}", recursive=True)
    local = cfg(tmp_path, num_shards=2)
    remote = cfg(tmp_path, paths=(f"flaky:///{corpus}/*/en_head.*",), num_shards=2, strict=strict)
    a = take(data.make_host_iterator(local, 0, 1), 5)
    b = take(data.make_host_iterator(remote, 0, 1), 5)
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert_batches_equal(x, y, f"batch {i} after retried reads")
    assert state["fails"] == 0 and state["reads"] > 2
    assert not state_counters(data.make_host_iterator(remote, 0, 1).get_state())["bad"]
    # failing for good: every try fails -> the file is a bad file, named, not a crash
    state["dead"] = "0001/en_head"
    one = cfg(tmp_path, paths=remote.paths, num_shards=1, strict=strict)
    where = f"flaky:///{corpus}/0001/en_head.json.gz:1: unreadable_file ("
    if strict:
        with pytest.raises(data.BadDataError) as e:
            take(data.make_host_iterator(one, 0, 1), 10)
        msg = str(e.value)
        assert "\n" not in msg and where in msg and "after 4 tries" in msg, msg
        return
    it = data.make_host_iterator(one, 0, 1)
    take(it, 10)
    bad = state_counters(it.get_state())
    assert bad["bad"] == {"unreadable_file": 1}, bad
    assert bad["badex"][0].startswith(where) and "after 4 tries" in bad["badex"][0], bad


# ---------------------------------------------------------------- every format, through fsspec
@pytest.mark.parametrize("kind", ["array.json", "array.json.gz", "lines.jsonl.zstd", "parquet", "arrow"])
def test_every_format_from_a_url_gives_the_local_batches(tmp_path, kind):
    """fsspec's in-memory file system stands in for s3:// (the same ranged reads of objects whose
    size the listing gave, as gs://: only the backend differs); restore mid-file is exact through
    it too."""
    import fsspec

    from tests.data_helpers import fcfg, write_docs
    write_docs(tmp_path, kind, n_files=2, docs_per_file=30)
    fs = fsspec.filesystem("memory")
    base = f"memory://t_{os.getpid()}_{kind}"
    fs.put(str(tmp_path), base, recursive=True)
    kw = dict(num_shards=2, files_per_stream=2, shuffle_window=3, seq_len=16, global_batch_size=4)
    local = fcfg(tmp_path, **kw)
    remote = fcfg(tmp_path, paths=(f"{base}/*/part*",), **kw)
    files = data.list_files(remote)
    assert len(files) == 2 and all(f.startswith("memory://") for f in files)
    a = data.make_host_iterator(local, 0, 1)
    b = data.make_host_iterator(remote, 0, 1, files=files)
    states, batches = [], []
    for i in range(30):
        states.append(jround(b.get_state()))
        batches.append(next(b))
        assert_batches_equal(next(a), batches[-1], f"{kind} batch {i}")
    for k in (7, 22):
        r = data.make_host_iterator(remote, 0, 1, files=files)
        r.set_state(states[k])
        assert_batches_equal(next(r), batches[k], f"{kind}: restore at {k}")
    fs.rm(base, recursive=True)


# ---------------------------------------------------------------- gzip seek points through a URL
@pytest.mark.slow
def test_gzip_seek_points_and_restore_from_a_url_match_the_local_file(tmp_path):
    """data/readers/gzseek.py on a URL: indexed_gzip reads through the object-store file, and a restore
    inflates from the seek point (the same points and bytes as the local file)."""
    import gzip
    import random

    import fsspec

    from data.readers import gzseek
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "epsilon"]
    text = b"".join((" ".join(rng.choice(words) for _ in range(50)) + "\n").encode() for _ in range(20000))
    path = str(tmp_path / "x.json.gz")
    with gzip.open(path, "wb") as f:
        f.write(text)
    fs = fsspec.filesystem("memory")
    url = f"memory://gz_{os.getpid()}/x.json.gz"
    fs.put(path, url)
    off = len(text) * 3 // 4
    got = {}
    for p in (path, url):
        finder = gzseek.PointFinder(p)
        point = finder.point_before(off)
        finder.close()
        assert point is not None and point[3] > 0
        fh = gzseek.open_gz_at(p, point, off)
        got[p] = (point, fh.read(4000))
        fh.close()
    assert got[url] == got[path]
    assert got[url][1] == text[off:off + 4000]
    fs.rm(url)


# ---------------------------------------------------------------- checkpoint.dir on gs://
def _train(run_dir, env, *overrides):
    import sys

    from tests.run_helpers import ROOT
    r = forked.run([sys.executable, str(ROOT / "train.py"), f"hydra.run.dir={run_dir}", *overrides],
                       capture_output=True, text=True, env=env, cwd=run_dir.parent, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return r.stdout


@pytest.mark.slow
def test_checkpoint_dir_on_gs_saves_and_resumes(gcs, tmp_path):
    """checkpoint.dir=gs://BUCKET/ckpt: a run of 6 steps saves step 6 into the emulator's bucket
    (nothing on local disk), a run of 12 resumes from it (its arrays read from the bucket) and
    its losses are those of one straight 12-step run with local checkpoints."""
    from tests.run_helpers import TINY_FAST, read_metrics
    em, _, _ = gcs
    env = {**os.environ, **em.env(), "JAX_PLATFORMS": "cpu"}
    # TINY_FAST's decay_steps is fixed (run_helpers.ONE_SCHEDULE): a 6-step and a 12-step run follow one schedule
    common = [*TINY_FAST, "train.log_every=1", "train.eval_every=0", "logger.progress_bar=false"]
    ckpt = f"gs://{BUCKET}/ckpt"
    run_dir = tmp_path / "gs"
    first = _train(run_dir, env, *common, "train.steps=6", f"checkpoint.dir={ckpt}")
    assert "Resuming" not in first
    fs = gcsfs.GCSFileSystem(token="anon", project="test")
    fs.invalidate_cache()
    assert fs.ls(f"{BUCKET}/ckpt") == [f"{BUCKET}/ckpt/6"]
    saved = fs.find(f"{BUCKET}/ckpt/6")
    assert f"{BUCKET}/ckpt/6/commit_success.txt" in saved      # Orbax's commit marker on gs://
    assert any("/state/" in f and "/d/" in f for f in saved), saved   # the arrays' OCDBT data files
    assert f"{BUCKET}/ckpt/6/data/process_0-of-1.json" in saved
    assert not (run_dir / "checkpoints").exists()

    before = len(em.requests)
    second = _train(run_dir, env, *common, "train.steps=12", f"checkpoint.dir={ckpt}")
    assert f"Resuming from latest checkpoint {ckpt}/6 at step 6" in second, second
    media = [p for m, p in em.requests[before:] if m == "GET" and "alt=media" in p]
    assert any("ckpt%2F6%2Fstate%2F" in p and "%2Fd%2F" in p for p in media), "no array read from the bucket"
    fs.invalidate_cache()
    assert sorted(fs.ls(f"{BUCKET}/ckpt")) == [f"{BUCKET}/ckpt/12", f"{BUCKET}/ckpt/6"]

    straight = tmp_path / "local"
    _train(straight, env, *common, "train.steps=12")
    got = {r["step"]: r["loss"] for r in read_metrics(run_dir)}
    want = {r["step"]: r["loss"] for r in read_metrics(straight)}
    assert sorted(got) == sorted(want) == list(range(1, 13))
    assert got == want, {s: (got[s], want[s]) for s in got if got[s] != want[s]}


def test_report_reads_a_run_directory_on_gs(gcs, tmp_path):
    """scripts/report.py RUN_DIR=gs://...: the page of a run directory on the bucket is the page of
    the same files on local disk (the run named by its URL)."""
    import importlib.util
    import json
    import re

    from tests.run_helpers import ROOT

    spec = importlib.util.spec_from_file_location("report", ROOT / "scripts" / "report.py")
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    local = tmp_path / "run7"
    local.mkdir()
    rows = [{"step": s, "loss": 8.0 - s / 4, "tokens_per_s": 1000.0 + s, "data_wait_frac": 0.01} for s in (2, 4, 6)]
    events = [{"event": "start", "t": 0.0}, {"event": "restore", "t": 1.0, "step": 0, "tier": "init", "seconds": 0.0},
              {"event": "compile", "t": 2.0, "step": 1},
              {"event": "interval", "t": 6.0, "step": 6, "interval_s": 4.0, "data_wait_s": 0.5, "stall_s": 0.0},
              {"event": "exit", "t": 7.0, "reason": "clean", "step": 6, "saved": 6}]
    (local / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (local / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    fs = gcsfs.GCSFileSystem(token="anon", project="test")
    fs.put(str(local), f"{BUCKET}/runs/run7", recursive=True)
    url = f"gs://{BUCKET}/runs/run7"

    assert report.main([str(local), "--out", str(tmp_path / "local.html")]) == 0
    assert report.main([url, "--out", str(tmp_path / "url.html")]) == 0

    def text(p):   # the page without its images and the run's name
        return re.sub(r'src="data:image/png;base64,[^"]*"', "", p.read_text()).replace(url, "RUN").replace(
            str(local), "RUN")
    assert text(tmp_path / "url.html") == text(tmp_path / "local.html")
    assert "Goodput" in text(tmp_path / "url.html") or "goodput" in text(tmp_path / "url.html")
    with pytest.raises(SystemExit, match="is not a directory"):
        report.main([f"gs://{BUCKET}/runs/nothing_here"])

"""One listing per run (issue #13 §2): what listing the data files costs, on which process.

    pytest tests/test_data_listing.py -q

What is counted and how:
  * in-process, Python audit hooks see every directory read (os.scandir/os.listdir) and open;
    os.stat has no audit event, so stats are counted by data/listing.py's one stat gateway
    (`Listing.stats`), checked here against the files found;
  * with strace installed (it is on the dev machine; the tests skip without it), the system
    calls of real processes: a whole `train.py` run (every process: the trainer, its input
    worker) makes at most one metadata call per data file, and a second host makes none.
"""
import dataclasses
import glob
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from run_helpers import TINY_FAST, make_cfg, read_metrics, without_device_count

import data
import train as train_mod
from data.listing import list_paths
from data.pipeline import state_counters
from tests.data_helpers import cfg, take, write_corpus

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "data" / "sample"

_events: list | None = None


def _audit(event, args):
    if _events is not None and event in ("os.scandir", "os.listdir", "open", "glob.glob"):
        _events.append((event, str(args[0]) if args else ""))


sys.addaudithook(_audit)


def _recorded(fn):
    """fn()'s result and the directory reads / opens it made."""
    global _events
    _events = []
    try:
        return fn(), list(_events)
    finally:
        _events = None


def make_tree(root: Path, n_dirs: int = 12) -> Path:
    """RedPajama's layout (one file per directory) plus a flat directory with a subdirectory
    and a hidden file, which globs must not return."""
    for i in range(n_dirs):
        (root / "rp" / f"{i:04d}").mkdir(parents=True)
        (root / "rp" / f"{i:04d}" / "en_head.json.gz").write_bytes(b"")
    flat = root / "flat"
    (flat / "sub.jsonl").mkdir(parents=True)     # a directory whose name matches *.jsonl
    (flat / "sub.jsonl" / "deep.jsonl").write_bytes(b"")
    for name in ("a.jsonl", "b.jsonl", ".hidden.jsonl"):
        (flat / name).write_bytes(b"")
    return root


def reference(patterns) -> list[str]:
    """What the old listing returned: glob, then a stat per match."""
    out = set()
    for p in patterns:
        out.update(f for f in glob.glob(p, recursive=True) if os.path.isfile(f))
    return sorted(out)


@pytest.mark.parametrize("rel_patterns, dirs_read, stats", [
    (["rp/*/en_head.json.gz"], 1, 12),          # one directory read, one stat per file
    (["flat/*.jsonl"], 1, 0),                   # the directory read gives the types: no stat
    (["rp/000[0-3]/en_head.json.gz", "flat/a.jsonl"], 1, 5),
    (["**/*.jsonl"], 16, 0),                    # every directory read once (root, rp, 12, flat, sub)
    (["rp/**"], 13, 0),
])
def test_listing_matches_glob_with_at_most_one_call_per_file(tmp_path, rel_patterns, dirs_read, stats):
    root = make_tree(tmp_path)
    patterns = [str(root / p) for p in rel_patterns]
    listing, events = _recorded(lambda: list_paths(patterns))
    assert listing.files == reference(patterns) and listing.files
    assert (listing.dirs_read, listing.stats) == (dirs_read, stats)
    assert listing.stats <= len(listing.files)
    # The audit hooks agree: nothing but the counted directory reads, and no file opened.
    assert [e for e, _ in events] == ["os.scandir"] * dirs_read, events


def make_redpajama_v2(root: Path) -> Path:
    """RedPajama-v2's own layout, documents/<snapshot>/<shard>/<lang>_<part>.json.gz: 2 snapshots x 3
    shards, each with English head and middle and German head; the bucket's root holds more than
    documents/ (quality signals)."""
    for snap in ("2023-06", "2023-14"):
        for shard in ("0000", "0001", "0002"):
            d = root / "documents" / snap / shard
            d.mkdir(parents=True)
            for name in ("en_head", "en_middle", "de_head"):
                (d / f"{name}.json.gz").write_bytes(b"")
            q = root / "quality_signals" / snap / shard
            q.mkdir(parents=True)
            (q / "en_head.signals.json.gz").write_bytes(b"")
    return root


@pytest.mark.parametrize("rel, n_files, dirs_read, stats", [
    # documents/, then each snapshot's directory; one stat per literal en_head.json.gz
    ("documents/*/*/en_head.json.gz", 6, 3, 6),
    # documents/, each snapshot's and each shard's directory read once (the types come with it): no stat
    ("documents/**/en_head.json.gz", 6, 9, 0),
    ("documents/2023-06/*/en_head.json.gz", 3, 1, 3),     # one snapshot: one directory read
])
def test_redpajama_v2_layout_lists_its_english_head_files(tmp_path, rel, n_files, dirs_read, stats):
    root = make_redpajama_v2(tmp_path / "redpajama-v2")
    listing, events = _recorded(lambda: list_paths([str(root / rel)]))
    assert listing.files == reference([str(root / rel)])
    assert len(listing.files) == n_files and all(f.endswith("/en_head.json.gz") for f in listing.files)
    assert all("/documents/" in f for f in listing.files)
    assert (listing.dirs_read, listing.stats) == (dirs_read, stats)
    assert [e for e, _ in events] == ["os.scandir"] * dirs_read, events   # no directory read twice


def test_the_redpajama_v2_config_names_the_datasets_own_layout(tmp_path, monkeypatch):
    """configs/data/redpajama_v2.yaml's default data.paths finds the English head files of a bucket
    mounted where it says (~/folder-for-bucket/redpajama-v2), in RedPajama-v2's own layout."""
    from omegaconf import OmegaConf

    monkeypatch.setenv("HOME", str(tmp_path))
    make_redpajama_v2(tmp_path / "folder-for-bucket" / "redpajama-v2")
    paths = OmegaConf.load(ROOT / "configs" / "data" / "redpajama_v2.yaml").paths
    files = list_paths(list(paths)).files
    assert [f.split("/documents/")[1] for f in files] == [
        f"{snap}/{shard}/en_head.json.gz" for snap in ("2023-06", "2023-14") for shard in ("0000", "0001", "0002")]


def test_relative_patterns_stay_relative(tmp_path, monkeypatch):
    make_tree(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert list_paths(["flat/*.jsonl"]).files == ["flat/a.jsonl", "flat/b.jsonl"] == reference(["flat/*.jsonl"])


def test_file_list_one_stat_per_entry_and_errors_name_the_line(tmp_path):
    root = make_tree(tmp_path)
    (root / "rp" / "list.txt").write_text("# training files\n0001/en_head.json.gz\n\n"
                                           f"{root}/flat/a.jsonl\n  0003/en_head.json.gz  \n")
    listing, events = _recorded(lambda: list_paths([f"@{root}/rp/list.txt", str(root / "flat" / "b.jsonl")]))
    assert listing.files == sorted([f"{root}/rp/0001/en_head.json.gz", f"{root}/flat/a.jsonl",
                                    f"{root}/rp/0003/en_head.json.gz", f"{root}/flat/b.jsonl"])
    assert (listing.dirs_read, listing.stats) == (0, 4)
    assert [e for e, _ in events] == ["open"]          # the list file itself

    (root / "bad.txt").write_text("rp/0001/en_head.json.gz\nrp/9999/en_head.json.gz\n")
    with pytest.raises(ValueError, match=r"data.paths: @.*bad.txt:2 names .*9999/en_head.json.gz.*not a file"):
        list_paths([f"@{root}/bad.txt"])
    with pytest.raises(ValueError, match=r"data.eval.paths: cannot read the file list @.*nope.txt"):
        list_paths([f"@{root}/nope.txt"], "data.eval.paths")
    with pytest.raises(ValueError, match=r"data.paths: '.*rp/\*/en_tail.json.gz' matches no file"):
        list_paths([str(root / "rp" / "*" / "en_head.json.gz"), str(root / "rp" / "*" / "en_tail.json.gz")])
    (root / "empty.txt").write_text("# nothing yet\n")
    with pytest.raises(ValueError, match="names no file"):
        list_paths([f"@{root}/empty.txt"])


# ---------------------------------------------------------------- whole runs
needs_strace = pytest.mark.skipif(shutil.which("strace") is None, reason="strace is not installed")


def copy_sample(dst: Path) -> Path:
    # The documents only: the sample's RPv2 companion folders (quality_signals/, duplicates/,
    # minhash/) would add a failed stat of <folder>/en_head.json.gz each to the glob's walk.
    shutil.copytree(SAMPLE, dst, ignore=shutil.ignore_patterns("tokenizer.json", "quality_signals", "duplicates",
                                                               "minhash"))
    return dst


@pytest.mark.slow
@needs_strace
def test_a_run_makes_at_most_one_metadata_call_per_file(tmp_path):
    # A whole train.py run (listing, validation, eval split, fingerprint, eval set, an input
    # worker, a checkpoint) under strace -f: every data file is stat-ed at most once.
    corpus = copy_sample(tmp_path / "corpus")
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench" / "bench_listing.py"), str(corpus),
                          "--out", str(tmp_path / "bench"), "--steps", "1", "--no-resume"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    figures = json.loads(out.stdout.strip().splitlines()[-1])["new_run"]
    assert figures["files_seen"] == 8, figures
    assert figures["max_metadata_one_file"] <= 1, figures
    assert figures["directory_reads"] == 1, figures


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_second_host_receives_the_list_and_never_touches_the_files(tmp_path):
    corpus = copy_sample(tmp_path / "corpus")
    port = free_port()
    env = without_device_count()
    env["JAX_PLATFORMS"] = "cpu"
    traced = shutil.which("strace") is not None
    procs = []
    for i in range(2):
        cmd = [sys.executable, str(ROOT / "tests" / "listing_host.py"), str(i), str(port), str(corpus)]
        if traced:
            cmd = ["strace", "-f", "-qq", "-e", "trace=%file", "-o", str(tmp_path / f"p{i}.strace"), *cmd]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    outs = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, stdout[-2000:] + stderr[-3000:]
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    expected = reference([f"{corpus}/*/en_head.json.gz"])
    assert outs[0]["files"] == outs[1]["files"] == expected
    # Process 0: one directory read for the first listing; the second reads it again, then
    # tries the held-out glob's missing directory.
    assert [e for e, _ in outs[0]["touched"]] == ["os.scandir"] * 3, outs[0]["touched"]
    assert outs[1]["touched"] == []
    # A listing error on process 0 reaches every process as the same one line (no host hangs).
    assert outs[0]["error"] == outs[1]["error"] and "data.eval.paths" in outs[0]["error"]
    if traced:
        lines = [(tmp_path / f"p{i}.strace").read_text() for i in range(2)]
        assert str(corpus) in lines[0]
        assert str(corpus) not in lines[1]          # not one system call names the corpus


@pytest.mark.slow
def test_resume_uses_the_saved_list_without_a_walk(tmp_path):
    corpus = copy_sample(tmp_path / "corpus")
    run = tmp_path / "run"
    common = [*TINY_FAST, "train.log_every=1", "train.eval_every=0", f"data.paths=['{corpus}/*/en_head.json.gz']"]
    train_mod.train(make_cfg(run, *common, "train.steps=2"))
    # A file added since is not part of the run: a new walk would find 9 files and the
    # fingerprint would stop the resume.
    shutil.copytree(corpus / "0007", corpus / "0008")
    summary, events = _recorded(lambda: train_mod.train(make_cfg(run, *common, "train.steps=3")))
    assert summary["start_step"] == 2 and summary["steps"] == 3
    walked = [p for e, p in events if e in ("os.scandir", "os.listdir") and p.startswith(str(corpus))]
    assert not walked, walked
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]

    # New patterns (here: a file list naming the same files) list afresh; same files, same run.
    (tmp_path / "list.txt").write_text("".join(f"{corpus}/{i:04d}/en_head.json.gz\n" for i in range(8)))
    common[-1] = f"data.paths=['@{tmp_path}/list.txt']"
    summary = train_mod.train(make_cfg(run, *common, "train.steps=4"))
    assert summary["start_step"] == 3 and summary["steps"] == 4


def test_a_file_gone_from_a_saved_list_is_skipped_and_named(tmp_path):
    # The resume trusts the saved list: a file deleted since is an unreadable file, counted and
    # named like other bad data (data.strict=true stops at it instead).
    write_corpus(tmp_path, n_files=4, docs_per_file=4)
    c = cfg(tmp_path, num_shards=2, global_batch_size=2, num_workers=0, shuffle_window=0)
    files = data.list_files(c)
    gone = files[1]
    os.remove(gone)
    it = data.make_host_iterator(c, 0, 1, files=files)
    take(it, 40)
    counters = state_counters(it.get_state())
    assert counters["bad"].get("unreadable_file", 0) >= 1
    assert any(ex.startswith(f"{gone}:") and "unreadable_file" in ex for ex in counters["badex"]), counters["badex"]
    strict = data.make_host_iterator(dataclasses.replace(c, strict=True), 0, 1, files=files)
    with pytest.raises(data.BadDataError, match="unreadable_file"):
        take(strict, 40)

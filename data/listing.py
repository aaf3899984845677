"""The run's file list: `data.paths` (globs, plain paths, `@list` files, directories) -> sorted file
paths.

A bucket mounted with gcsfuse holds thousands of files, and every uncached metadata call
(stat, lookup) is a bucket request. `list_paths` therefore costs at most one metadata call
per file: a glob component is matched against one read of its directory (the entries' types
come with the read), and only a literal last component (`*/en_head.json.gz`, a plain path,
an entry of a list file) is stat-ed, once. train.py runs it on one process, hands the list
to the other hosts and saves it with the checkpoint, so a run lists its bucket once. A URL
pattern's objects come with their sizes (one list request), kept with the listing ("sizes"), so
that no process of the run, a resumed one included, asks the store for an object's metadata.

Entries of a pattern list:
  /mnt/rp/documents/*/*/en_head.json.gz  a glob (`*`, `?`, `[...]`, `**` for any depth)
  /mnt/rp/0001/en_head.json.gz  a plain path
  @/mnt/rp/train_files.txt    a text file of paths, one per line (blank lines and `#`
                              comments skipped; relative paths are relative to the list
                              file's directory); entries are literal, never globs
  /data/tok_dir               a directory written by scripts/prepare_data.py, or a Hugging Face
                              datasets `save_to_disk` directory (its Arrow files, data/readers/formats.py)
"""
from __future__ import annotations

import dataclasses
import fnmatch
import glob
import os
import re
import stat
import time
from typing import Callable

from data.readers import objstore  # no fsspec until a URL is met (objstore imports it then)


@dataclasses.dataclass
class Listing:
    files: list[str]            # sorted, deduplicated
    dirs_read: int = 0          # directory reads (os.scandir)
    stats: int = 0              # per-file metadata calls (os.stat)
    # {url: size} of the objects URL patterns matched, from their listing: opened without a
    # metadata request (data/readers/objstore.py), the converter's progress total; local files and @list
    # entries are not in it
    sizes: dict[str, int] = dataclasses.field(default_factory=dict)

    def describe(self) -> str:
        return (f"{len(self.files)} files ({self.dirs_read} directory reads, "
                f"{self.stats} stats)")


def list_paths(patterns, setting: str = "data.paths") -> Listing:
    """Every file matched by `patterns`; ValueError naming the first entry that matches no
    file (or the list file and line naming a missing one). `setting` names the config key
    in those messages."""
    if isinstance(patterns, str):
        patterns = (patterns,)
    walker = _Walker()
    files: set[str] = set()
    sizes: dict[str, int] = {}
    for p in patterns:
        p = str(p)
        if p.startswith("@"):
            files.update(walker.list_file(p[1:], setting))
            continue
        if "://" in p:
            found = _list_url(p, setting)
            walker.dirs_read += 1   # one list request per URL pattern (sizes come with it)
            files.update(found)
            sizes.update(found)
            continue
        found = walker.expand(os.path.expanduser(p))
        if not found and not glob.has_magic(p) and os.path.isdir(os.path.expanduser(p)):
            found = _converted_dir(p, setting)
        if not found:
            raise ValueError(f"{setting}: {p!r} matches no file")
        files.update(found)
    return Listing(sorted(files), walker.dirs_read, walker.stats, sizes)


def _list_url(pattern: str, setting: str) -> dict[str, int]:
    """The objects a URL pattern matches with their sizes, from one listing request
    (data/readers/objstore.py). A URL without a glob that names a "folder" (hf://datasets/ORG/NAME[@REV], a
    bucket prefix) stands for its train files, chosen as for a local dataset folder (_hf_select)
    from that same listing, plus one read of its README.md (the dataset card) when it has one."""

    folder = not any(c in pattern for c in "*?[")
    try:
        if folder:
            sizes, rels = objstore.list_folder(pattern)
            found = sorted(sizes)
        else:
            found, sizes = objstore.list_url(pattern)
            rels = {}
    except ValueError as e:
        raise ValueError(f"{setting}: {e}") from None
    except Exception as e:   # noqa: BLE001 - a backend's error: named in one line
        raise ValueError(f"{setting}: {pattern!r} cannot be listed: {type(e).__name__}: "
                         f"{str(e).splitlines()[0][:200] if str(e) else ''}") from None
    if not found:
        raise ValueError(f"{setting}: {pattern!r} matches no file")
    from data.streams import records  # only names; array_record is imported when a part is read
    part = next((f for f in found if f.endswith(records.PART_SUFFIX)), None)
    if part is not None:
        # converted corpora are read from local paths (data/streams/records.py): said now, not later as
        # a mix of records and "text" files or a missing manifest
        raise ValueError(records.url_dir_message(part, setting))
    if rels:
        chosen = _url_folder(pattern.rstrip("/"), rels, setting)
        sizes = {u: sizes[u] for u in chosen}
    return sizes


def _url_folder(url: str, rels: dict[str, str], setting: str) -> list[str]:
    """The train files (URLs) of a folder at a URL, given {url: relative path} of its objects."""
    by_rel = {rel: u for u, rel in rels.items()
              # as the local walk: nothing under a hidden folder (.git, .huggingface, .cache)
              if not any(part.startswith(".") for part in rel.split("/")[:-1])}
    if "state.json" in by_rel or "dataset_dict.json" in by_rel:
        # a save_to_disk directory is read from its state.json locally; its JSON files are no data
        raise ValueError(f"{setting}: {url!r} is a Hugging Face save_to_disk directory: at a URL give "
                         f"its Arrow files as a glob ({url}/*.arrow, or {url}/SPLIT/*.arrow)")
    card = None
    if "README.md" in by_rel:
        try:
            with objstore.open_url(by_rel["README.md"]) as f:
                card = f.read().decode("utf-8", errors="replace")
        except (OSError, ValueError) as e:
            raise ValueError(f"{setting}: {url}/README.md: the dataset card cannot be read "
                             f"({type(e).__name__})") from None
    chosen = _hf_select(list(by_rel), card, url, setting)
    if chosen is None:
        raise ValueError(f"{setting}: {url!r} holds no file of a format read here: give globs of "
                         "its files instead (e.g. URL/*.parquet, URL/**/*.json.gz)")
    return [by_rel[rel] for rel in chosen]


def _converted_dir(path: str, setting: str) -> list[str]:
    """A directory stands for the files it describes, read from its own metadata (no walk, no
    stat): the ArrayRecord parts of a directory written by scripts/prepare_data.py (its
    manifest), or the Arrow files of a Hugging Face `save_to_disk` directory (its state.json)."""
    from data.streams import records  # array_record is imported only for converted corpora

    if records.is_converted_dir(path):
        return records.part_files(path)
    hf = _hf_saved_dir(path, setting)
    if hf is not None:
        return hf
    hf = _hf_repo_dir(path, setting)
    if hf is not None:
        return hf
    raise ValueError(f"{setting}: {path!r} is a directory, neither written by scripts/prepare_data.py "
                     f"({records.MANIFEST}) nor by Hugging Face datasets' save_to_disk (state.json), nor "
                     "a Hugging Face dataset folder with data files we read: give globs of its files "
                     "instead (e.g. DIR/*.parquet, DIR/**/*.json.gz)")


# A file's split in a hub dataset folder, from its path as the hub's default layout names it
# (data/train-00000-of-00004.parquet, train/part-0.jsonl, en/validation.json.gz ...).
_SPLIT_WORDS = {"train": ("train", "training"), "validation": ("validation", "valid", "val", "dev"),
                "test": ("test", "testing", "eval", "evaluation")}


def _path_split(rel: str) -> str | None:
    tokens = set(re.split(r"[-._ 0-9/]+", rel.lower()))
    found = [split for split, words in _SPLIT_WORDS.items() if tokens & set(words)]
    return found[0] if len(found) == 1 else None


def _hf_repo_dir(path: str, setting: str) -> list[str] | None:
    """The training files of a Hugging Face dataset folder (a `huggingface-cli download
    --repo-type dataset` snapshot or a clone of the hub repository): _hf_select over its files.
    One walk, hidden folders (.git, .cache) skipped; None: no file of a format we read."""
    rels = []
    for root, dirs, names in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        rels += [os.path.relpath(os.path.join(root, n), path) for n in sorted(names)]
    try:
        with open(os.path.join(path, "README.md"), encoding="utf-8") as f:
            card = f.read()
    except FileNotFoundError:
        card = None
    chosen = _hf_select(rels, card, path, setting)
    return None if chosen is None else [os.path.join(path, rel) for rel in chosen]


def _hf_select(rels: list[str], card: str | None, where: str, setting: str) -> list[str] | None:
    """The train split of a dataset folder whose files are `rels` (paths relative to it, "/"
    separated) and whose README.md reads `card` (None: none), resolved as the hub does: the
    card's `configs:` (its YAML header: the `default: true` config, else "default", else the
    first; its `train` split, or its only one), else every file of a format we read, those whose
    path names the train split when any path names a split. None: no such file. Globs in
    `configs:` are relative to the folder and matched as glob.glob(recursive=True) would
    (_glob_rel). Shared by a local folder and one at a URL (`where` names it in messages)."""
    from data.readers.formats import name_format

    configs = _card_configs(card, f"{where}/README.md", setting)
    if configs:
        chosen = next((c for c in configs if c.get("default")), None) or \
            next((c for c in configs if c.get("config_name") == "default"), configs[0])
        name = chosen.get("config_name", "default")
        data_files = chosen.get("data_files")
        if isinstance(data_files, (str, list)) and all(isinstance(d, str) for d in _as_list(data_files)):
            data_files = [{"split": "train", "path": data_files}]
        splits = {d.get("split", "train"): _as_list(d.get("path")) for d in _as_list(data_files)
                  if isinstance(d, dict)}
        if not splits:
            raise ValueError(f"{setting}: {where}/README.md: config {name!r} lists no data_files")
        split = "train" if "train" in splits else (next(iter(splits)) if len(splits) == 1 else None)
        if split is None:
            raise ValueError(f"{setting}: {where}/README.md: config {name!r} has no train split "
                             f"({', '.join(splits)}): give the files of one as a glob")
        matchers = [_glob_rel(pattern) for pattern in splits[split]]
        files = sorted({rel for rel in rels if any(m(rel) for m in matchers)})
        if not files:
            raise ValueError(f"{setting}: {where}/README.md: config {name!r} split {split!r} "
                             f"({', '.join(splits[split])}) matches no file in the folder")
        return files
    found = [rel for rel in rels if name_format(rel.rsplit("/", 1)[-1]) is not None]
    if not found:
        return None
    by_split = [(_path_split(rel), rel) for rel in found]
    if any(split for split, _ in by_split):
        found = [rel for split, rel in by_split if split == "train"]
        if not found:
            raise ValueError(f"{setting}: {where!r}: its data files name splits but none is train "
                             f"({', '.join(sorted({s for s, _ in by_split if s}))}): give one's files as a glob")
    return found


def _glob_rel(pattern: str) -> Callable[[str], bool]:
    """A matcher of relative paths for a glob, with glob.glob(recursive=True)'s rules (which a
    local folder's `configs:` globs were matched with): `*`, `?`, `[...]` stay within a path
    component, a `**` component spans any number of them (none included), and a name starting
    with "." is matched only by a component that starts with "." too."""
    out = []
    parts = [c for c in pattern.split("/") if c and c != "."]
    for i, comp in enumerate(parts):
        last = i == len(parts) - 1
        if comp == "**":
            out.append(r"(?:[^/.][^/]*/)*[^/.][^/]*" if last else r"(?:[^/.][^/]*/)*")
            continue
        body = "" if comp.startswith(".") else r"(?!\.)"
        j = 0
        while j < len(comp):
            c = comp[j]
            if c == "*":
                body += "[^/]*"
            elif c == "?":
                body += "[^/]"
            elif c == "[" and _class_end(comp, j) > 0:
                end = _class_end(comp, j)
                inner = comp[j + 1:end].replace("\\", "\\\\").replace("[", "\\[")
                body += "[" + ("^" + inner[1:] if inner.startswith("!") else
                               "\\^" + inner[1:] if inner.startswith("^") else inner) + "]"
                j = end
            else:
                body += re.escape(c)
            j += 1
        out.append(body + ("" if last else "/"))
    rx = re.compile("".join(out), re.DOTALL)
    return lambda rel: rx.fullmatch(rel) is not None


def _class_end(comp: str, j: int) -> int:
    """The index of the `]` closing the bracket class opened at comp[j] (-1: none, a literal `[`),
    as fnmatch reads it: a `]` right after `[` or `[!` belongs to the class."""
    k = j + 1
    k += comp[k:k + 1] == "!"
    k += comp[k:k + 1] == "]"
    return comp.find("]", k)


def _as_list(x) -> list:
    return [] if x is None else (x if isinstance(x, list) else [x])


def _card_configs(text: str | None, readme: str, setting: str) -> list[dict]:
    """The `configs:` of a dataset card's YAML header ([] without a card or without configs);
    `readme` names the card in messages."""
    import yaml

    if text is None or not text.startswith("---"):
        return []
    header = text[3:].split("\n---", 1)[0]
    try:
        meta = yaml.safe_load(header) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"{setting}: {readme}: its YAML header does not parse "
                         f"({str(e).splitlines()[0]})") from None
    configs = meta.get("configs") if isinstance(meta, dict) else None
    return [c for c in configs if isinstance(c, dict)] if isinstance(configs, list) else []


def _hf_saved_dir(path: str, setting: str) -> list[str] | None:
    """The Arrow files of a `datasets` save_to_disk directory, in its own order (None: not one).
    A DatasetDict directory (dataset_dict.json) names its splits: one of them must be chosen."""
    import json

    dict_file = os.path.join(path, "dataset_dict.json")
    if os.path.isfile(dict_file):
        try:
            with open(dict_file) as f:
                splits = json.load(f).get("splits", [])
        except (OSError, ValueError):
            splits = []
        raise ValueError(f"{setting}: {path!r} is a Hugging Face DatasetDict: give one of its splits, "
                         f"e.g. {os.path.join(path, splits[0] if splits else 'train')!r} "
                         f"(splits: {', '.join(splits) or 'none listed'})")
    state = os.path.join(path, "state.json")
    try:
        with open(state) as f:
            files = [d["filename"] for d in json.load(f)["_data_files"]]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{setting}: {state} is not a readable save_to_disk state ({type(e).__name__}: "
                         f"{e})") from None
    if not files:
        raise ValueError(f"{setting}: {state} lists no data file")
    return [os.path.join(path, f) for f in files]


class _Walker:
    """Glob expansion with one read per directory (cached) and one stat per literal file."""

    def __init__(self):
        self.dirs_read = 0
        self.stats = 0
        self._entries: dict[str, list[tuple[str, bool, bool]]] = {}

    def expand(self, pattern: str) -> list[str]:
        if not glob.has_magic(pattern):
            return [pattern] if self._is_file(pattern) else []
        base = os.sep if os.path.isabs(pattern) else ""
        parts = [c for c in pattern.split(os.sep) if c]
        return list(self._expand(base, parts))

    def list_file(self, path: str, setting: str) -> list[str]:
        """The entries of a list file (itself local or at a URL). A local entry is stat-ed once; a
        URL entry is taken as written (a request per object would defeat the one listing per run):
        a missing object is named when it is read, under data.strict's policy."""
        url = objstore.is_url(path)
        path = path if url else os.path.expanduser(path)
        try:
            if url:
                with objstore.open_url(path) as f:
                    lines = f.read().decode("utf-8").splitlines()
            else:
                with open(path) as f:
                    lines = f.read().splitlines()
        except (OSError, ValueError) as e:
            raise ValueError(f"{setting}: cannot read the file list @{path} "
                             f"({getattr(e, 'strerror', None) or type(e).__name__})") from None
        root = os.path.dirname(path)
        out = []
        for n, line in enumerate(lines, 1):
            entry = line.strip()
            if not entry or entry.startswith("#"):
                continue
            if objstore.is_url(entry):
                out.append(entry)
                continue
            if url and not entry.startswith(("/", "~")):    # relative to the list file's place on the bucket
                out.append(f"{root}/{entry}")
                continue
            entry = os.path.join(root, os.path.expanduser(entry))
            if not self._is_file(entry):
                raise ValueError(f"{setting}: @{path}:{n} names {entry!r}, which is not a file")
            out.append(entry)
        if not out:
            raise ValueError(f"{setting}: the file list @{path} names no file")
        return out

    def _expand(self, base: str, parts: list[str]):
        head, rest = parts[0], parts[1:]
        if head == "**":    # zero or more directories
            entries = self._list(base)     # read first: a literal next component is answered from it
            yield from (self._expand(base, rest) if rest else self._files_below(base))
            for name, is_dir, _ in entries:
                if is_dir and not name.startswith("."):
                    yield from self._expand(os.path.join(base, name), parts)
        elif glob.has_magic(head):
            for name, is_dir, is_file in self._list(base):
                # glob's rule: a leading dot is matched only by a pattern's leading dot.
                if name.startswith(".") and not head.startswith("."):
                    continue
                if not fnmatch.fnmatchcase(name, head):
                    continue
                if rest and is_dir:
                    yield from self._expand(os.path.join(base, name), rest)
                elif not rest and is_file:
                    yield os.path.join(base, name)
        elif rest:
            # No check here: the next directory read finds out whether it exists.
            yield from self._expand(os.path.join(base, head), rest)
        else:
            path = os.path.join(base, head)
            if base in self._entries:
                # A directory already read (a `**` walk passes through it): its entries answer
                # (documents/**/en_head.json.gz costs a read per directory and no stat).
                if any(name == head and is_file for name, _, is_file in self._entries[base]):
                    yield path
            elif self._is_file(path):
                yield path

    def _files_below(self, base: str):
        for name, _, is_file in self._list(base):
            if is_file and not name.startswith("."):
                yield os.path.join(base, name)

    def _list(self, directory: str) -> list[tuple[str, bool, bool]]:
        """(name, is_dir, is_file) of a directory's entries, read once per listing. The types
        come from the directory read itself (d_type) except for symlinks, which cost a stat."""
        if directory not in self._entries:
            self.dirs_read += 1
            try:
                with os.scandir(directory or ".") as it:
                    self._entries[directory] = [(e.name, e.is_dir(), e.is_file()) for e in it]
            except OSError:     # missing or unreadable: matches nothing, as with glob
                self._entries[directory] = []
        return self._entries[directory]

    def _is_file(self, path: str) -> bool:
        self.stats += 1
        try:
            return stat.S_ISREG(os.stat(path).st_mode)
        except OSError:
            return False


def all_files(files: list[str] | dict[str, list[str]]) -> list[str]:
    """A listing's files as one list (every source's files, in source order)."""
    if isinstance(files, dict):
        return [f for fs in files.values() for f in fs]
    return list(files)


def run_listing(patterns: list | dict, eval_paths: list, saved: dict | None, *,
                from_process_0: Callable = lambda make: make(), log: Callable | None = None) -> dict:
    """The run's files, {"paths", "eval_paths": the patterns; "train", "eval": their files}
    ("paths" and "train" keyed by source name for a mixture, given `patterns` as
    {source name: patterns}), and "sizes": {url: size} of the files listed from URL patterns
    (absent without any: a listing of local files is what it always was). Every host keeps the
    sizes (data/readers/objstore.py SIZES), so opening those objects asks the store nothing.

    A resumed run reuses the listing saved with its checkpoint (`saved`) when it was made from
    the same patterns, and trusts it: a file deleted since then is found when read (an
    unreadable file, skipped and counted; data.strict=true stops), and files added since are not
    trained on. New patterns (a moved mount, another glob) or checkpoint.allow_data_change=true
    (saved=None) list afresh, and the fingerprint compares the lists. `from_process_0(make)`
    runs `make` on one process and hands its JSON result (or its ValueError) to every host
    (model/runtime/distributed.py), so a bucket is walked once per run.

    A mixture reuses the saved listing source by source: a changed mixture
    (data.mixture_change=continue) lists only its added sources (or those with new patterns),
    and "parked" keeps the patterns and files of sources no longer listed, so that listing one
    again reads the very files its parked position refers to. scripts/show_step.py lists a
    run's files with this same function."""
    mixture = isinstance(patterns, dict)
    patterns = ({name: list(p) for name, p in patterns.items()} if mixture else list(patterns))
    wanted = {"paths": patterns, "eval_paths": list(eval_paths)}
    say = log or (lambda line: print(line, flush=True))

    def walk() -> dict:
        if saved and all(saved.get(k) == v for k, v in wanted.items()):
            n = len(all_files(saved["train"])) + len(saved["eval"])
            say(f"data: {n} files from the checkpoint's list (no new listing)")
            return saved
        t0 = time.perf_counter()
        out = dict(wanted)
        sizes = dict(saved.get("sizes", {})) if saved else {}   # of the sources reused below
        if mixture:
            known = saved_source_listings(saved)
            train, listed, reused = {}, [], []
            for name, p in patterns.items():
                if name in known and known[name]["paths"] == p:
                    train[name] = known[name]["files"]
                    reused.append(name)
                    continue
                part = list_paths(p, f"data.sources[{name}].paths")
                train[name] = part.files
                sizes.update(part.sizes)
                listed.append(f"{name}: {part.describe()}")
            what = "; ".join(listed + ([f"the checkpoint's list for {', '.join(reused)}"] if reused else []))
            parked = {name: v for name, v in known.items() if name not in patterns}
            if parked:
                out["parked"] = parked
        else:
            part = list_paths(patterns, "data.paths")
            train, what = part.files, part.describe()
            sizes.update(part.sizes)
        held_out = list_paths(eval_paths, "data.eval.paths") if eval_paths else None
        if held_out:
            sizes.update(held_out.sizes)
        say(f"data: listed {what}" + (f" + held-out {held_out.describe()}" if held_out else "")
            + f" in {time.perf_counter() - t0:.1f} s")
        out = {**out, "train": train, "eval": held_out.files if held_out else []}
        kept = set(all_files(train)) | set(out["eval"]) | {
            f for v in out.get("parked", {}).values() for f in v["files"]}
        sizes = {f: n for f, n in sorted(sizes.items()) if f in kept}
        return {**out, "sizes": sizes} if sizes else out

    # Process 0 decides for all (reuse or walk): hosts whose resolved patterns differ (another
    # install directory behind ${project_root:}) must still take the same branch, or the
    # others would wait in the broadcast for a process 0 that never enters it.
    listing = from_process_0(walk)
    # A listing saved before sizes were kept has none: its objects' sizes are asked when opened.
    objstore.remember_sizes(listing.get("sizes", {}))
    return listing


def saved_source_listings(saved: dict | None) -> dict:
    """{source name: {"paths", "files"}} of a saved mixture listing, listed and parked sources."""
    if not saved or not isinstance(saved.get("paths"), dict):
        return {}
    known = dict(saved.get("parked", {}))
    known.update({name: {"paths": p, "files": saved["train"][name]} for name, p in saved["paths"].items()})
    return known

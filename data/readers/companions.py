"""RedPajama-v2's companion files, found from a documents file's own path, and the selection they
make: which documents of a file are handed out (data.quality, data.dedup), decided per record
before anything is tokenized (data/readers/sources.py asks `FileSelection.judge`).

Layout (RPv2's; the same under a local path, a mount or a gs:// URL):
  <root>/documents/<snap>/<shard>/<lang>_<part>.json.gz                the documents
  <root>/quality_signals/<snap>/<shard>/<lang>_<part>.signals.json.gz  JSON lines, one per document
  <root>/duplicates/<snap>/<shard>/<lang>_<part>.duplicates.parquet    `doc_id`: every copy but the first
  <root>/minhash/<snap>/<shard>/<lang>_<part>.minhash.parquet          band hashes (the conversion's)
  <out>/fuzzy/<snap>/<shard>/<lang>_<part>.fuzzy.json                 the rows --dedup fuzzy dropped
The fuzzy lists are written by scripts/prepare_data.py --dedup fuzzy beside its parts (`<out>` its
--out; data.fuzzy_lists=<out> in the stream): a JSON object {"source": the input file as the
conversion's job.json names it, "threshold": --dedup-threshold, "rows": sorted rows dropped}.
The part after a path's last `documents/` directory is its relative name; a path without one
(the bundled sample's `<shard>/<lang>_<part>.json.gz`) takes its last two components, the
directory above them as the root. `data.companions` puts the root elsewhere.

A signals line is `{"id": "<rel>.json.gz/<row>", "id_int", "metadata", "quality_signals"}`, row
counted from 0 in the documents file; each signal a list of [start, end, score] spans. The
signals file is read beside its documents file, a line per record, in lockstep: its position
([line, byte offset, .gz seek point]) is saved in the reader slot's state beside the documents
file's, so a restore deep in a file seeks both (data/readers/gzseek.py), re-reading neither.

Bad input, each a bad record of data/readers/sources.py (named file:line, counted; data.strict=true
stops there): `missing_companion` (the signals or duplicates file, or the fuzzy list, of a
documents file is not there: every document of it), `signals_row_mismatch` (the line beside a document names another
row, or the file ends first: that document has no signals), `malformed_signals` (not a JSON
object with `id` and `quality_signals`), `null_signal` (a score a rule needs is null or absent).
"""
from __future__ import annotations

import json

import orjson

from data.readers import formats, gzseek
from data.readers.quality import Null, Rules

KINDS = ("signals", "duplicates", "minhash", "fuzzy")
DEDUPS = ("exact", "fuzzy")
THRESHOLDS = ("0.7", "0.8", "0.9", "1.0")
_DIRS = {"signals": "quality_signals", "duplicates": "duplicates", "minhash": "minhash", "fuzzy": "fuzzy"}
_SUFFIX = {"signals": ".signals.json.gz", "duplicates": ".duplicates.parquet",
           "minhash": ".minhash.parquet", "fuzzy": ".fuzzy.json"}
# The documents' name endings a companion's name replaces.
_DOC_ENDINGS = (".json.gz", ".jsonl.gz", ".json.zst", ".jsonl.zst", ".jsonl", ".json")
# The first rule name a document dropped as an exact duplicate is counted under.
EXACT = "dedup: exact"
# The name a fuzzy duplicate is counted under (the conversion's done/ markers and manifest, the stream).
FUZZY = "dedup: fuzzy"


def split_path(path: str) -> tuple[str, str]:
    """(root, relative name without its format's ending) of a documents file."""
    parts = path.split("/")
    if "documents" in parts[:-1]:
        i = len(parts) - 2 - parts[:-1][::-1].index("documents")
        root, rel = "/".join(parts[:i]), "/".join(parts[i + 1:])
    else:
        root, rel = "/".join(parts[:-2]), "/".join(parts[-2:])
    for end in _DOC_ENDINGS:
        if rel.endswith(end):
            return root, rel[: -len(end)]
    return root, rel.rsplit(".", 1)[0]


def rel_name(path: str, kind: str) -> str:
    """`kind`'s name below its root for the documents file `path` ("fuzzy/2023-06/0000/en_head.fuzzy.json"):
    the one place companion names are made (the conversion writes a fuzzy list under it)."""
    return f"{_DIRS[kind]}/{split_path(path)[1]}{_SUFFIX[kind]}"


def companion_path(path: str, kind: str, root: str | None = None) -> str:
    """Where `kind` ("signals", "duplicates", "minhash", "fuzzy") of the documents file `path`
    is; `root`: data.companions (None: the documents' own root)."""
    base = root.rstrip("/") if root else split_path(path)[0]
    return f"{base}/{rel_name(path, kind)}" if base else rel_name(path, kind)


def row_of(doc_id: str) -> int | None:
    """The row an RPv2 id names (`.../<lang>_<part>.json.gz/<row>`), None if it names none."""
    tail = doc_id.rsplit("/", 1)[-1]
    return int(tail) if tail.isdigit() else None


def duplicate_rows(path: str) -> set[int]:
    """The rows a duplicates parquet lists (its `doc_id` column). FileNotFoundError when absent."""
    ids = formats.read_parquet_columns(path, ["doc_id"]).column(0).to_pylist()
    return {r for r in map(row_of, (i for i in ids if i)) if r is not None}


def fuzzy_list_text(source: str, threshold: str, rows) -> str:
    """A fuzzy list's bytes: the same for the same input file, threshold and rows, whichever
    runner wrote it."""
    return json.dumps({"rows": sorted(int(r) for r in rows), "source": source, "threshold": threshold},
                      sort_keys=True)


def fuzzy_rows(path: str, threshold: str) -> set[int]:
    """The rows a fuzzy list drops. FileNotFoundError when absent; ValueError (one line naming
    the list and both thresholds) when it was written at another threshold."""
    src = formats.open_raw(path)
    try:
        rec = json.loads(src.read())
    finally:
        src.close()
    if rec.get("threshold") != threshold:
        raise ValueError(f"data.dedup_threshold={threshold} but {path} was written at "
                         f"--dedup-threshold {rec.get('threshold')}")
    return set(rec["rows"])


class SignalsFile:
    """One signals file read a line per documents record, from a saved [line, offset, point]."""

    def __init__(self, path: str, state: list | None = None, seek_points: bool = True):
        self.path = path
        self.line, self.off, self.point = (int(state[0]), int(state[1]), state[2]) if state else (0, 0, None)
        # FileNotFoundError when absent
        self.fh = formats.open_bytes(path, self.off, self.point, seek_points)
        self.finder = None
        self.recheck = self.off

    def get(self, row: int):
        """The signals dict of documents row `row` -> (signals, None), or (None, (kind, line, detail))."""
        while self.line < row:           # another part's rows: read past, not parsed
            n = len(self.fh.readline())
            if n == 0:
                break
            self.off += n
            self.line += 1
        raw = self.fh.readline() if self.line == row else b""
        self.off += len(raw)
        self.line += 1 if raw else 0
        where = row + 1
        if not raw:
            return None, ("signals_row_mismatch", where, "the signals file ends before this row")
        try:
            rec = orjson.loads(raw)
            sig, got = rec["quality_signals"], row_of(str(rec["id"]))
            if not isinstance(sig, dict):
                raise TypeError
        except (orjson.JSONDecodeError, KeyError, TypeError):
            return None, ("malformed_signals", where, "")
        if got != row:
            return None, ("signals_row_mismatch", where, f"its id {rec['id']!r} names row {got}")
        return sig, None

    def state(self, refresh: bool = True) -> list:
        """[line, offset, seek point]: the point refreshed every half spacing, as a slot's
        (refresh=False: the last point found, still valid, without indexing further)."""
        if refresh and self.off >= self.recheck:
            if self.finder is None:   # the open file's own points, or a second pass beside it
                self.finder = gzseek.own_points(self.fh) or gzseek.PointFinder(self.path, self.point)
            self.point = self.finder.point_before(self.off)
            self.recheck = self.off + gzseek.SPACING // 2
        return [self.line, self.off, self.point]

    def close(self) -> None:
        self.fh.close()
        if self.finder is not None:
            self.finder.close()
            self.finder = None


class Selection:
    """What a run keeps: data.quality's rules and data.dedup, over companions under `root`."""

    def __init__(self, quality: tuple[str, ...] = (), dedup: str = "", root: str | None = None,
                 fuzzy_lists: str = "", threshold: str = "", seek_points: bool = True):
        self.rules = Rules(quality)
        # the stream saves the signals file's position (its reader finds seek points as it
        # reads); a conversion reads each file through once and saves none
        self.seek_points = seek_points
        self.dedup = tuple(d for d in dedup.split(",") if d) if dedup else ()
        self.root = root or None
        # data.fuzzy_lists: the --out of a conversion with --dedup fuzzy (its fuzzy/ lists), read
        # when dedup has fuzzy; threshold: data.dedup_threshold, checked against each list's
        self.fuzzy_lists, self.threshold = fuzzy_lists, threshold

    def __bool__(self) -> bool:
        return bool(self.rules) or "exact" in self.dedup or "fuzzy" in self.dedup

    def open(self, path: str, state: list | None) -> "FileSelection":
        return FileSelection(self, path, state)


class FileSelection:
    """One documents file's selection: its signals beside it, its duplicate rows."""

    def __init__(self, sel: Selection, path: str, state: list | None):
        self.sel = sel
        self.sig = self.sig_missing = None
        self.dups = self.dups_missing = None
        self.fuzzy = self.fuzzy_missing = None
        if "fuzzy" in sel.dedup:
            fp = companion_path(path, "fuzzy", sel.fuzzy_lists)
            try:
                self.fuzzy = fuzzy_rows(fp, sel.threshold)
            except FileNotFoundError:
                self.fuzzy_missing = fp
        if sel.rules:
            sp = companion_path(path, "signals", sel.root)
            try:
                self.sig = SignalsFile(sp, state, sel.seek_points)
            except FileNotFoundError:
                self.sig_missing = sp
        if "exact" in sel.dedup:
            dp = companion_path(path, "duplicates", sel.root)
            try:
                self.dups = duplicate_rows(dp)
            except FileNotFoundError:
                self.dups_missing = dp

    def judge(self, row: int):
        """None: keep row; ("drop", rule name); or ("bad", kind, path, line, detail). Fuzzy
        first, then exact, then the rules: the conversion's order (data/convert/parts.py)."""
        if self.fuzzy_missing:
            return "bad", "missing_companion", self.fuzzy_missing, 0, "no fuzzy dedup list"
        if self.fuzzy is not None and row in self.fuzzy:
            return "drop", FUZZY
        if self.dups_missing:
            return "bad", "missing_companion", self.dups_missing, 0, "no duplicates file"
        if self.dups is not None and row in self.dups:
            return "drop", EXACT
        if not self.sel.rules:
            return None
        if self.sig_missing:
            return "bad", "missing_companion", self.sig_missing, 0, "no signals file"
        sig, bad = self.sig.get(row)
        if bad is not None:
            return ("bad", bad[0], self.sig.path) + bad[1:]
        try:
            failed = self.sel.rules.first_failed(sig)
        except Null as e:
            return "bad", "null_signal", self.sig.path, row + 1, f"{e.name} is null"
        return None if failed is None else ("drop", failed)

    def state(self, refresh: bool = True) -> list | None:
        return self.sig.state(refresh) if self.sig is not None else None

    def close(self) -> None:
        if self.sig is not None:
            self.sig.close()

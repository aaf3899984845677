"""A virtual shard's documents from its files, whatever their format, and bad-record handling.

A `ShardReader` reads the files (or parts of files) of one virtual shard: a seeded per-epoch
order, a few open at once ("slots") interleaved document by document, documents longer than
`PIECE_CHARS` cut into pieces. Files are read through data/readers/formats.py's record readers (JSON
lines, JSON arrays, Parquet, Arrow: one interface, so nothing here depends on the format).
Its position is a small JSON dict (epoch, next part in the order, per slot: part, record,
piece, the record's position in the file, for a .gz slot deep in its file a seek point (see
data/readers/gzseek.py), and the file's format). A restore reopens each slot's file at its position:
.jsonl / .json by a seek, .json.gz from the seek point (a bounded re-read, ~3 MB of text at
most), .jsonl.zst by decompressing from the start (zstd frames are not indexed), Parquet by
reading the one row group holding the row.

A part is the records `record % split == residue` of a file: with fewer files than virtual
shards, `split` shards read the same file and each parses only its own records
(decompression is ~100x cheaper than tokenization). A Parquet or Arrow file with at least
`split` row groups splits by group instead (`group % split == residue`): each part decodes
only its own groups.
"""
from __future__ import annotations

import time
import zlib

import numpy as np

from data.readers import companions, formats, gzseek, objstore
from data.timing import zero_times

# Documents longer than this (characters) are tokenized in pieces, cut at whitespace.
PIECE_CHARS = 100_000
# The first few bad records of each shard are named (file:line: kind).
MAX_BAD_EXAMPLES = 5

BAD_KINDS = ("malformed_json", "invalid_utf8", "missing_key", "non_string_text", "null_text",
             "empty_text", "truncated_file", "corrupt_file", "empty_file", "unreadable_file",
             "unrecognized_file", "missing_companion", "signals_row_mismatch", "malformed_signals",
             "null_signal")
# A document data.quality / data.dedup does not hand out is counted in BadRecords.counts under
# this prefix and its rule's name (not a bad record: data/pipeline.py reports them apart).
DROPPED = "dropped: "


class BadDataError(ValueError):
    """Raised in strict mode for the first bad record, naming file:line and the kind.

    Its message is the whole story in one line: it crosses Grain's worker processes as itself
    (pickled with its one argument) and train.py prints it as one line."""


class NoValidDocumentError(BadDataError):
    """A virtual shard (or a held-out file) whose files hold no valid document at all: raised
    when its first window is read, i.e. at start-up, not when the shard first comes round."""


def split_pieces(text: str, piece_chars: int = PIECE_CHARS) -> list[str]:
    """Cut a long text into pieces of at most piece_chars, preferring whitespace cuts."""
    if len(text) <= piece_chars:
        return [text]
    out, start, n = [], 0, len(text)
    while start < n:
        end = min(start + piece_chars, n)
        if end < n:
            cut = text.rfind(" ", start + piece_chars // 2, end)
            if cut < 0:
                cut = text.rfind("\n", start + piece_chars // 2, end)
            if cut > start:
                end = cut + 1
        out.append(text[start:end])
        start = end
    return out


class BadRecords:
    """Counts bad records by kind and keeps the first few names."""

    def __init__(self, strict: bool, counts: dict | None = None, examples: list | None = None):
        self.strict = strict
        self.counts = dict(counts or {})
        self.examples = list(examples or [])

    def add(self, path: str, line_no: int, kind: str, detail: str = "") -> None:
        where = f"{path}:{line_no}: {kind}" + (f" ({detail})" if detail else "")
        if self.strict:
            raise BadDataError(f"bad record at {where} (data.strict=true; set it false to "
                               "skip and count bad records)")
        self.counts[kind] = self.counts.get(kind, 0) + 1
        if len(self.examples) < MAX_BAD_EXAMPLES and where not in self.examples:
            self.examples.append(where)

    def drop(self, rule: str) -> None:
        """A document the selection drops (data/readers/companions.py), under its first failed rule."""
        key = DROPPED + rule
        self.counts[key] = self.counts.get(key, 0) + 1


def epoch_file_order(n_files: int, seed: int, shard: int, epoch: int) -> list[int]:
    rng = np.random.default_rng([seed, shard, epoch, 1])
    return rng.permutation(n_files).tolist()


class _Slot:
    __slots__ = ("order_idx", "line", "piece", "off", "point", "fmt", "rec", "pieces",
                 "line_len", "finder", "recheck", "sel", "sel_state")

    def __init__(self, order_idx: int, line: int = 0, piece: int = 0, off: int = 0,
                 point: list | None = None, fmt: str | None = None, sel_state: list | None = None):
        self.order_idx = order_idx   # index into the epoch's part order
        self.line = line             # 0-based index of the current (next unread) record
        self.piece = piece           # pieces of the current record's document already emitted
        self.off = off               # the record's position (data/readers/formats.py: a byte offset, a row)
        self.point = point           # .gz seek point at or before off (None: from the start)
        self.fmt = fmt               # the file's format once opened (data/readers/formats.py)
        self.rec = None              # open record reader positioned at record `line` (+1 if pieces)
        self.pieces = None           # the current document's pieces when piece > 0
        self.line_len = 0            # how far that document's record moves the position
        self.finder = None           # gzseek.PointFinder, once a .gz slot needs points
        self.recheck = off           # refresh `point` once off reaches this
        self.sel = None              # the file's selection (companions.FileSelection), once open
        self.sel_state = sel_state   # its signals file's saved position

    def advance(self, n: int, records: int = 1) -> None:
        self.line += records
        self.off += n

    def state(self, path: str) -> list:
        """[part, line, piece, offset, seek point, format] (+ [the signals file's position] with
        data.quality); the point is refreshed every half spacing of reading, so a restore
        re-reads at most ~1.5 spacings. A slot not open yet keeps the point it was given (valid
        for its position, which has not moved)."""
        if self.off >= self.recheck and path.endswith(".gz") and self.rec is not None:
            if self.finder is None:   # the open file's own points, or a second pass beside it
                self.finder = (gzseek.own_points(getattr(self.rec, "fh", None))
                               or gzseek.PointFinder(path, self.point))
            self.point = self.finder.point_before(self.off)
            self.recheck = self.off + gzseek.SPACING // 2
        st = [self.order_idx, self.line, self.piece, self.off, self.point, self.fmt]
        if self.sel is not None:
            self.sel_state = self.sel.state()
        if self.sel_state is not None:
            st.append(self.sel_state)
        return st

    def close(self) -> None:
        if self.rec is not None:
            self.rec.close()
            self.rec = None
        if self.finder is not None:
            self.finder.close()
            self.finder = None
        if self.sel is not None:   # a closed slot's position, without indexing the file further
            self.sel_state = self.sel.state(refresh=False)
            self.sel.close()
            self.sel = None


class ShardReader:
    """Reads one virtual shard's documents as pieces, interleaving `files_per_stream` parts.

    Each piece is (text, doc_id, is_doc_first, is_doc_last). doc_id is a global identity:
    (epoch * n_all_files + file index in the sorted global list) << 24 | line.
    Part i is the lines `line % split == residues[i]` of files[i] (split 1: whole files).
    """

    def __init__(self, files: list[str], file_ids: list[int], n_all_files: int, shard: int,
                 seed: int, files_per_stream: int, text_key: str, bad: BadRecords,
                 times: dict | None = None, split: int = 1, residues: list[int] | None = None,
                 select: companions.Selection | None = None):
        self.files = files
        # data.quality / data.dedup: which records are handed out (None or empty: all)
        self.select = select if select else None
        self.file_ids = file_ids
        self.split = split
        self.residues = residues or [0] * len(files)
        self.n_all = n_all_files
        self.shard = shard
        self.seed = seed
        self.fps = max(1, files_per_stream)
        self.text_key = text_key
        self.bad = bad
        self.times = zero_times() if times is None else times   # "read", "parse" (data/timing.py)
        self.epoch = 0
        self.next = 0
        self.slots: list[_Slot] = []
        self.rr = 0
        self.order = None
        self._epoch_docs = 0

    # ---- state ----
    @staticmethod
    def initial_state() -> dict:
        return {"epoch": 0, "next": 0, "slots": [], "rr": 0, "edocs": 0}

    def get_state(self) -> dict:
        return {"epoch": self.epoch, "next": self.next,
                "slots": [s.state(self._path(s)) for s in self.slots],
                "rr": self.rr, "edocs": self._epoch_docs}

    def set_state(self, st: dict) -> None:
        self.close()
        self.epoch = int(st["epoch"])
        self.next = int(st["next"])
        self.order = None
        # a slot saved before formats were recorded (5 fields) is sniffed again when opened
        self.slots = [_Slot(int(sl[0]), int(sl[1]), int(sl[2]), int(sl[3]), sl[4],
                            sl[5] if len(sl) > 5 else None, sl[6] if len(sl) > 6 else None)
                      for sl in st["slots"]]
        self.rr = int(st["rr"])
        self._epoch_docs = int(st.get("edocs", 0))

    def close(self) -> None:
        for s in self.slots:
            s.close()

    # ---- reading ----
    def _order(self) -> list[int]:
        if self.order is None:
            self.order = epoch_file_order(len(self.files), self.seed, self.shard, self.epoch)
        return self.order

    def _fill_slots(self) -> None:
        order = self._order()
        while len(self.slots) < self.fps and self.next < len(order):
            self.slots.append(_Slot(self.next))
            self.next += 1

    def _path(self, slot: _Slot) -> str:
        return self.files[self._order()[slot.order_idx]]

    def _residue(self, slot: _Slot) -> int:
        return self.residues[self._order()[slot.order_idx]]

    def _open(self, slot: _Slot) -> bool:
        """Opens the slot's file at its record's position. False when unreadable."""
        path = self._path(slot)
        try:
            slot.rec = formats.open_records(path, self.text_key, slot.off, slot.point, slot.fmt,
                                            part=(self.split, self._residue(slot)), seek_points=True)
        except formats.FileProblem as e:   # the whole file: named at the file, once
            if self._residue(slot) == 0:
                self.bad.add(path, 0, e.kind, e.detail)
            return False
        except (OSError, EOFError, ValueError, zlib.error) as e:  # the record was reached before
            if self._residue(slot) == 0:   # the file's other parts skip it silently
                self.bad.add(path, slot.line + 1, "unreadable_file", _read_error(e))
            return False
        slot.fmt = slot.rec.fmt
        if self.select is not None:
            slot.sel = self.select.open(path, slot.sel_state)
        return True

    def _finish_slot(self, i: int) -> None:
        s = self.slots[i]
        s.close()
        order = self._order()
        if self.next < len(order):
            self.slots[i] = _Slot(self.next)
            self.next += 1
        else:
            del self.slots[i]
            if self.slots:
                self.rr %= len(self.slots)
            else:
                self.rr = 0

    def _new_epoch(self) -> None:
        if self._epoch_docs == 0:
            why = "; ".join(self.bad.examples) or ", ".join(self.files[:MAX_BAD_EXAMPLES])
            if self.select is not None:
                why += "; data.quality / data.dedup keep none of its documents"
            raise NoValidDocumentError(
                f"virtual shard {self.shard}: none of its {len(self.files)} file(s) holds a valid "
                f"document ({why}); fix or remove those files, or lower data.num_shards")
        self.epoch += 1
        self.next = 0
        self.rr = 0
        self.order = None
        self._epoch_docs = 0

    def _doc_id(self, slot: _Slot) -> int:
        fid = self.file_ids[self._order()[slot.order_idx]]
        return ((self.epoch * self.n_all + fid) << 24) | (slot.line & 0xFFFFFF)

    def next_piece(self):
        """-> (text, doc_id, first, last). Loops over epochs forever."""
        while True:
            if not self.slots:
                if self.next >= len(self._order()):
                    self._new_epoch()
                self._fill_slots()
            i = self.rr
            s = self.slots[i]
            if s.piece > 0:
                if s.pieces is None:  # restored mid-document: re-read that one line
                    if s.rec is None and not self._open(s):
                        self._finish_slot(i)
                        continue
                    raw, n = s.rec.next()
                    text, _ = s.rec.parse(raw)
                    s.pieces = split_pieces(text)
                    s.line_len = n
                k = s.piece
                text = s.pieces[k]
                did = self._doc_id(s)
                last = k + 1 == len(s.pieces)
                if last:
                    s.advance(s.line_len)
                    s.piece = 0
                    s.pieces = None
                    self.rr = (self.rr + 1) % len(self.slots)
                else:
                    s.piece += 1
                return text, did, False, last
            if s.rec is None and not self._open(s):
                self._finish_slot(i)
                continue
            path = self._path(s)
            f0 = objstore.FETCH_S[0]
            t0 = time.perf_counter()
            try:
                raw, n = s.rec.next()
            except EOFError as e:   # the compressed stream (or the JSON array) ends too early
                if self._residue(s) == 0:   # named once, not by each part of the file
                    self.bad.add(path, s.line + 1, "truncated_file", str(e) or type(e).__name__)
                self._finish_slot(i)
                continue
            except formats.FileProblem as e:
                if self._residue(s) == 0:
                    self.bad.add(path, s.line + 1, e.kind, e.detail)
                self._finish_slot(i)
                continue
            except (objstore.ReadError, FileNotFoundError) as e:   # a URL failing after its
                if self._residue(s) == 0:                          # retries, a vanished object
                    self.bad.add(path, s.line + 1, "unreadable_file", _read_error(e))
                self._finish_slot(i)
                continue
            except Exception as e:  # noqa: BLE001 - any decoder's error: gzip's BadGzipFile
                # (not gzip, bad CRC), zlib.error, zstandard.ZstdError, pyarrow's ArrowInvalid
                # (a damaged row group), an OSError of the mount
                if self._residue(s) == 0:
                    self.bad.add(path, s.line + 1, "corrupt_file", f"{type(e).__name__}: {e}")
                self._finish_slot(i)
                continue
            t1 = time.perf_counter()
            fetch = objstore.FETCH_S[0] - f0   # of it, waiting on an object store (0: local files)
            self.times["read"] += t1 - t0 - fetch
            self.times["fetch"] += fetch
            if n == 0:
                if s.line == 0 and self._residue(s) == 0:
                    self.bad.add(path, 0, "empty_file")
                self._finish_slot(i)
                continue
            if raw is formats.OTHER_PART:   # row groups of the file's other parts, not read
                s.advance(n, records=n)
                continue
            if self.split > 1 and not s.rec.splits_itself and s.line % self.split != self._residue(s):
                s.advance(n)   # another shard's record: not parsed here
                continue
            text, kind = s.rec.parse(raw)
            self.times["parse"] += time.perf_counter() - t1
            if kind is not None:
                detail = formats.missing_key_detail(raw, self.text_key) \
                    if kind == "missing_key" and len(self.bad.examples) < MAX_BAD_EXAMPLES else ""
                self.bad.add(path, s.line + 1, kind, detail)
                s.advance(n)
                continue
            if text is None:   # a blank line: no record
                s.advance(n)
                continue
            if s.sel is not None:   # data.quality / data.dedup: decided before tokenizing
                t2 = time.perf_counter()
                verdict = s.sel.judge(s.line)
                self.times["select"] += time.perf_counter() - t2
                if verdict is not None:
                    if verdict[0] == "drop":
                        self.bad.drop(verdict[1])
                    else:
                        self.bad.add(*verdict[2:4], verdict[1], verdict[4])
                    s.advance(n)
                    continue
            self._epoch_docs += 1
            did = self._doc_id(s)
            if len(text) > PIECE_CHARS:
                s.pieces = split_pieces(text)
                s.piece = 1
                s.line_len = n
                return s.pieces[0], did, True, False
            s.advance(n)
            self.rr = (self.rr + 1) % len(self.slots)
            return text, did, True, True


def _read_error(e: BaseException) -> str:
    """An unreadable file's detail: an object store's own message (the URL, the tries), else
    the error's type (a local path is already named beside it)."""
    if isinstance(e, objstore.ReadError) or (isinstance(e, FileNotFoundError) and "://" in str(e)):
        return str(e)
    return type(e).__name__


def no_document_reason(path: str, text_key: str, strict: bool = False) -> str | None:
    """None when `path` holds at least one valid document, else why not ("file:line: kind" of
    its first bad records). Reads up to the first valid document only: a cheap check for a few
    files (the held-out ones), not for a bucket. Strict: raises at the first bad record."""
    reader = ShardReader([path], [0], 1, 0, 0, 1, text_key, BadRecords(strict))
    try:
        reader.next_piece()
    except NoValidDocumentError:
        return "; ".join(reader.bad.examples) or f"{path}: no document"
    finally:
        reader.close()
    return None

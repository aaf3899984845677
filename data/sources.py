"""Line readers for .json.gz / .jsonl / .jsonl.zst, and bad-record handling.

A `ShardReader` reads the files of one virtual shard: a seeded per-epoch file order, a few
files open at once ("slots") interleaved document by document, documents longer than
`PIECE_CHARS` cut into pieces. Its position is a tiny JSON dict (epoch, next file in the
order, per slot: file, line, piece), restorable by re-reading at most one file per slot.
"""
from __future__ import annotations

import io
import time

import numpy as np
import orjson

from data.timing import zero_times

try:  # isal's igzip is ~3x faster than the stdlib gzip module for decompression.
    from isal import igzip as _gzip
except ImportError:  # pragma: no cover
    import gzip as _gzip

# Documents longer than this (characters) are tokenized in pieces, cut at whitespace.
PIECE_CHARS = 100_000
# The first few bad records of each shard are named (file:line: kind).
MAX_BAD_EXAMPLES = 5

BAD_KINDS = ("malformed_json", "invalid_utf8", "missing_key", "non_string_text",
             "empty_text", "truncated_file", "corrupt_file", "empty_file", "unreadable_file")


class BadDataError(ValueError):
    """Raised in strict mode for the first bad record, naming file:line and the kind.

    Its message is the whole story in one line: it crosses Grain's worker processes as itself
    (pickled with its one argument) and train.py prints it as one line."""


class NoValidDocumentError(BadDataError):
    """A virtual shard (or a held-out file) whose files hold no valid document at all: raised
    when its first window is read, i.e. at start-up, not when the shard first comes round."""


def open_lines(path: str):
    """Binary file object yielding lines, decompressing by extension."""
    if path.endswith(".gz"):
        return _gzip.open(path, "rb")
    if path.endswith(".zst") or path.endswith(".zstd"):
        import zstandard
        fh = open(path, "rb")
        reader = zstandard.ZstdDecompressor().stream_reader(fh, read_across_frames=True,
                                                            closefd=True)
        return io.BufferedReader(reader, buffer_size=1 << 20)
    return open(path, "rb", buffering=1 << 20)


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


def parse_line(line: bytes, text_key: str):
    """-> (text, None) or (None, bad_kind)."""
    try:
        rec = orjson.loads(line)
    except orjson.JSONDecodeError:
        try:
            line.decode("utf-8")
        except UnicodeDecodeError:
            return None, "invalid_utf8"
        return None, "malformed_json"
    if not isinstance(rec, dict) or text_key not in rec:
        return None, "missing_key"
    text = rec[text_key]
    if not isinstance(text, str):
        return None, "non_string_text"
    if not text.strip():
        return None, "empty_text"
    return text, None


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


def epoch_file_order(n_files: int, seed: int, shard: int, epoch: int) -> list[int]:
    rng = np.random.default_rng([seed, shard, epoch, 1])
    return rng.permutation(n_files).tolist()


class _Slot:
    __slots__ = ("order_idx", "line", "piece", "fh", "pieces", "eof_checked")

    def __init__(self, order_idx: int, line: int = 0, piece: int = 0):
        self.order_idx = order_idx   # index into the epoch's file order
        self.line = line             # 0-based index of the current (next unread) line
        self.piece = piece           # pieces of the current line's document already emitted
        self.fh = None               # open file positioned at line `line` (+1 if pieces set)
        self.pieces = None           # the current document's pieces when piece > 0
        self.eof_checked = False


class ShardReader:
    """Reads one virtual shard's documents as pieces, interleaving `files_per_stream` files.

    Each piece is (text, doc_id, is_doc_first, is_doc_last). doc_id is a global identity:
    (epoch * n_all_files + file index in the sorted global list) << 24 | line.
    """

    def __init__(self, files: list[str], file_ids: list[int], n_all_files: int, shard: int,
                 seed: int, files_per_stream: int, text_key: str, bad: BadRecords,
                 times: dict | None = None):
        self.files = files
        self.file_ids = file_ids
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
                "slots": [[s.order_idx, s.line, s.piece] for s in self.slots],
                "rr": self.rr, "edocs": self._epoch_docs}

    def set_state(self, st: dict) -> None:
        self.close()
        self.epoch = int(st["epoch"])
        self.next = int(st["next"])
        self.slots = [_Slot(int(a), int(b), int(c)) for a, b, c in st["slots"]]
        self.rr = int(st["rr"])
        self._epoch_docs = int(st.get("edocs", 0))
        self.order = None

    def close(self) -> None:
        for s in self.slots:
            if s.fh is not None:
                s.fh.close()
                s.fh = None

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

    def _open(self, slot: _Slot) -> bool:
        """Opens the slot's file and skips to its line. False when unreadable."""
        path = self._path(slot)
        try:
            slot.fh = open_lines(path)
            for _ in range(slot.line):
                if not slot.fh.readline():
                    break
        except (OSError, EOFError, ValueError) as e:  # the line was reached before: rare
            self.bad.add(path, slot.line + 1, "unreadable_file", type(e).__name__)
            return False
        return True

    def _finish_slot(self, i: int) -> None:
        s = self.slots[i]
        if s.fh is not None:
            s.fh.close()
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
                    if s.fh is None and not self._open(s):
                        self._finish_slot(i)
                        continue
                    raw = s.fh.readline()
                    text, _ = parse_line(raw, self.text_key)
                    s.pieces = split_pieces(text)
                k = s.piece
                text = s.pieces[k]
                did = self._doc_id(s)
                last = k + 1 == len(s.pieces)
                if last:
                    s.line += 1
                    s.piece = 0
                    s.pieces = None
                    self.rr = (self.rr + 1) % len(self.slots)
                else:
                    s.piece += 1
                return text, did, False, last
            if s.fh is None and not self._open(s):
                self._finish_slot(i)
                continue
            path = self._path(s)
            t0 = time.perf_counter()
            try:
                raw = s.fh.readline()
            except EOFError as e:   # the compressed stream ends before its end marker
                self.bad.add(path, s.line + 1, "truncated_file", str(e) or type(e).__name__)
                self._finish_slot(i)
                continue
            except Exception as e:  # noqa: BLE001 - any decoder's error: gzip's BadGzipFile
                # (not gzip, bad CRC), zlib.error, zstandard.ZstdError, an OSError of the mount
                self.bad.add(path, s.line + 1, "corrupt_file", f"{type(e).__name__}: {e}")
                self._finish_slot(i)
                continue
            t1 = time.perf_counter()
            self.times["read"] += t1 - t0
            if not raw:
                if s.line == 0:
                    self.bad.add(path, 0, "empty_file")
                self._finish_slot(i)
                continue
            if not raw.strip():  # blank line: not a record
                s.line += 1
                continue
            text, kind = parse_line(raw, self.text_key)
            self.times["parse"] += time.perf_counter() - t1
            if kind is not None:
                self.bad.add(path, s.line + 1, kind)
                s.line += 1
                continue
            self._epoch_docs += 1
            did = self._doc_id(s)
            if len(text) > PIECE_CHARS:
                s.pieces = split_pieces(text)
                s.piece = 1
                return s.pieces[0], did, True, False
            s.line += 1
            self.rr = (self.rr + 1) % len(self.slots)
            return text, did, True, True


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

"""What an input file holds, and one record reader per format behind one small interface.

Every reader is opened at a position and hands out records; it is all that data/readers/sources.py's
ShardReader (and scripts/prepare_data.py, scripts/show_step.py) know of a format:

  rec = open_records(path, text_key, off, point, fmt)   positioned at `off`
  raw, n = rec.next()        the next record and how far it moves the position (n == 0: the end)
  text, kind = rec.parse(raw)  the document's text, or (None, bad kind), or (None, None): no record
  rec.fmt                    the format read (saved with the position, so a restore never sniffs)

Formats (a record's number, counted from 1, names it in bad-record messages as `file:N`):
  lines    JSON lines, plain or compressed (.gz, .zst, .zstd): a record is a line; the position
           is the byte offset in the uncompressed text (.gz: plus a seek point, data/readers/gzseek.py).
  array    one JSON array of objects (TinyStories' .json files), plain or compressed: a record is
           an element, found by a scan that skips strings whole (memory: one document, not the
           file); the position is the byte offset where the scan resumes, so a restore seeks.
  parquet  a record is a row's text_key value; only that column is read, one row group at a
           time; the position is the row in the file, so a restore reads one row group.
  arrow    Arrow IPC (the data files of a Hugging Face `save_to_disk` directory): as parquet,
           record batch by record batch (memory-mapped: skipping batches costs no read).

Which format a file holds: its name where that says it (.parquet, .arrow, .jsonl*, .ndjson*),
else its content: a `.json` (or `.json.gz`, `.json.zst`) whose first non-blank byte is `[` is an
array, one whose first line is a JSON object is JSON lines, anything else is neither and is
named in one line (`sniff`). Files with other names are recognized by content too (Parquet's and
Arrow's magic bytes, gzip/zstd JSON), so a list of oddly named shards still reads.
"""
from __future__ import annotations

import io
import re

import orjson

from data.readers import gzseek

# What is read, for the messages that name an unreadable file.
READ_FORMATS = ("JSON lines (.jsonl, .json; gzip .gz or zstd .zst/.zstd), JSON arrays of objects "
                "(.json, .json.gz), Parquet (.parquet), Arrow (.arrow; Hugging Face save_to_disk "
                "directories), directories written by scripts/prepare_data.py")
_COMPRESSED = (".gz", ".zst", ".zstd")
# Bytes read to tell a file's format (a first JSON line longer than this is taken as JSON lines).
SNIFF_BYTES = 1 << 16
# The JSON-array scanner reads this much at a time; a document longer than that grows the buffer.
ARRAY_READ = 1 << 20


class FileProblem(Exception):
    """A whole file is unreadable as what it claims to be: a bad record of `kind` (data/readers/sources.py
    BAD_KINDS) named at the file, not at a line (a missing column, a broken Parquet footer, a JSON
    file that is neither lines nor an array)."""

    def __init__(self, kind: str, detail: str):
        super().__init__(f"{kind} ({detail})")
        self.kind = kind
        self.detail = detail


# ------------------------------------------------------------------ what a file is
def name_format(path: str) -> str | None:
    """The format a file name says: "lines", "json" (lines or array: by content), "parquet",
    "arrow", or None (the name says nothing)."""
    name = path.rsplit("/", 1)[-1].lower()
    for c in _COMPRESSED:
        if name.endswith(c):
            name = name[: -len(c)]
            break
    if name.endswith(".jsonl") or name.endswith(".ndjson"):
        return "lines"
    if name.endswith(".json"):
        return "json"
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith(".arrow"):
        return "arrow"
    return None


def open_bytes(path: str, off: int = 0, point: list | None = None, seek_points: bool = False):
    """Binary file object of the uncompressed bytes from offset `off`, decompressing by name or,
    for other names, by magic bytes (`point`: a .gz seek point at or before off). `seek_points`:
    a reader that saves its position (the stream's, not a conversion's or a sniff's) reads a .gz
    file with its own seek points where it can (data/readers/gzpoints.py)."""
    comp = _compression(path)
    if comp == "gz":
        return gzseek.open_gz_at(path, point, off, seek_points)
    if comp == "zst":
        fh = io.BufferedReader(_ZstdFrames(open_raw(path)), buffer_size=1 << 20)
        while off > 0:   # no frame index: re-read from the start
            got = len(fh.read(min(off, 1 << 20)))
            if not got:
                break
            off -= got
        return fh
    fh = open_raw(path)
    fh.seek(off)
    return fh


class _ZstdFrames(io.RawIOBase):
    """The decompressed bytes of a zstd file, frame after frame. EOFError when the file ends
    inside a frame (a truncated file), as gzip raises: zstandard's stream reader ends there
    without a word, so a cut file would read as a shorter (or empty) one."""

    RAW_READ = 1 << 18     # compressed bytes per read (JSON text inflates ~4-10x)

    def __init__(self, fh):
        import zstandard
        self._fh = fh
        self._dctx = zstandard.ZstdDecompressor()
        self._frame = None     # the decompressor of the frame being read (None: between frames)
        self._out = b""
        self._pos = 0

    def _inflate(self, raw: bytes) -> bytes:
        out = []
        while raw:
            if self._frame is None:
                self._frame = self._dctx.decompressobj()
            out.append(self._frame.decompress(raw))
            raw = b""
            if self._frame.eof:        # the frame is whole; what follows starts the next one
                raw = self._frame.unused_data
                self._frame = None
        return b"".join(out)

    def readinto(self, b) -> int:
        while self._pos >= len(self._out):
            raw = self._fh.read(self.RAW_READ)
            if not raw:
                if self._frame is not None:
                    self._frame = None
                    raise EOFError("the zstd file ends inside a frame")
                return 0
            self._out, self._pos = self._inflate(raw), 0
        n = min(len(b), len(self._out) - self._pos)
        b[:n] = self._out[self._pos:self._pos + n]
        self._pos += n
        return n

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        if not self.closed:
            self._fh.close()
        super().close()


def open_raw(path: str):
    """The file's stored bytes, buffered: a local file, or a URL through data/readers/objstore.py."""
    if "://" in path:
        from data.readers import objstore
        return objstore.open_url(path)
    return open(path, "rb", buffering=1 << 20)


def read_parquet_columns(path: str, columns: list[str]):
    """A Parquet file's `columns` as a pyarrow Table: a local file by its path (Arrow's own file
    reader), a URL through open_raw. Not a Python file object for a local file: pyarrow 25 read
    that way sometimes aborts the interpreter at exit ("terminate called without an active
    exception", exit 134 after a finished run). FileNotFoundError when absent."""
    import pyarrow.parquet as pq

    if "://" not in path:
        return pq.read_table(path, columns=columns)
    src = open_raw(path)
    try:
        return pq.read_table(src, columns=columns)
    finally:
        src.close()


def _compression(path: str) -> str | None:
    low = path.lower()
    if low.endswith(".gz"):
        return "gz"
    if low.endswith(".zst") or low.endswith(".zstd"):
        return "zst"
    if name_format(path) is not None:
        return None
    try:   # an unknown name: compressed if its magic bytes say so
        with open_raw(path) as f:
            magic = f.read(4)
    except OSError:
        return None
    if magic[:2] == b"\x1f\x8b":
        return "gz"
    if magic == b"\x28\xb5\x2f\xfd":
        return "zst"
    return None


def _head(path: str) -> bytes:
    """Up to SNIFF_BYTES of the file's uncompressed start (less if it ends or cannot be read)."""
    out = b""
    try:
        with open_bytes(path) as fh:
            while len(out) < SNIFF_BYTES:
                got = fh.read(SNIFF_BYTES - len(out))
                if not got:
                    break
                out += got
    except EOFError:   # truncated: what was read tells the format; the reader names the damage
        pass
    return out


def _looks_like(head: bytes) -> str:
    """A few words on what a file that is not read looks like, for the one-line error."""
    if not head:
        return "an empty file"
    if head[:4] == b"PK\x03\x04":
        return "a zip archive"
    if len(head) > 262 and head[257:262] == b"ustar":
        return "a tar archive"
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        return f"binary data (first bytes {head[:8].hex(' ')})"
    first = text.lstrip("\ufeff \t\r\n").split("\n", 1)[0][:60]
    if first.startswith("{"):
        return f"one JSON document spread over several lines (first line {first!r})"
    kind = "CSV text" if first.count(",") >= 2 or first.count("\t") >= 2 else "plain text"
    return f"{kind} (first line {first!r})"


def sniff(path: str) -> str:
    """The format of a file by its name and, where that is ambiguous, its first bytes:
    "lines", "array", "parquet" or "arrow". FileProblem("unrecognized_file", what it looks like)
    for anything else. A file that cannot be opened or decompressed is taken as JSON lines: the
    reader names that damage when it reads."""
    fmt = name_format(path)
    if fmt in ("lines", "parquet", "arrow"):
        return fmt
    try:
        head = _head(path)
    except Exception:   # noqa: BLE001 - a decoder's or the file system's error: named when read
        return "lines"
    if fmt is None:
        if head[:4] == b"PAR1":
            return "parquet"
        if head[:6] == b"ARROW1" or head[:4] == b"\xff\xff\xff\xff":
            return "arrow"
    body = head.lstrip(b"\xef\xbb\xbf \t\r\n")
    if not body and fmt == "json":
        return "lines"   # empty: the reader names it empty_file
    if body[:1] == b"[":
        return "array"
    if body[:1] == b"{":
        line = body.split(b"\n", 1)
        if len(line) == 1 and len(head) >= SNIFF_BYTES:
            return "lines"   # a first line longer than the sniff: taken as JSON lines
        try:
            if isinstance(orjson.loads(line[0]), dict):
                return "lines"
        except orjson.JSONDecodeError:
            pass
    raise FileProblem("unrecognized_file",
                      f"not JSON lines nor a JSON array of objects: it looks like {_looks_like(head)}; "
                      f"read: {READ_FORMATS}")


def check_readable(files: list[str], setting: str = "data.paths") -> None:
    """Fails in one line (ValueError naming the file, what it looks like and the formats read) when
    the first file of each kind of name is not a format read here. Reads the start of one file per
    file-name ending that does not say its format (`.json`: lines or array; unknown endings), none
    for the others: cheap for a bucket of thousands of shards."""
    seen = set()
    for path in files:
        fmt = name_format(path)
        if fmt in ("lines", "parquet", "arrow"):
            continue
        ending = path.rsplit("/", 1)[-1].partition(".")[2].lower()
        if ending in seen:
            continue
        seen.add(ending)
        try:
            sniff(path)
        except FileProblem as e:
            raise ValueError(f"{setting}: {path} is not read: {e.detail}") from None


# ------------------------------------------------------------------ JSON
def parse_json(raw: bytes, text_key: str):
    """One JSON record -> (text, None) or (None, bad kind)."""
    try:
        rec = orjson.loads(raw)
    except orjson.JSONDecodeError:
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            return None, "invalid_utf8"
        return None, "malformed_json"
    return record_text(rec, text_key)


def record_text(rec, text_key: str):
    """A parsed JSON record -> (text, None) or (None, bad kind)."""
    if not isinstance(rec, dict) or text_key not in rec:
        return None, "missing_key"
    text = rec[text_key]
    if not isinstance(text, str):
        return None, "null_text" if text is None else "non_string_text"
    if not text.strip():
        return None, "empty_text"
    return text, None


def missing_key_detail(raw, text_key: str) -> str:
    """What a record without `text_key` holds instead (named with the first one of a shard, so
    that the message points at data.text_key)."""
    try:
        rec = orjson.loads(raw) if isinstance(raw, (bytes, str)) else raw
    except orjson.JSONDecodeError:
        return ""
    if isinstance(rec, dict):
        keys = ", ".join(list(rec)[:8])
        return f"no {text_key!r}; its keys: {keys} (set data.text_key)"
    return f"a JSON {type(rec).__name__}, not an object"


class LineRecords:
    """JSON lines: a record is one line (blank lines are no record)."""
    fmt = "lines"
    splits_itself = False   # a split file's parts are every split-th record (ShardReader)

    def __init__(self, path: str, text_key: str, off: int = 0, point: list | None = None,
                 part: tuple[int, int] | None = None, seek_points: bool = False):
        self.text_key = text_key
        self.fh = open_bytes(path, off, point, seek_points)
        self.raw_file = getattr(self.fh, "fileobj", None) or self.fh

    def next(self):
        raw = self.fh.readline()
        return raw, len(raw)

    def parse(self, raw: bytes):
        if not raw.strip():
            return None, None
        return parse_json(raw, self.text_key)

    def close(self) -> None:
        self.fh.close()


# A JSON token the array scanner stops at: a whole string (skipped in one C-level match), a
# bracket or a comma; a lone `"` is a string not yet complete in the buffer.
_TOKEN = re.compile(rb'"[^"\\]*(?:\\[\s\S][^"\\]*)*"|[{}\[\],]|"')
_WS = b" \t\r\n"
# Where an object element may end: a `}` followed by the array's `,` or `]`. A candidate is taken
# when orjson parses the element up to it (a JSON object ends at its own closing brace, so a
# successful parse is the element's true end); the exact scan is the fallback. Text holds few
# `},` or `}]`, so this finds most elements with one C-level search and one parse (~3x the scan).
_OBJ_END = re.compile(rb'\}[ \t\r\n]*[,\]]')
_CANDIDATES = 4


class ArrayRecords:
    """One JSON array of objects: a record is an element. Position `off`: 0 before the `[`, else
    where the scan for the next element starts (after the previous element's comma)."""
    fmt = "array"
    splits_itself = False

    def __init__(self, path: str, text_key: str, off: int = 0, point: list | None = None,
                 part: tuple[int, int] | None = None, seek_points: bool = False):
        self.path = path
        self.text_key = text_key
        self.fh = open_bytes(path, off, point, seek_points)
        self.raw_file = getattr(self.fh, "fileobj", None) or self.fh
        self.buf = b""
        self.i = 0
        self.base = off           # file offset of buf[0]
        self.eof = False
        self.opened = off > 0     # the `[` is behind the position
        self.closed = False       # the `]` was read
        # (bytes, object) of the element the fast path parsed to find its end: parse() of those
        # very bytes, called next, takes the object instead of parsing the element a second time
        self._parsed = (None, None)

    def _fill(self) -> bool:
        """More bytes after buf[i:] (buf[:i] is dropped); False at the end of the file."""
        if self.eof:
            return False
        got = self.fh.read(max(ARRAY_READ, len(self.buf) - self.i))
        if not got:
            self.eof = True
            return False
        self.base += self.i
        self.buf = self.buf[self.i:] + got
        self.i = 0
        return True

    def _skip_ws(self) -> bool:
        """Moves i to the next non-blank byte; False at the end of the file."""
        while True:
            buf, i, n = self.buf, self.i, len(self.buf)
            while i < n and buf[i] in _WS:
                i += 1
            self.i = i
            if i < n:
                return True
            if not self._fill():
                return False

    def _element_end(self) -> int | None:
        """End (exclusive) of the element starting at buf[i], or None when the buffer ends first."""
        buf, depth = self.buf, 0
        for m in _TOKEN.finditer(buf, self.i):
            c = buf[m.start()]
            if c == 0x22:     # '"'
                if m.end() - m.start() == 1:
                    return None   # a string running past the buffer
                if depth == 0:
                    return m.end()
            elif c == 0x7B or c == 0x5B:   # '{' '['
                depth += 1
            elif c == 0x7D or c == 0x5D:   # '}' ']'
                depth -= 1
                if depth == 0:
                    return m.end()
                if depth < 0:      # the array's own ']' ends a bare value
                    return m.start()
            elif depth == 0:       # ',' after a bare value (number, true, null)
                return m.start()
        return None

    def _object_end(self) -> int | None:
        """The fast path for an object element: the first `}` before `,` / `]` up to which the
        element parses (None: no such candidate among the first few in the buffer)."""
        buf, i = self.buf, self.i
        for k, m in enumerate(_OBJ_END.finditer(buf, i)):
            if k == _CANDIDATES:
                return None
            raw = buf[i:m.start() + 1]
            try:
                self._parsed = (raw, orjson.loads(raw))
            except orjson.JSONDecodeError:
                continue
            return m.start() + 1
        return None

    def next(self):
        """-> (the element's bytes, bytes moved) or (None, 0) after the array's `]`. EOFError
        when the file ends inside the array; FileProblem when it does not start with `[`."""
        if self.closed:
            return None, 0
        p0 = self.base + self.i
        if not self.opened:
            if not self._skip_ws():
                return None, 0   # an empty file
            if self.buf[self.i:self.i + 3] == b"\xef\xbb\xbf":
                self.i += 3
                self._skip_ws()
            if self.buf[self.i:self.i + 1] != b"[":
                raise FileProblem("unrecognized_file", "a .json file that is not a JSON array of "
                                  "objects after all (its first byte changed since it was sniffed)")
            self.i += 1
            self.opened = True
        if not self._skip_ws():
            raise EOFError("the JSON array ends without its closing ']'")
        c = self.buf[self.i]
        if c == 0x5D:        # ']': the array is over
            self.i += 1
            self.closed = True
            return None, 0
        if c == 0x2C:        # ',' where an element should be: an empty element
            self.i += 1
            return b"", self.base + self.i - p0
        self._parsed = (None, None)
        while True:
            end = self._object_end() if c == 0x7B else None
            fast = end is not None
            if end is None:
                end = self._element_end()
            if end is not None:
                break
            if not self._fill():
                raise EOFError("the file ends inside an element of its JSON array")
        raw = self._parsed[0] if fast else None
        if raw is None or len(raw) != end - self.i:
            raw = self.buf[self.i:end]
        self.i = end
        if self._skip_ws() and self.buf[self.i] == 0x2C:
            self.i += 1      # the comma goes with the element: the next scan starts after it
        return raw, self.base + self.i - p0

    def parse(self, raw: bytes):
        seen, rec = self._parsed
        if raw is seen:
            return record_text(rec, self.text_key)
        return parse_json(raw, self.text_key)

    def close(self) -> None:
        self.fh.close()


# ------------------------------------------------------------------ columnar (Parquet, Arrow)
# A column reader's next() for rows of groups another part of a split file owns (skipped unread).
OTHER_PART = object()


def _pyarrow():
    try:
        import pyarrow
    except ImportError:   # pragma: no cover - a dependency; named for an install without it
        raise FileProblem("unreadable_file", "reading Parquet/Arrow needs pyarrow: pip install "
                          "pyarrow") from None
    return pyarrow


class _ColumnRecords:
    """Rows of one string column, read group by group (Parquet row groups, Arrow record batches).
    Position `off`: the row in the file; a restore loads only the group holding it."""

    def _setup(self, path: str, text_key: str, off: int, schema, sizes: list[int],
               part: tuple[int, int] | None = None) -> None:
        pa = _pyarrow()
        self.text_key = text_key
        if text_key not in schema.names:
            cols = ", ".join(schema.names[:8])
            raise FileProblem("missing_key", f"no column {text_key!r}; its columns: {cols} "
                              "(set data.text_key)")
        typ = schema.field(text_key).type
        if not (pa.types.is_string(typ) or pa.types.is_large_string(typ)
                or getattr(pa.types, "is_string_view", lambda t: False)(typ)):
            raise FileProblem("non_string_text", f"column {text_key!r} holds {typ}, not text")
        self.sizes = sizes
        self.group, self.first = 0, 0      # the group holding row `off`, and its first row
        while self.group < len(sizes) and self.first + sizes[self.group] <= off:
            self.first += sizes[self.group]
            self.group += 1
        self.row = off
        self.values = None
        # A file read by `split` shards (fewer files than shards) whose groups are enough to
        # go round: part `residue` owns the groups `g % split == residue` and never decodes
        # another's. With fewer groups than parts, the parts split by row (ShardReader).
        self.splits_itself = part is not None and part[0] > 1 and len(sizes) >= part[0]
        self.part = part

    def _owned(self, g: int) -> bool:
        return not self.splits_itself or g % self.part[0] == self.part[1]

    def next(self):
        """-> (value, 1) for the next row, (OTHER_PART, rows) for the rows up to this part's
        next group (or the end), or (None, 0) at the end."""
        while self.values is None or self.row - self.first >= len(self.values):
            if self.values is not None:
                self.first += len(self.values)
                self.group += 1
                self.values = None
            if self.group >= len(self.sizes):
                self.values = []
                return None, 0
            if not self._owned(self.group):
                skipped = 0
                while self.group < len(self.sizes) and not self._owned(self.group):
                    skipped += self.first + self.sizes[self.group] - max(self.row, self.first)
                    self.first += self.sizes[self.group]
                    self.row = self.first
                    self.group += 1
                return OTHER_PART, skipped
            self.values = self._load(self.group).to_pylist()
        v = self.values[self.row - self.first]
        self.row += 1
        return v, 1

    def parse(self, value):
        if value is None:
            return None, "null_text"
        if not value.strip():
            return None, "empty_text"
        return value, None


class ParquetRecords(_ColumnRecords):
    fmt = "parquet"

    def __init__(self, path: str, text_key: str, off: int = 0, point: list | None = None,
                 part: tuple[int, int] | None = None, seek_points: bool = False):
        pa = _pyarrow()
        import pyarrow.parquet as pq
        try:
            # reads the footer only (a URL: through a buffered object-store file, closed with it)
            self._src = open_raw(path) if "://" in path else None
            self.pf = pq.ParquetFile(self._src or path)
            meta = self.pf.metadata
            sizes = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
            schema = self.pf.schema_arrow
        except (pa.ArrowException, OSError) as e:
            if isinstance(e, FileNotFoundError):
                raise
            raise FileProblem("corrupt_file", f"not a readable Parquet file: {e}") from None
        self.raw_file = None
        self._setup(path, text_key, off, schema, sizes, part)

    def _load(self, g: int):
        # one thread: the tokenizer has the cores; a column of one row group is one decode job
        return self.pf.read_row_group(g, columns=[self.text_key], use_threads=False).column(0)

    def close(self) -> None:
        self.pf.close()
        if self._src is not None:
            self._src.close()


class ArrowRecords(_ColumnRecords):
    """An Arrow IPC stream (what `datasets`' save_to_disk writes) or IPC file, memory-mapped."""
    fmt = "arrow"

    def __init__(self, path: str, text_key: str, off: int = 0, point: list | None = None,
                 part: tuple[int, int] | None = None, seek_points: bool = False):
        pa = _pyarrow()
        self.raw_file = None
        try:
            self.src = pa.memory_map(path) if "://" not in path else pa.BufferReader(_whole(path))
            if self.src.read(6) == b"ARROW1":
                self.src.seek(0)
                reader = pa.ipc.open_file(self.src)
                self.batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
            else:
                self.src.seek(0)
                reader = pa.ipc.open_stream(self.src)
                self.batches = list(reader)   # zero-copy views of the mapped file
            schema = reader.schema
        except (pa.ArrowException, OSError) as e:
            if isinstance(e, FileNotFoundError):
                raise
            raise FileProblem("corrupt_file", f"not a readable Arrow file: {e}") from None
        self._setup(path, text_key, off, schema, [b.num_rows for b in self.batches], part)

    def _load(self, g: int):
        return self.batches[g].column(self.text_key)

    def close(self) -> None:
        self.batches = []
        self.src.close()


def _whole(url: str) -> bytes:
    """An Arrow file from a URL, read whole: its batches are zero-copy views of these bytes."""
    with open_raw(url) as f:
        return f.read()


_READERS = {"lines": LineRecords, "array": ArrayRecords, "parquet": ParquetRecords,
            "arrow": ArrowRecords}


def open_records(path: str, text_key: str, off: int = 0, point: list | None = None,
                 fmt: str | None = None, part: tuple[int, int] | None = None, seek_points: bool = False):
    """The record reader of `path` positioned at `off` (`fmt`: the format a saved position was
    read in, else sniffed). `part`: (split, residue) when `split` shards read the file; a reader
    whose `splits_itself` is true then returns only that part's records (the others' as
    OTHER_PART, unread), else the caller keeps every split-th record. FileProblem for a file
    that is not a format read here. `seek_points`: as open_bytes."""
    return _READERS[fmt or sniff(path)](path, text_key, off, point, part, seek_points)

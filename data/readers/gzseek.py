"""Resume points inside .gz files, so that restoring a reader deep in a file re-reads a bounded
amount of it instead of everything before its position.

A deflate stream can only be resumed at a block boundary, which may fall inside a byte, and
with the 32 KB of text before it (back-references reach that far): a *seek point* is
(compressed byte offset, bit count, uncompressed offset, window), the zran design of zlib's
examples. The stream's reader finds them itself as it inflates (data/readers/gzpoints.py:
`open_gz_at(..., seek_points=True)`, `own_points`); without a loadable zlib, indexed_gzip
(zran) finds them in a second pass (`PointFinder`: it cannot stream fast, each read
re-inflating from the nearest point, ~10x slower than isal here, so it runs beside the reader,
a spacing behind, and the reader streams with isal). A point is saved in the reader's JSON
state as [header_end, cmp, bits, uncmp, base64(zlib(window))] (~18-20 KB of JSON), only once
the position is deep enough to need one. Which point a state holds depends on the reader's
history (a restored reader may save another, equally valid one); the data never does.

Resuming is `open_gz_at`: the stream's reader resumes at the point with zlib's own
inflatePrime (gzpoints.py); elsewhere Python's zlib inflates from the point, with the window as
its dictionary, and as Python's zlib has no inflatePrime, when the block starts inside a byte a
few no-op deflate blocks are put before it (`_prime`). The resumed member's CRC is not checked
(its start was never read); later members are checked as usual.

Costs: the point finder reads the compressed file a second time (sequentially, just behind
the reader: served by the page cache when the file is local or cached) and inflates it with
zlib; it keeps at most MAX_POINTS windows per open file. The stream's one-pass reader costs
neither (0.59 s of CPU per 160 MB-of-text file with its points, against 0.27 + 0.65 s).
"""
from __future__ import annotations

import base64
import io
import struct
import zlib

import indexed_gzip

from data.readers import gzpoints

try:  # isal's igzip is ~3x faster than the stdlib gzip module for decompression.
    from isal import igzip as _gzip
except ImportError:  # pragma: no cover
    import gzip as _gzip

# Uncompressed bytes between the points the finder keeps. A restore re-inflates at most
# ~1.5 x SPACING of text (the state's point is refreshed every SPACING / 2 of reading):
# ~3 MB of text, ~1.3 MB of a RedPajama-like .json.gz, ~12 ms of zlib on an idle core here.
# Smaller: cheaper restores, more (cheap) point refreshes; the finder's work stays ~1.5 zlib
# passes over the file whatever the spacing.
SPACING = 2 << 20
# Positions before this are restored by re-reading from the file's start: no window saved.
FREE_REREAD = SPACING
WINDOW = 32768
# The finder drops older windows (re-seeding its index from its newest point) beyond this.
MAX_POINTS = 8
_READ = 256 << 10
_HEADER = struct.Struct("<5sBBQQIII")    # GZIDX, version 1, flags, sizes, spacing, window, n
_POINT = struct.Struct("<QQBB")          # cmp offset, uncmp offset, bits, has-window flag


def _encode(header_end: int, cmp: int, bits: int, uncmp: int, window: bytes) -> list:
    # zlib level 1: a new point every SPACING of text (~80 in a 160 MB documents file), each
    # window compressed on the reader's thread; level 6 took 1.03 ms a window (3 us a document
    # of web-length text, documents and signals files together), level 1 0.19 ms, for 11% more
    # bytes (14.9 KB against 13.4 on RPv2-like text). Any level restores the same.
    return [header_end, cmp, bits, uncmp,
            base64.b64encode(zlib.compress(window, 1)).decode("ascii")]


def _window(point: list) -> bytes:
    return zlib.decompress(base64.b64decode(point[4]))


class PointFinder:
    """The newest seek point at or before a reader's offset in one .gz file, found by an
    indexed_gzip index built as the reader advances (seeded with the reader's restore point,
    so a restored reader never re-reads the file's start)."""

    def __init__(self, path: str, start: list | None = None):
        self.path = path
        self._ig = None
        self._last = None                # the last point handed out, encoded
        self._raw: list[tuple] = []      # (cmp, uncmp, bits, window) from the index
        self._header_end = None
        self._size = 0
        if start is not None:
            self._seed(start)

    def _open(self) -> None:
        # drop_handles=False: one open file, not an open per read (a bucket request on gcsfuse)
        if "://" in self.path:   # a URL: zran reads through our buffered object-store file
            self._ig = indexed_gzip._IndexedGzipFile(fileobj=_open_stored(self.path), spacing=SPACING,
                                                     window_size=WINDOW, skip_crc_check=True)
            self._size = _HEADER.unpack_from(self._export(), 0)[3]
            return
        self._ig = indexed_gzip._IndexedGzipFile(self.path, spacing=SPACING, window_size=WINDOW,
                                                 skip_crc_check=True, drop_handles=False)
        self._size = _HEADER.unpack_from(self._export(), 0)[3]

    def _export(self) -> bytes:
        buf = io.BytesIO()
        self._ig.export_index(fileobj=buf)
        return buf.getvalue()

    def _seed(self, point: list) -> None:
        """A fresh index holding only the stream start and `point` (encoded): indexed_gzip
        expands from its last point, so the finder reads on from there, not from the start."""
        header_end, cmp, bits, uncmp = point[:4]
        self._seed_raw(header_end, (cmp, uncmp, bits, _window(point)))

    def _seed_raw(self, header_end: int, raw: tuple) -> None:
        if self._ig is not None:
            self._ig.close()
        self._open()
        cmp, uncmp, bits, window = raw
        idx = (_HEADER.pack(b"GZIDX", 1, 0, self._size, 0, SPACING, WINDOW, 2)
               + _POINT.pack(header_end, 0, 0, 0) + _POINT.pack(cmp, uncmp, bits, 1) + window)
        self._ig.import_index(fileobj=io.BytesIO(idx))
        self._header_end = header_end
        self._raw = [raw]

    def _parse(self, idx: bytes) -> list[tuple]:
        n = _HEADER.unpack_from(idx, 0)[7]
        heads = [_POINT.unpack_from(idx, _HEADER.size + i * _POINT.size) for i in range(n)]
        at = _HEADER.size + n * _POINT.size
        out = []
        for cmp, uncmp, bits, has_window in heads:
            if has_window:   # points without a window start a gzip member: not resumable here
                out.append((cmp, uncmp, bits, idx[at:at + WINDOW]))
                at += WINDOW
            elif uncmp == 0 and self._header_end is None:
                self._header_end = cmp
        return out

    def point_before(self, off: int) -> list | None:
        """The encoded newest point at or before uncompressed offset `off` (None before
        FREE_REREAD: re-reading from the start is as cheap)."""
        if off < FREE_REREAD:
            return None
        if not self._raw or self._raw[-1][1] <= off - SPACING:
            if self._ig is None:
                self._open()
            self._ig.seek(off)   # expands the index up to (at least) off
            self._raw = self._parse(self._export())
            if len(self._raw) > MAX_POINTS:
                older = [p for p in self._raw if p[1] <= off]
                if older:
                    self._seed_raw(self._header_end, older[-1])
        best = None
        for p in self._raw:
            if p[1] <= off and (best is None or p[1] > best[1]):
                best = p
        if best is None:
            return None
        if self._last is None or self._last[3] != best[1]:
            cmp, uncmp, bits, window = best
            self._last = _encode(self._header_end, cmp, bits, uncmp, window)
        return self._last

    def close(self) -> None:
        if self._ig is not None:
            self._ig.close()
            self._ig = None


def _prime(bits_before: int, window: bytes) -> tuple[bytes, bytes, int]:
    """zlib has no inflatePrime in Python: instead of shifting the file's bits, prepend
    no-op fixed-Huffman blocks whose total length is `bits_before` (mod 8), so that the
    file's byte boundaries stay byte boundaries (stored blocks align to them).
    -> (prefix bytes, the dictionary to prime zlib with, bytes of output to drop).

    An empty fixed block is 10 bits (2 mod 8). Odd lengths need a block with one match of
    length 3 at distance 32768 (35 bits, 3 mod 8); it re-emits the window's last 3 bytes,
    taken from a dictionary rotated so that afterwards the history is exactly the window."""
    n_bits = bits_before % 8
    if n_bits == 0:
        return b"", window, 0
    out, filled = 0, 0

    def put(value: int, n: int) -> None:          # deflate's LSB-first bit order
        nonlocal out, filled
        out |= value << filled
        filled += n

    def put_code(code: int, n: int) -> None:      # Huffman codes go in MSB first
        put(int(f"{code:0{n}b}"[::-1], 2), n)

    drop, zdict = 0, window
    if n_bits % 2:
        put(0, 1), put(1, 2)                      # BFINAL=0, BTYPE=01 (fixed Huffman)
        put_code(257 - 256, 7)                    # length 3
        put_code(29, 5), put(32768 - 24577, 13)   # distance 32768
        put_code(0, 7)                            # end of block
        drop, zdict = 3, window[-3:] + window[:-3]
    while filled % 8 != n_bits:
        put(0, 1), put(1, 2), put_code(0, 7)      # an empty fixed block
    return out.to_bytes((filled + 7) // 8, "little"), zdict, drop


class _InflateFrom(io.RawIOBase):
    """A gzip file's text from a seek point on: zlib raw inflate primed with the window (see
    `_prime`); later gzip members by isal."""

    def __init__(self, path: str, point: list):
        _, cmp, bits, _, _ = point
        self._fh = _open_stored(path)
        self._start = cmp - 1 if bits else cmp     # the byte holding the block's first bit
        self._fh.seek(self._start)
        prefix, zdict, self._drop = _prime(8 - bits if bits else 0, _window(point))
        first = b""
        if prefix:   # the prefix's last byte takes the point's byte's high `bits` bits
            byte = self._fh.read(1)[0]
            keep = (0xFF << (8 - bits)) & 0xFF
            first = prefix[:-1] + bytes([prefix[-1] | (byte & keep)])
        self._head = len(first) - 1 if first else 0   # fed bytes before the file's next byte
        self._z = zlib.decompressobj(-15, zdict=zdict)
        self._fed = 0
        self._out = b""
        self._rest = None        # isal reader of the following members, once this one ends
        self._done = False
        self._feed(first)

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        while not self._out and not self._done:
            self._more()
        n = min(len(b), len(self._out))
        b[:n] = self._out[:n]
        self._out = self._out[n:]
        return n

    def _more(self) -> None:
        if self._rest is not None:
            self._out = self._rest.read(_READ)
            self._done = not self._out
            return
        chunk = self._fh.read(_READ)
        if not chunk:
            raise EOFError("Compressed file ended before the end-of-stream marker was reached")
        self._feed(chunk)

    def _feed(self, data: bytes) -> None:
        if not data:
            return
        self._fed += len(data)
        out = self._z.decompress(data)
        if self._drop:
            k = min(self._drop, len(out))
            out, self._drop = out[k:], self._drop - k
        self._out += out
        if self._z.eof:
            self._next_member(self._start + self._fed - len(self._z.unused_data) - self._head)

    def _next_member(self, trailer: int) -> None:
        """The member's deflate data ends before byte `trailer`; after its 8-byte trailer:
        the file's end or another member."""
        size = self._fh.seek(0, io.SEEK_END)
        nxt = trailer + 8
        if nxt >= size:
            self._rest = io.BytesIO()
            return
        self._fh.seek(nxt)
        self._rest = _gzip.GzipFile(fileobj=self._fh, mode="rb")

    def close(self) -> None:
        if self._rest is not None:
            self._rest.close()
        self._fh.close()
        super().close()


def _open_stored(path: str):
    """The .gz file's compressed bytes: a local file (unbuffered: the inflater reads big chunks)
    or a URL through data/readers/objstore.py."""
    if "://" in path:
        from data.readers import objstore
        return objstore.open_url(path)
    return open(path, "rb", buffering=0)


class _PointReader(io.BufferedReader):
    """A .gz file's text from its start that finds its own seek points as it goes
    (data/readers/gzpoints.py): `point_before` is PointFinder's, without a second pass."""

    _encoded = None   # the last point handed out, encoded

    @property
    def fileobj(self):
        return self.raw.fileobj

    def point_before(self, off: int) -> list | None:
        """The encoded newest point at or before uncompressed offset `off` (None before
        FREE_REREAD); the last one handed out when the kept ones are all past `off`."""
        if off < FREE_REREAD:
            return None
        raw = self.raw
        best = None
        for p in raw.points:
            if p[1] <= off:
                best = p
        if best is not None and (self._encoded is None or self._encoded[3] != best[1]):
            cmp, uncmp, bits, window = best
            self._encoded = _encode(raw.header_end, cmp, bits, uncmp, window)
        return self._encoded


def own_points(fh) -> _PointReader | None:
    """`fh` when it finds its own seek points (open_gz_at with seek_points), else None."""
    return fh if isinstance(fh, _PointReader) else None


def open_gz_at(path: str, point: list | None, off: int, seek_points: bool = False):
    """Binary line reader of a .gz file positioned at uncompressed offset `off`: inflated from
    `point` (at or before off) or, without one, from the start. seek_points: a reader that finds
    its own points as it reads on (`own_points`), where zlib-ng or the system's zlib can be loaded."""
    if seek_points and gzpoints.ZLIB is not None:   # from the start or on from the point
        # 4 points kept: the reader is at most its buffer (256 KB) behind the inflater, the
        # points a SPACING apart; ~0.9 MB a file in all, as isal's reader holds. Its text and
        # points are gzip's and PointFinder's (tests/test_data_seek.py)
        start = None if point is None else (*point[:4], _window(point))
        fh = _PointReader(gzpoints.PointInflater(_open_stored(path), SPACING, 4, start),
                          buffer_size=256 << 10)
        base = 0 if point is None else point[3]
    elif point is None:
        if "://" in path:
            fh = _gzip.GzipFile(fileobj=_open_stored(path), mode="rb")
            fh.myfileobj = fh.fileobj   # GzipFile closes myfileobj: the URL's file closes with it
        else:
            fh = _gzip.open(path, "rb")
        base = 0
    else:
        fh = io.BufferedReader(_InflateFrom(path, point), buffer_size=1 << 20)
        base = point[3]
    todo = off - base
    while todo > 0:
        got = len(fh.read(min(todo, 1 << 20)))
        if not got:
            break
        todo -= got
    return fh

"""A .gz file read in one pass that finds its own seek points (data/readers/gzseek.py's kind:
compressed offset, bit count, uncompressed offset, the 32 KB window before it).

The stream's readers save a seek point in their state, so that a restore deep in a file re-reads
a bounded amount of it. gzseek.PointFinder finds the points with indexed_gzip, which inflates the
file a second time beside the reader's own (isal) pass. Per 160 MB documents file of web text on
the 2-core machine: the reader's isal pass with its lines 0.27 s of CPU, the finder's zlib pass
0.57 s plus 0.08 s of windows compressed at level 6 (scripts/bench/bench_quality.py). Here the
reader inflates itself (through ctypes, `inflate(Z_BLOCK)`: it returns at every deflate block's
end, where `data_type` says how many bits of the last byte the next block starts after), keeps
the window from its own output, and hands the text out, one pass instead of two. It inflates with
zlib-ng (the `zlib-ng` package's extension exports its native `zng_` calls), else the system's
zlib: the same file, its text and its points, in 0.36 s of CPU with zlib-ng, 0.66 s with zlib
(0.59 s with its lines, before zlib-ng).

Points are kept in the file's first gzip member only (RedPajama-v2's files have one): a later
member's position is restored from the first member's last point (gzseek._InflateFrom reads the
following members with isal). Without either library the reader is isal's and
gzseek.PointFinder finds the points, as before.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import io

WINDOW = 32768
_IN = 256 << 10       # compressed bytes per read
_OUT = 256 << 10      # text per inflate call, after the window's worth kept before it
_Z_OK, _Z_STREAM_END, _Z_BUF_ERROR, _Z_BLOCK = 0, 1, -5, 5


class _ZStream(ctypes.Structure):
    """zlib.h's z_stream, the library's public ABI."""
    _fields_ = [("next_in", ctypes.c_void_p), ("avail_in", ctypes.c_uint), ("total_in", ctypes.c_ulong),
                ("next_out", ctypes.c_void_p), ("avail_out", ctypes.c_uint), ("total_out", ctypes.c_ulong),
                ("msg", ctypes.c_char_p), ("state", ctypes.c_void_p), ("zalloc", ctypes.c_void_p),
                ("zfree", ctypes.c_void_p), ("opaque", ctypes.c_void_p), ("data_type", ctypes.c_int),
                ("adler", ctypes.c_ulong), ("reserved", ctypes.c_ulong)]


class _ZngStream(ctypes.Structure):
    """zlib-ng.h's zng_stream (its native API: 32-bit counts and checksum, size_t totals)."""
    _fields_ = [("next_in", ctypes.c_void_p), ("avail_in", ctypes.c_uint32), ("total_in", ctypes.c_size_t),
                ("next_out", ctypes.c_void_p), ("avail_out", ctypes.c_uint32), ("total_out", ctypes.c_size_t),
                ("msg", ctypes.c_char_p), ("state", ctypes.c_void_p), ("zalloc", ctypes.c_void_p),
                ("zfree", ctypes.c_void_p), ("opaque", ctypes.c_void_p), ("data_type", ctypes.c_int),
                ("adler", ctypes.c_uint32), ("reserved", ctypes.c_ulong)]


class _Inflate:
    """One library's inflate calls, under zlib's names: `init(stream_ref, window_bits)`,
    `inflate`, `reset2`, `prime`, `set_dictionary`, `end`; `stream`: its z_stream type."""

    def __init__(self, name: str, stream, init, inflate, reset2, prime, set_dictionary, end):
        self.name, self.stream = name, stream
        p = ctypes.POINTER(stream)
        for f, args in ((inflate, [p, ctypes.c_int]), (reset2, [p, ctypes.c_int]),
                        (prime, [p, ctypes.c_int, ctypes.c_int]), (set_dictionary, [p, ctypes.c_char_p, ctypes.c_uint]),
                        (end, [p])):
            f.argtypes = args
        self.init, self.inflate, self.reset2, self.prime = init, inflate, reset2, prime
        self.set_dictionary, self.end = set_dictionary, end


def _load_zlib_ng() -> _Inflate | None:
    """zlib-ng's native inflate, from the `zlib-ng` package's extension module (it links zlib-ng
    in and exports its `zng_` calls): 2.4x zlib's speed on web text (0.28 against 0.69 s of CPU
    for a 160 MB-of-text file). None where the package or those calls are missing."""
    try:
        from zlib_ng import zlib_ng
        lib = ctypes.CDLL(zlib_ng.__file__)
        lib.zng_inflateInit2.argtypes = [ctypes.POINTER(_ZngStream), ctypes.c_int]
        return _Inflate("zlib-ng", _ZngStream, lib.zng_inflateInit2, lib.zng_inflate, lib.zng_inflateReset2,
                        lib.zng_inflatePrime, lib.zng_inflateSetDictionary, lib.zng_inflateEnd)
    except (ImportError, OSError, AttributeError):
        return None


def _load_zlib() -> _Inflate | None:
    name = ctypes.util.find_library("z")
    if name is None:   # pragma: no cover - every Linux and macOS host has one
        return None
    try:
        z = ctypes.CDLL(name)
        z.zlibVersion.restype = ctypes.c_char_p
        version = z.zlibVersion()
        z.inflateInit2_.argtypes = [ctypes.POINTER(_ZStream), ctypes.c_int, ctypes.c_char_p, ctypes.c_int]

        def init(sp, bits):
            return z.inflateInit2_(sp, bits, version, ctypes.sizeof(_ZStream))
        return _Inflate("zlib", _ZStream, init, z.inflate, z.inflateReset2, z.inflatePrime,
                        z.inflateSetDictionary, z.inflateEnd)
    except (OSError, AttributeError):   # pragma: no cover
        return None


ZLIB = _load_zlib_ng() or _load_zlib()


class PointInflater(io.RawIOBase):
    """The text of a .gz file from its start (`fh`: its compressed bytes, closed with it), and
    the seek points met on the way: `points`, [(cmp, uncmp, bits, window)] at least `spacing`
    of text apart, the newest `keep` of them; `header_end` where the first member's deflate data
    starts. EOFError when the file ends inside a member (as gzip's), OSError naming zlib's
    complaint for data that is not gzip or fails its check.

    `start`: (header_end, cmp, bits, uncmp, window), a seek point to read on from (a restore):
    the text from `uncmp` on, and the points after it, as a reader from the start finds them.
    The resumed member's CRC is not checked (its start is not read); later members' are."""

    def __init__(self, fh, spacing: int, keep: int, start: tuple | None = None):
        self._fh = fh
        self._spacing, self._keep = spacing, keep
        self._s = ZLIB.stream()
        self._sp = ctypes.byref(self._s)
        bits = 47 if start is None else -15       # a gzip member, or raw deflate from a point
        if ZLIB.init(self._sp, bits) != _Z_OK:
            raise MemoryError(f"{ZLIB.name} inflateInit2 failed")
        self._live = True
        self._in_base = self._out_base = 0        # where total_in / total_out count from
        self._raw = start is not None             # inside a resumed member (no gzip trailer read)
        self._in = ctypes.create_string_buffer(_IN)
        self._out = ctypes.create_string_buffer(WINDOW + _OUT)
        self._in_at, self._out_at = ctypes.addressof(self._in), ctypes.addressof(self._out)
        self._view = memoryview(self._out).cast("B")
        self._fill = 0          # text in _out
        self._given = 0         # of it, handed out
        self._ended = False     # the last member ended with the file
        self._first = True      # still in the first member: points are kept
        self._read_any = False
        self._last = 0          # uncompressed offset of the newest point
        self.points: list[tuple] = []
        self.header_end = None
        if start is not None:
            self.header_end, cmp, nbits, uncmp, window = start
            fh.seek(cmp - 1 if nbits else cmp)    # the byte holding the block's first bits
            if nbits:
                ZLIB.prime(self._sp, nbits, fh.read(1)[0] >> (8 - nbits))
            ZLIB.set_dictionary(self._sp, window, len(window))
            self._in_base, self._out_base, self._last = cmp, uncmp, uncmp
            self._read_any = True

    @property
    def fileobj(self):
        """The compressed file (what gzip's `fileobj` is: its tell() is the bytes read)."""
        return self._fh

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        while self._given == self._fill and not self._ended:
            self._step()
        n = min(len(b), self._fill - self._given)
        b[:n] = self._view[self._given:self._given + n]
        self._given += n
        return n

    def _step(self) -> None:
        s = self._s
        if self._fill == len(self._out):       # full: the last WINDOW bytes stay as history
            ctypes.memmove(self._out_at, self._out_at + self._fill - WINDOW, WINDOW)
            self._fill = self._given = WINDOW
        if s.avail_in == 0:
            got = self._fh.readinto(self._in)
            if not got:
                if not self._read_any:
                    self._ended = True          # an empty file (after a member, _member_end)
                    return
                raise EOFError("Compressed file ended before the end-of-stream marker was reached")
            self._read_any = True
            s.next_in, s.avail_in = self._in_at, got
        room = len(self._out) - self._fill
        s.next_out, s.avail_out = self._out_at + self._fill, room
        rc = ZLIB.inflate(self._sp, _Z_BLOCK)
        self._fill += room - s.avail_out
        if rc == _Z_STREAM_END:
            self._member_end()
            return
        if rc not in (_Z_OK, _Z_BUF_ERROR):
            raise OSError(f"not a valid gzip file: {ZLIB.name} error {rc} "
                          f"({(s.msg or b'').decode(errors='replace')})")
        dt = s.data_type
        if self._first and dt & 128 and not dt & 64:   # a block's end, not the last block's
            out = self._out_base + s.total_out
            if out == 0:
                if self.header_end is None:
                    self.header_end = s.total_in
            elif out - self._last >= self._spacing and self._fill >= WINDOW:
                self._last = out
                self.points.append((self._in_base + s.total_in, out, dt & 7,
                                    self._view[self._fill - WINDOW:self._fill].tobytes()))
                del self.points[:-self._keep]

    def _member_end(self) -> None:
        """A member ended: another may follow (read on, no points), or the file ends. A resumed
        member's deflate data ends before its 8-byte trailer, which gzip's own reading skips."""
        self._first = False
        skip = 8 if self._raw else 0
        self._raw = False
        if ZLIB.reset2(self._sp, 47) != _Z_OK:   # pragma: no cover
            raise OSError(f"{ZLIB.name} inflateReset2 failed")
        s = self._s
        while True:
            if skip and s.avail_in:
                k = min(skip, s.avail_in)
                s.next_in, s.avail_in, skip = s.next_in + k, s.avail_in - k, skip - k
            if s.avail_in and not skip:
                return
            got = self._fh.readinto(self._in)
            if not got:
                if skip:
                    raise EOFError("Compressed file ended before the end-of-stream marker was reached")
                self._ended = True
                return
            s.next_in, s.avail_in = self._in_at, got

    def close(self) -> None:
        if self._live:
            self._live = False
            ZLIB.end(self._sp)
            self._fh.close()
        super().close()

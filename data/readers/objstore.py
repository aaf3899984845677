"""Files named by URL (`gs://`, `s3://`, `hf://`, `memory://`...): listed and opened through fsspec.

Local paths never come here: `is_url` is checked first and the readers keep their plain `open`.
A URL is read in large blocks (BLOCK, a read-ahead cache per open file) so that one request's
latency is spread over megabytes of text, and a listing asks the store once per pattern with
sizes included (`glob(detail=True)`), never once per file. fsspec and its backends are imported
only here and only when a URL is met, so validating a config stays light.

The sizes of a listing are kept (SIZES, `remember_sizes`) and travel with the run's listing (saved
with the checkpoint, data/listing.py) and with the StreamSpec to input worker processes: opening
an object of known size asks the store nothing, where an fsspec file would first fetch the
object's metadata (one request per file, in every fresh process: a resume, each input worker).

Credentials are whatever the backend finds (gcsfs: application default credentials, the
metadata server, GOOGLE_APPLICATION_CREDENTIALS); they are never part of a URL we keep, and the
messages here print the URL only.
"""
from __future__ import annotations

import io
import time

# Bytes fetched per request: at ~100 MB/s from a bucket and ~20-50 ms per request, 8 MB keeps
# the request latency under a third of the transfer time.
BLOCK = 8 << 20
# Seconds this process spent in object-store reads (requests and transfer): the per-stage table's
# "fetch" (data/timing.py), taken out of "read" by data/readers/sources.py around each record it reads.
FETCH_S = [0.0]
# {url: size in bytes} of the objects listed in (or handed to) this process. Every reader of a URL
# (data/readers/formats.py, data/readers/gzseek.py, held-out files) opens it by its URL alone; a per-process table
# spares threading a size through each of them. Objects are taken as unchanged since the listing,
# as the listing itself is.
SIZES: dict[str, int] = {}
RETRIES = 4            # tries of a read that fails with a transient error
BACKOFF_S = 0.2        # first wait between tries, doubled each time

# The pip extra that installs each scheme's backend (named in the one-line error).
_EXTRAS = {"gs": "gcs", "gcs": "gcs", "s3": "s3"}
_PACKAGES = {"gs": "gcsfs", "gcs": "gcsfs", "s3": "s3fs", "hf": "huggingface_hub"}


def is_url(path) -> bool:
    return "://" in str(path)


def scheme(url: str) -> str:
    return str(url).split("://", 1)[0].lower()


def filesystem(url: str):
    """The fsspec file system of `url`'s scheme; ValueError in one line naming the pip extra when
    its backend is not installed."""
    try:
        import fsspec
    except ImportError:
        raise ValueError(f"{url}: reading URLs needs fsspec: pip install -e '.[gcs]' (or pip install gcsfs)") from None
    s = scheme(url)
    try:
        return fsspec.filesystem(s)
    except ImportError:
        extra = _EXTRAS.get(s)
        pkg = _PACKAGES.get(s, "its fsspec backend")
        hint = f"pip install -e '.[{extra}]' (or pip install {pkg})" if extra else f"pip install {pkg}"
        raise ValueError(f"{url}: the {s}:// scheme needs {pkg}: {hint}") from None
    except ValueError as e:   # fsspec: "Protocol not known"
        raise ValueError(f"{url}: {s}:// is not a URL scheme fsspec knows ({e})") from None


def _full(fs, url: str, path: str) -> str:
    """A path as fsspec returns it (no scheme) back to a URL of `url`'s scheme."""
    return fs.unstrip_protocol(path) if "://" not in path else path


def list_url(pattern: str) -> tuple[list[str], dict[str, int]]:
    """The files matching a URL pattern (a glob, `**` for any depth, or a plain object) with their
    sizes from the listing itself: one list request per pattern, none per file."""
    fs = filesystem(pattern)
    if any(c in pattern for c in "*?["):
        found = fs.glob(pattern, detail=True)
    else:
        # a plain object or a "directory": one listing of its prefix, sizes included
        found = fs.find(pattern, detail=True)
    sizes = _sizes(fs, pattern, found)
    remember_sizes(sizes)
    return sorted(sizes), sizes


def list_folder(url: str) -> tuple[dict[str, int], dict[str, str]]:
    """The objects under a URL without a glob, from one listing (as list_url): their sizes
    ({url: size}) and {url: path relative to `url`}, the second empty when `url` names an object
    itself rather than a "folder". data/listing.py picks a dataset folder's train files by those
    relative paths, as it does for a local folder."""
    fs = filesystem(url)
    found = fs.find(url, detail=True)
    sizes = _sizes(fs, url, found)
    remember_sizes(sizes)
    # The folder as the backend spells its paths: hf:// writes a revision given as
    # `@refs/convert/parquet` quoted in the paths it returns (resolve_path reuses what find cached).
    root = fs._strip_protocol(url).rstrip("/")
    if hasattr(fs, "resolve_path"):
        try:
            root = fs.resolve_path(url).unresolve().rstrip("/")
        except Exception:   # noqa: BLE001 - the plain stripped path is then the best guess
            pass
    rels = {_full(fs, url, p): p[len(root) + 1:] for p, info in found.items()
            if info.get("type", "file") == "file" and p.startswith(root + "/")}
    return sizes, rels


def _sizes(fs, url: str, found: dict) -> dict[str, int]:
    return {_full(fs, url, p): int(info.get("size") or 0)
            for p, info in found.items() if info.get("type", "file") == "file"}


def remember_sizes(sizes) -> None:
    """Objects' sizes ({url: size} or (url, size) pairs) known from a listing: opening one of
    them then costs no metadata request."""
    SIZES.update(sizes)


def known_sizes(paths) -> dict[str, int]:
    """{url: size} of those of `paths` whose size this process knows (local paths never)."""
    return {p: SIZES[p] for p in paths if p in SIZES}


class ReadError(OSError):
    """A read of a URL that kept failing after RETRIES tries (the message names the URL)."""


def _transient(e: BaseException) -> bool:
    if isinstance(e, FileNotFoundError):
        return False   # an object that vanished: not worth a retry
    return isinstance(e, (OSError, TimeoutError, ConnectionError)) or type(e).__name__ in (
        "HttpError", "ClientError", "ServerDisconnectedError", "ClientPayloadError")


def _reads_ranges(fs) -> bool:
    """Whether the backend reads a byte range in one request of its own (gcsfs, s3fs, any async
    backend; memory://), not through fsspec's default cat_file, which opens a file per call."""
    from fsspec.asyn import AsyncFileSystem
    from fsspec.spec import AbstractFileSystem

    return isinstance(fs, AsyncFileSystem) or type(fs).cat_file is not AbstractFileSystem.cat_file


class _Ranged:
    """The read surface of an fsspec file (read, seek, size) over an object of known size, read
    through the backend's ranged GET (`cat_file`), BLOCK bytes ahead as fsspec's "readahead"
    cache does. Why not fs.open(size=...): gcsfs's GCSFile fetches the object's metadata in its
    constructor whatever size it is given (its content type); a ranged GET needs none."""

    def __init__(self, fs, url: str, size: int, block: int):
        from fsspec.caching import ReadAheadCache

        self.size = size
        self.loc = 0
        self._cache = ReadAheadCache(block, lambda start, end: fs.cat_file(url, start=start, end=end), size)

    def read(self, n: int = -1) -> bytes:
        end = self.size if n is None or n < 0 else min(self.size, self.loc + n)
        data = self._cache._fetch(self.loc, end)
        self.loc += len(data)
        return data

    def seek(self, off: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.loc, 2: self.size}[whence]
        if base + off < 0:
            raise ValueError(f"seek before the start of the object ({base + off})")
        self.loc = base + off
        return self.loc

    def close(self) -> None:
        self._cache = None


class _Retrying(io.RawIOBase):
    """A file object of a URL whose reads and seeks are retried with backoff; the whole object is
    re-opened at the same position after a failure (an fsspec file may be left half-read).
    `size`: the object's size when known (from a listing): then opening it asks for nothing."""

    def __init__(self, url: str, block: int, size: int | None = None):
        self.url = url
        self._block = block
        self._size = size
        self._pos = 0
        self._fh = None
        self._retry(self._reopen)

    def _reopen(self):
        fs = filesystem(self.url)
        if self._fh is not None:
            try:
                self._fh.close()
            except Exception:   # noqa: BLE001 - the broken handle is dropped anyway
                pass
        if self._size is not None and _reads_ranges(fs):
            self._fh = _Ranged(fs, self.url, self._size, self._block)
        else:
            # others (hf://) open a file; size= spares the metadata request where the backend's
            # file honours it (fsspec's AbstractBufferedFile does)
            extra = {} if self._size is None else {"size": self._size}
            self._fh = fs.open(self.url, "rb", block_size=self._block, cache_type="readahead", **extra)
        if self._pos:
            self._fh.seek(self._pos)
        return None

    def _retry(self, fn):
        """fn() with retries; fn must look self._fh up when called: a retry re-opens it, and a
        method bound to the old handle would read a closed file."""
        wait = BACKOFF_S
        for attempt in range(RETRIES):
            try:
                return fn()
            except Exception as e:   # noqa: BLE001 - sorted below: transient or not
                if isinstance(e, FileNotFoundError):
                    raise FileNotFoundError(f"{self.url}: the object does not exist (any more)") from None
                if not _transient(e) or attempt == RETRIES - 1:
                    raise ReadError(f"{self.url}: read failed after {attempt + 1} tries: "
                                    f"{type(e).__name__}") from None
                time.sleep(wait)
                wait *= 2
                try:
                    self._reopen()
                except Exception:   # noqa: BLE001 - the next try reports it
                    pass

    # --- the file-object surface the readers use
    def readinto(self, b) -> int:
        t0 = time.perf_counter()
        data = self._retry(lambda: self._fh.read(len(b)))
        FETCH_S[0] += time.perf_counter() - t0
        self._pos += len(data)
        b[: len(data)] = data
        return len(data)

    def seek(self, off: int, whence: int = 0) -> int:
        self._pos = self._retry(lambda: self._fh.seek(off, whence))
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def writable(self) -> bool:
        return False

    @property
    def size(self) -> int:
        return self._fh.size

    def close(self) -> None:
        if not self.closed and self._fh is not None:
            self._fh.close()
        super().close()


def open_url(url: str, block: int | None = None, size: int | None = None):
    """A seekable buffered binary file object of the object at `url`, read BLOCK bytes per
    request, every read retried (RETRIES tries with backoff) on a transient error. `size` (else
    the size a listing gave, SIZES): no metadata request; unknown: one (fsspec's fs.info)."""
    size = SIZES.get(url) if size is None else size
    return io.BufferedReader(_Retrying(url, block or BLOCK, size), buffer_size=1 << 20)

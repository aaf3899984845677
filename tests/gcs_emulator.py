"""A local GCS emulator for tests and scripts/bench/bench_objstore.py: gcp-storage-emulator on a free
port in this process, every request it answers logged, an optional latency added per request, and
optionally the object generations real GCS keeps (what TensorStore's gcs driver relies on)."""
import os
import socket
import threading
import time
from http import HTTPStatus
from urllib.parse import parse_qs, unquote, urlparse

# gcsfs probes each bucket's type (hierarchical namespace) through a gRPC API the emulator lacks,
# and waits ~60 s for it: off before gcsfs is imported.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

from gcp_storage_emulator import server as emulator  # noqa: E402

BUCKET = "corpus"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


class Emulator:
    """gcp-storage-emulator on a free port, with every request it answers logged (method, path)
    and an optional latency added per request (a real bucket's ~20 ms).

    generations=True adds two things real GCS does and the emulator does not, both needed by
    TensorStore's gcs driver (Orbax's arrays, OCDBT's manifest): the `x-goog-generation` header on
    an object's media download, and the `ifGenerationMatch` / `ifGenerationNotMatch` preconditions
    (412 / 304) on object reads, uploads and deletes. Without them TensorStore reads generation 0
    from every download and its next conditional read fails with "Malformed StorageGeneration"."""

    def __init__(self, generations: bool = False):
        self.requests: list[tuple[str, str]] = []
        self.latency_s = 0.0
        self.generations = generations
        self._lock = threading.Lock()
        handler = emulator.RequestHandler
        self._orig = {m: getattr(handler, m) for m in ("do_GET", "do_POST", "do_PUT", "do_DELETE", "do_PATCH")}
        for m, fn in self._orig.items():
            setattr(handler, m, self._logged(m[3:], fn))
        self.port = _free_port()
        self.server = emulator.create_server("localhost", self.port, in_memory=True, default_bucket=BUCKET)
        self.server.start()

    def _logged(self, method, fn):
        em = self

        def wrapped(handler_self):
            with em._lock:
                em.requests.append((method, handler_self.path))
            if em.latency_s:
                time.sleep(em.latency_s)
            if em.generations and em._precondition(method, handler_self):
                return None
            return fn(handler_self)
        return wrapped

    # ------------------------------------------------------------ object generations (real GCS)
    def _object(self, method, url):
        """(bucket, object name) a request names, or None: .../b/B/o/NAME (read, delete) or an
        upload .../b/B/o?name=NAME."""
        path, query = url.path, parse_qs(url.query)
        if "/b/" not in path or "/o" not in path:
            return None
        bucket, _, rest = path.split("/b/", 1)[1].partition("/o")
        if rest.startswith("/") and "/" not in rest[1:] and method in ("GET", "DELETE"):
            return bucket, unquote(rest[1:])     # clients send a name's "/" as %2F
        if not rest and method == "POST" and "name" in query:
            return bucket, query["name"][0]
        return None

    def _precondition(self, method, handler) -> bool:
        """Answers a failed precondition itself (True); otherwise arms the generation header of a
        media download and lets the emulator answer (False). The emulator serves one request at
        a time, so the check and the write it guards are atomic, as on GCS."""
        url = urlparse(handler.path)
        named = self._object(method, url)
        if named is None:
            return False
        from gcp_storage_emulator.exceptions import NotFound
        try:
            generation = int(handler.storage.get_file_obj(*named)["generation"])
        except NotFound:
            generation = 0      # GCS: ifGenerationMatch=0 means "the object does not exist"
        query = parse_qs(url.query)
        match, not_match = query.get("ifGenerationMatch"), query.get("ifGenerationNotMatch")
        status = None
        if match and int(match[0]) != generation:
            status = HTTPStatus.PRECONDITION_FAILED
        elif method == "GET" and not_match and generation and int(not_match[0]) == generation:
            status = HTTPStatus.NOT_MODIFIED
        if status is not None:
            if method == "POST":     # the body is not wanted, but read: the client is sending it
                handler.rfile.read(int(handler.headers.get("Content-Length") or 0))
            handler.send_response(status.value, status.phrase)
            handler.send_header("Content-Length", "0")
            handler.end_headers()
            return True
        if method == "GET" and generation and query.get("alt") == ["media"]:
            end_headers = handler.end_headers

            def with_generation():
                handler.send_header("x-goog-generation", str(generation))
                end_headers()
            handler.end_headers = with_generation
        return False

    def lists(self) -> list[str]:
        """Object listings: GET .../b/BUCKET/o?... (not a single object's metadata or media)."""
        return [p for m, p in self.requests if m == "GET" and p.split("?")[0].rstrip("/").endswith(f"/b/{BUCKET}/o")]

    def per_object(self) -> list[str]:
        """Requests naming one object's metadata (GET .../o/NAME without alt=media)."""
        return [p for m, p in self.requests
                if m == "GET" and "/o/" in p.split("?")[0] and "alt=media" not in p]

    def stop(self):
        self.server.stop()
        for m, fn in self._orig.items():
            setattr(emulator.RequestHandler, m, fn)

    def env(self) -> dict[str, str]:
        """What another process needs to use this emulator for gs:// through every client the app
        has: gcsfs (data.paths, and etils.epath, which Orbax and train.py use for gs:// paths)
        anonymous on the emulator, and TensorStore (Orbax's arrays) on it with a fixed bearer
        token, so no credential file, GCE metadata server or token refresh is ever consulted."""
        url = f"http://localhost:{self.port}"
        return {"STORAGE_EMULATOR_HOST": url, "FSSPEC_GCS_TOKEN": "anon", "FSSPEC_GCS_PROJECT": "test",
                "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
                "TENSORSTORE_GCS_HTTP_URL": url, "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator"}

    def connect(self, mp=None):
        """STORAGE_EMULATOR_HOST and fsspec's gcs defaults (anonymous) pointed here; returns a
        gcsfs file system on the emulator. `mp` (a pytest MonkeyPatch): set through it, so a test
        undoes it, with the FSSPEC_GCS_* variables that input worker processes read when they
        import fsspec."""
        import fsspec
        import gcsfs
        if mp is None:
            os.environ["STORAGE_EMULATOR_HOST"] = f"http://localhost:{self.port}"
            fsspec.config.conf["gcs"] = {"token": "anon", "project": "test"}
        else:
            mp.setenv("STORAGE_EMULATOR_HOST", f"http://localhost:{self.port}")
            mp.setenv("FSSPEC_GCS_TOKEN", "anon")
            mp.setenv("FSSPEC_GCS_PROJECT", "test")
            fsspec.config.conf.setdefault("gcs", {})
            mp.setitem(fsspec.config.conf, "gcs", {"token": "anon", "project": "test"})
        gcsfs.GCSFileSystem.clear_instance_cache()
        return gcsfs.GCSFileSystem(token="anon", project="test")

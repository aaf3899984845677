"""A local GCS emulator for tests and scripts/bench/bench_objstore.py: gcp-storage-emulator on a free
port in this process, every request it answers logged, an optional latency added per request."""
import os
import socket
import threading
import time

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
    and an optional latency added per request (a real bucket's ~20 ms)."""

    def __init__(self):
        self.requests: list[tuple[str, str]] = []
        self.latency_s = 0.0
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
            return fn(handler_self)
        return wrapped

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

    def connect(self):
        """STORAGE_EMULATOR_HOST and fsspec's gcs defaults (anonymous) pointed here; returns a
        gcsfs file system on the emulator."""
        import fsspec
        import gcsfs
        os.environ["STORAGE_EMULATOR_HOST"] = f"http://localhost:{self.port}"
        fsspec.config.conf["gcs"] = {"token": "anon", "project": "test"}
        gcsfs.GCSFileSystem.clear_instance_cache()
        return gcsfs.GCSFileSystem(token="anon", project="test")

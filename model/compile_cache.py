"""A compiled program's figures kept under the program's fingerprint: a plan compiled once is not
compiled again while nothing that reaches the compiler has changed (scripts/compile_tpu.py).

Compiling an 8B plan for its TPU slice takes 30-60 CPU-s on 2 cores; `--search`, a plan checked again
after an unrelated edit, and the test suite's experiment checks compile the same programs over and
over. The compiler is deterministic: the same program, devices, compiler and flags give the same
executable, so its memory figures and collectives can be read once and kept.

The fingerprint is a SHA-256 over everything the figures depend on:
- the lowered program as StableHLO text without source locations, a Pallas kernel's inside it too
  (a moved line in model/, another checkout or virtual environment do not count; any change to
  shapes, shardings, ops or donation does);
- the caller's facts about where it runs (the slice, the devices in mesh order, the HBM capacity
  the fit is judged against, the mesh the collectives are read over);
- the compiler: jax, jaxlib and libtpu versions, LIBTPU_INIT_ARGS and XLA_FLAGS, and jax's
  optimisation-effort settings (--quick's);
- the code that reads figures out of a compiled program (the caller passes its functions and
  modules): a fix there is a new fingerprint.

Entries are JSON files (figures only, never pickles) named by the fingerprint and written
atomically, so concurrent compiles of one cache do not see half an entry. The directory keeps its
newest `MAX_ENTRIES`; an entry older than that is compiled again when asked for.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import inspect
import json
import os
import re
import tempfile
import time
from pathlib import Path

MAX_ENTRIES = 512      # ~2 KB each: a search's dozens of plans for years of edits


def default_dir() -> Path:
    """$JAXPT_TPU_COMPILE_CACHE, else $XDG_CACHE_HOME/jaxpt/tpu_compiles (~/.cache by default)."""
    if os.environ.get("JAXPT_TPU_COMPILE_CACHE"):
        return Path(os.environ["JAXPT_TPU_COMPILE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "jaxpt" / "tpu_compiles"


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def compiler_facts() -> dict:
    """What, beside the program, decides what the compiler emits."""
    import jax

    return {
        "jax": jax.__version__, "jaxlib": _version("jaxlib"), "libtpu": _version("libtpu"),
        "LIBTPU_INIT_ARGS": os.environ.get("LIBTPU_INIT_ARGS", ""), "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
        "exec_time_optimization_effort": float(jax.config.jax_exec_time_optimization_effort),
        "memory_fitting_effort": float(jax.config.jax_memory_fitting_effort),
    }


def code_digest(*code) -> str:
    """A digest of the code that turns a compiled program into figures: the source of each function
    or module."""
    h = hashlib.sha256()
    for part in code:
        h.update(inspect.getsource(part).encode())
    return h.hexdigest()


# A Pallas TPU kernel (splash attention) sits in the program as a custom call whose backend config
# holds the kernel's MLIR bytecode, base64, with its source locations: this checkout's and the
# virtual environment's paths. Printed without them it is the same kernel wherever it was lowered.
_KERNEL_BODY = re.compile(r"(\\22body\\22: \\22)([A-Za-z0-9+/=]+)(\\22)")


def _kernel_text(body: str) -> str:
    import base64

    from jax._src.interpreters import mlir
    from jax._src.lib import tpu
    from jax._src.lib.mlir import ir

    ctx = mlir.make_ir_context()
    tpu.register_dialect(ctx)
    with ctx, ir.Location.unknown():
        ctx.allow_unregistered_dialects = True     # the serialized (stable_mosaic) form, as jax reads it
        return ir.Module.parse(base64.b64decode(body)).operation.get_asm(enable_debug_info=False)


def program_text(lowered) -> str:
    """The lowered program as StableHLO without source locations, its kernels' included (a kernel
    that cannot be read back stays as lowered: a fingerprint then differs between checkouts,
    never wrongly matches)."""
    def without_locations(m: re.Match) -> str:
        try:
            kernel = hashlib.sha256(_kernel_text(m.group(2)).encode()).hexdigest()
        except Exception:   # noqa: BLE001  jax's private MLIR bindings moved: keep the body itself
            return m.group(0)
        return f"{m.group(1)}kernel-sha256:{kernel}{m.group(3)}"

    return _KERNEL_BODY.sub(without_locations, lowered.as_text(debug_info=False))


def fingerprint(lowered, facts: dict) -> str:
    """SHA-256 of the lowered program (program_text: no source locations), the compiler's facts and
    the caller's `facts` (JSON-able: slice, devices, capacity, the figures' code digest...)."""
    h = hashlib.sha256(program_text(lowered).encode())
    h.update(json.dumps({**compiler_facts(), **facts}, sort_keys=True, default=str).encode())
    return h.hexdigest()


class CompileCache:
    """Figures by fingerprint in `root` (created when first written)."""

    def __init__(self, root: Path | str):
        self.root = Path(root)

    def _path(self, key: str) -> Path:
        return self.root / f"{key}.json"

    def get(self, key: str) -> dict | None:
        """The figures kept for `key`, or None (never kept, unreadable, or kept for another key)."""
        try:
            entry = json.loads(self._path(key).read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(entry, dict) or entry.get("fingerprint") != key or not isinstance(entry.get("figures"), dict):
            return None
        os.utime(self._path(key))     # recently used: kept by the pruning below
        return entry["figures"]

    def put(self, key: str, figures: dict, label: str = "") -> None:
        """Keeps `figures` (JSON) for `key`; `label` says in the file what was compiled, for a reader."""
        self.root.mkdir(parents=True, exist_ok=True)
        entry = {"fingerprint": key, "label": label, "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                 "figures": figures}
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(entry, f, indent=1, sort_keys=True)
            f.write("\n")
        os.replace(tmp, self._path(key))
        self._prune()

    def _prune(self) -> None:
        entries = sorted(self.root.glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True)
        for old in entries[MAX_ENTRIES:]:
            old.unlink(missing_ok=True)

"""Pre-tokenized sources: a directory written by scripts/prepare_data.py, read by random access.

The directory holds one ArrayRecord file per converted input file (records: one document's
bare token ids, uint16 or uint32, no EOS/BOS) and `manifest.json` (tokenizer hash, dtype,
documents and tokens per file). All its documents form one index space [0, N), files in the
manifest's order.

A virtual shard's stream (RecordShardStream): epoch e's order is a seeded bijection of [0, N)
computed on the fly (data/streams/permutation.py); virtual shard v takes positions v, v+V, v+2V, ...
of it, so each epoch uses every document exactly once across all shards, whatever the file
boundaries. Documents are read in blocks of consecutive positions (each block: one
`read(list)` call per file it touches, on a shared I/O pool, several blocks read ahead), get
EOS (and BOS) as text documents do (packing.assemble) and go through the same packers.

Shard state, the text streams' convention: {"start": {"epoch", "pos", "carry", "c"},
"emitted": k, "c": counters}: where the current window (whole blocks, >= 1 row) began and
how many of its rows were emitted. Restoring reads that window again and skips k rows.
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import hashlib
import json
import os
import threading
import time

import numpy as np

from data.streams import buckets, packing
from data.streams.permutation import FeistelPermutation
from data.streams.shard import COUNTER_KEYS, RESHAPE, WindowRows, zero_counters

MANIFEST = "manifest.json"
FORMAT = "jaxpt-records-1"
PART_SUFFIX = ".array_record"
# A block holds about this many rows' worth of documents (from the manifest's mean length):
# the unit of a read-ahead read and of what a restore re-reads.
BLOCK_ROWS = 64
MAX_BLOCK_DOCS = 4096
# How a record stores token ids, and how many ids each dtype holds: uint16 for vocabularies of up
# to 65,536 ids (Llama 2, Mistral), uint32 above (Llama 3's 128,256, Qwen's 151,665).
TOKEN_DTYPES = {"uint16": 1 << 16, "uint32": 1 << 32}


def token_dtype(n_ids: int) -> str:
    """The narrowest stored dtype for a tokenizer of `n_ids` ids (0 .. n_ids - 1)."""
    for name, holds in TOKEN_DTYPES.items():
        if n_ids <= holds:
            return name
    raise ValueError(f"a tokenizer of {n_ids:,} ids: no stored dtype holds them")


# ---------------------------------------------------------------- the converted directory
def is_converted_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(os.path.expanduser(str(path)), MANIFEST))


def from_local_storage(url: str, setting: str = "data.paths") -> str:
    """How a converted corpus at `url` gets to where it is read from (the end of the lines below
    and of the converter's summary)."""
    how = {"gs": f"gcloud storage cp -r {url} DIR, or mount the bucket with gcsfuse",
           "s3": f"aws s3 cp --recursive {url} DIR, or mount the bucket (mountpoint-s3)"}.get(
        "gs" if url.startswith("gcs://") else url.split("://", 1)[0].lower(), "copy it to local disk")
    return f"converted corpora from local or mounted storage: {how}, then {setting}=DIR"


def url_dir_message(part_url: str, setting: str = "data.paths") -> str:
    """The one line for a converted corpus named by URL. Its manifest, sizes and records are read
    with local file calls (os, ArrayRecordReader by path), and a block of documents is hundreds
    of random reads: a mount's page cache or a local copy serves them, a request each would not."""
    url = part_url.rsplit("/", 1)[0]
    return (f"{setting}: {url} is a converted corpus on an object store; training reads "
            + from_local_storage(url, setting))


def load_manifest(root: str) -> dict:
    path = os.path.join(root, MANIFEST)
    try:
        with open(path, "rb") as f:
            m = json.loads(f.read())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a readable manifest ({e}); convert again with "
                         "scripts/prepare_data.py") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise ValueError(f"{path}: not a manifest of this version (format {FORMAT!r}); convert "
                         "again with scripts/prepare_data.py")
    return m


def manifest_hash(m: dict) -> str:
    """The identity of a converted corpus (what a checkpoint's fingerprint holds)."""
    return hashlib.sha256(json.dumps(m, sort_keys=True).encode()).hexdigest()[:16]


def part_files(root: str) -> list[str]:
    """The directory's ArrayRecord files, in the manifest's order."""
    root = os.path.expanduser(str(root))
    return [os.path.join(root, p["file"]) for p in load_manifest(root)["files"]]


class RecordsInfo:
    """What a stream needs to know about the (selected) files of a converted directory."""

    def __init__(self, root: str, manifest: dict, files: list[str]):
        self.root = root
        self.manifest = manifest
        by_name = {p["file"]: p for p in manifest["files"]}
        self.files = files
        self.parts = []
        for f in files:
            name = os.path.basename(f)
            if name not in by_name:
                raise ValueError(f"data.paths: {f} is not listed in {os.path.join(root, MANIFEST)}")
            self.parts.append(by_name[name])
        self.docs = [int(p["documents"]) for p in self.parts]
        self.documents = sum(self.docs)
        self.tokens = sum(int(p["tokens"]) for p in self.parts)
        self.dtype = manifest.get("dtype")
        if self.dtype not in TOKEN_DTYPES:
            raise ValueError(f"{os.path.join(root, MANIFEST)}: dtype {self.dtype!r} is not one of "
                             f"{', '.join(TOKEN_DTYPES)}; convert again with scripts/prepare_data.py")
        self.hash = manifest_hash(manifest)

    def check(self, tokenizer_hash: str, tokenizer_path: str, tokenizer_ids: int) -> None:
        """The files are those the manifest describes, written with the run's tokenizer (of
        `tokenizer_ids` ids) in a dtype that holds its ids: one stat per file, no read."""
        where = os.path.join(self.root, MANIFEST)
        if self.manifest["tokenizer"] != tokenizer_hash:
            raise ValueError(
                f"data.paths: {self.root} was converted with another tokenizer (hash "
                f"{self.manifest['tokenizer']} in {where}) than tokenizer.path={tokenizer_path} "
                f"(hash {tokenizer_hash}): convert again or use that tokenizer")
        if tokenizer_ids > TOKEN_DTYPES[self.dtype]:
            raise ValueError(
                f"data.paths: {where} stores token ids as {self.dtype} (ids below "
                f"{TOKEN_DTYPES[self.dtype]:,}) but tokenizer.path={tokenizer_path} has "
                f"{tokenizer_ids:,} ids: its ids would not read back; convert again with "
                "scripts/prepare_data.py")
        for f, p in zip(self.files, self.parts, strict=True):
            try:
                size = os.path.getsize(f)
            except OSError:
                raise ValueError(f"data.paths: {f} is listed in {where} but missing") from None
            if size != int(p["bytes"]):
                raise ValueError(f"data.paths: {f} has {size} bytes, {where} says {p['bytes']}: "
                                 "the file changed after conversion; convert again")
        if self.documents == 0:
            raise ValueError(f"data.paths: {self.root} holds no document")


def describe(files: list[str]) -> RecordsInfo | None:
    """RecordsInfo when `files` are parts of one converted directory, None for text files."""
    parts = [f for f in files if f.endswith(PART_SUFFIX)]
    if not parts:
        return None
    url = next((f for f in parts if "://" in f), None)
    if url is not None:   # an @list entry or a saved listing naming a part by URL
        raise ValueError(url_dir_message(url))
    if len(parts) != len(files):
        text = next(f for f in files if not f.endswith(PART_SUFFIX))
        raise ValueError(f"data.paths mixes converted records ({parts[0]}) with text files "
                         f"({text}): one kind per source")
    roots = sorted({os.path.dirname(os.path.abspath(f)) for f in files})
    if len(roots) > 1:
        raise ValueError(f"data.paths names parts of several converted directories ({roots[0]}, "
                         f"{roots[1]}): one directory per source")
    root = roots[0]
    if not is_converted_dir(root):
        raise ValueError(f"data.paths: {parts[0]} is not in a directory written by "
                         f"scripts/prepare_data.py (no {MANIFEST} beside it)")
    return RecordsInfo(root, load_manifest(root), [os.path.abspath(f) for f in files])


def stream_fields(files: list[str]) -> dict:
    """The StreamSpec fields of a source over `files`: {} for text files; for the parts of a
    converted directory, the records kind with its documents per file, tokens and dtype."""
    info = describe(files)
    if info is None:
        return {}
    return dict(kind="records", records_docs=tuple(info.docs), records_tokens=info.tokens,
                records_dtype=info.dtype)


# ---------------------------------------------------------------- reading
class RecordStore:
    """Open readers of a converted directory's files and an I/O thread pool, shared by all
    record streams of a process: every shard reads from every file, so readers are per file,
    not per shard. ArrayRecordReader.read(list) is safe to call from several threads.

    `read_latency_s` adds a sleep to every read call: benchmarks set it to stand in for a
    bucket's latency (never set in training)."""

    IO_THREADS = 16
    read_latency_s = 0.0
    _shared: dict = {}
    _lock = threading.Lock()

    @classmethod
    def acquire(cls, files: tuple[str, ...]) -> "RecordStore":
        with cls._lock:
            store = cls._shared.get(files)
            if store is None:
                store = cls._shared[files] = cls(files)
            store.refs += 1
            return store

    def __init__(self, files: tuple[str, ...]):
        self.files = files
        self.refs = 0
        self._readers: dict[int, object] = {}
        self._open_lock = threading.Lock()
        self.pool = concurrent.futures.ThreadPoolExecutor(self.IO_THREADS,
                                                          thread_name_prefix="records-io")

    def release(self) -> None:
        with self._lock:
            self.refs -= 1
            if self.refs > 0:
                return
            del self._shared[self.files]
        self.pool.shutdown(wait=True, cancel_futures=True)
        for r in self._readers.values():
            r.close()
        self._readers.clear()

    def _reader(self, f: int):
        r = self._readers.get(f)
        if r is None:
            from array_record.python.array_record_module import ArrayRecordReader
            with self._open_lock:
                r = self._readers.get(f)
                if r is None:
                    # No read-ahead buffer: reads are random, a buffer only wastes bytes.
                    r = self._readers[f] = ArrayRecordReader(self.files[f],
                                                             "readahead_buffer_size:0")
        return r

    def read(self, f: int, indices: list[int]) -> list[bytes]:
        if self.read_latency_s:
            time.sleep(self.read_latency_s)
        return self._reader(f).read(indices)


class _Block:
    """Documents at positions [pos, pos + count) of epoch `epoch` of one shard's sequence: one
    read per file on the I/O pool, started when the block is created."""
    __slots__ = ("epoch", "pos", "count", "docs", "order", "futures")

    def __init__(self, stream: "RecordShardStream", epoch: int, pos: int, count: int):
        self.epoch, self.pos, self.count = epoch, pos, count
        j = np.arange(pos, pos + count, dtype=np.int64)
        self.docs = stream.perm(epoch)(stream.shard + j * stream.V)       # global doc indices
        file_of = np.searchsorted(stream.cum, self.docs, side="right") - 1
        local = self.docs - stream.cum[file_of]
        self.order = np.argsort(file_of, kind="stable")     # documents grouped by file
        grouped_files, local_sorted = file_of[self.order], local[self.order]
        cuts = np.flatnonzero(np.diff(grouped_files)) + 1
        self.futures = [
            stream.store.pool.submit(stream.store.read, int(fs[0]), ls.tolist())
            for fs, ls in zip(np.split(grouped_files, cuts), np.split(local_sorted, cuts),
                              strict=True) if len(fs)]

    def tokens(self, dtype) -> tuple[np.ndarray, np.ndarray]:
        """-> (flat tokens of the documents in position order, in the stored dtype: assemble
        widens them to int32 as it places them; tokens per document)."""
        recs = [r for fut in self.futures for r in fut.result()]
        ordered = [None] * self.count
        for k, i in enumerate(self.order.tolist()):
            ordered[i] = recs[k]
        lens = np.fromiter((len(r) for r in ordered), np.int64, self.count) // dtype.itemsize
        flat = np.frombuffer(b"".join(ordered), dtype)
        return flat, lens

    def cancel(self) -> None:
        for fut in self.futures:
            fut.cancel()


_PACKER: list = []
_PACKER_LOCK = threading.Lock()


def _packing_thread() -> concurrent.futures.ThreadPoolExecutor:
    """This process's one thread that packs records windows ahead (RecordShardStream._install):
    one, not one per shard, because the work holds the GIL anyway; apart from the read pool,
    whose reads a packing task waits on."""
    with _PACKER_LOCK:
        if not _PACKER:
            _PACKER.append(concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="records-pack"))
        return _PACKER[0]


def initial_record_state() -> dict:
    return {"start": {"epoch": 0, "pos": 0, "carry": None, "c": zero_counters()},
            "emitted": 0, "c": zero_counters()}


class RecordShardStream(WindowRows):
    """One virtual shard's rows from a converted directory (the ShardStream interface)."""

    AHEAD_BLOCKS = 4

    def __init__(self, spec, shard: int, encoder, state: dict | None):
        del encoder   # token ids are stored: EOS/BOS ids come with the spec
        self.spec = spec
        self.shard = shard
        self.V = spec.num_shards
        self.eos = spec.eos_id
        self.bos = spec.bos_id if spec.add_bos else None
        self.dtype = np.dtype(spec.records_dtype)
        docs = np.asarray(spec.records_docs, np.int64)
        self.cum = np.concatenate([[0], np.cumsum(docs)])
        self.N = int(self.cum[-1])
        # positions of this shard's sequence per epoch: shard, shard + V, ... < N
        self.n_pos = max(0, -(-(self.N - shard) // self.V))
        if self.n_pos == 0:
            raise ValueError(f"virtual shard {shard} gets no document: data.num_shards="
                             f"{self.V} exceeds the {self.N} documents of the converted data")
        R = spec.seq_len + 1
        mean = max(1.0, spec.records_tokens / max(self.N, 1)) + 1
        self.block_docs = int(min(MAX_BLOCK_DOCS, max(1, round(BLOCK_ROWS * R / mean))))
        self.packer = (packing.ConcatPacker(R) if spec.packing == "concat"
                       else packing.FirstFitPacker(R))
        self._perm: tuple[int, FeistelPermutation] | None = None
        self.store = RecordStore.acquire(spec.files)
        self._ahead: collections.deque[_Block] = collections.deque()
        self._restore(state or initial_record_state())

    def perm(self, epoch: int) -> FeistelPermutation:
        if self._perm is None or self._perm[0] != epoch:
            self._perm = (epoch, FeistelPermutation(self.N, [self.spec.seed, epoch]))
        return self._perm[1]

    # ---- state ----
    def get_state(self) -> dict:
        return {"start": self._start, "emitted": self.emitted,
                "c": {**self.c, "bad": {}, "badex": []}}

    def _restore(self, st: dict) -> None:
        if RESHAPE in st:
            st = self._continued(st)
        s = st["start"]
        self._settle()
        for b in self._ahead:
            b.cancel()
        self._ahead.clear()
        self._next = (int(s["epoch"]), int(s["pos"]))
        self.packer.set_carry(s["carry"])
        self.c = {k: int(s["c"].get(k, 0)) for k in COUNTER_KEYS}
        self._start = s
        self._kept_epoch = int(s["epoch"])   # a bucketed shard's last epoch with a kept document
        self._install(self._pack_window())
        self._skip_emitted(int(st["emitted"]), len(self.tok))

    def _continued(self, st: dict) -> dict:
        """A state saved at another seq_len (RESHAPE, data/resume.py): its window rebuilt at that
        length (blocks are the old length's), turned into a state of this length
        (WindowRows.remainder_state)."""
        saved = {k: v for k, v in st.items() if k != RESHAPE}
        if int(st[RESHAPE]) == self.spec.seq_len:
            return saved
        old = RecordShardStream(dataclasses.replace(self.spec, seq_len=int(st[RESHAPE])), self.shard, None, saved)
        try:
            nxt = {k: v for k, v in old._next_start.items() if k != "c"}
            return old.remainder_state(nxt, saved["c"])
        finally:
            old.close()

    def _left_rows(self) -> range:
        return range(self.emitted, len(self.tok))

    # ---- rows ----
    def _fill_ahead(self) -> None:
        while len(self._ahead) < self.AHEAD_BLOCKS:
            epoch, pos = self._next
            count = min(self.block_docs, self.n_pos - pos)
            self._ahead.append(_Block(self, epoch, pos, count))
            self._next = (epoch + 1, 0) if pos + count >= self.n_pos else (epoch, pos + count)

    def _pack_window(self) -> tuple:
        """Whole blocks until at least one row: their documents with EOS (BOS), packed ->
        (tok, did, seg, pos, m_tok, m_docs, m_segs, first, documents dropped by the length bucket).
        Advances the read-ahead and the packer: run by one thread at a time (the caller's, or
        the packing thread for the next window while the caller hands out the current one's rows)."""
        parts, n, oob = [], 0, 0
        sp = self.spec
        while n == 0:
            self._fill_ahead()
            blk = self._ahead.popleft()
            flat, lens = blk.tokens(self.dtype)
            # doc ids unique over epochs: segment ids never merge one document's two epochs
            dids = blk.epoch * self.N + blk.docs
            if sp.min_tokens or sp.max_tokens:
                flat, lens, dids, dropped = buckets.keep_records(flat, lens, dids, sp.min_tokens, sp.max_tokens)
                oob += dropped
                if not len(lens):
                    if blk.epoch >= self._kept_epoch + 2:
                        raise buckets.stuck(self.shard, len(sp.files), sp.min_tokens, sp.max_tokens,
                                            sp.bucket_key)
                    continue
                self._kept_epoch = blk.epoch
            ones = np.ones(len(lens), bool)
            tok, did, first = packing.assemble(flat, lens, dids, ones, ones, self.eos, self.bos)
            if isinstance(self.packer, packing.FirstFitPacker):
                rows = self.packer.add(tok, did, first, lasts_end=True)
                fl = self.packer.flush()
                rows = tuple(np.concatenate([a, b]) for a, b in zip(rows, fl, strict=True))
            else:
                rows = self.packer.add(tok, did, first)
            parts.append(rows)
            n += len(rows[0])
        if len(parts) == 1:
            tok, did, first = parts[0]
        else:
            tok, did, first = (np.concatenate([p[i] for p in parts]) for i in range(3))
        seg, pos = packing.segments_positions(did)
        return (tok, did, seg, pos, (did >= 0).sum(1).tolist(), first.sum(1).tolist(),
                seg.max(1).tolist(), first, oob)

    def _install(self, window: tuple) -> None:
        """Makes `window` the current one and starts packing the next on the packing thread.
        Packing a window costs ~1 ms of Python; every shard of a host reaches its window's end
        within a few batches of the others (same block size), and packing them all in the
        batch that needs them made that batch ~10x slower than the median (bursts the
        prefetch of a fast training step could not absorb). Packed ahead, the work is spread
        over the batches in between; the next window's start is taken before its packing
        moves the read-ahead and the packer."""
        (self.tok, self.did, self.seg, self.pos, self.m_tok, self.m_docs,
         self.m_segs, self.first, oob) = window
        self.c["oob"] += oob     # the window's out-of-bucket documents, counted when it starts
        self.emitted = 0
        self._next_start = self._snapshot()
        self._next_window = _packing_thread().submit(self._pack_window)

    def _settle(self) -> None:
        """Waits for the window being packed ahead (it moves the read-ahead and the packer)."""
        fut, self._next_window = getattr(self, "_next_window", None), None
        if fut is not None:
            try:
                fut.result()
            except Exception:   # noqa: BLE001 - a restore or close discards that window
                pass

    def _snapshot(self) -> dict:
        """The next window's start: the first read-ahead block's position (the read-ahead
        is never empty after a window is built)."""
        nxt = self._ahead[0]
        return {"epoch": nxt.epoch, "pos": nxt.pos, "carry": self.packer.carry_state(),
                "c": {**self.c, "bad": {}, "badex": []}}

    def _take(self) -> int:
        i = self.emitted
        self.emitted += 1
        return self._count(i)

    def next_row_into(self, b: int, out: dict) -> None:
        if self.emitted >= len(self.tok):
            # counters of the rows handed out so far: the snapshot was taken before them
            self._start = {**self._next_start, "c": {**self.c, "bad": {}, "badex": []}}
            window, self._next_window = self._next_window.result(), None
            self._install(window)
        self._row_into(b, out)

    def close(self) -> None:
        self._settle()
        for b in self._ahead:
            b.cancel()
        self._ahead.clear()
        if self.store is not None:
            self.store.release()
            self.store = None

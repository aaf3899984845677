"""One virtual shard's row stream (ShardStream) and its state.

A virtual shard's stream is deterministic and independent of hosts and workers:
files in a seeded per-epoch order -> documents -> chunks of ~one window of text -> batched
tokenization -> packer -> windows of whole chunks (>= W rows), each permuted with a seed
from (seed, shard, window index).
Its state: the reader + packer carry + counters at the start of the current window, and how
many rows of the window were emitted. Restoring regenerates that one window and skips.

Where the cores go: a chunk is handed to the tokenizer's thread pool as soon as it is read
(BatchEncoder.submit; the tokenizer releases the GIL), and each shard keeps as many chunks
read ahead as the pool has threads, so the tokenizer runs on every core while this thread
reads and packs. The read-ahead never shows in the data: a chunk depends only on the reader
position it starts from, and the next window's start state is the first read-ahead chunk's.

Layout of a host batch (R = seq_len + 1 tokens per packed row, non-overlapping):
inputs = row[:-1], targets = row[1:]; segment_ids count documents inside the row from 1
(0 = padding); positions restart at 0 at each document start AND at the start of a row (a
document continued from the previous row starts again at 0); loss_mask = 1 where target t
belongs to the same document as input t. EOS ends every document (BOS optional).

Shard state: {"start": {"reader", "carry", "win", "c"}, "emitted": k, "rows": n, "c": counters};
the counters (rows, docs, tokens, pad, segs, bad records) cover the rows emitted so far, so a
consumed state gives exact consumed statistics. Bad records are counted when read and
reported per window (the window is read ahead of consumption). "rows": the current window's row
count (absent in states saved before it was kept): with it, the trainer's head batch after a
restore tokenizes the window only up to the rows it hands out (`ShardStream(head_rows=...)`).

A state may carry RESHAPE, the row length it was saved at (data.shape_change=continue marks the
saved states of a run resumed at another data.seq_len, data/resume.py): restoring it rebuilds
that window at the old length and continues from its remainder (WindowRows.remainder_state).
"""
from __future__ import annotations

import collections
import dataclasses
import time

import numpy as np

from data.readers import companions, objstore
from data.readers.sources import BadRecords, ShardReader
from data.streams import buckets, packing
from data.timing import zero_times
from data.tokenizer import BatchEncoder

# 2: windows are whole CHUNK_CHARS chunks; 3: reader slots hold byte offsets and .gz seek
# points, files split across shards when there are fewer files than shards
STATE_VERSION = 3
STATE_MARK = "__vshards__"
# "oob": documents dropped by a length bucket (data/streams/buckets.py), counted per window built;
# states saved before it existed lack it (read with .get)
COUNTER_KEYS = ("rows", "docs", "tokens", "pad", "segs", "trunc", "drop", "oob")
# Characters per tokenizer call: about one shuffle window of text, at most CHUNK_CHARS.
# Windows are whole chunks, so this is part of the data order: changing it changes the
# batches (and needs a new STATE_VERSION).
CHUNK_CHARS = 1 << 17
CHUNK_CHARS_PER_TOKEN = 4
# A saved shard state marked with the seq_len it was saved at (data/resume.py continue_at_length).
RESHAPE = "saved_seq_len"


class _Chunk:
    """Pieces handed to the encoder's thread pool, with the reader position and bad-record counts
    from just before they were read."""
    __slots__ = ("reader_state", "bad_counts", "bad_examples", "meta", "future")

    def __init__(self, reader_state, bad_counts, bad_examples):
        self.reader_state = reader_state
        self.bad_counts = bad_counts
        self.bad_examples = bad_examples
        self.meta = None
        self.future = None


@dataclasses.dataclass(frozen=True)
class StreamSpec:
    """Everything a worker needs, picklable and small (no tokenizer object)."""
    files: tuple[str, ...]          # the global sorted file list
    num_shards: int
    tokenizer_json: str
    seq_len: int
    text_key: str
    strict: bool
    packing: str
    shuffle_window: int
    files_per_stream: int
    add_bos: bool
    seed: int
    rows_per_shard: int             # k: rows each virtual shard adds to every global batch
    num_workers: int
    debug: bool = False
    process_index: int = 0
    process_count: int = 1
    group: int = 1                  # host batches per element (per worker IPC message)
    worker_nice: int = 0            # a worker process lowers its CPU priority by this much
    head_batch: str = "first"       # data.head_batch: the first batch's maker (data/workers.py)
    # A weighted mixture (data/streams/mixture.py): ((name, weight, StreamSpec of that source), ...);
    # then `files` is empty and each source's spec holds its own files and text_key.
    mixture: tuple = ()
    # "text": files are JSON lines; "records": files are the ArrayRecord parts of a converted
    # directory (data/streams/records.py), with their documents per file, total tokens and dtype
    # from its manifest.
    kind: str = "text"
    eos_id: int = -1                # the tokenizer's EOS and BOS (-1: none) ids
    bos_id: int = -1
    records_docs: tuple[int, ...] = ()
    records_tokens: int = 0
    records_dtype: str = ""
    # ((url, size), ...) of `files` listed from URL patterns: a worker process opens them without
    # asking the store for their metadata (data/readers/objstore.py SIZES); () for local files
    sizes: tuple = ()
    # A length bucket (data/streams/buckets.py): keep documents of min_tokens..max_tokens tokens
    # (0: no bound); bucket_key names the setting in messages
    min_tokens: int = 0
    max_tokens: int = 0
    bucket_key: str = ""
    # data.quality's rules (data/readers/quality.py parse), data.dedup ("", "exact", "fuzzy",
    # "exact,fuzzy"), data.companions ("": beside the documents) and, with fuzzy, data.fuzzy_lists
    # and data.dedup_threshold: which documents are handed out
    quality: tuple = ()
    dedup: str = ""
    companions: str = ""
    fuzzy_lists: str = ""
    dedup_threshold: str = ""


def url_sizes(files) -> tuple:
    """StreamSpec.sizes of `files`: the sizes this process knows of those that are URLs."""
    return tuple(sorted(objstore.known_sizes(files).items()))


def zero_counters() -> dict:
    c = {k: 0 for k in COUNTER_KEYS}
    c["bad"] = {}
    c["badex"] = []
    return c


def initial_shard_state() -> dict:
    return {"start": {"reader": ShardReader.initial_state(), "carry": None, "win": 0,
                      "c": zero_counters()},
            "emitted": 0, "c": zero_counters()}


def file_split(n_files: int, num_shards: int) -> int:
    """Parts per file: 1 while there are at least as many files as virtual shards, else
    enough for every shard to get one (part of the data order: in the fingerprint)."""
    return max(1, -(-num_shards // max(n_files, 1)))


def shard_files(spec_files, num_shards: int, shard: int):
    """The shard's parts: part p = (file p // split, lines with line % split == p % split),
    parts dealt round robin to the shards. -> (paths, file indices, residues, split)."""
    split = file_split(len(spec_files), num_shards)
    parts = range(shard, len(spec_files) * split, num_shards)
    return ([spec_files[p // split] for p in parts], [p // split for p in parts],
            [p % split for p in parts], split)


class WindowRows:
    """A built window's rows handed out one by one and counted: the part of a virtual shard's
    stream that the text (ShardStream) and records (data/streams/records.py) kinds share. Needs: tok
    [rows, R], seg, pos, did, m_tok / m_docs / m_segs (per row), c (counters), emitted, shard,
    _take()."""

    def _count(self, i: int) -> int:
        c = self.c
        c["rows"] += 1
        c["tokens"] += self.m_tok[i]
        c["pad"] += self.tok.shape[1] - self.m_tok[i]
        c["docs"] += self.m_docs[i]
        c["segs"] += self.m_segs[i]
        return i

    def _row_into(self, b: int, out: dict) -> None:
        """The next row of the window (counted) into row b of the output arrays."""
        i = self._take()
        out["tok"][b] = self.tok[i]
        out["seg"][b] = self.seg[i]
        out["pos"][b] = self.pos[i]
        if "did" in out:
            out["did"][b] = self.did[i]

    def remainder_state(self, nxt: dict, consumed: dict) -> dict:
        """data.shape_change=continue: this stream, restored at the row length a state was saved
        at, as a state for a stream of another row length. `nxt`: the next window's start (its
        reader position and packer carry-over); `consumed`: the saved state's counters. The
        window's rows not yet handed out and the carry-over become the new start's carry-over
        (packing.remainder: one token list, documents whole and in packing order), so the new
        packer re-packs them at its length into its first window, whose shuffle mixes them with
        what is read next: every token read but not consumed comes exactly once, counters go on
        from the consumed ones (a document counts once, where its first token is handed out)."""
        left = np.asarray(self._left_rows(), np.int64)
        ct, cd, cf = packing.carry_from_state(nxt["carry"])
        carry = packing.remainder(np.concatenate([self.tok[left].reshape(-1), ct]),
                                  np.concatenate([self.did[left].reshape(-1), cd]),
                                  np.concatenate([self.first[left].reshape(-1), cf]),
                                  open_doc=int(cd[-1]) if len(cd) else None)
        return {"start": {**nxt, "carry": packing.carry_to_state(*carry), "c": consumed},
                "emitted": 0, "c": consumed}

    def _skip_emitted(self, k: int, window_rows: int) -> None:
        """After a restore rebuilt the window: hand out again the k rows already emitted."""
        if k > window_rows:
            raise ValueError(f"virtual shard {self.shard}: state has {k} rows emitted from a "
                             f"window of {window_rows}: data or settings changed")
        for _ in range(k):
            self._take()


class ShardStream(WindowRows):
    def __init__(self, spec: StreamSpec, shard: int, encoder: BatchEncoder, state: dict,
                 times: dict | None = None, head_rows: int = 0):
        """head_rows > 0: a stream that hands out only that many rows (the trainer's head batch,
        data/workers.py head_slab); restored from a state that knows its window's row count, it
        builds the window only up to the last of them."""
        self.spec = spec
        self.shard = shard
        self.enc = encoder
        # this process's stage timers (data/timing.py), shared by its streams; never in the state
        self.times = zero_times() if times is None else times
        objstore.remember_sizes(spec.sizes)   # in an input worker: the listing's sizes arrive here
        files, ids, residues, split = shard_files(spec.files, spec.num_shards, shard)
        self.bad = BadRecords(spec.strict)
        self.reader = ShardReader(files, ids, len(spec.files), shard, spec.seed,
                                  spec.files_per_stream, spec.text_key, self.bad, self.times,
                                  split=split, residues=residues,
                                  select=companions.Selection(spec.quality, spec.dedup,
                                                              spec.companions, spec.fuzzy_lists,
                                                              spec.dedup_threshold))
        R = spec.seq_len + 1
        if spec.packing == "concat":
            self.packer = packing.ConcatPacker(R)
        else:
            self.packer = packing.FirstFitPacker(R)
        self.W = max(int(spec.shuffle_window), 1)
        self.chunk_chars = min(CHUNK_CHARS, max(256, self.W * R * CHUNK_CHARS_PER_TOKEN))
        self._ahead = collections.deque()   # chunks read ahead, being tokenized
        self._restore(state, head_rows)

    # ---- state ----
    def get_state(self) -> dict:
        bad, badex = self._bad_now
        return {"start": self._start, "emitted": self.emitted, "rows": self.rows,
                "c": {**self.c, "bad": dict(bad), "badex": list(badex)}}

    def _restore(self, st: dict, head_rows: int = 0) -> None:
        if RESHAPE in st:
            st = self._continued(st)
        s = st["start"]
        self._ahead.clear()   # drop read-ahead chunks: reading restarts at s["reader"]
        self.reader.set_state(s["reader"])
        self.packer.set_carry(s["carry"])
        self.win = int(s["win"])
        c = s["c"]
        self.c = {k: int(c.get(k, 0)) for k in COUNTER_KEYS}
        self.bad.counts = {k: int(v) for k, v in c["bad"].items()}
        self.bad.examples = list(c["badex"])
        self._start = s
        self._kept_epoch = int(s["reader"]["epoch"])   # a bucketed shard's last epoch with a kept document
        k, n = int(st["emitted"]), st.get("rows")
        if head_rows and n is not None and k + head_rows <= int(n):
            self._restore_head(st, k, int(n), head_rows)
            return
        self._build_window(read_ahead=False)
        self._skip_emitted(k, len(self.perm))

    def _continued(self, st: dict) -> dict:
        """A state saved at another seq_len (RESHAPE): its window rebuilt at that length by a
        stream of the old spec (its chunks are the old length's), turned into a state of this
        length. Costs one window's tokenization, once, at the switch."""
        saved = {k: v for k, v in st.items() if k != RESHAPE}
        if int(st[RESHAPE]) == self.spec.seq_len:
            return saved
        old = ShardStream(dataclasses.replace(self.spec, seq_len=int(st[RESHAPE])), self.shard, self.enc,
                          saved, self.times)
        try:   # built without read-ahead: the reader stands where the next window starts
            nxt = {"reader": old.reader.get_state(), "carry": old.packer.carry_state(), "win": old.win}
            return old.remainder_state(nxt, saved["c"])
        finally:
            old.close()

    def _left_rows(self) -> list:
        """The window's rows not handed out yet, in packing order."""
        return sorted(self.perm[self.emitted:])

    def _restore_head(self, st: dict, k: int, n: int, head_rows: int) -> None:
        """The window rebuilt only up to the last of rows perm[k : k + head_rows], the ones the
        head batch hands out: rows come out of the packer in window order (concat, and first fit
        but for the bins its final flush emits), so the rows before that one are all that is
        needed. A restore deep in the shards tokenized every shard's whole window on the way to
        the first batch: 9.9 M tokens with 56 shards at seq 2048, ~0.94 s at the 16-core host's
        tokenizer-alone rate; about half of that now, on average. The counters are the state's
        (what a whole window's _skip_emitted recounts); a different window (the data changed) gives
        other rows than the workers', which the trainer checks (data/workers.py _check_head)."""
        perm = self._window_perm(n)
        need = max(perm[k:k + head_rows]) + 1
        self._build_window(read_ahead=False, rows_needed=need)
        if len(self.tok) < need:
            raise ValueError(f"virtual shard {self.shard}: state's window has {n} rows, rebuilt it "
                             f"has {len(self.tok)}: data or settings changed")
        self.perm = perm
        self.rows = n
        self.emitted = k
        c = st["c"]
        self.c = {key: int(c.get(key, 0)) for key in COUNTER_KEYS}
        self._bad_now = (dict(c["bad"]), list(c["badex"]))

    def _window_perm(self, n: int) -> list:
        """The order a window of n rows hands them out in: seeded by (seed, shard, window)."""
        if self.W > 1:
            return np.random.default_rng([self.spec.seed, self.shard, self.win, 2]).permutation(n).tolist()
        return list(range(n))

    def _snapshot(self) -> dict:
        """The next window's start: where its first (read-ahead) chunk began reading."""
        nxt = self._ahead[0]
        return {"reader": nxt.reader_state, "carry": self.packer.carry_state(),
                "win": self.win, "c": {**self.c, "bad": dict(nxt.bad_counts),
                                       "badex": list(nxt.bad_examples)}}

    # ---- rows ----
    def _target_rows(self) -> int:
        """W rows, but a shard's first window is shorter by a shard-dependent fraction so
        that shards refill their windows at different times (smoother worker load, faster
        first batch). Depends only on (shard, window index): topology independent."""
        if self.win > 0:
            return self.W
        frac = 0.125 + 0.875 * ((self.shard * 0.6180339887498949) % 1.0)
        return max(1, int(self.W * frac))

    def _read_chunk(self) -> "_Chunk":
        """Reads pieces up to chunk_chars and hands them to the encoder's pool at once, so the
        tokenizer (Rust, GIL released) runs while this thread reads the next chunk and packs
        the previous one. A chunk depends only on the reader position it starts at, which
        keeps windows (whole chunks) identical after a restore. With a length bucket a chunk ends
        with a document's last piece: a document is judged whole (data/streams/buckets.py)."""
        ch = _Chunk(self.reader.get_state(), dict(self.bad.counts), list(self.bad.examples))
        texts, dids, firsts, lasts = [], [], [], []
        chars = 0
        next_piece = self.reader.next_piece
        whole = bool(self.spec.min_tokens or self.spec.max_tokens)
        while chars < self.chunk_chars or (whole and not lasts[-1]):
            text, did, first, last = next_piece()
            texts.append(text)
            dids.append(did)
            firsts.append(first)
            lasts.append(last)
            chars += len(text)
        ch.meta = (dids, firsts, lasts)
        ch.future = self.enc.submit(texts)
        return ch

    def _build_window(self, read_ahead: bool = True, rows_needed: int | None = None) -> None:
        """Whole chunks until the window has its target rows. `enc.threads` chunks are kept
        read ahead, so that many tokenizer calls run while this thread packs; the next window
        starts at the first of them, and that chunk's recorded reader position and bad-record
        counts are the next window's start state.

        read_ahead=False (the window a stream starts or restores at): only the chunks this
        window needs are read. On the way to the first batch every shard of the process builds
        such a window, and the tokenizer pool runs its calls first come, first served: one
        shard's read-ahead chunks queued in front of the next shard's first chunk (~2x the
        tokens of the first batch with 4 shards on 2 threads). `fill_ahead` starts the
        read-ahead once the first batch is out. Which chunks are read early never changes the
        data: a chunk depends only on the reader position it starts at.

        rows_needed: stop once the window's first rows_needed rows are made (_restore_head); the
        window's arrays then hold those rows only (and the perm is the caller's)."""
        if read_ahead:
            self.fill_ahead()
        parts = []
        n = 0
        target = self._target_rows()
        times = self.times
        while n < target and (rows_needed is None or n < rows_needed):
            if self._ahead:
                ch = self._ahead.popleft()
                if read_ahead:
                    self._ahead.append(self._read_chunk())
            else:
                ch = self._read_chunk()
            t0 = time.perf_counter()
            flat, lens = ch.future.result()
            t1 = time.perf_counter()
            times["tokenize_wait"] += t1 - t0
            dids, firsts, lasts = ch.meta
            if self.spec.min_tokens or self.spec.max_tokens:
                kept = self._in_bucket(ch, flat, lens)
                if kept is None:     # no document of this chunk is in the bucket
                    continue
                flat, lens, dids, firsts, lasts = kept
            tok, did, first = packing.assemble(
                flat, lens, dids, firsts, lasts, self.enc.eos,
                self.enc.bos if self.spec.add_bos else None)
            if isinstance(self.packer, packing.FirstFitPacker):
                rows = self.packer.add(tok, did, first, lasts_end=lasts[-1])
            else:
                rows = self.packer.add(tok, did, first)
            parts.append(rows)
            n += len(rows[0])
            times["pack"] += time.perf_counter() - t1
        t1 = time.perf_counter()
        fl = self.packer.flush() if rows_needed is None or n < rows_needed else None
        if fl is not None:
            parts.append(fl)
        # bad records read for this window (the read-ahead chunks' are not yet reported)
        if self._ahead:
            self._bad_now = (self._ahead[0].bad_counts, self._ahead[0].bad_examples)
        else:                  # nothing read beyond this window: the counts so far
            self._bad_now = (dict(self.bad.counts), list(self.bad.examples))
        tok = np.concatenate([p[0] for p in parts])
        did = np.concatenate([p[1] for p in parts])
        first = np.concatenate([p[2] for p in parts])
        seg, pos = packing.segments_positions(did)
        self.tok, self.did, self.seg, self.pos, self.first = tok, did, seg, pos, first
        self.perm = self._window_perm(len(tok)) if rows_needed is None else None
        self.rows = len(tok)
        real = did >= 0
        self.m_tok = real.sum(1).tolist()
        self.m_docs = first.sum(1).tolist()
        self.m_segs = seg.max(1).tolist()
        self.emitted = 0
        self.win += 1
        times["pack"] += time.perf_counter() - t1

    def _in_bucket(self, ch: "_Chunk", flat, lens):
        """The chunk's pieces without its documents outside the bucket (counted in "oob"), as
        (flat, lens, dids, firsts, lasts); None when none is left."""
        sp = self.spec
        *kept, dropped = buckets.keep_documents(flat, lens, *ch.meta, sp.min_tokens, sp.max_tokens)
        self.c["oob"] += dropped
        epoch = int(ch.reader_state["epoch"])
        if kept[2]:
            self._kept_epoch = epoch
            return kept
        if epoch >= self._kept_epoch + 2:
            raise buckets.stuck(self.shard, len(self.reader.files), sp.min_tokens, sp.max_tokens,
                                sp.bucket_key)
        return None

    def _take(self) -> int:
        i = self.perm[self.emitted]
        self.emitted += 1
        return self._count(i)

    def fill_ahead(self) -> None:
        """Reads chunks ahead (handed to the tokenizer) until `enc.threads` are in flight."""
        while len(self._ahead) < self.enc.threads:
            self._ahead.append(self._read_chunk())

    def close(self) -> None:
        self.reader.close()

    def next_row_into(self, b: int, out: dict) -> None:
        if self.emitted >= len(self.perm):
            if not self._ahead:      # a first window built without read-ahead
                self._ahead.append(self._read_chunk())
            self._start = self._snapshot()
            self._build_window()
        self._row_into(b, out)


def progress(shard_state: dict) -> int:
    return int(shard_state["c"]["rows"])

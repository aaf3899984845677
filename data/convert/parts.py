"""The conversion's parts: one input file -> one ArrayRecord file of its kept documents' token ids,
written under a temporary name and renamed when complete, with its done/ marker (its counts).
scripts/prepare_data.py runs `Converter` over a host's share of the files in this process; the
Beam pipeline (data/convert/beam.py) runs the same `Converter.run` on one file per element, so
both write the same bytes for the same inputs and selection.
"""
from __future__ import annotations

import collections
import hashlib
import json
import os
import shutil
import tempfile
import time

from data.readers import companions, formats, objstore, quality
from data.readers.companions import FUZZY
from data.readers.sources import BAD_KINDS, DROPPED, MAX_BAD_EXAMPLES, BadRecords, split_pieces
from data.state import files_hash
from data.streams import records
from data.tokenizer import BatchEncoder, available_cores, set_thread_env, tokenizer_hash

# Characters of text per tokenizer call (~64 web documents): large enough that a call's fixed
# cost vanishes, small enough that every core gets calls near the end of a file.
CHUNK_CHARS = 1 << 18
# Records per ArrayRecord chunk = 1: each document is read alone by random access.
WRITER_OPTIONS = "group_size:1"


def part_name(i: int) -> str:
    return f"part-{i:06d}{records.PART_SUFFIX}"


def tmp_name(path: str, owner) -> str:
    """Where `path` is written before its rename: one name per host, so a restarted host
    overwrites what its killed run left."""
    return f"{path}.tmp-h{owner}"


def _atomic_write(path: str, text: str, owner) -> None:
    tmp = tmp_name(path, owner)
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class LocalOut:
    """--out on a local disk or a mount: parts written under a temporary name and renamed."""

    def __init__(self, root: str, owner):
        self.root, self.owner = root, owner
        self._leftovers: list[str] | None = None

    def join(self, *names: str) -> str:
        return os.path.join(self.root, *names)

    def open(self) -> None:
        os.makedirs(self.join("done"), exist_ok=True)

    def read_json(self, name: str) -> dict | None:
        try:
            with open(self.join(name)) as f:
                return json.load(f)
        except FileNotFoundError:
            return None

    def write_text(self, name: str, text: str) -> None:
        if "/" in name:   # done/... exists; a fuzzy list's directories are made here
            os.makedirs(os.path.dirname(self.join(name)), exist_ok=True)
        _atomic_write(self.join(name), text, self.owner)

    def finished(self, i: int, listed: str | None = None) -> bool:
        """Part i is complete (its done marker is written after the part's rename and its fuzzy
        list, `listed`); the temporary files a killed run left for it (under any host's name: the
        share may have been another host's) removed otherwise."""
        final, done = self.join(part_name(i)), self.join(done_name(i))
        if os.path.exists(done) and os.path.exists(final):
            return True
        if self._leftovers is None:
            self._leftovers = ([self.join(n) for n in os.listdir(self.root)]
                               + [self.join("done", n) for n in os.listdir(self.join("done"))])
        ends = (final + ".tmp-", done + ".tmp-")
        for path in self._leftovers:
            if path.startswith(ends):
                os.remove(path)
        if listed is not None:   # a list's directory is its input's own: listed per part
            lp = self.join(listed)
            try:
                names = os.listdir(os.path.dirname(lp))
            except FileNotFoundError:
                names = []
            for n in names:
                if n.startswith(os.path.basename(lp) + ".tmp-"):
                    os.remove(os.path.join(os.path.dirname(lp), n))
        return False

    def staging(self, i: int) -> str:
        return tmp_name(self.join(part_name(i)), self.owner)

    def commit(self, i: int, staged: str) -> None:
        os.replace(staged, self.join(part_name(i)))

    def done_markers(self, n: int) -> list[dict] | None:
        out = []
        for i in range(n):
            m = self.read_json(done_name(i))
            if m is None:
                return None
            out.append(m)
        return out

    def close(self) -> None:
        pass


class UrlOut:
    """--out at a URL. An object store writes an object whole or not at all, so an uploaded part
    needs no temporary name there: it is written locally (ArrayRecordWriter takes a local path) in
    a staging directory, uploaded, then deleted, so local disk holds one part at a time. The done
    marker goes up after its part and the manifest after every marker, so a listing never shows a
    done part without its bytes, nor a manifest before its parts."""

    def __init__(self, root: str, owner, tmp: str | None):
        self.root, self.owner = root.rstrip("/"), owner
        self.fs = objstore.filesystem(root)
        # One directory per --out and host: a restart clears what its killed run left in flight.
        key = hashlib.sha256(self.root.encode()).hexdigest()[:12]
        self.stage = os.path.join(tmp or tempfile.gettempdir(), f"jaxpt-prepare-{key}-h{owner}")
        self.listed: set[str] = set()
        self._base = self.fs._strip_protocol(self.root).rstrip("/")

    def _names(self, under: str) -> set[str]:
        """Names (relative to --out) of the objects below `under`: one listing, never cached
        (other hosts upload meanwhile)."""
        self.fs.invalidate_cache()
        try:
            found = self.fs.find(self.join(under) if under else self.root)
        except FileNotFoundError:
            return set()
        return {p[len(self._base) + 1:] for p in found if p.startswith(self._base + "/")}

    def join(self, *names: str) -> str:
        return "/".join((self.root, *names))

    def open(self) -> None:
        shutil.rmtree(self.stage, ignore_errors=True)
        os.makedirs(self.stage)
        self.listed = self._names("")   # the one listing of a (re)start: job.json, finished parts

    def read_json(self, name: str) -> dict | None:
        if name not in self.listed:
            return None
        return json.loads(self.fs.cat_file(self.join(name)))

    def write_text(self, name: str, text: str) -> None:
        self.fs.pipe_file(self.join(name), text.encode())

    def finished(self, i: int, listed: str | None = None) -> bool:
        return done_name(i) in self.listed and part_name(i) in self.listed

    def staging(self, i: int) -> str:
        return os.path.join(self.stage, part_name(i))

    def commit(self, i: int, staged: str) -> None:
        self.fs.put_file(staged, self.join(part_name(i)))
        os.remove(staged)

    def done_markers(self, n: int) -> list[dict] | None:
        """Every part's marker, or None while some host's part is not done: one listing (not
        the cached one of the start: other hosts upload meanwhile), then one read per part."""
        have = self._names("done")
        names = [done_name(i) for i in range(n)]
        if any(name not in have for name in names):
            return None
        got = self.fs.cat([self.join(name) for name in names])   # concurrent where the backend can
        got = {self.fs._strip_protocol(k): v for k, v in got.items()}   # keys lose the scheme
        return [json.loads(got[f"{self._base}/{name}"]) for name in names]

    def close(self) -> None:
        shutil.rmtree(self.stage, ignore_errors=True)


def done_name(i: int) -> str:
    return "done/" + part_name(i)[:-len(records.PART_SUFFIX)] + ".json"


class BadRecordStop(SystemExit):
    """--strict: the first bad record ends the run with one line naming file:line."""




def documents(path: str, text_key: str, bad: BadRecords, strict: bool, progress, select=None,
              fuzzy: set[int] | None = None):
    """(text pieces) per valid document of one file, in file order; bad records counted (or,
    strict, raised) by the streaming path's rules (data/readers/sources.py), whatever the file's format
    (data/readers/formats.py). `select`: --quality / --dedup exact (companions.Selection), judged
    per document before it is tokenized; `fuzzy`: the rows --dedup fuzzy drops."""
    def report(line_no, kind, detail="", where=path):
        if strict:
            raise BadRecordStop(f"prepare_data: bad record at {where}:{line_no}: {kind}"
                                + (f" ({detail})" if detail else "")
                                + " (--strict; drop it to skip and count bad records)")
        bad.add(where, line_no, kind, detail)

    try:
        rec = formats.open_records(path, text_key)
    except formats.FileProblem as e:
        report(0, e.kind, e.detail)
        return
    except OSError as e:
        report(0, "unreadable_file", type(e).__name__)
        return
    raw_file = rec.raw_file   # compressed bytes read: the bar's unit (None: columnar files)
    sel = select.open(path, None) if select else None
    try:
        line_no = 0
        while True:
            try:
                raw, n = rec.next()
            except (EOFError, OSError, ValueError) as e:
                report(line_no + 1, "truncated_file", str(e) or type(e).__name__)
                return
            except formats.FileProblem as e:
                report(line_no + 1, e.kind, e.detail)
                return
            if n == 0:
                if line_no == 0:
                    report(0, "empty_file")
                return
            line_no += 1
            if line_no % 256 == 0 and raw_file is not None:
                try:
                    progress(raw_file.tell())
                except (OSError, ValueError):
                    pass
            text, kind = rec.parse(raw)
            if kind is not None:
                report(line_no, kind, formats.missing_key_detail(raw, text_key)
                       if kind == "missing_key" else "")
                continue
            if text is None:   # a blank line
                continue
            if fuzzy and line_no - 1 in fuzzy:
                bad.drop(FUZZY)
                continue
            verdict = sel.judge(line_no - 1) if sel is not None else None
            if verdict is not None:
                if verdict[0] == "drop":
                    bad.drop(verdict[1])
                else:
                    report(verdict[3], verdict[1], verdict[4], where=verdict[2])
                continue
            yield split_pieces(text)
    finally:
        rec.close()
        if sel is not None:
            sel.close()


class _Chunk:
    __slots__ = ("part", "pieces_per_doc", "future", "last")

    def __init__(self, part, pieces_per_doc, future, last):
        self.part, self.pieces_per_doc, self.future, self.last = part, pieces_per_doc, future, last


class Converter:
    def __init__(self, args, files: list[str], tok, sizes: dict[str, int] | None = None, owner=None):
        """`owner` names this writer's temporary files (default: --process-index); each Beam
        worker has its own, so two attempts at one part never write the same file."""
        self.args = args
        self.files = files
        self.sizes = dict(sizes or {})
        self.out = args.out
        owner = args.process_index if owner is None else owner
        self.store = (UrlOut(args.out, owner, args.tmp) if objstore.is_url(args.out)
                      else LocalOut(args.out, owner))
        self.dtype = records.token_dtype(tok.get_vocab_size())   # said in job.json and the manifest
        self.tok_hash = tokenizer_hash(tok)
        self.threads = available_cores()
        set_thread_env(1)
        self.enc = BatchEncoder(tok.to_str(), self.threads)
        self.job = {"format": records.FORMAT, "tokenizer": self.tok_hash, "dtype": self.dtype,
                    "text_key": args.text_key, "sources": self._rel_sources(),
                    "sources_hash": files_hash(files)}
        # --quality / --dedup: named in job.json and the manifest only when set (a plain
        # conversion's files stay what they were)
        self.selection = selection_of(args)
        if self.selection:
            self.job["selection"] = self.selection
        self.select = companions.Selection(tuple(self.selection.get("quality", ())),
                                           "exact" if "exact" in self.selection.get("dedup", "") else "",
                                           args.companions, seek_points=False) if self.selection else None
        self.fuzzy = None

    def size(self, i: int) -> int:
        """Input i's bytes (the progress bar's unit): a URL's from its pattern's listing; a URL
        named in an @list file costs one request (it is read whole anyway)."""
        f = self.files[i]
        if f not in self.sizes:
            self.sizes[f] = objstore.filesystem(f).size(f) if objstore.is_url(f) else os.path.getsize(f)
        return self.sizes[f]

    def _rel_sources(self) -> list[str]:
        """Local files relative to their common directory (mount point independent); a URL as
        it is (its bucket and path are its name wherever it is read from)."""
        local = [f for f in self.files if not objstore.is_url(f)]
        if not local:
            return list(self.files)
        root = os.path.commonpath([os.path.abspath(f) for f in local])
        if len(local) == 1:
            root = os.path.dirname(root)
        return [f if objstore.is_url(f) else os.path.relpath(os.path.abspath(f), root) for f in self.files]

    def start(self) -> None:
        self.store.open()
        old = self.store.read_json("job.json")
        if old is not None:
            if old != self.job:
                diff = sorted(k for k in self.job if old.get(k) != self.job[k])
                raise SystemExit(f"prepare_data: --out {self.out} holds a conversion with other "
                                 f"{', '.join(diff)} ({self.store.join('job.json')}); use another --out")
        else:
            self.store.write_text("job.json", json.dumps(self.job, indent=1, sort_keys=True))

    def pending(self, mine: list[int]) -> list[int]:
        """My parts not yet complete."""
        return [i for i in mine if not self.store.finished(i, self.fuzzy_list_name(i))]

    def fuzzy_list_name(self, i: int) -> str | None:
        """Where input i's fuzzy list goes under --out (data.fuzzy_lists=--out reads it), with
        --dedup fuzzy; else None."""
        if "fuzzy" not in self.selection.get("dedup", ""):
            return None
        return companions.rel_name(self.files[i], "fuzzy")

    def _chunks(self, todo: list[int], bads: dict, bar):
        """Chunks of documents handed to the tokenizer pool in order; a chunk never spans
        two files."""
        done_bytes = 0
        for i in todo:
            path = self.files[i]
            bad = bads[i] = BadRecords(False)
            base = done_bytes

            def progress(pos, base=base):
                bar.update(base + pos - bar.n)

            texts, per_doc, chars = [], [], 0
            if self.fuzzy is not None and path not in self.fuzzy:   # its minhash file is missing
                mp = companions.companion_path(path, "minhash", self.args.companions)
                if self.args.strict:
                    raise BadRecordStop(f"prepare_data: bad record at {mp}:0: missing_companion "
                                        "(--strict; drop it to skip and count bad records)")
                bad.add(mp, 0, "missing_companion", "no minhash file: none of its documents kept")
                yield _Chunk(i, [], self.enc.submit([]), True)
                done_bytes += self.size(i)
                continue
            fz = self.fuzzy.get(path) if self.fuzzy is not None else None
            for pieces in documents(path, self.args.text_key, bad, self.args.strict, progress,
                                    self.select, fz):
                texts.extend(pieces)
                per_doc.append(len(pieces))
                chars += sum(map(len, pieces))
                if chars >= CHUNK_CHARS:
                    yield _Chunk(i, per_doc, self.enc.submit(texts), False)
                    texts, per_doc, chars = [], [], 0
            yield _Chunk(i, per_doc, self.enc.submit(texts), True)
            done_bytes += self.size(i)
            bar.update(done_bytes - bar.n)

    def run(self, todo: list[int], bar) -> dict:
        from array_record.python.array_record_module import ArrayRecordWriter
        dt = self.dtype
        bads: dict = {}
        stats = collections.Counter()
        t0 = time.perf_counter()
        writer = None
        docs = tokens = 0
        ahead: collections.deque = collections.deque()
        chunks = self._chunks(todo, bads, bar)
        # `threads` calls in flight keep every core busy while this thread reads, parses,
        # and writes the previous chunks' records.
        exhausted = False
        while True:
            while not exhausted and len(ahead) < 2 * self.threads:
                try:
                    ahead.append(next(chunks))
                except StopIteration:
                    exhausted = True
            if not ahead:
                break
            ch = ahead.popleft()
            i = ch.part
            if writer is None:
                tmp = self.store.staging(i)
                writer = ArrayRecordWriter(tmp, WRITER_OPTIONS)
                docs = tokens = 0
            flat, lens = ch.future.result()
            ends = lens.cumsum()
            starts = ends - lens
            p = 0
            for n in ch.pieces_per_doc:   # a document = all its pieces' tokens
                a, b = int(starts[p]), int(ends[p + n - 1])
                writer.write(flat[a:b].astype(dt).tobytes())
                p += n
            docs += len(ch.pieces_per_doc)
            tokens += int(lens.sum())
            stats["docs"] += len(ch.pieces_per_doc)
            stats["tokens"] += int(lens.sum())
            el = max(time.perf_counter() - t0, 1e-9)
            bar.set_postfix_str(f"{stats['docs'] / el:,.0f} docs/s, {stats['tokens'] / el:,.0f} "
                                f"tok/s", refresh=False)
            if ch.last:
                writer.close()
                writer = None
                nbytes = os.path.getsize(tmp)
                self.store.commit(i, tmp)
                bad = bads.pop(i)
                rows = self.fuzzy.get(self.files[i]) if self.fuzzy is not None else None
                if rows is not None:   # no list for a file whose minhash file is missing
                    self.store.write_text(self.fuzzy_list_name(i), companions.fuzzy_list_text(
                        self.job["sources"][i], self.args.dedup_threshold, rows))
                self.store.write_text(done_name(i), json.dumps({
                    "file": part_name(i), "source": self.job["sources"][i],
                    "documents": docs, "tokens": tokens, "bytes": nbytes,
                    "bad_records": {k: v for k, v in sorted(bad.counts.items()) if not k.startswith(DROPPED)},
                    **({"dropped": {k[len(DROPPED):]: v for k, v in sorted(bad.counts.items())
                                    if k.startswith(DROPPED)}} if self.selection else {}),
                    "bad_examples": bad.examples}, sort_keys=True))
                stats["parts"] += 1
        stats["seconds"] = time.perf_counter() - t0
        return stats

    def manifest(self) -> dict | None:
        """The manifest once every part is done (any host may finish last), else None."""
        parts = self.store.done_markers(len(self.files))
        if parts is None:
            return None
        bad: collections.Counter = collections.Counter()
        examples = []
        for p in parts:
            bad.update(p["bad_records"])
            examples.extend(p["bad_examples"][:MAX_BAD_EXAMPLES - len(examples)])
        dropped: collections.Counter = collections.Counter()
        for p in parts:
            dropped.update(p.get("dropped", {}))
        sel = {"selection": self.selection, "dropped": dict(sorted(dropped.items()))} if self.selection else {}
        return {"format": records.FORMAT, "tokenizer": self.tok_hash, "dtype": self.dtype,
                "text_key": self.args.text_key, **sel, "documents": sum(p["documents"] for p in parts),
                "tokens": sum(p["tokens"] for p in parts),
                "bad_records": {k: bad[k] for k in BAD_KINDS if bad[k]},
                "bad_examples": examples,
                "files": [{k: p[k] for k in ("file", "source", "documents", "tokens", "bytes")}
                          for p in parts]}


def selection_of(args) -> dict:
    """--quality / --dedup as job.json holds them ({} without either); ValueError for a bad one."""
    rules = list(quality.parse(args.quality)) if args.quality else []
    asked = [d for d in (args.dedup or "").replace(" ", "").split(",") if d and d != "none"]
    if set(asked) - set(companions.DEDUPS):
        raise ValueError(f"--dedup {args.dedup}: must be exact, fuzzy or exact,fuzzy")
    dedup = ",".join(d for d in companions.DEDUPS if d in asked)
    if not rules and not dedup:
        return {}
    out = {"quality": rules, "dedup": dedup, "companions": args.companions or ""}
    if "fuzzy" in dedup:
        out["dedup_threshold"] = args.dedup_threshold
    return out

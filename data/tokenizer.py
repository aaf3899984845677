"""Tokenizer loading and batched encoding (per batch of documents, never per token)."""
from __future__ import annotations

import array
import hashlib
import os
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

assert array.array("I").itemsize == 4, "BatchEncoder.encode joins array('I') bytes as int32"

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[\w.\-]+)?$")


def tokenizer_file(spec: str) -> str | None:
    """The local tokenizer.json for spec (file or directory), None when spec is a hub id.

    Raises FileNotFoundError naming `tokenizer.path` when spec looks like a local path that
    does not exist.
    """
    p = os.path.expanduser(str(spec))
    if os.path.isfile(p):
        return p
    if os.path.isdir(p):
        f = os.path.join(p, "tokenizer.json")
        if os.path.isfile(f):
            return f
        raise FileNotFoundError(f"tokenizer.path={spec!r}: directory has no tokenizer.json")
    looks_local = (p.startswith(("/", ".", "~")) or p.endswith(".json") or os.sep + os.sep in p
                   or not _HUB_ID.match(p))
    if looks_local:
        raise FileNotFoundError(f"tokenizer.path={spec!r}: no such file or directory")
    return None


def load_tokenizer(spec: str):
    """tokenizer.json path | directory holding it | Hugging Face hub id."""
    import tokenizers
    f = tokenizer_file(spec)
    if f is not None:
        try:
            return tokenizers.Tokenizer.from_file(f)
        except Exception as e:  # noqa: BLE001 - re-raised with the setting named
            raise ValueError(f"tokenizer.path={spec!r}: not a valid tokenizer.json ({e})") from e
    try:
        return tokenizers.Tokenizer.from_pretrained(spec)
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"tokenizer.path={spec!r}: not a local file and could not be loaded "
                         f"from the Hugging Face hub ({e})") from e


# The tokenizer this process's input uses, with its JSON: the trainer's head batch (data/workers.py
# head_slab) builds an encoder from StreamSpec.tokenizer_json while the trainer already holds the
# tokenizer it was made from; parsing the JSON again held the GIL for ~65-80 ms of the ~1 s to the
# first batch (the 32k Llama-class tokenizer; a 128k one longer), and serializing it (to_str) for
# every iterator and hash ~16-50 ms. One run, one tokenizer: only the latest pair is kept (a tuple
# swapped whole, so threads read a consistent pair). An encoder only encodes: the tokenizer is
# shared, never changed (its encode calls run side by side, as every pool's do).
_REMEMBERED: tuple = (None, None)   # (tokenizer JSON, the tokenizers.Tokenizer parsed from it)


def tokenizer_json(tok) -> str:
    """tok.to_str(), serialized once per process for the tokenizer this run uses."""
    global _REMEMBERED
    j, t = _REMEMBERED
    if t is not tok:
        j = tok.to_str()
        _REMEMBERED = (j, tok)
    return j


def parsed_tokenizer(tok_json: str):
    """The tokenizer of `tok_json`, parsed once per process."""
    global _REMEMBERED
    j, t = _REMEMBERED
    if t is None or j != tok_json:
        import tokenizers
        t = tokenizers.Tokenizer.from_str(tok_json)
        _REMEMBERED = (tok_json, t)
    return t


# Document end and start, by name, first found wins: SentencePiece (Llama 2, Mistral), GPT-2 and
# Qwen (<|endoftext|>; no BOS), Llama 3 (<|end_of_text|> and <|begin_of_text|>: pre-training's
# document boundaries, not the chat turn's <|eot_id|>), Gemma, BERT.
EOS_NAMES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "[SEP]")
BOS_NAMES = ("<s>", "<|begin_of_text|>", "<bos>", "[CLS]")


def special_ids(tok) -> tuple[int, int | None]:
    """(eos_id, bos_id) found by the usual names among the tokenizer's special tokens; among its
    whole vocabulary only when it marks no token special. A byte-level vocabulary (Llama 3's,
    Qwen's) may hold "</s>" or "<s>" as an ordinary piece of text: that is no boundary token."""
    special = {t.content: i for i, t in tok.get_added_tokens_decoder().items() if t.special}

    def find(names):
        for n in names:
            i = special.get(n) if special else tok.token_to_id(n)
            if i is not None:
                return i
        return None
    eos, bos = find(EOS_NAMES), find(BOS_NAMES)
    if eos is None:
        raise ValueError("tokenizer.path: the tokenizer has no end-of-sequence token "
                         f"(looked for {', '.join(EOS_NAMES)}"
                         + (" among its special tokens)" if special else ")"))
    return eos, bos


def tokenizer_hash(tok) -> str:
    return hashlib.sha256(tokenizer_json(tok).encode()).hexdigest()[:16]


def set_thread_env(threads: int) -> None:
    """Size the tokenizer's Rayon pool; must run before the first parallel encode."""
    threads = max(1, int(threads))
    os.environ["RAYON_NUM_THREADS"] = str(threads)
    os.environ["RAYON_RS_NUM_CPUS"] = str(threads)
    os.environ["TOKENIZERS_PARALLELISM"] = "true" if threads > 1 else "false"


def serial_calls_unless_set() -> None:
    """The trainer's tokenizer calls run each on its own thread, as an input worker's do, unless
    TOKENIZERS_PARALLELISM says otherwise. Unset, the tokenizer runs every encode_batch call on its
    Rayon pool over all cores: the trainer's head batch (data/workers.py head_slab), a pool of one
    thread per core, then funnels every call into that one pool, whose rate on the 16-core H100
    host was 6.1 M tok/s against 10.5 M for one serial call per thread (bench_input.py's two
    ways). Set only when unset, so once per process: called before the process's first input
    workers spawn (an environment edited while a vfork'ed child execs can kill that child; the
    Rayon pool's size, RAYON_NUM_THREADS, is read once and is left alone)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# Tokenizer threads per input process (data/host.py make_encoder).
MAX_ENCODE_THREADS = 4


def encode_threads(cores: int, num_workers: int) -> int:
    """Tokenizer threads of each input process: its share of the cores rounded down, plus one
    (at least 1, at most MAX_ENCODE_THREADS), so the workers' threads always outnumber the cores.
    Every worker gets the same count, as the host batch waits for its slowest worker, and a worker
    ahead of the others waits with its buffer full: with exactly a core's worth of threads each, the
    cores it leaves idle then are lost. On the lent H100 host (14 cores): 8 workers of 1 thread
    each used 8 of the 14 cores (0.64-0.70 x the tokenizer alone); 8 of 2 threads each (16 on 14
    cores) 99% of them, 0.88; 14 workers of 1 thread each 86% of theirs, 0.76. The few threads over
    the cores share them, and the workers run nicer than the trainer (data.worker_nice), so the
    trainer's loop never waits behind them."""
    return min(MAX_ENCODE_THREADS, cores // max(num_workers, 1) + 1)


def core_share(cores: int, num_workers: int) -> float:
    """The cores one input process's tokenizer threads actually get: its threads, or its share
    of the cores where the threads outnumber them."""
    return min(encode_threads(cores, num_workers), cores / max(num_workers, 1))


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover
        return os.cpu_count() or 1


class BatchEncoder:
    """Encodes lists of texts into one flat int32 array plus per-text lengths.

    `submit` encodes on a pool of `threads` threads, each running the tokenizer serially on its
    own call (set_thread_env(1)): the tokenizer releases the GIL, so the calls run in parallel
    while the caller reads and packs the neighbouring chunks, and no core idles between calls.
    Several serial calls in flight beat one parallel call over the same cores (no idle tail
    while the longest document of a call finishes).
    """

    def __init__(self, tok_json: str, threads: int = 1, times: dict | None = None):
        self.tok = parsed_tokenizer(tok_json)
        self._fast = getattr(self.tok, "encode_batch_fast", None)
        self.eos, self.bos = special_ids(self.tok)
        self.threads = max(1, int(threads))
        self._pool = None
        # "tokenize" seconds (data/timing.py), added from the pool's threads
        self.times = {"tokenize": 0.0} if times is None else times
        self._times_lock = threading.Lock()

    def encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """-> (all ids as one int32 array, ids per text)."""
        if not texts:
            return np.zeros(0, np.int32), np.zeros(0, np.int64)
        fn = self._fast or self.tok.encode_batch
        encs = fn(texts, add_special_tokens=False)
        # Each text's id list into an array("I"), their bytes joined into one int32 array (ids
        # are < 2**31): array's unsigned path takes a list ~3x faster than numpy's (11 against 31
        # ns a token on web text, the lists themselves ~21 ns, the tokenizer ~800-1200): ~2% of
        # a tokenizer thread. The heavy Encoding objects are freed here, not kept while a chunk waits.
        arrs = [array.array("I", e.ids) for e in encs]
        lens = np.fromiter(map(len, arrs), np.int64, len(arrs))
        return np.frombuffer(b"".join(arrs), np.int32).copy(), lens

    def submit(self, texts: list[str]) -> Future:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="tokenize")
        return self._pool.submit(self._encode_timed, texts)

    def _encode_timed(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        # Timed inside the task and counted when it ends (not when its result is collected, a
        # window later): the caller's wait for the result is not tokenization time.
        t0 = time.perf_counter()
        out = self.encode(texts)
        dt = time.perf_counter() - t0
        with self._times_lock:
            self.times["tokenize"] += dt
        return out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

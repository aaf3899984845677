"""Downstream tasks in the lm-evaluation-harness's request model: local JSON-lines files ->
examples -> (context, continuation) requests -> token ids -> fixed-shape packed rows.

Scoring the rows is model/evals/evaluate.py's; this module is pure Python/numpy.

Task files are read at construction (before training starts), never mid-run: a malformed line
is a one-line ValueError naming file:line (`on_bad_line: error`, the default), or it is skipped
and counted (`on_bad_line: skip`).

Formats (`format:`), each turned into the harness's request strings exactly as its task YAMLs
do (lm_eval/tasks/{hellaswag,arc,piqa,lambada}); choices get the harness's target delimiter " ":
    generic    {"context": str, "choices": [str], "gold": int}    (multiple choice)
               {"context": str, "continuation": str}             (loglikelihood: continuation as is)
    hellaswag  {"activity_label", "ctx_a", "ctx_b", "endings": [4], "label"}
    arc        {"question", "choices": {"text": [...], "label": [...]}, "answerKey"}
    piqa       {"goal", "sol1", "sol2", "label"}
    lambada    {"text"}: the last word given the rest (loglikelihood)

Tokenization follows the harness's causal-LM path (lm_eval/api/model.py `_encode_pair`,
models/huggingface.py): trailing spaces of the context move to the continuation; the
continuation's ids are those of encode(context + continuation) past len(encode(context));
an empty context is the prefix token (BOS when the tokenizer has one, else EOS). A request
longer than seq_len + 1 tokens loses tokens from the left, as the harness truncates.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from typing import Any, Callable, Mapping, Sequence

import numpy as np

log = logging.getLogger(__name__)

KINDS = ("multiple_choice", "loglikelihood")
ON_BAD_LINE = ("error", "skip")


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """One task of `eval.tasks`: a name (metrics tasks/<name>/acc), a JSON-lines file, its format."""

    name: str
    path: str
    format: str = "generic"
    kind: str = "multiple_choice"
    limit: int | None = None     # the first N examples only

    @classmethod
    def from_mapping(cls, m: Mapping[str, Any], where: str = "eval.tasks") -> "TaskSpec":
        m = dict(m.items())
        unknown = set(m) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {sorted(unknown)}; expected name, path, format, kind, limit")
        for key in ("name", "path"):
            if not m.get(key):
                raise ValueError(f"{where}: missing '{key}'")
        fmt = m.get("format", "generic")
        if fmt not in FORMATS:
            raise ValueError(f"{where}.format={fmt!r}; expected one of {sorted(FORMATS)}")
        kind = m.get("kind") or ("loglikelihood" if fmt == "lambada" else "multiple_choice")
        if kind not in KINDS:
            raise ValueError(f"{where}.kind={kind!r}; expected one of {list(KINDS)}")
        if fmt != "generic" and kind != FORMATS[fmt][0]:
            raise ValueError(f"{where}: format {fmt} is a {FORMATS[fmt][0]} task, not {kind}")
        limit = m.get("limit")
        if limit is not None and (not isinstance(limit, int) or limit < 1):
            raise ValueError(f"{where}.limit={limit!r}; expected a positive integer or null")
        return cls(name=str(m["name"]), path=os.path.expanduser(str(m["path"])), format=fmt, kind=kind, limit=limit)


@dataclasses.dataclass(frozen=True)
class Example:
    """One scored example: its requests share `context`; `choices` are the continuations as the
    harness scores them (delimiter included); `norm_lens` are what acc_norm divides by."""

    task: str
    line: int
    context: str
    choices: tuple[str, ...]
    gold: int
    norm_lens: tuple[float, ...]


# ----------------------------------------------------------------------------- formats
# Each returns (context, choices without delimiter, gold) for multiple choice, or
# (context, (continuation,), 0) for loglikelihood; a KeyError/TypeError/ValueError is a bad line.

def _hellaswag_text(text: str) -> str:
    # lm_eval/tasks/hellaswag/utils.py preprocess: WikiHow artefacts out.
    text = text.strip().replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    return text.replace("  ", " ")


def _hellaswag(d):
    ctx = d["ctx_a"] + " " + d["ctx_b"].capitalize()
    choices = [_hellaswag_text(e) for e in d["endings"]]
    return _hellaswag_text(d["activity_label"] + ": " + ctx), choices, int(d["label"])


def _arc(d):
    labels = list(d["choices"]["label"])
    return f"Question: {d['question']}\nAnswer:", list(d["choices"]["text"]), labels.index(d["answerKey"])


def _piqa(d):
    return f"Question: {d['goal']}\nAnswer:", [d["sol1"], d["sol2"]], int(d["label"])


def _lambada(d):
    words = d["text"].split(" ")
    if len(words) < 2:
        raise ValueError("text has fewer than two words")
    return " ".join(words[:-1]), [" " + words[-1]], 0


def _generic_mc(d):
    return d["context"], list(d["choices"]), d["gold"]


def _generic_ll(d):
    return d["context"], [d["continuation"]], 0


# format -> (kind, doc -> fields, target delimiter)
FORMATS: dict[str, tuple[str, Callable, str]] = {
    "generic": ("multiple_choice", _generic_mc, " "),
    "hellaswag": ("multiple_choice", _hellaswag, " "),
    "arc": ("multiple_choice", _arc, " "),
    "piqa": ("multiple_choice", _piqa, " "),
    "lambada": ("loglikelihood", _lambada, ""),
}


def _fields(spec: TaskSpec):
    if spec.format == "generic" and spec.kind == "loglikelihood":
        return _generic_ll, ""
    _, fn, delim = FORMATS[spec.format]
    return fn, delim


def read_task(spec: TaskSpec, on_bad_line: str = "error") -> tuple[list[Example], int]:
    """(examples, number of skipped lines) of one task file. Blank lines are ignored.

    A line that is not a JSON object, lacks a field, has an empty choice list or a gold index
    out of range raises ValueError("<file>:<line>: ...") with on_bad_line="error"; with "skip"
    it is counted and the first one is logged.
    """
    if not os.path.isfile(spec.path):
        raise FileNotFoundError(f"eval.tasks[{spec.name}].path={spec.path!r}: no such file")
    fn, delim = _fields(spec)
    examples: list[Example] = []
    skipped = 0
    with open(spec.path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                doc = json.loads(line)
                if not isinstance(doc, dict):
                    raise ValueError(f"expected a JSON object, got {type(doc).__name__}")
                context, choices, gold = fn(doc)
                if not isinstance(context, str) or not choices or not all(isinstance(c, str) for c in choices):
                    raise ValueError("context must be a string and choices a non-empty list of strings")
                if isinstance(gold, bool) or not isinstance(gold, int) or not 0 <= gold < len(choices):
                    raise ValueError(f"gold={gold!r} is not an index into {len(choices)} choices")
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                msg = f"{spec.path}:{lineno}: " + (f"missing field {e}" if isinstance(e, KeyError) else str(e))
                if on_bad_line == "error":
                    raise ValueError(msg + " (eval.on_bad_line=skip skips such lines)") from None
                if not skipped:
                    log.warning("task %s: skipping malformed line %s", spec.name, msg)
                skipped += 1
                continue
            # acc_norm: the harness divides by len() of each choice string (lm_eval/api/task.py
            # process_results): characters, which are bytes for ASCII text.
            examples.append(Example(task=spec.name, line=lineno, context=context,
                                    choices=tuple(delim + c for c in choices), gold=gold,
                                    norm_lens=tuple(float(max(len(c), 1)) for c in choices)))
            if spec.limit and len(examples) >= spec.limit:
                break
    if not examples:
        raise ValueError(f"{spec.path}: no usable examples ({skipped} malformed lines)")
    return examples, skipped


# ----------------------------------------------------------------------------- tokens


@dataclasses.dataclass(frozen=True)
class Request:
    """Token ids of one (context, continuation) request, before truncation."""

    context: tuple[int, ...]
    continuation: tuple[int, ...]


class RequestEncoder:
    """(context, continuation) strings -> Request, the harness's causal-LM way (module docstring).

    `add_bos`: training put BOS before every document (data.add_bos); every encoded string then
    starts with it, as the exported tokenizer's template does (scripts/export_hf.py).
    """

    def __init__(self, tokenizer, add_bos: bool = False):
        from data.tokenizer import special_ids

        self.tok = tokenizer
        eos, bos = special_ids(tokenizer)
        self.bos = bos if add_bos else None
        self.prefix_id = bos if bos is not None else eos

    def _encode(self, texts: Sequence[str]) -> list[list[int]]:
        ids = [e.ids for e in self.tok.encode_batch(list(texts))]
        return [[self.bos] + x if self.bos is not None else x for x in ids]

    def encode(self, pairs: Sequence[tuple[str, str]]) -> list[Request]:
        ctxs, wholes, empty = [], [], []
        for context, continuation in pairs:
            empty.append(context == "")
            n_spaces = len(context) - len(context.rstrip())
            if n_spaces:
                context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
            ctxs.append(context)
            wholes.append(context + continuation)
        ctx_ids, whole_ids = self._encode(ctxs), self._encode(wholes)
        conts = [p[1] for p in pairs]
        cont_ids = self._encode([c for c, e in zip(conts, empty, strict=True) if e]) if any(empty) else []
        out, k = [], 0
        for c, w, e in zip(ctx_ids, whole_ids, empty, strict=True):
            if e:
                out.append(Request((self.prefix_id,), tuple(cont_ids[k])))
                k += 1
            else:
                out.append(Request(tuple(c), tuple(w[len(c):])))
        return out


# ----------------------------------------------------------------------------- packing


@dataclasses.dataclass
class PackedRows:
    """Requests packed into [rows, seq_len] int32 arrays (the training batch's keys, plus
    branch_ids), and where each request's scored tokens lie: request i is row[i], targets
    [start[i], end[i])."""

    inputs: np.ndarray
    targets: np.ndarray
    segment_ids: np.ndarray
    positions: np.ndarray
    branch_ids: np.ndarray
    row: np.ndarray
    start: np.ndarray
    end: np.ndarray


@dataclasses.dataclass
class _Unit:
    """What one segment of a packed row holds: a shared prefix (branch 0: context tokens but
    the last) and one branch per request (the context's last token, then the continuation but
    its last token; targets the continuation). A lone request is a unit with an empty prefix."""

    prefix: tuple[int, ...]
    branches: list[tuple[int, tuple[int, ...], tuple[int, ...], int]]   # (request, inputs, targets, n scored)

    def __len__(self) -> int:
        return len(self.prefix) + sum(len(b[1]) for b in self.branches)


def _units(requests: Sequence[Request], seq_len: int, share_contexts: bool = True) -> list[_Unit]:
    """Requests with the same context share it: the multiple-choice case, where every choice of
    an example repeats the context (HellaSwag: ~4 x 80 context tokens for ~4 x 25 scored ones).
    A group is split into units of at most seq_len tokens; a request that needs truncation
    (context + continuation > seq_len + 1) is scored alone on its last seq_len + 1 tokens."""
    by_context: dict[tuple[int, ...], list[int]] = {}
    units = []
    for i, r in enumerate(requests):
        if not r.continuation:
            raise ValueError(f"request {i}: the continuation encodes to no tokens")
        if r.context and len(r.context) + len(r.continuation) <= seq_len + 1:
            by_context.setdefault(r.context if share_contexts else (i, r.context), []).append(i)
        else:
            toks = (r.context + r.continuation)[-(seq_len + 1):]
            n = min(len(r.continuation), len(toks) - 1)
            units.append(_Unit((), [(i, toks[:-1], toks[1:], n)]))
    for members in by_context.values():
        ctx = requests[members[0]].context
        unit = _Unit(ctx[:-1], [])
        for i in members:
            cont = requests[i].continuation
            branch = (i, (ctx[-1],) + cont[:-1], cont, len(cont))
            if unit.branches and len(unit) + len(cont) > seq_len:
                units.append(unit)
                unit = _Unit(ctx[:-1], [])
            unit.branches.append(branch)
        units.append(unit)
    return units


def pack_requests(requests: Sequence[Request], seq_len: int, rows_multiple: int = 1,
                  share_contexts: bool = True) -> PackedRows:
    """First-fit-decreasing packing of requests into rows of seq_len tokens.

    A request is the last seq_len + 1 tokens of context + continuation (left truncation, the
    harness's way); inputs are all but its last token, targets all but its first, and its scored
    tokens are the last len(continuation) targets. Requests with the same context share one copy
    of it (_units; the model's attention_mask keeps their continuations apart). Each unit is its
    own segment (ids from 1, 0 = padding), positions restart at 0, so packed units never see each
    other. The number of rows is rounded up to a multiple of `rows_multiple` (the batch shape the
    step compiles for). share_contexts=False packs every request alone (the benchmark's baseline).
    """
    n = len(requests)
    units = _units(requests, seq_len, share_contexts)
    order = sorted(range(len(units)), key=lambda u: (-len(units[u]), units[u].branches[0][0]))   # then first request
    fill: list[int] = []          # tokens used per row
    row_of, off_of = np.zeros(len(units), np.int64), np.zeros(len(units), np.int64)
    first_open = 0                # rows before it are full to within the shortest unit
    shortest = min((len(u) for u in units), default=0)
    for u in order:
        need = len(units[u])
        # First fit over the open rows (a window of 256 bounds the cost at many thousand rows).
        for r in range(first_open, min(len(fill), first_open + 256)):
            if fill[r] + need <= seq_len:
                break
        else:
            r = len(fill)
            fill.append(0)
        row_of[u], off_of[u] = r, fill[r]
        fill[r] += need
        while first_open < len(fill) and fill[first_open] + shortest > seq_len:
            first_open += 1
    n_rows = -(-max(len(fill), 1) // rows_multiple) * rows_multiple
    shape = (n_rows, seq_len)
    inputs, targets = np.zeros(shape, np.int32), np.zeros(shape, np.int32)
    segs, pos, branch = (np.zeros(shape, np.int32) for _ in range(3))
    seg_count = np.zeros(n_rows, np.int32)
    row, start, end = (np.zeros(n, np.int64) for _ in range(3))
    for u in order:  # segment ids in packing order, so they are the same on every host
        r, o, unit = row_of[u], off_of[u], units[u]
        seg_count[r] += 1
        m = len(unit)
        segs[r, o:o + m] = seg_count[r]
        p = len(unit.prefix)
        if p:
            inputs[r, o:o + p] = unit.prefix
            targets[r, o:o + p - 1] = unit.prefix[1:]   # not scored; the last one is each branch's
            pos[r, o:o + p] = np.arange(p)
        at = o + p
        for b, (i, ins, tgts, n_scored) in enumerate(unit.branches, start=1):
            k = len(ins)
            inputs[r, at:at + k], targets[r, at:at + k] = ins, tgts
            pos[r, at:at + k] = np.arange(p, p + k)
            branch[r, at:at + k] = b
            row[i], start[i], end[i] = r, at + k - n_scored, at + k
            at += k
    return PackedRows(inputs, targets, segs, pos, branch, row, start, end)


# ----------------------------------------------------------------------------- passkey retrieval
# A synthetic long-context task, made locally (Mohtashami & Jaggi 2023, "Landmark Attention"): a
# random number hidden at a depth in repeated filler text, asked for at the end. Scored as a
# loglikelihood request: acc = the key's tokens are the greedy continuation of the context.
PASSKEY_INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
                 "I will quiz you about the important information there.")
PASSKEY_FILLER = (" The grass is green.", " The sky is blue.", " The sun is yellow.", " Here we go.",
                  " There and back again.")
PASSKEY_LINE = " The pass key is {key}. Remember it. {key} is the pass key."
PASSKEY_QUESTION = " What is the pass key? The pass key is"


@dataclasses.dataclass(frozen=True)
class PasskeyConfig:
    """`eval.passkey`: prompts of each length (tokens, context and key together) with the key at
    each depth (0.0: right after the introduction, 1.0: right before the question), `samples`
    keys each, from `seed`. Empty lengths: off."""

    lengths: tuple[int, ...] = ()
    depths: tuple[float, ...] = (0.0, 0.5, 1.0)
    samples: int = 4
    digits: int = 5
    seed: int = 0

    @classmethod
    def from_mapping(cls, m: Mapping[str, Any] | None, where: str = "eval.passkey") -> "PasskeyConfig":
        m = dict((m or {}).items())
        unknown = set(m) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {sorted(unknown)}; expected lengths, depths, samples, "
                             "digits, seed")
        lengths, depths = m.get("lengths") or [], m.get("depths", cls.depths)
        if isinstance(lengths, (int, str)) or any(isinstance(n, bool) or not isinstance(n, int) or n < 32
                                                   for n in lengths):
            raise ValueError(f"{where}.lengths={lengths!r}; expected a list of token counts >= 32")
        if isinstance(depths, (int, float, str)) or not depths or any(
                isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 <= d <= 1 for d in depths):
            raise ValueError(f"{where}.depths={depths!r}; expected a non-empty list of fractions in [0, 1]")
        for key, low, high in (("samples", 1, 100_000), ("digits", 1, 18), ("seed", 0, 2**63)):
            v = m.get(key, getattr(cls, key))
            if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
                raise ValueError(f"{where}.{key}={v!r}; expected an integer in [{low}, {high}]")
        return cls(lengths=tuple(int(n) for n in lengths), depths=tuple(float(d) for d in depths),
                   samples=int(m.get("samples", cls.samples)), digits=int(m.get("digits", cls.digits)),
                   seed=int(m.get("seed", cls.seed)))

    def check_fits(self, seq_len: int) -> None:
        too_long = [n for n in self.lengths if n > seq_len + 1]
        if too_long:
            raise ValueError(f"eval.passkey.lengths: {too_long[0]} tokens do not fit a scoring row of "
                             f"eval.seq_len={seq_len} (+1; null: data.seq_len): raise eval.seq_len or "
                             "shorten the prompt")


def passkey_group(length: int, depth: float) -> str:
    """The metric suffix of one (length, depth) cell: acc_len1024_depth50 (depth in percent)."""
    return f"acc_len{length}_depth{round(depth * 100)}"


def _filler(start: int, n: int) -> str:
    return "".join(PASSKEY_FILLER[i % len(PASSKEY_FILLER)] for i in range(start, start + n))


def _passkey_prompt(key: str, before: int, after: int) -> str:
    """The introduction, `before` filler sentences, the key line, `after` more, the question."""
    return (PASSKEY_INTRO + _filler(0, before) + PASSKEY_LINE.format(key=key) + _filler(before, after)
            + PASSKEY_QUESTION)


def passkey_examples(cfg: PasskeyConfig, tokenizer, add_bos: bool = False) -> tuple[list[Example], list[str]]:
    """(examples, their metric group) of the passkey task, a pure function of cfg and the tokenizer:
    for each length L, depth d and sample, a key of cfg.digits digits (from the seed) and the
    most filler sentences n for which context + " " + key is at most L tokens (BOS included when
    add_bos), round(d * n) of them before the key line."""
    from data.tokenizer import special_ids

    extra = 1 if add_bos and special_ids(tokenizer)[1] is not None else 0

    def n_tokens(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False).ids) + extra

    examples, groups = [], []
    for li, length in enumerate(cfg.lengths):
        for di, depth in enumerate(cfg.depths):
            for k in range(cfg.samples):
                rng = np.random.default_rng([cfg.seed, li, di, k])
                key = str(int(rng.integers(10 ** (cfg.digits - 1), 10 ** cfg.digits)))
                def fits(n: int, key=key, depth=depth, length=length) -> bool:
                    before = round(depth * n)
                    return n_tokens(_passkey_prompt(key, before, n - before) + " " + key) <= length

                if not fits(0):
                    raise ValueError(f"eval.passkey.lengths: {length} tokens cannot hold the prompt without "
                                     f"filler ({n_tokens(_passkey_prompt(key, 0, 0))} tokens): raise it")
                lo, hi = 0, 1
                while fits(hi):
                    lo, hi = hi, hi * 2
                while hi - lo > 1:
                    mid = (lo + hi) // 2
                    lo, hi = (mid, hi) if fits(mid) else (lo, mid)
                before = round(depth * lo)
                context = _passkey_prompt(key, before, lo - before)
                examples.append(Example(task="passkey", line=len(examples) + 1, context=context,
                                        choices=(" " + key,), gold=0, norm_lens=(float(len(key) + 1),)))
                groups.append(passkey_group(length, depth))
    return examples, groups

"""RedPajama-v2's quality rules: presets and rule strings over its quality signals, judged per
document before it is tokenized (data/readers/sources.py asks `Rules.first_failed`).

A rule is a condition a document must meet to be kept, over RPv2 signal names:

  "rps_doc_word_count >= 50"                     a document-level signal (its one span's score)
  "frac(rps_lines_start_with_bulletpoint) <= 0.9"   a line-level signal as the fraction of its
                                                  lines' scores (sum / number of line spans)
  "sum(rps_lines_start_with_bulletpoint) / ccnet_nlines <= 0.9"   summed, over another signal

Operators: < <= > >= == !=. A document is kept when every rule holds. A preset is a named list
of rules; presets combine with `+` ("gopher+c4") and a list may mix presets and rules.

A score a rule needs that is null (or absent, or a division by zero) cannot be judged: the
document is not handed out and is counted as a bad record `null_signal` (data.strict=true
stops there), never trained on unscored.
"""
from __future__ import annotations

import re

# Each preset's rules (keep conditions) and where they come from (docs/data.md repeats them).
PRESETS: dict[str, tuple[str, ...]] = {
    # Rae et al. 2021, "Scaling Language Models: Methods, Analysis & Insights from Training
    # Gopher" (arXiv 2112.11446), appendix A.1.1, as RPv2's README and paper (arXiv 2411.12372)
    # express them over RPv2's signals.
    "gopher": (
        "rps_doc_word_count >= 50",
        "rps_doc_word_count <= 100000",
        "rps_doc_mean_word_length >= 3",
        "rps_doc_mean_word_length <= 10",
        "rps_doc_symbol_to_word_ratio <= 0.1",
        "rps_doc_frac_lines_end_with_ellipsis <= 0.3",
        "rps_doc_frac_no_alph_words <= 0.2",
        "sum(rps_lines_start_with_bulletpoint) / ccnet_nlines <= 0.9",
        "rps_doc_frac_chars_top_2gram <= 0.20",
        "rps_doc_frac_chars_top_3gram <= 0.18",
        "rps_doc_frac_chars_top_4gram <= 0.16",
        "rps_doc_frac_chars_dupe_5grams <= 0.15",
        "rps_doc_frac_chars_dupe_6grams <= 0.14",
        "rps_doc_frac_chars_dupe_7grams <= 0.13",
        "rps_doc_frac_chars_dupe_8grams <= 0.12",
        "rps_doc_frac_chars_dupe_9grams <= 0.11",
        "rps_doc_frac_chars_dupe_10grams <= 0.10",
    ),
    # Raffel et al. 2019, "Exploring the Limits of Transfer Learning" (arXiv 1910.10683), 2.2
    # (C4's filters), as RPv2's README expresses them over its signals.
    "c4": (
        "rps_doc_num_sentences >= 3",
        "rps_doc_ldnoobw_words <= 0",
        "rps_doc_lorem_ipsum <= 0",
        "rps_doc_curly_bracket <= 0",
    ),
    # RedPajama-v1's CommonCrawl filter: a classifier of pages Wikipedia cites vs random pages;
    # the threshold is the one of RPv2's README snippet.
    "rpv1": (
        "rps_doc_ml_wikiref_score >= 0.25",
    ),
}

_OPS = {"<": float.__lt__, "<=": float.__le__, ">": float.__gt__, ">=": float.__ge__,
        "==": float.__eq__, "!=": float.__ne__}
_TERM = r"(?:(sum|frac)\(\s*([A-Za-z_][\w]*)\s*\)|([A-Za-z_][\w]*))"
_RULE = re.compile(rf"^\s*{_TERM}\s*(?:/\s*{_TERM}\s*)?(<=|>=|==|!=|<|>)\s*"
                   r"([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*$")


class Null(Exception):
    """A score a rule needs is null or absent: `name` says which."""

    def __init__(self, name: str):
        super().__init__(name)
        self.name = name


def _term(agg, name, plain):
    """(how, signal name): how is "doc", "sum" or "frac"."""
    return ("doc", plain) if plain else (agg, name)


def _value(signals: dict, how: str, name: str) -> float:
    spans = signals.get(name)
    if not spans:
        raise Null(name)
    if how == "doc":
        if len(spans) != 1:
            raise ValueError(f"{name} has {len(spans)} spans: a line-level signal is read as "
                             f"sum({name}) or frac({name})")
        score = spans[0][2]
        if score is None:
            raise Null(name)
        return float(score)
    total = 0.0
    for span in spans:
        if span[2] is None:
            raise Null(name)
        total += span[2]
    return total if how == "sum" else total / len(spans)


class Rule:
    """One keep condition, parsed once: `holds(signals)` -> bool; Null when a score is null."""

    def __init__(self, text: str, name: str):
        m = _RULE.match(text)
        if not m:
            raise ValueError(f"data.quality: cannot read the rule {text!r}: write SIGNAL OP NUMBER, "
                             "with SIGNAL a signal name, sum(NAME) or frac(NAME) (a line-level "
                             "signal), optionally / another; OP one of < <= > >= == !=")
        g = m.groups()
        self.num = _term(*g[0:3])
        self.den = _term(*g[3:6]) if (g[4] or g[5]) else None
        self.op = _OPS[g[6]]
        self.bound = float(g[7])
        self.text = " ".join(text.split())
        self.name = name          # how it is counted: "gopher: rps_doc_word_count >= 50"

    def signals(self) -> set[str]:
        return {t[1] for t in (self.num, self.den) if t is not None}

    def holds(self, signals: dict) -> bool:
        v = _value(signals, *self.num)
        if self.den is not None:
            d = _value(signals, *self.den)
            if d == 0:
                raise Null(self.den[1])
            v /= d
        return self.op(v, self.bound)


def parse(quality) -> tuple[str, ...]:
    """data.quality (None, "", a preset name, "gopher+c4", a rule, or a list of those) as the
    tuple of rule strings it stands for, each prefixed with where it came from ("gopher: ...",
    "rule: ..."): what the fingerprint and StreamSpec hold. ValueError naming a bad entry."""
    if quality is None or quality == "" or quality == []:
        return ()
    items = [quality] if isinstance(quality, str) else list(quality)
    out: list[str] = []
    for item in items:
        item = str(item).strip()
        if _RULE.match(item):
            Rule(item, "")
            out.append(f"rule: {' '.join(item.split())}")
            continue
        for name in item.split("+"):
            name = name.strip()
            if name not in PRESETS:
                raise ValueError(f"data.quality: {name!r} is neither a preset ({', '.join(PRESETS)}; "
                                 "combine with +) nor a rule such as 'rps_doc_word_count >= 50'")
            out.extend(f"{name}: {r}" for r in PRESETS[name])
    # one rule once, in its first place
    return tuple(dict.fromkeys(out))


class Rules:
    """The parsed rules of `parse`'s tuple, judged in order.

    Judged once per document on the reader's thread, beside the tokenizer: the rules are turned
    into one Python function (`_compile`), each signal's score read once however many rules use
    it. Rule by rule through `Rule.holds`, the 17 gopher rules took 9.7 us a document of the
    users'-scale bench corpus on the 2-core machine; compiled, 5.4 us, ~2.5 of it summing
    `rps_lines_start_with_bulletpoint`'s ~67 line spans. Same verdicts, same Null, same errors
    (tests/test_data_quality.py holds them against `Rule.holds` one by one)."""

    def __init__(self, rules: tuple[str, ...]):
        self.rules = [Rule(r.split(": ", 1)[1], r) for r in rules]
        # the signal names the rules read, in the order they are first read
        self.signals = tuple(dict.fromkeys(t[1] for r in self.rules for t in (r.num, r.den) if t is not None))
        self._check = _compile(self.rules)

    def __bool__(self) -> bool:
        return bool(self.rules)

    def first_failed(self, signals: dict) -> str | None:
        """The name of the first rule the document fails (None: kept). Null for a null score."""
        i = self._check(signals)
        return None if i < 0 else self.rules[i].name


_SYMBOL = {float.__lt__: "<", float.__le__: "<=", float.__gt__: ">", float.__ge__: ">=",
           float.__eq__: "==", float.__ne__: "!="}


def _multi(name: str, spans) -> None:
    _value({name: spans}, "doc", name)   # raises its ValueError


def _compile(rules: list[Rule]):
    """check(signals) -> the index of the first rule that fails, -1 when all hold; Null (a null
    or absent score, a zero denominator) where `Rule.holds` raises it, in the same rule order.
    The source is made of signal names the rule grammar admits (identifiers, written with repr)
    and bounds passed as values, never of free text.

    Two functions: `checked` reads each score with every check `_value` makes; `check`, the one
    returned, takes the well-formed case's short way (one span of three, unpacked; `+ 0.0` where
    `float()` was: the same value for an int, a TypeError for None or text) and hands any
    exception to `checked`, which then judges the document from the start as `Rule.holds` would
    (its Null, its ValueError, its numeric text). Gopher's rules, a document: 2.9-3.6 -> 2.5 us
    on short documents, 5.3 -> 4.8 us on web-length ones (most of it the bullet-point lines' sum)."""
    env = {"Null": Null, "_value": _value, "_multi": _multi, "float": float}
    checked, fast = ["def checked(s):"], ["def check(s):", "  try:"]
    local: dict = {}                       # (how, name) -> the local holding its value
    for i, r in enumerate(rules):
        for how, name in (t for t in (r.num, r.den) if t is not None):
            if (how, name) in local:
                continue
            v = local[(how, name)] = f"v{len(local)}"
            if how == "doc":
                checked += [f"    x = s.get({name!r})",
                            f"    if not x: raise Null({name!r})",
                            f"    if len(x) != 1: _multi({name!r}, x)",
                            f"    {v} = x[0][2]",
                            f"    if {v} is None: raise Null({name!r})",
                            f"    {v} = float({v})"]
                fast += [f"    ((_, _, {v}),) = s[{name!r}]",
                         f"    {v} = {v} + 0.0"]
            else:
                line = f"    {v} = _value(s, {how!r}, {name!r})"   # sum / frac
                checked.append(line)
                fast.append(line)
        value = local[r.num]
        if r.den is not None:
            den = local[r.den]
            checked.append(f"    if {den} == 0: raise Null({r.den[1]!r})")
            value = f"{value} / {den}"             # in `check`, a zero raises: `checked` decides
        env[f"b{i}"] = r.bound
        test = f"    if not ({value} {_SYMBOL[r.op]} b{i}): return {i}"
        checked.append(test)
        fast.append(test)
    checked.append("    return -1")
    fast += ["    return -1", "  except Exception:", "    return checked(s)"]
    exec(compile("\n".join(checked + fast), "<data.quality rules>", "exec"), env)  # noqa: S102 - see the docstring
    return env["check"]

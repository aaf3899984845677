"""Weighted mixtures of sources (`data.sources`), mixed row by row inside each virtual shard.

Virtual shard v of a mixture holds one sub-stream per source: that source's own shard v (its
files split V ways, its text_key, its own shuffle windows), built by the same factory as any
shard stream (data/host.py make_shard_stream, which hands them to the mixture), so every kind
of source can be mixed. The fixed global batch layout stays: shard v fills rows [v*k, (v+1)*k) of every global batch.

Which source fills a row is a pure function of the row's index g in the global row order
(g = batch * B + v * k + j): a Weyl sequence u_g = g * 0x9E3779B97F4A7C15 mod 2^64 (the golden
ratio, a low-discrepancy sequence) compared with the sources' cumulative weights. Over any n
consecutive global rows, each source's row count is within a few rows of weight * n (the
discrepancy of the golden-ratio sequence grows like log n), so the share of every source over
any 100 batches is exact to well under 1%. A pure function of g needs no state of its own
beyond the shard's row count, restores exactly, does not depend on hosts or workers, and keeps
working if the weights change (issue #16: re-weighting on resume).

Shares are shares of rows: with `concat` packing every row is full, so row share = token share;
with `first_fit` a source's padding counts toward its rows (metrics report both).

State (JSON): {"sched": {"row": n}, "sources": {name: that source's shard state},
"parked": {name: shard state}, "c": counters summed over the sources, parked ones included};
the row schedule is apart from the sources' positions, and the sub-states are keyed by name,
so a resumed run (data.mixture_change=continue) can re-weight, add or drop sources while every
kept source continues exactly from its own position, packer carry-over included. An added
source starts from its initial state; a dropped one's state is "parked": carried verbatim
through every later save (and host or worker count change: it travels inside its shard's
state), so listing the source again continues it where it stopped. "c" counts what the shard
emitted over the whole run, so it includes parked sources (totals never go back when a source
is dropped, and progress() stays the row count); per-source metrics report listed sources only.

Memory: every sub-stream keeps its own shuffle window (W rows of tokens, segment ids,
positions and doc ids: ~20 * W * (seq_len + 1) bytes) and `encoder.threads` tokenizer chunks
read ahead (<= 128 k characters each), so a host with S sources x its shards holds S times the
windows of a single source. The window of a small-weight source lasts longer, it is not larger.
"""
from __future__ import annotations

import bisect
import dataclasses
import zlib

import numpy as np

from data.streams import records
from data.streams.shard import COUNTER_KEYS, StreamSpec, url_sizes, zero_counters

_WEYL = 0x9E3779B97F4A7C15          # round(2^64 / golden ratio), odd
_MASK = (1 << 64) - 1
# Debug doc ids (data/readers/sources.py: (epoch * n_files + file) << 24 | line) carry the source's
# index in bits 56..62, so a test can tell sources apart; source 0's ids are unchanged.
SOURCE_ID_SHIFT = 56


def source_thresholds(weights) -> list[int]:
    """Cumulative weights as integer thresholds on [0, 2^64): source i owns
    [t[i-1], t[i]). Integers, so the schedule is identical on every machine."""
    total = float(sum(weights))
    acc, out = 0.0, []
    for w in weights[:-1]:
        acc += float(w)
        out.append(int(acc / total * (1 << 64)))
    out.append(1 << 64)
    return out


def source_of_row(thresholds: list[int], g: int) -> int:
    """The source that fills global row g."""
    return bisect.bisect_right(thresholds, (g * _WEYL) & _MASK)


def source_of_doc_id(doc_id):
    """Source index of (an array of) debug doc ids >= 0."""
    return np.asarray(doc_id) >> SOURCE_ID_SHIFT


def mixture_spec(base: StreamSpec, cfg, files: dict[str, list[str]]) -> StreamSpec:
    """The StreamSpec of a mixture (cfg: a DataConfig with sources): the base spec without
    files, plus per source the base spec with that source's files, text key and seed."""
    return dataclasses.replace(base, files=(), mixture=tuple(
        (src.name, src.weight,
         dataclasses.replace(base, files=tuple(files[src.name]), text_key=cfg.source_text_key(src),
                             seed=source_seed(cfg.seed, src.name), sizes=url_sizes(files[src.name]),
                             **records.stream_fields(files[src.name]), **cfg.source_bucket(src),
                             **{"quality": (), "dedup": "", **cfg.selection(src)}))
        for src in cfg.sources))


def source_seed(seed: int, name: str) -> int:
    """A source's own seed (its file orders and window shuffles), stable per name: two
    sources never share the same random orders, whatever their position in the list."""
    return ((int(seed) & 0xFFFFFFFF) << 32) + zlib.crc32(name.encode())   # >= 0, as numpy needs


def initial_mixture_state(initial_sources: dict) -> dict:
    """A mixture shard that has emitted nothing, given each source's initial shard state."""
    return {"sched": {"row": 0}, "sources": dict(initial_sources), "parked": {}, "c": zero_counters()}


def saved_sub_states(state: dict) -> dict:
    """{source name: saved sub-state}, listed and parked sources alike (a name is in one of the
    two; states written before parking existed have no "parked")."""
    return {**state.get("parked", {}), **state["sources"]}


class MixtureShardStream:
    """One virtual shard of a mixture: rows from its sources' sub-streams, in the row
    schedule's order. Same interface as ShardStream. It receives the sub-streams built (at
    `state`'s positions) and each source's initial state (for a restore that lacks one), so
    every kind of stream can be mixed without this file knowing how streams are made."""

    def __init__(self, spec: StreamSpec, shard: int, subs: list, state: dict, initial: dict):
        self.spec = spec
        self.shard = shard
        self.names = [name for name, _, _ in spec.mixture]
        self.thresholds = source_thresholds([w for _, w, _ in spec.mixture])
        self.k = spec.rows_per_shard
        self.batch_rows = spec.rows_per_shard * spec.num_shards   # B: rows of a global batch
        self.subs = list(subs)
        self._initial = dict(initial)
        self.parked = self._park(saved_sub_states(state))
        self.row = int(state["sched"]["row"])

    def _park(self, saved: dict) -> dict:
        """Saved sub-states of sources no longer listed, kept verbatim (never read here)."""
        return {name: st for name, st in sorted(saved.items()) if name not in self.names}

    # ---- state ----
    def get_state(self) -> dict:
        sub_states = {name: s.get_state() for name, s in zip(self.names, self.subs, strict=True)}
        return {"sched": {"row": self.row}, "sources": sub_states, "parked": dict(self.parked),
                "c": add_counters([*sub_states.values(), *self.parked.values()])}

    def _restore(self, st: dict) -> None:
        saved = saved_sub_states(st)
        for name, s in zip(self.names, self.subs, strict=True):
            s._restore(saved.get(name) or self._initial[name])
        self.parked = self._park(saved)
        self.row = int(st["sched"]["row"])

    def fill_ahead(self) -> None:
        for s in self.subs:
            fill = getattr(s, "fill_ahead", None)
            if fill is not None:
                fill()

    def close(self) -> None:
        for s in self.subs:
            s.close()

    # ---- rows ----
    def next_row_into(self, b: int, out: dict) -> None:
        n = self.row
        g = (n // self.k) * self.batch_rows + self.shard * self.k + n % self.k
        i = source_of_row(self.thresholds, g)
        self.subs[i].next_row_into(b, out)
        self.row = n + 1
        if i and "did" in out:
            d = out["did"][b]
            np.bitwise_or(d, np.int64(i) << SOURCE_ID_SHIFT, out=d, where=d >= 0)


def add_counters(states) -> dict:
    """Counters ("c") summed over shard states of any kind."""
    tot = zero_counters()
    for st in states:
        c = st["c"]
        for key in COUNTER_KEYS:
            tot[key] += int(c.get(key, 0))
        for key, v in c["bad"].items():
            tot["bad"][key] = tot["bad"].get(key, 0) + int(v)
        tot["badex"].extend(c["badex"])
    return tot


def source_counters(shard_states: dict, parked: bool = False) -> dict:
    """{source name: counters summed over the given mixture shard states, plus "epoch": the
    highest epoch any of those shards is reading in that source}; {} for a single source.
    Listed sources only, unless `parked` (the base of a delta: a source listed again after it
    was parked counts from where it stopped)."""
    per: dict = {}
    epochs: dict = {}
    for st in shard_states.values():
        if "sources" not in st:
            continue
        subs = saved_sub_states(st) if parked else st["sources"]
        for name, sub in subs.items():
            per.setdefault(name, []).append(sub)
            epochs[name] = max(epochs.get(name, 0), _reading_epoch(sub))
    return {name: {**add_counters(subs), "epoch": epochs[name]} for name, subs in per.items()}


def _reading_epoch(sub_state: dict) -> int:
    """The epoch a text source's shard is reading (its current window's start)."""
    return int(sub_state.get("start", {}).get("reader", {}).get("epoch", 0))

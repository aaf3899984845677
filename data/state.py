"""Per-virtual-shard states: merging saved host states (any P, N), fingerprint, stats."""
from __future__ import annotations

import hashlib
import json
import os

from data.config import DataConfig, list_files
from data.host import find_shard_states
from data.listing import all_files
from data.readers import formats
from data.streams import records
from data.streams.shard import COUNTER_KEYS, file_split
from data.tokenizer import load_tokenizer, tokenizer_hash


def merge_host_states(host_states: list[dict]) -> dict:
    """Saved per-host iterator states (any host count P, worker count N) -> per-shard states.

    Each shard appears in exactly one host's state as a live stream; other copies (the
    main-process placeholder of a worker that had not produced a batch yet) are never more
    advanced, so the most advanced copy wins.
    """
    found: dict = {}
    nshards = set()
    for hs in host_states:
        _collect_num_shards(hs, nshards)
        find_shard_states(hs, found)
    if not found:
        raise ValueError("no input-pipeline state found in the saved host states")
    if len(nshards) > 1:
        raise ValueError(f"saved host states disagree on the number of virtual shards: "
                         f"{sorted(nshards)}")
    V = nshards.pop()
    missing = [v for v in range(V) if str(v) not in found]
    if missing:
        raise ValueError(f"saved host states lack virtual shards {missing} (of {V}): were all "
                         "hosts' states collected?")
    return {"num_shards": V, "shards": {str(v): found[str(v)] for v in range(V)}}


def _collect_num_shards(state, out: set) -> None:
    if isinstance(state, dict):
        if "__vshards__" in state:
            out.add(int(state["num_shards"]))
            return
        for v in state.values():
            _collect_num_shards(v, out)
    elif isinstance(state, (list, tuple)):
        for v in state:
            _collect_num_shards(v, out)


def normalize_shard_states(shard_states: dict | None, num_shards: int) -> dict | None:
    if shard_states is None:
        return None
    if "shards" in shard_states:
        if int(shard_states.get("num_shards", num_shards)) != num_shards:
            raise ValueError(f"shard_states hold {shard_states['num_shards']} virtual shards, "
                             f"data.num_shards={num_shards}")
        shard_states = shard_states["shards"]
    return {str(k): v for k, v in shard_states.items()}


def files_hash(files: list[str]) -> str:
    """Hash of the file list relative to its common directory (mount point independent)."""
    if not files:
        return ""
    root = os.path.commonpath([os.path.abspath(f) for f in files])
    if len(files) == 1:
        root = os.path.dirname(root)
    rel = [os.path.relpath(os.path.abspath(f), root) for f in files]
    return hashlib.sha256("\n".join(rel).encode()).hexdigest()[:16]


def _split_marks(key: str, files: list[str], num_shards: int) -> dict:
    """The split of files among shards, when they are fewer (else nothing: an unsplit run's
    fingerprint stays what it was). Parquet/Arrow files split by row group since #21 (before:
    by row): named, so a run saved under the row split is not resumed as if split by group."""
    split = file_split(len(files), num_shards)
    if split <= 1:
        return {}
    marks = {key: split}
    if any(formats.name_format(f) in ("parquet", "arrow") for f in files):
        marks[f"{key}_by"] = "row_group"
    return marks


def bucket_marks(min_key: str, max_key: str, bucket: dict) -> dict:
    """A length bucket's bounds (data/streams/buckets.py), named only when set: the fingerprint
    of a run without one stays what it was."""
    return {k: bucket[f] for k, f in ((min_key, "min_tokens"), (max_key, "max_tokens")) if bucket[f]}


def selection_marks(prefix: str, sel: dict) -> dict:
    """data.quality's rules, data.dedup and data.companions (and data.fuzzy_lists with
    data.dedup_threshold for fuzzy), named only when a selection is set
    (the fingerprint of a run without one stays what it was): another selection is other data."""
    if not sel:
        return {}
    return {f"{prefix}quality": list(sel["quality"]), f"{prefix}dedup": sel["dedup"],
            f"{prefix}companions": sel["companions"],
            # fuzzy dedup's lists and threshold, named only with it
            **{f"{prefix}{k}": sel[k] for k in ("fuzzy_lists", "dedup_threshold") if k in sel}}


def fingerprint(cfg: DataConfig, tokenizer=None,
                files: list[str] | dict[str, list[str]] | None = None) -> dict:
    """What the saved data positions depend on. A mixture adds, per source,
    "source.NAME.{share,files,num_files,text_key}" (one diff line per changed setting);
    a single-source run's fingerprint is unchanged."""
    files = list_files(cfg) if files is None else files
    tok = tokenizer if tokenizer is not None else load_tokenizer(cfg.tokenizer)
    flat = all_files(files)
    fp = {"tokenizer": tokenizer_hash(tok), "files": files_hash(flat),
          "num_files": len(flat), "seq_len": cfg.seq_len, "seed": cfg.seed,
          "packing": cfg.packing, "num_shards": cfg.num_shards, "text_key": cfg.text_key,
          "add_bos": cfg.add_bos, "shuffle_window": cfg.shuffle_window,
          "files_per_stream": cfg.files_per_stream}
    # files split across shards (fewer files than shards) read in another order: named only
    # then, so that the fingerprint of an unsplit run stays what it was
    if not cfg.sources:
        fp.update(_split_marks("file_split", flat, cfg.num_shards))
        fp.update(bucket_marks("min_doc_tokens", "max_doc_tokens", cfg.bucket()))
        fp.update(selection_marks("", cfg.selection()))
    else:
        total = sum(src.weight for src in cfg.sources)
        fp["sources"] = [src.name for src in cfg.sources]
        for src in cfg.sources:
            fp.update({f"source.{src.name}.share": src.weight / total,
                       f"source.{src.name}.files": files_hash(files[src.name]),
                       f"source.{src.name}.num_files": len(files[src.name]),
                       f"source.{src.name}.text_key": cfg.source_text_key(src)})
            fp.update(bucket_marks(f"source.{src.name}.min_tokens", f"source.{src.name}.max_tokens",
                                   cfg.source_bucket(src)))
            fp.update(_split_marks(f"source.{src.name}.file_split", files[src.name], cfg.num_shards))
            fp.update(selection_marks(f"source.{src.name}.", cfg.selection(src)))
    # A converted directory: the manifest holds documents and tokens per file, so its hash
    # identifies the corpus without reading (or walking) the files.
    if cfg.sources:
        for src in cfg.sources:
            info = records.describe(files[src.name])
            if info is not None:
                fp[f"source.{src.name}.manifest"] = info.hash
    else:
        info = records.describe(flat)
        if info is not None:
            fp["manifest"] = info.hash
    return fp


# ---------------------------------------------------------------- changing a mixture on resume
# Global keys a mixture may change under data.mixture_change=continue: the list of sources and
# the aggregates over all sources' files (each kept source's own "source.NAME.*" keys guard its
# files), and data.text_key, only a default (each source's effective key is its own entry).
_MIXTURE_FREE_KEYS = ("sources", "files", "num_files", "text_key")


def _source_key(key: str) -> tuple[str, str] | None:
    """"source.NAME.FIELD" -> (NAME, FIELD); NAME may hold dots, FIELD never does."""
    if not key.startswith("source."):
        return None
    name, _, field = key[len("source."):].rpartition(".")
    return name, field


def _known_sources(fp: dict) -> set:
    """Names of the sources a fingerprint describes: listed ones and parked ones."""
    return {sk[0] for sk in map(_source_key, fp) if sk is not None}


def carry_parked_sources(saved: dict, current: dict) -> dict:
    """The run's data fingerprint plus, for every source of the saved one that is not listed
    now (dropped now, or parked earlier), its entries but the share: what a parked source was,
    so that listing it again is checked against it, and a later resume with the same config
    finds the same fingerprint. Only between two mixtures (a parked state lives in a mixture's
    shard states)."""
    if "sources" not in saved or "sources" not in current:
        return dict(current)
    listed = set(current["sources"])
    out = dict(current)
    for key, value in saved.items():
        sk = _source_key(key)
        if sk is not None and sk[0] not in listed and sk[1] != "share":
            out[key] = value
    return out


def mixture_changes(saved: dict, current: dict) -> tuple[set, list[str]]:
    """data.mixture_change=continue: (the data fingerprint keys whose change is accepted, one
    line per accepted change for the log). Shares may change and sources may be added, dropped
    or listed again; any change that would break the exact continuation of a source's saved
    position (its files or text key, the tokenizer, seq_len, packing, shards, seed, ...)
    raises ValueError in one line naming the key. `current` has gone through
    carry_parked_sources."""
    if not saved:     # a checkpoint without a data fingerprint: the plain check reports it
        return set(), []
    was_mix, is_mix = "sources" in saved, "sources" in current
    if was_mix != is_mix:
        # A single stream shuffles with data.seed, a mixture's source with its own seed
        # (data/streams/mixture.py source_seed): the saved position means nothing to the other form.
        was = "a mixture (data.sources)" if was_mix else "one source (data.paths)"
        raise ValueError(f"data.mixture_change=continue: the checkpoint read {was}, this run does "
                         "not; a position cannot carry over between the two forms (set "
                         "checkpoint.allow_data_change=true to read the data afresh)")
    if not is_mix:
        return set(), []
    known = _known_sources(saved)
    accepted, changed = set(), []
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key, "<absent>"), current.get(key, "<absent>")
        if same_value(a, b):
            continue
        sk = _source_key(key)
        if key in _MIXTURE_FREE_KEYS or (sk is not None and (sk[1] == "share" or sk[0] not in known)):
            accepted.add(key)
            continue
        raise ValueError(
            f"data.mixture_change=continue cannot continue the saved positions exactly: data.{key} "
            f"changed (checkpoint={a!r} now={b!r}); only shares and the list of data.sources may "
            "change (a source read differently needs a new name), or set "
            "checkpoint.allow_data_change=true to read all data afresh")
    before, now = saved["sources"], current["sources"]
    parked = known - set(before)
    for name in now:
        if name in parked:
            changed.append(f"source {name} listed again: continues where it stopped")
        elif name not in known:
            changed.append(f"source {name} added: starts from its beginning")
    changed += [f"source {name} dropped: its position is kept" for name in before if name not in now]
    changed += [f"source {name} share {saved[f'source.{name}.share']:.4g} -> "
                f"{current[f'source.{name}.share']:.4g}"
                for name in now if f"source.{name}.share" in accepted and name in before]
    return accepted, changed


def same_value(a, b) -> bool:
    """Equal once JSON round tripped (a saved tuple comes back as a list)."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def sum_counters(shard_states: dict) -> dict:
    tot = {k: 0 for k in COUNTER_KEYS}
    bad: dict = {}
    ex: list = []
    for _, st in sorted(shard_states.items(), key=lambda kv: int(kv[0])):
        c = st["c"]
        for k in COUNTER_KEYS:
            tot[k] += int(c.get(k, 0))
        for k, v in c["bad"].items():
            bad[k] = bad.get(k, 0) + int(v)
        ex.extend(c["badex"])
    tot["bad"] = bad
    tot["badex"] = ex
    return tot

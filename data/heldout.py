"""The held-out set: which files are held out (`data.eval.paths`, or the last
`data.eval.holdout_files` training files), the reader settings for them, and the fixed
evaluation batches kept on device.

Plain functions of the config and the run's listing (data/listing.py run_listing), so that
scripts/show_step.py makes the very split training made.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from data.config import DataConfig
from data.listing import all_files


def eval_settings(eval_map: dict) -> tuple[list, int]:
    """(data.eval.paths, data.eval.holdout_files), checked without touching the files (and the
    other data.eval settings: eval_options)."""
    unknown = set(eval_map) - {"paths", "holdout_files", "min_doc_tokens", "position_buckets"}
    if unknown:
        raise ValueError(f"unknown setting(s): {', '.join(sorted('data.eval.' + k for k in unknown))}")
    eval_options(eval_map)
    paths = eval_map.get("paths")
    # One glob or a list of globs (data.eval.paths='/mnt/rp/held_out/*.json.gz' works).
    eval_paths = [paths] if isinstance(paths, str) else list(paths or [])
    holdout = int(eval_map.get("holdout_files") or 0)
    if eval_paths and holdout:
        raise ValueError("set data.eval.paths or data.eval.holdout_files, not both")
    return eval_paths, holdout


def eval_options(eval_map: dict | None) -> tuple[int, int]:
    """(data.eval.min_doc_tokens, data.eval.position_buckets), checked: the held-out documents'
    length bucket (data/streams/buckets.py; 0: all documents) and the number of position buckets
    the held-out loss is also reported in (model/evals/evaluate.py position_losses; 0: none)."""
    eval_map = eval_map or {}
    out = []
    for key in ("min_doc_tokens", "position_buckets"):
        v = eval_map.get(key) or 0
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"data.eval.{key}={v!r}: must be an integer >= 0 (0: off)")
        out.append(v)
    return out[0], out[1]


def data_settings(data_map: dict, tokenizer: str) -> tuple[DataConfig, list, int]:
    """A run's resolved `data` section -> (the training DataConfig, data.eval.paths,
    data.eval.holdout_files), checked without touching the files: where train.py and
    data/torch.py both start. data.paths may be one glob or a list: DataConfig takes either."""
    data_map = dict(data_map)
    eval_map = data_map.pop("eval", None) or {}
    data_cfg = DataConfig.from_mapping({**data_map, "tokenizer": tokenizer})
    eval_paths, holdout = eval_settings(eval_map)
    if holdout and data_cfg.sources:
        raise ValueError("data.eval.holdout_files works with data.paths only: with data.sources, "
                         "hold out files through data.eval.paths (read with data.text_key)")
    return data_cfg, eval_paths, holdout


def split_eval(data_cfg: DataConfig, listing: dict, holdout: int, min_doc_tokens: int = 0):
    """(training config, held-out config or None, training files, held-out files). The held-out
    set is `data.eval.paths` (must not overlap training files), or the last
    `data.eval.holdout_files` files of the training list, removed from training. With
    data.sources the held-out files come from data.eval.paths only, read with data.text_key.
    Held-out documents are bucketed by `min_doc_tokens` (data.eval.min_doc_tokens) only, never by
    the training data's bucket."""
    train_files, eval_files = listing["train"], listing["eval"]
    if eval_files:
        overlap = sorted(set(eval_files) & set(all_files(train_files)))
        if overlap:
            raise ValueError(f"data.eval.paths overlaps the training files (e.g. {overlap[0]}); "
                             "held-out data must not be trained on")
    elif holdout:
        if holdout >= len(train_files):
            raise ValueError(f"data.eval.holdout_files={holdout} leaves no training file "
                             f"(data.paths matches {len(train_files)})")
        eval_files, train_files = train_files[-holdout:], train_files[:-holdout]
    else:
        return data_cfg, None, train_files, []
    eval_cfg = dataclasses.replace(data_cfg, sources=(), num_workers=0,
                                   num_shards=_eval_shards(data_cfg.global_batch_size, len(eval_files)),
                                   shuffle_window=0, files_per_stream=1,
                                   min_doc_tokens=min_doc_tokens, max_doc_tokens=0)
    return data_cfg, eval_cfg, train_files, eval_files


def _eval_shards(batch: int, n_files: int) -> int:
    """Virtual shards must divide the batch (fixed batch layout) and not outnumber the files; the
    largest such count spreads the fixed eval batches over the most held-out files."""
    return max(v for v in range(1, min(n_files, batch) + 1) if batch % v == 0)


def valid_eval_files(eval_cfg: DataConfig, files: list[str], *, announce: bool):
    """(held-out config, files) over those held-out files that hold a valid document, or
    (None, []) when none does. Evaluation is a view on a lenient run, not its purpose: an empty,
    truncated or corrupt held-out file is named in one line and left out, never fatal
    (data.strict=true: the first bad record raises with file:line). Reads each held-out file up to
    its first valid document, the same on every host, so all hosts agree."""
    from data.readers.sources import no_document_reason

    reasons = [no_document_reason(f, eval_cfg.text_key, eval_cfg.strict) for f in files]
    good = [f for f, why in zip(files, reasons, strict=True) if why is None]
    bad = [why for why in reasons if why is not None]
    if bad and announce:
        shown = "; ".join(bad[:3]) + (f"; and {len(bad) - 3} more" if len(bad) > 3 else "")
        outcome = "training without evaluation" if not good else f"evaluating on the other {len(good)}"
        print(f"data.eval: {len(bad)} of {len(files)} held-out file(s) hold no valid document ({shown}): "
              f"{outcome}", flush=True)
    if not good:
        return None, []
    if not bad:
        return eval_cfg, files
    return dataclasses.replace(eval_cfg, num_shards=_eval_shards(eval_cfg.global_batch_size, len(good))), good


class HeldOutSet:
    """A fixed set of held-out batches, built once and kept on device, so every evaluation sees
    the same tokens. Every host reads the same eval rows and keeps its slice of each batch: the
    held-out set may be a single file, fewer than the hosts. `eval_step(params, batch)` returns
    {"loss_sum", "n_tokens", "loss_by_pos", "tokens_by_pos"} (model/step.py)."""

    def __init__(self, eval_cfg: DataConfig, files: list[str], n_batches: int, sharding,
                 eval_step: Callable, tokenizer):
        import jax

        from data.pipeline import make_host_iterator

        local = eval_cfg.global_batch_size // jax.process_count()
        lo = jax.process_index() * local
        it = make_host_iterator(eval_cfg, 0, 1, files=files, tokenizer=tokenizer)
        self.batches = []
        for _ in range(n_batches):
            rows = next(it)
            self.batches.append({k: jax.make_array_from_process_local_data(sharding, v[lo:lo + local])
                                 for k, v in rows.items()})
        if hasattr(it, "close"):
            it.close()
        self.eval_step = eval_step

    def sums(self, params) -> dict:
        """The eval step's sums over all held-out batches, on the host: loss_sum and n_tokens
        (scalars), loss_by_pos and tokens_by_pos ([seq_len]: by the token's position in its
        document within the row)."""
        import jax

        sums = jax.device_get([self.eval_step(params, b) for b in self.batches])
        return {k: sum(s[k] for s in sums) for k in sums[0]}

    def loss(self, params) -> float:
        s = self.sums(params)
        return float(s["loss_sum"] / max(1, s["n_tokens"]))

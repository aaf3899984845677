"""Input pipeline: sharded text -> tokens -> packed rows -> global jax.Arrays.

One file per concept, imported in this order (no circle; tests/test_imports.py keeps it so):
  timing, permutation, packing, objstore (URLs through fsspec), gzseek, sources (readers),
  tokenizer, listing (what a run reads),
  shard (one virtual shard's text stream and state), records (the same from a directory
  converted by scripts/prepare_data.py), mixture (weighted mixtures, given built sources),
  autoworkers (data.num_workers=auto), config (DataConfig and its checks), host (the fixed
  batch layout, a host's iterator; builds the streams), workers (input worker processes), state
  (fingerprint, merging host states), pipeline (the host iterator and the device prefetcher);
  and the data decisions a run makes: heldout (the held-out split and batches), resume (resuming
  on changed data), batch_log (the per-step batch hashes training and show_step share).

The names below load their module on first use, so that `from data.config import DataConfig`
(config checks) starts neither Grain nor JAX.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "data.autoworkers": ["AutoWorkers", "is_auto"],
    "data.batch_log": ["BatchLog"],
    "data.config": ["DataConfig", "SourceConfig", "check_files", "check_shards", "list_files", "validate",
                    "validate_settings"],
    "data.heldout": ["HeldOutSet", "eval_settings", "split_eval", "valid_eval_files"],
    "data.host": ["find_shard_states"],
    "data.listing": ["Listing", "all_files", "list_paths", "run_listing"],
    "data.pipeline": ["DevicePrefetcher", "make_host_dataset", "make_host_iterator", "restore_host_iterator"],
    "data.resume": ["ResumePlan", "plan_resume"],
    "data.sources": ["BadDataError", "NoValidDocumentError", "no_document_reason"],
    "data.state": ["carry_parked_sources", "fingerprint", "merge_host_states", "mixture_changes"],
    "data.tokenizer": ["load_tokenizer"],
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'data' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value      # later lookups skip this function
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))

"""Input pipeline: sharded text -> tokens -> packed rows -> global jax.Arrays.

Two bands, then the pipeline's assembly at the top (no circle, each band imports only the ones
below it; tests/test_imports.py keeps it so):
  readers/     files -> documents: object stores, gzip seek points, one reader per format
  streams/     documents -> one virtual shard's packed rows and its state; mixtures of them
  convert/     the conversion (scripts/prepare_data.py): input files -> ArrayRecord parts, in this
               process or on Apache Beam (convert/beam.py imports Beam; nothing else imports it)
  timing, tokenizer        leaves every band may use: stage clocks, the tokenizer and its pool
  listing      what a run reads: paths, globs, URLs and folders -> one listing per run
  config       DataConfig and its checks (loads neither Grain nor JAX)
  autoworkers  data.num_workers=auto
  host         the fixed batch layout and a host's iterator over its virtual shards
  workers      input worker processes
  state        fingerprint and merging host states
  pipeline     the host iterator and the device prefetcher
  carried      the next batch a checkpoint carries, handed out first on restore
  feed         the run's input started in one call (train.py), with auto's worker switch
  heldout, resume, batch_log   the run's data decisions: the held-out split, resuming on changed
               data, the per-step batch hashes training and show_step share
  torch        Batches: the host iterator for a PyTorch loop (a rank in the role of a process);
               not exported below, as it imports torch

The names below load their module on first use, so that `from data.config import DataConfig`
(config checks) starts neither Grain nor JAX.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "data.autoworkers": ["AutoWorkers", "is_auto"],
    "data.batch_log": ["BatchLog"],
    "data.config": ["DataConfig", "SourceConfig", "check_files", "check_shards", "check_tokenizer", "list_files",
                    "validate",
                    "validate_settings"],
    "data.feed": ["Feed"],
    "data.heldout": ["HeldOutSet", "data_settings", "eval_settings", "split_eval", "valid_eval_files"],
    "data.host": ["find_shard_states"],
    "data.listing": ["Listing", "all_files", "list_paths", "run_listing"],
    "data.pipeline": ["DevicePrefetcher", "make_host_dataset", "make_host_iterator", "restore_host_iterator"],
    "data.resume": ["ResumePlan", "continue_at_length", "mark_length", "plan_resume"],
    "data.readers.sources": ["BadDataError", "NoValidDocumentError", "no_document_reason"],
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

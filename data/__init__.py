"""Input pipeline: sharded JSON-lines text -> tokens -> packed rows -> global jax.Arrays.

See data/shard.py (one virtual shard's stream and state), data/records.py (the same from a
directory converted by scripts/prepare_data.py), data/mixture.py (weighted mixtures of
sources), data/host.py (the fixed batch layout, a host's iterator) and data/workers.py (input
worker processes).
"""
from data.autoworkers import is_auto
from data.config import (
                         DataConfig,
                         SourceConfig,
                         all_files,
                         check_files,
                         check_shards,
                         list_files,
                         validate,
                         validate_settings,
)
from data.host import find_shard_states
from data.listing import Listing, list_paths
from data.pipeline import DevicePrefetcher, make_host_dataset, make_host_iterator, restore_host_iterator
from data.sources import BadDataError, NoValidDocumentError, no_document_reason
from data.state import carry_parked_sources, fingerprint, merge_host_states, mixture_changes
from data.tokenizer import load_tokenizer

__all__ = ["DataConfig", "SourceConfig", "all_files", "check_files", "check_shards", "DevicePrefetcher",
           "BadDataError", "NoValidDocumentError", "carry_parked_sources", "find_shard_states",
           "fingerprint", "is_auto", "list_files", "list_paths", "Listing",
           "load_tokenizer", "make_host_dataset", "make_host_iterator", "merge_host_states",
           "mixture_changes", "no_document_reason", "restore_host_iterator", "validate", "validate_settings"]

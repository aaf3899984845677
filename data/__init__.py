"""Input pipeline: sharded JSON-lines text -> tokens -> packed rows -> global jax.Arrays.

See data/shard.py (one virtual shard's stream and state), data/records.py (the same from a
directory converted by scripts/prepare_data.py), data/host.py (the fixed batch layout, a
host's iterator) and data/workers.py (input worker processes).
"""
from data.config import DataConfig, list_files, validate
from data.pipeline import (DevicePrefetcher, make_host_dataset, make_host_iterator,
                           restore_host_iterator)
from data.sources import BadDataError
from data.state import fingerprint, merge_host_states
from data.tokenizer import load_tokenizer

__all__ = ["DataConfig", "DevicePrefetcher", "BadDataError", "fingerprint", "list_files",
           "load_tokenizer", "make_host_dataset", "make_host_iterator", "merge_host_states",
           "restore_host_iterator", "validate"]

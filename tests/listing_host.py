"""One host of tests/test_data_listing.py's two-host test: `python listing_host.py ID PORT CORPUS`.

Joins a real 2-process jax.distributed job, counts (Python audit hooks) every directory read
and open that names the corpus, runs the run's listing (data/listing.py run_listing, as
train.py calls it) for a good and for a bad pattern, and
prints one JSON line.
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

process_id, port, corpus = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
touched = []


def _audit(event, args):
    if event in ("os.scandir", "os.listdir", "open", "glob.glob") and args and str(args[0]).startswith(corpus):
        touched.append([event, str(args[0])])


sys.addaudithook(_audit)

import jax  # noqa: E402

jax.config.update("jax_platforms", "cpu")
jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=2, process_id=process_id)

import data as data_lib  # noqa: E402
from model.runtime.distributed import from_process_0  # noqa: E402

cfg = data_lib.DataConfig(paths=(f"{corpus}/*/en_head.json.gz",), tokenizer="unused", seq_len=8,
                          global_batch_size=4)
listing = data_lib.run_listing(cfg.patterns(), [], None, from_process_0=from_process_0)
try:
    data_lib.run_listing(cfg.patterns(), [f"{corpus}/nothing/*.json.gz"], None, from_process_0=from_process_0)
    error = None
except ValueError as e:
    error = str(e)
print(json.dumps({"files": listing["train"], "touched": touched, "error": error}), flush=True)

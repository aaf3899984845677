"""One process of tests/test_tasks_multihost.py: `python tasks_host.py ID N PORT OUT`.

Joins an N-process jax.distributed job (4 fake CPU devices each; N=1: one process of 8), builds
the FSDP mesh over every process's devices, scores the bundled sample tasks with TaskEvaluator
and (process 0) writes the metrics and per-request log-likelihoods as JSON to OUT.
"""
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
process_id, n_proc, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
devices = f"--xla_force_host_platform_device_count={8 // n_proc}"
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {devices}".strip()   # the suite's compile level kept

import jax  # noqa: E402

jax.config.update("jax_platforms", "cpu")
if n_proc > 1:
    jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=n_proc, process_id=process_id)

import numpy as np  # noqa: E402
import yaml  # noqa: E402
from flax import nnx  # noqa: E402

from data.tokenizer import load_tokenizer  # noqa: E402
from model import sharding as shd  # noqa: E402
from model.evals.evaluate import TaskEvaluator, TasksConfig  # noqa: E402
from model.llama import Llama, LlamaConfig  # noqa: E402
from model.step import param_shardings  # noqa: E402

CFG = LlamaConfig(vocab_size=4096, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=64,
                  dtype="float32", remat="none")
mesh_cfg = yaml.safe_load((ROOT / "configs" / "mesh" / "fsdp.yaml").read_text())
mesh, rules = shd.make_mesh(mesh_cfg), shd.rules_from_cfg(mesh_cfg)
shardings = param_shardings(CFG, mesh, rules)
with jax.default_device(jax.local_devices()[0]):   # the same numbers in every process, then sharded
    host = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(Llama(CFG, rngs=nnx.Rngs(5)), nnx.Param)))
params = jax.tree.map(lambda x, s: jax.make_array_from_callback(x.shape, s, lambda i, x=x: x[i]), host, shardings)
tasks = TasksConfig.from_mapping({"tasks": [
    {"name": "mc", "path": str(ROOT / "data" / "sample_tasks" / "definitions_mc.jsonl")},
    {"name": "lam", "path": str(ROOT / "data" / "sample_tasks" / "definitions_lambada.jsonl"), "format": "lambada"}]})
ev = TaskEvaluator(tasks, load_tokenizer(str(ROOT / "data" / "sample" / "tokenizer.json")), model_cfg=CFG, mesh=mesh,
                   rules=rules, param_shardings=shardings, seq_len=64, batch_rows=8)
metrics = ev.evaluate(params)
ll, greedy = ev.scorer.score_packed(params, ev.packed)
if process_id == 0:
    Path(out).write_text(json.dumps({"metrics": metrics, "ll": ll.tolist(), "greedy": greedy.tolist(),
                                     "devices": len(jax.devices()), "processes": jax.process_count()}))

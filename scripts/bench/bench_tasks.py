#!/usr/bin/env python3
"""Downstream-task scoring speed: the in-loop scorer (model/evals/evaluate.py) vs the lm_eval adapter
"jaxpt" (model/evals/harness.py) vs the harness's HF backend on the exported model, same examples, same
weights (fp32), one process on this machine's devices; and the in-loop share of training time.

    python scripts/bench/bench_tasks.py                       # configs/model/tiny.yaml, 256 tokens
    python scripts/bench/bench_tasks.py --repeat 16 --every 100,1000

The task is the bundled data/sample_tasks/definitions_mc.jsonl repeated --repeat times (4
choices per example). The share is t_eval / (every * t_step + t_eval) with t_step one training
step of the tiny sample run (global batch 16 x 256) timed in the same process. The adapter and
HF figures need the [eval] and [hf] extras (and torch); they are skipped without them.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
import yaml

from train import PROJECT_ROOT as ROOT  # the project is installed editable

sys.path.insert(0, str(ROOT))
from data.tokenizer import load_tokenizer  # noqa: E402
from model.evals.evaluate import TaskEvaluator, TasksConfig  # noqa: E402
from model.evals.tasks import pack_requests  # noqa: E402
from model.llama import LlamaConfig  # noqa: E402
from model.step import build_program  # noqa: E402

TOKENIZER = str(ROOT / "data" / "sample" / "tokenizer.json")


def timed(fn, n=3):
    fn()  # compile / warm
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def main() -> None:
    from model.runtime.distributed import quiet_cpu_start

    quiet_cpu_start()   # no libtpu warnings on a machine without a TPU (JAX_PLATFORMS, if set, wins)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=8)
    ap.add_argument("--every", default="100,1000")
    args = ap.parse_args()
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model_map = yaml.safe_load((ROOT / "configs" / "model" / "tiny.yaml").read_text())
    cfg = LlamaConfig.from_mapping(model_map)
    seq = cfg.max_seq_len
    tmp = Path(tempfile.mkdtemp(prefix="bench_tasks_"))
    lines = (ROOT / "data" / "sample_tasks" / "definitions_mc.jsonl").read_text().splitlines() * args.repeat
    task_file = tmp / "mc.jsonl"
    task_file.write_text("\n".join(lines) + "\n")
    n_ex = len(lines)

    # ---- in loop: the run's Program (mesh, shardings) and its train step, as train.py builds them
    import optax

    mesh_cfg = yaml.safe_load((ROOT / "configs" / "mesh" / "default.yaml").read_text())
    tx = optax.adamw(1e-3)
    prog = build_program(cfg, tx, mesh_cfg, global_batch=16, z_loss=0.0, microbatches=1)
    from model.step import init_train_state

    state, _ = init_train_state(cfg, tx, prog.mesh, prog.rules, seed=0)
    ev = TaskEvaluator(TasksConfig.from_mapping({"tasks": [{"name": "mc", "path": str(task_file)}]}),
                       load_tokenizer(TOKENIZER), model_cfg=cfg, mesh=prog.mesh, rules=prog.rules,
                       param_shardings=prog.state_shardings["params"], seq_len=seq, batch_rows=16)
    t_eval = timed(lambda: ev.evaluate(state["params"]))
    rng = np.random.default_rng(0)
    tok = rng.integers(1, cfg.vocab_size, (16, seq + 1)).astype(np.int32)
    batch = {"inputs": tok[:, :-1], "targets": tok[:, 1:], "segment_ids": np.ones((16, seq), np.int32),
             "positions": np.broadcast_to(np.arange(seq, dtype=np.int32), (16, seq)).copy(),
             "loss_mask": np.ones((16, seq), np.int32)}
    batch = {k: jax.device_put(v, prog.batch_sharding) for k, v in batch.items()}
    holder = {"s": state}

    def train_step():
        holder["s"], m = prog.train_step(holder["s"], batch)
        jax.block_until_ready(m)

    t_step = timed(train_step, n=5)
    rows = ev.packed.inputs.shape[0]
    print(f"in-loop: {n_ex} examples ({len(ev.requests)} requests) in {rows} rows of {seq}: {t_eval:.3f} s "
          f"= {n_ex / t_eval:.1f} examples/s; train step {t_step * 1e3:.1f} ms")
    # The same requests with every context packed once per choice (no shared prefixes).
    alone = pack_requests(ev.requests, seq, rows_multiple=16, share_contexts=False)
    t_alone = timed(lambda: ev.scorer.score_packed(holder["s"]["params"], alone))
    print(f"  without shared contexts: {alone.inputs.shape[0]} rows, {t_alone:.3f} s = {n_ex / t_alone:.1f} "
          f"examples/s; shared / alone speed {t_alone / t_eval:.2f}x")
    for every in (int(x) for x in args.every.split(",")):
        print(f"  share of training time at eval.tasks_every={every}: {t_eval / (every * t_step + t_eval):.4f}")
    results = {"in_loop": n_ex / t_eval}

    # ---- the harness: adapter and HF backend on a checkpoint of the same model
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager

        import model.evals.harness  # noqa: F401
    except ImportError as e:
        print(f"harness figures skipped: {e}")
        return
    import importlib.util

    from model.runtime import checkpoint as ckpt_lib

    params = jax.device_get(holder["s"]["params"])   # state was donated to the train step
    meta = {"config": {"model": dataclasses.asdict(cfg), "tokenizer": {"path": TOKENIZER}, "data": {"add_bos": False}}}
    ckpt = ckpt_lib.save_params(tmp / "ckpt", params, meta)
    spec = importlib.util.spec_from_file_location("export_hf", ROOT / "scripts" / "export_hf.py")
    export_hf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(export_hf)
    export_hf.export(ckpt, str(tmp / "hf"), dtype="float32")   # the same fp32 weights as ours
    (tmp / "tasks").mkdir()
    (tmp / "tasks" / "bench_mc.yaml").write_text(
        f"task: bench_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {task_file}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: \"{{context}}\"\n"
        "doc_to_choice: \"{{choices}}\"\ndoc_to_target: \"{{gold}}\"\nmetric_list:\n  - metric: acc\n")
    tm = TaskManager(include_path=str(tmp / "tasks"))
    models = {"adapter (jaxpt)": lambda: model.evals.harness.JaxptLM(run_dir=ckpt, batch_rows=16),
              "HF backend (HFLM, torch CPU)": lambda: HFLM(pretrained=str(tmp / "hf"), device="cpu",
                                                           dtype="float32", batch_size=16)}
    for name, make in models.items():
        lm = make()
        lm_eval.simple_evaluate(model=lm, tasks=["bench_mc"], task_manager=tm, limit=16, bootstrap_iters=0)  # warm
        t0 = time.perf_counter()
        out = lm_eval.simple_evaluate(model=lm, tasks=["bench_mc"], task_manager=tm, bootstrap_iters=0)
        dt = time.perf_counter() - t0
        results[name] = n_ex / dt
        print(f"{name}: {n_ex} examples in {dt:.3f} s = {n_ex / dt:.1f} examples/s "
              f"(acc {out['results']['bench_mc']['acc,none']:.4f}; includes the harness's own request building)")
    print(json.dumps(results))


if __name__ == "__main__":
    main()

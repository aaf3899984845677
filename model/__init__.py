"""The network and its compiled program, with the run's machinery and evaluation in rooms of their own:
  llama       the Llama-style network (NNX): config, attention, scanned layers
  sharding    logical axis names -> mesh axes
  step        the mesh, shardings, abstract state and jitted train/eval steps (Program)
  optimizer   AdamW and the lr schedule
  flops       FLOPs per token and device peaks (MFU)
  hf          Hugging Face Llama configs and weights, in and out
  runtime/    the run's machinery: hosts, checkpoints, resume, rollback, watchdog, goodput, meters
  evals/      downstream tasks, the in-loop evaluators and the lm-evaluation-harness model

Names load their module on first use, so a command can set JAX's platform
(model/runtime/distributed.py quiet_cpu_start) before anything imports JAX.
"""
from __future__ import annotations

import importlib

__all__ = ["Llama", "LlamaConfig"]


def __getattr__(name: str):
    if name not in __all__:
        raise AttributeError(f"module 'model' has no attribute {name!r}")
    value = getattr(importlib.import_module("model.llama"), name)
    globals()[name] = value
    return value

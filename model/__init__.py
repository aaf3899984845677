"""Llama model, sharding rules, train step and FLOP accounting (model/llama.py), and the run's
runtime: distributed.py (hosts), meters.py (what the loop measures), checkpoint.py.

Names load their module on first use, so a command can set JAX's platform (model/distributed.py
quiet_cpu_start) before anything imports JAX.
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

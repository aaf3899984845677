"""Llama model, sharding rules, train step and FLOP accounting. See model/llama.py."""
from model.llama import Llama, LlamaConfig

__all__ = ["Llama", "LlamaConfig"]

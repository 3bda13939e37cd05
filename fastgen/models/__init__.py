"""Decoder-only model families (Llama, Qwen2, Qwen3) and their weight loading."""

from fastgen.models.llama import DecoderForCausalLM
from fastgen.models.loader import load_weights

__all__ = ["DecoderForCausalLM", "load_weights"]

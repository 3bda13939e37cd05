"""Which model class serves each Hugging Face architecture, and the switches it reads.

A family joins by adding its architectures here: nothing else in the engine branches on the
model. The class is imported only when a model of that architecture is built.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Architecture:
    """module / class_name: where the model class lives. attention_bias: the q/k/v projections
    carry a bias (Qwen2). qk_norm: q and k are RMS-normalised per head before RoPE (Qwen3)."""

    module: str
    class_name: str
    attention_bias: bool = False
    qk_norm: bool = False


_LLAMA_FAMILY = "fastgen.models.llama_family"

ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture(_LLAMA_FAMILY, "LlamaFamilyForCausalLM"),
    "MistralForCausalLM": Architecture(_LLAMA_FAMILY, "LlamaFamilyForCausalLM"),
    "Qwen2ForCausalLM": Architecture(_LLAMA_FAMILY, "LlamaFamilyForCausalLM", attention_bias=True),
    "Qwen3ForCausalLM": Architecture(_LLAMA_FAMILY, "LlamaFamilyForCausalLM", qk_norm=True),
}


def model_class(architecture: str) -> type:
    entry = ARCHITECTURES[architecture]
    return getattr(importlib.import_module(entry.module), entry.class_name)

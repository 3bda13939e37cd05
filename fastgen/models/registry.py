"""Which model class and which config class serve each Hugging Face architecture.

A family joins by adding its architectures here: nothing else in the engine branches on the
model. Both classes are named by import path and imported when first needed: the config class
when a config.json is read (its module must not import torch), the model class when a model of
that architecture is built.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class Architecture:
    """model / config: "module:Class" of the model (an nn.Module) and of its
    `fastgen.models.config.ModelConfig` subclass. switches: keyword arguments the config class's
    `from_hf` receives, so architectures that share one class differ only in data here."""

    model: str
    config: str
    switches: dict[str, object] = field(default_factory=dict)


_LLAMA_FAMILY = Architecture("fastgen.models.llama_family:LlamaFamilyForCausalLM",
                             "fastgen.models.llama_family_config:LlamaFamilyConfig")

ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": _LLAMA_FAMILY,
    "MistralForCausalLM": replace(_LLAMA_FAMILY, switches={"bias": "none"}),
    "Qwen2ForCausalLM": replace(_LLAMA_FAMILY, switches={"bias": "qkv"}),
    "Qwen3ForCausalLM": replace(_LLAMA_FAMILY, switches={"qk_norm": True, "head_dim": 128}),
    "GPT2LMHeadModel": Architecture("fastgen.models.gpt2:GPT2LMHeadModel",
                                    "fastgen.models.gpt2_config:GPT2ModelConfig"),
}


def _resolve(path: str) -> type:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def model_class(architecture: str) -> type:
    return _resolve(ARCHITECTURES[architecture].model)


def config_class(architecture: str) -> type:
    return _resolve(ARCHITECTURES[architecture].config)

"""Loads a Hugging Face checkpoint's safetensors into fastgen's merged-projection modules."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from fastgen.layers.linear import MergedLinear

# checkpoint module name -> (fastgen merged module name, shard index)
_MERGED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def checkpoint_files(folder: str | Path) -> list[Path]:
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise ValueError(f"model={str(folder)!r} has no *.safetensors weight files")
    return files


def load_weights(model: nn.Module, folder: str | Path) -> None:
    """Copy every checkpoint tensor into `model`, cast to the model's dtype.

    Raises ValueError naming what is missing when the checkpoint does not cover the model, or
    when a tensor's shape disagrees with the config.
    """
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    loaded: set[str] = set()
    for path in checkpoint_files(folder):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                loaded.update(_load_one(params, modules, name, f.get_tensor(name)))
    expected = {n for n in params if not (n == "lm_head.weight" and model.config.tie_word_embeddings)}
    for name, module in modules.items():
        if isinstance(module, MergedLinear):
            for suffix in ("weight", "bias"):
                if f"{name}.{suffix}" in expected:
                    expected.remove(f"{name}.{suffix}")
                    expected.update(f"{name}.{suffix}#{i}" for i in range(len(module.shard_sizes)))
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"model={str(folder)!r}: checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")


def _load_one(params, modules, name: str, tensor: torch.Tensor) -> list[str]:
    """Load one checkpoint tensor; return the keys it filled (none for ignored tensors)."""
    if not name.startswith("lm_head."):
        name = name.removeprefix("model.")
    if "rotary_emb" in name:
        return []
    module_path, _, suffix = name.rpartition(".")
    parent, _, leaf = module_path.rpartition(".")
    if leaf in _MERGED:
        merged_name, shard = _MERGED[leaf]
        merged_path = f"{parent}.{merged_name}"
        module = modules[merged_path]
        target = params[f"{merged_path}.{suffix}"].narrow(
            0, module.shard_offset(shard), module.shard_sizes[shard]
        )
        key = f"{merged_path}.{suffix}#{shard}"
    elif name in params:
        target, key = params[name], name
    else:
        return []  # e.g. an lm_head stored beside tied embeddings
    if target.shape != tensor.shape:
        raise ValueError(f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, model expects {tuple(target.shape)}")
    with torch.no_grad():
        target.copy_(tensor)
    return [key]

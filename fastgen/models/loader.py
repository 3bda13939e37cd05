"""Loads a Hugging Face checkpoint's safetensors into a fastgen model.

Each model class says how its family's checkpoints are laid out in a `CheckpointFormat`
(class attribute `checkpoint_format`); the loader itself knows no family. Tensors are opened as
lazy slices: a module with `load_checkpoint_tensor` (the tensor-parallel layers) narrows one to
its shard before reading, so a rank reads only what it holds; other parameters are read whole.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path

from safetensors import safe_open
from torch import nn
from tqdm.auto import tqdm

from fastgen.layers.parallel_linear import ColumnParallelLinear, check_shape, copy_into
from fastgen.models.checkpoint_index import checkpoint_files, read_header
from fastgen.models.checkpoint_tensor import CheckpointTensor
from fastgen.models.config import HEAD_TENSOR


@dataclass(frozen=True)
class CheckpointFormat:
    """How a family's checkpoint tensor names and layouts map onto its fastgen module.

    prefix: stripped from the names that carry it (the base model's name: checkpoints are saved
        with and without it, e.g. "transformer.h.0..." and "h.0..." for GPT-2).
    merged: checkpoint module name -> (fastgen `ColumnParallelLinear` name, projection index),
        for projections that fastgen stacks into one matmul.
    transposed: module names whose weight is stored [in, out] (GPT-2's Conv1D), transposed into
        nn.Linear's [out, in] on load.
    ignored: patterns (fnmatch, on names without the prefix) of tensors that hold no weight
        (RoPE's inv_freq, GPT-2's causal-mask buffers). They are skipped, as is an lm_head saved
        beside embeddings it is tied to (`ModelConfig.head_as_stored` unties a different one);
        any other tensor that matches no parameter is refused: dropping it would run another
        model than the checkpoint's (a bias the config turns on that fastgen's layer lacks).
    """

    prefix: str = ""
    merged: Mapping[str, tuple[str, int]] = field(default_factory=dict)
    transposed: frozenset[str] = frozenset()
    ignored: tuple[str, ...] = ()


def load_weights(model: nn.Module, folder: str | Path) -> None:
    """Copy every checkpoint tensor into `model`, cast to the model's dtype.

    Raises ValueError naming what is missing when the checkpoint does not cover the model, or
    when a tensor's shape disagrees with the config.
    """
    fmt: CheckpointFormat = model.checkpoint_format
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    loaded: set[str] = set()
    tied_head_file = None  # the file holding an lm_head the model ties to its embeddings
    files = checkpoint_files(folder)
    # A bar on an interactive terminal for checkpoints of several files (tqdm's disable=None: off
    # when stderr is not a TTY); one small file loads too fast to need it.
    for path in tqdm(files, desc="loading weights", unit="file", disable=None if len(files) > 1 else True):
        read_header(path)  # a file that is not one (a git-lfs pointer, a cut download) is named
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                filled = _load_one(fmt, params, modules, name, f.get_slice(name))
                if filled is None:
                    raise ValueError(f"model={str(folder)!r}: checkpoint tensor {name!r} ({path.name}) matches no "
                                     f"parameter of {type(model).__name__} as config.json describes it")
                loaded.update(filled)
                if name.removeprefix(fmt.prefix) == HEAD_TENSOR and HEAD_TENSOR not in params:
                    tied_head_file = path
    if tied_head_file is not None:
        loaded.update(_embeddings_from_tied_head(model, params, modules, loaded, tied_head_file))
    expected = {n for n in params if not (n == HEAD_TENSOR and model.config.tie_word_embeddings)}
    for name, module in modules.items():
        if isinstance(module, ColumnParallelLinear) and module.merged:
            for suffix in ("weight", "bias"):
                if f"{name}.{suffix}" in expected:
                    expected.remove(f"{name}.{suffix}")
                    expected.update(f"{name}.{suffix}#{i}" for i in range(len(module.shards)))
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"model={str(folder)!r}: checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")


def _embeddings_from_tied_head(model: nn.Module, params, modules, loaded: set[str], path: Path) -> list[str]:
    """The embeddings' keys filled from a tied lm_head, where the checkpoint stores only the
    head: transformers then ties the other way round, and the model is the same. Where the
    embeddings were stored too they are not read again (`head_as_stored` found them equal)."""
    fmt: CheckpointFormat = model.checkpoint_format
    names = [n.removeprefix(fmt.prefix) for n in model.config.embedding_tensors]
    embedding = next((n for n in names if n in params), None)
    if embedding is None or embedding in loaded:
        return []
    with safe_open(str(path), framework="pt") as f:
        head = next(n for n in f.keys() if n.removeprefix(fmt.prefix) == HEAD_TENSOR)
        return _load_one(fmt, params, modules, embedding, f.get_slice(head)) or []


def _load_one(fmt: CheckpointFormat, params, modules, name: str, source) -> list[str] | None:
    """Load one checkpoint tensor (`source`: its lazy slice); return the keys it filled (none
    for skipped tensors), or None when it matches no parameter and is not to be skipped."""
    stripped = name.removeprefix(fmt.prefix)
    if any(fnmatchcase(stripped, pattern) for pattern in fmt.ignored):
        return []
    module_path, _, suffix = stripped.rpartition(".")
    parent, _, leaf = module_path.rpartition(".")
    tensor = CheckpointTensor(name, source, transposed=suffix == "weight" and leaf in fmt.transposed)
    index = None
    if leaf in fmt.merged:
        merged_name, index = fmt.merged[leaf]
        module_path = f"{parent}.{merged_name}"
    key = f"{module_path}.{suffix}"
    if key not in params:
        # An lm_head saved beside the embeddings it is tied to holds their values.
        return [] if key == HEAD_TENSOR else None
    module = modules[module_path]
    if hasattr(module, "load_checkpoint_tensor"):
        return [f"{module_path}.{filled}" for filled in module.load_checkpoint_tensor(suffix, tensor, index)]
    target = params[key]
    check_shape(tensor, tuple(target.shape))
    copy_into(target, tensor)
    return [key]

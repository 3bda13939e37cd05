"""Read a llama-architecture GGUF's tensors under Hugging Face Llama names and layout.

Two things differ between llama.cpp's files and HF checkpoints besides quantization: the names
(`blk.3.attn_q.weight` vs `model.layers.3.self_attn.q_proj.weight`) and the row order of the Q
and K projections, which llama.cpp's converter permutes per head so that its rotary embedding
can rotate adjacent pairs (x0, x1), (x2, x3) ... where HF rotates halves (x0, x_{d/2}) ...
"""

from __future__ import annotations

import os
import re

import numpy as np
import torch
from tqdm.auto import tqdm

# llama.cpp name -> HF Llama name, for tensors outside the layer stack.
GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",  # absent when the embeddings are tied
}

# llama.cpp per-layer suffix -> HF per-layer suffix.
LAYER_NAMES = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}

_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")


def hf_name(gguf_name: str) -> str:
    """HF Llama name of a llama.cpp tensor name; KeyError for a name Llama does not have."""
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    match = _LAYER_RE.fullmatch(gguf_name)
    if match is None or match.group(2) not in LAYER_NAMES:
        raise KeyError(f"no HF Llama name for GGUF tensor {gguf_name!r}")
    return f"model.layers.{match.group(1)}.{LAYER_NAMES[match.group(2)]}"


def unpermute_rows(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head Q/K row permutation of a (n_heads * head_dim, in) weight.

    llama.cpp stores, within each head, the rows of the first rotary half and of the second
    half interleaved (r0, r_{d/2}, r1, r_{d/2+1}, ...); HF keeps them as two contiguous halves.
    Returns a contiguous tensor of the same shape and dtype.
    """
    rows, cols = weight.shape
    half = rows // n_heads // 2
    if half * 2 * n_heads != rows:
        raise ValueError(f"{rows} rows do not split into {n_heads} heads of even size")
    return weight.reshape(n_heads, half, 2, cols).transpose(1, 2).reshape(rows, cols).contiguous()


def read_llama_gguf_tensors(gguf_path: str | os.PathLike, num_heads: int, num_kv_heads: int,
                            dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Dequantize every tensor of a llama GGUF into an HF Llama state dict of `dtype`.

    Shapes follow torch (out_features, in_features). q_proj and k_proj are un-permuted with
    `num_heads` and `num_kv_heads`. `lm_head.weight` is present only if the file has a separate
    output matrix. Raises KeyError for a tensor with no Llama counterpart.
    """
    import gguf  # imported here: only the one-time conversion needs it

    from fastgen.models.gguf_index import read_tensors

    heads_for = {"self_attn.q_proj.weight": num_heads, "self_attn.k_proj.weight": num_kv_heads}
    state = {}
    # A bar on an interactive terminal (tqdm's disable=None: off when stderr is not a TTY).
    for tensor in tqdm(read_tensors(gguf_path), desc="converting GGUF tensors", unit="tensor", disable=None):
        name = hf_name(tensor.name)
        # GGUF lists dims fastest-first (ne0 = columns), the reverse of torch's order.
        # dequantize() returns float32 rows already in numpy order; the reshape makes that
        # explicit for every type, and np.array copies off the read-only memory map.
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        shape = tuple(int(d) for d in reversed(tensor.shape))
        weight = torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape))
        suffix = name.split(".", 3)[-1] if name.startswith("model.layers.") else ""
        if suffix in heads_for:
            weight = unpermute_rows(weight, heads_for[suffix])
        state[name] = weight.to(dtype).contiguous()
    return state

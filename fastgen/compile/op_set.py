"""The set of small functions the model and the sampler call, compiled or eager."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from fastgen.compile import ops
from fastgen.compile.sampling_ops import apply_penalties, pick_tokens, sample_tokens, scale_logits


@dataclass(frozen=True)
class OpSet:
    """The element-wise pieces of a decoder step (RMSNorm, RoPE and SwiGLU for the Llama family;
    LayerNorm and GELU for GPT-2) and the sampler's arithmetic (penalties, then sampling). With `compiled`,
    each is a torch.compile'd function (Inductor fuses its element-wise work into few kernels;
    the sampler's top-k/top-p filter stays eager, see `sample_tokens`); otherwise the plain eager
    functions."""

    rms_norm: Callable
    add_rms_norm: Callable
    apply_rope: Callable
    silu_and_mul: Callable
    layer_norm: Callable
    add_layer_norm: Callable
    gelu_tanh: Callable
    sample_tokens: Callable
    apply_penalties: Callable
    compiled: bool


# Every engine of a process compiles the same functions again for its dtype, device and norm
# epsilon, and dynamo keeps at most `recompile_limit` (8 by default) versions of one function:
# with fullgraph=True the ninth engine of a process failed to start (seen in the GPU test run).
RECOMPILE_LIMIT = 64


def _raise_recompile_limit() -> None:
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # torch < 2.6
    setattr(config, name, max(getattr(config, name), RECOMPILE_LIMIT))


def _compile(fn: Callable) -> Callable:
    # dynamic=True: one graph serves every batch size and sequence length, so a new shape after
    # warm-up does not trigger a recompile.
    return torch.compile(fn, dynamic=True, fullgraph=True)


def build_op_set(compiled: bool) -> OpSet:
    if compiled:
        _raise_recompile_limit()
    wrap = _compile if compiled else (lambda fn: fn)
    return OpSet(
        rms_norm=wrap(ops.rms_norm),
        add_rms_norm=wrap(ops.add_rms_norm),
        apply_rope=wrap(ops.apply_rope),
        silu_and_mul=wrap(ops.silu_and_mul),
        layer_norm=wrap(ops.layer_norm),
        add_layer_norm=wrap(ops.add_layer_norm),
        gelu_tanh=wrap(ops.gelu_tanh),
        sample_tokens=partial(sample_tokens, scale=wrap(scale_logits), pick=wrap(pick_tokens)),
        apply_penalties=wrap(apply_penalties),
        compiled=compiled,
    )

"""Builds the compiled (or eager) function set handed to the model and the sampler."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from fastgen.compile import ops
from fastgen.sampling import sample_tokens


@dataclass(frozen=True)
class FusedOps:
    rms_norm: Callable
    add_rms_norm: Callable
    apply_rope: Callable
    silu_and_mul: Callable
    sample_tokens: Callable
    compiled: bool


def _compile(fn: Callable) -> Callable:
    # dynamic=True: one graph serves every batch size and sequence length, so a new shape after
    # warm-up does not trigger a recompile.
    return torch.compile(fn, dynamic=True, fullgraph=True)


def build_ops(enabled: bool) -> FusedOps:
    wrap = _compile if enabled else (lambda fn: fn)
    return FusedOps(
        rms_norm=wrap(ops.rms_norm),
        add_rms_norm=wrap(ops.add_rms_norm),
        apply_rope=wrap(ops.apply_rope),
        silu_and_mul=wrap(ops.silu_and_mul),
        sample_tokens=wrap(sample_tokens),
        compiled=enabled,
    )

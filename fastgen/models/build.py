"""How a model is built before its weights load: in the engine's dtype, without random init."""

from __future__ import annotations

from contextlib import contextmanager

import torch


@contextmanager
def default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


# The initializers nn.Linear / nn.Embedding / nn.LayerNorm call when built.
_INITIALIZERS = ("kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_", "uniform_", "normal_",
                 "trunc_normal_", "ones_", "zeros_")


@contextmanager
def skip_weight_init(skip: bool):
    """Build modules without drawing random weights that the checkpoint overwrites anyway (most
    of a small model's build time). The loader refuses a checkpoint that misses a weight, so
    nothing left uninitialized is ever used."""
    if not skip:
        yield
        return
    saved = {name: getattr(torch.nn.init, name) for name in _INITIALIZERS}
    try:
        for name in _INITIALIZERS:
            setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)

"""One checkpoint tensor, read lazily: a layer narrows it to the rows or columns it holds before
anything is read, so a tensor-parallel rank reads its shard of a weight, never the whole."""

from __future__ import annotations

import math

import torch


class CheckpointTensor:
    """A window onto a stored tensor, in the model's orientation.

    source: a safetensors slice (`safe_open(...).get_slice(name)`) or a tensor; anything indexable
        by a tuple of slices. transposed: the 2-D tensor is stored [in, out] (GPT-2's Conv1D) and
        is seen here as nn.Linear's [out, in]. name: the checkpoint name, for error messages.
    `shape` is the window's shape; `narrow` makes a smaller window without reading; `read`
    materialises only the window.
    """

    def __init__(self, name: str, source, transposed: bool = False, window: tuple[tuple[int, int], ...] | None = None):
        self.name = name
        self._source = source
        self._transposed = transposed
        if window is None:
            stored = tuple(source.get_shape()) if hasattr(source, "get_shape") else tuple(source.shape)
            window = tuple((0, n) for n in (stored[::-1] if transposed else stored))
        self._window = window  # (start, length) per dim, model orientation

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(length for _, length in self._window)

    def narrow(self, dim: int, start: int, length: int) -> CheckpointTensor:
        """Rows [start, start + length) of dimension `dim` of this window (like Tensor.narrow)."""
        offset, size = self._window[dim]
        if start < 0 or length < 0 or start + length > size:
            raise ValueError(f"checkpoint tensor {self.name}: [{start}, {start + length}) of dim {dim} "
                             f"is outside its {size} entries")
        window = list(self._window)
        window[dim] = (offset + start, length)
        return CheckpointTensor(self.name, self._source, self._transposed, tuple(window))

    def read_numel(self) -> int:
        """Elements `read` materialises."""
        return math.prod(self.shape)

    def read(self) -> torch.Tensor:
        index = tuple(slice(start, start + length) for start, length in self._window)
        if self._transposed:
            return self._source[index[::-1]].t()
        return self._source[index]

"""CUDA graphs for decode: capture per padded batch size, replay over persistent buffers."""

from fastgen.graphs.batch_sizes import default_capture_sizes, padded_size
from fastgen.graphs.runner import CudaGraphRunner

__all__ = ["CudaGraphRunner", "default_capture_sizes", "padded_size"]

"""Decode as one unit per step: CUDA graphs (captured per padded batch size, replayed over
persistent buffers) and, on CPU, the decode step compiled whole."""

from fastgen.graphs.batch_sizes import default_capture_sizes, padded_size
from fastgen.graphs.runner import CudaGraphRunner

__all__ = ["CudaGraphRunner", "default_capture_sizes", "padded_size"]

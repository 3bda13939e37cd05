"""Decode CUDA graphs: captured per padded batch size, replayed over persistent buffers (the
CPU's compiled steps are `fastgen.cpu`)."""

from fastgen.graphs.batch_sizes import default_capture_sizes, padded_size
from fastgen.graphs.runner import CudaGraphRunner

__all__ = ["CudaGraphRunner", "default_capture_sizes", "padded_size"]

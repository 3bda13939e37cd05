"""Marker handling shared by the test suite and the benchmark suites (each its own rootdir)."""

from __future__ import annotations

import pytest
import torch


def skip_cuda_tests_without_gpu(items) -> None:
    """Mark every `cuda`-marked item skipped when this machine has no CUDA GPU."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)

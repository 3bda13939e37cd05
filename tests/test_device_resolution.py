"""EngineConfig resolves the device once, to `cpu` or `cuda:N`: torch 2.11's
`torch.cuda.set_device` (and everything else that takes a device index) refuses a bare "cuda".
CUDA is faked here by patching torch.cuda's queries; the index check is torch's own."""

from __future__ import annotations

import pytest
import torch
from torch.cuda._utils import _get_device_index

from fastgen.config import EngineConfig, resolve_device


@pytest.fixture
def two_gpus(monkeypatch):
    """A machine with two CUDA devices whose thread's current device is 1."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.mark.parametrize(("asked", "resolved"), [("cuda", "cuda:1"), ("auto", "cuda:1"), ("cuda:0", "cuda:0"),
                                                 ("cpu", "cpu")])
def test_cuda_and_auto_resolve_to_the_current_device_index(two_gpus, asked, resolved):
    assert resolve_device(asked) == resolved


def test_config_device_is_resolved_at_construction(two_gpus, tiny_models):
    config = EngineConfig(model=tiny_models["qwen3"], device="cuda")
    assert config.device == "cuda:1"
    assert config.torch_device == torch.device("cuda", 1)
    # What torch.cuda.set_device runs first: it raises for an index-less device.
    assert _get_device_index(config.torch_device) == 1
    with pytest.raises(ValueError, match="specified index"):
        _get_device_index(torch.device("cuda"))


def test_auto_without_cuda_is_cpu(no_gpu, tiny_models):
    assert EngineConfig(model=tiny_models["qwen3"]).device == "cpu"


def test_cuda_without_cuda_is_refused(no_gpu, tiny_models):
    with pytest.raises(ValueError, match=r"device='cuda' but CUDA is not available"):
        EngineConfig(model=tiny_models["qwen3"], device="cuda")


def test_device_index_past_the_last_gpu_is_refused(two_gpus, tiny_models):
    with pytest.raises(ValueError, match=r"device='cuda:2' but this machine has 2 CUDA device\(s\)"):
        EngineConfig(model=tiny_models["qwen3"], device="cuda:2")

"""A tensor-parallel engine in a process where the application has initialised torch.distributed
itself: refused at once, with the application's group left alone and no worker started."""

from __future__ import annotations

import pytest

from fastgen import LLM
from fastgen.distributed.supervisor import WorkerSupervisor


def test_the_applications_own_process_group_is_left_alone(tiny_models, tmp_path, monkeypatch):
    import torch.distributed as dist

    def no_spawn(*args, **kwargs):
        raise AssertionError("a worker was started for an engine that is refused")

    monkeypatch.setattr(WorkerSupervisor, "spawn", no_spawn)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match="torch.distributed is already initialized"):
            LLM(tiny_models["qwen3"], tensor_parallel_size=2, dtype="float32", num_kv_blocks=16)
        assert dist.is_initialized()
    finally:
        dist.destroy_process_group()

"""A decode step uploads only what its graph reads, and sampled ids come back through pinned
memory behind the step rather than through a blocking `.tolist()` of a device tensor."""

from __future__ import annotations

import pytest
import torch

from fastgen.scheduler_output import SchedulerOutput
from fastgen.worker.buffers import CpuGpuBuffer, TokenReadback
from fastgen.worker.step_inputs import StepInputBuilder
from tests.worker.test_block_table import decoding


@pytest.fixture
def uploads(monkeypatch) -> list[str]:
    """Names of the builder's buffers uploaded, in order (CpuGpuBuffer.copy_to_gpu is spied on)."""
    names: list[str] = []
    real = CpuGpuBuffer.copy_to_gpu

    def spy(self, n):
        names.append(self.name)
        return real(self, n)

    monkeypatch.setattr(CpuGpuBuffer, "copy_to_gpu", spy)
    return names


def named_builder() -> StepInputBuilder:
    builder = StepInputBuilder(4, 64, 4, 4, torch.device("cpu"))
    for name, value in vars(builder).items():
        if isinstance(value, CpuGpuBuffer):
            value.name = name
    builder.block_table.buffer.name = "block_table"
    return builder


def test_decode_uploads_only_what_the_graph_reads(uploads):
    builder = named_builder()
    a, b = decoding(0, 6, [1, 2]), decoding(1, 3, [3])
    inputs = builder.build_decode(SchedulerOutput([a, b], [1, 1], False, [True, True], [(), ()]), pad_to=4)
    assert sorted(uploads) == ["block_table", "context_lens", "input_ids", "positions", "slot_mapping"]
    assert inputs.meta.query_start_loc is None and inputs.meta.logits_indices is None


def test_prefill_uploads_its_offsets_and_logits_rows(uploads):
    builder = named_builder()
    a = decoding(0, 6, [1, 2])
    a.num_computed_tokens = 0
    inputs = builder.build_prefill(SchedulerOutput([a], [6], True, [True], [()]))
    assert {"query_start_loc", "logits_indices"} <= set(uploads)
    assert inputs.meta.logits_indices.tolist() == [5]


def test_token_readback_returns_each_steps_ids_once():
    readback = TokenReadback(8, torch.device("cpu"))
    readback.start(torch.tensor([5, 7, 9]))
    with pytest.raises(AssertionError, match="never read"):
        readback.start(torch.tensor([1]))
    assert readback.wait() == [5, 7, 9]
    readback.start(torch.tensor([4]))
    assert readback.wait() == [4]

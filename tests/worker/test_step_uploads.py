"""A decode step uploads only what its graph reads, and sampled ids come back through pinned
memory behind the step rather than through a blocking `.tolist()` of a device tensor."""

from __future__ import annotations

import pytest
import torch

from fastgen.scheduler_output import SchedulerOutput
from fastgen.worker import packed_upload
from fastgen.worker.buffers import CpuGpuBuffer, TokenReadback
from fastgen.worker.step_inputs import StepInputBuilder
from tests.worker.test_block_table import decoding


@pytest.fixture
def uploads(monkeypatch) -> list[str]:
    """Names of the builder's buffers uploaded, in order (CpuGpuBuffer.copy_to_gpu is spied on)."""
    names: list[str] = []
    real = CpuGpuBuffer.copy_to_gpu

    def spy(self, n):
        names.append(getattr(self, "name", "unnamed"))
        return real(self, n)

    monkeypatch.setattr(CpuGpuBuffer, "copy_to_gpu", spy)
    return names


def named_builder(max_draft_tokens: int = 0) -> StepInputBuilder:
    builder = StepInputBuilder(4, 64, 4, 4, torch.device("cpu"), max_draft_tokens=max_draft_tokens)
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


def test_a_verify_step_as_decode_rows_gives_each_token_its_context_and_its_sequences_table(uploads):
    """Sequence a verifies two drafts (three rows: its last token, then the drafts), b decodes a
    token still on the device (overlap): a row each, padded to 8; every row's block table is
    its sequence's, gathered on upload; the rows sample in `fill_prefill`'s order."""
    builder = named_builder(max_draft_tokens=3)
    a, b = decoding(0, 6, [1, 2]), decoding(1, 3, [3])
    b.num_computed_tokens, b.num_pending_tokens = 3, 1
    out = SchedulerOutput([a, b], [3, 1], True, [True, True], [(), ()], num_decodes=2, draft_tokens=((7, 8), ()))
    assert builder.can_fill_verify(out) and not builder.can_fill_verify(out, rows=17)
    layout = builder.fill_verify(out, pad_to=8)
    assert layout.several_rows_a_sequence and not layout.is_prefill and layout.num_rows == 8
    assert layout.sample_rows == (0, 0, 0, 1) and layout.num_seqs == 2
    assert (layout.pending_rows, layout.pending_seq_ids) == ((3,), (1,))
    inputs = builder.upload(layout)
    assert inputs.input_ids.tolist() == [6, 7, 8, 0, 0, 0, 0, 0]
    assert inputs.positions.tolist() == [5, 6, 7, 3, 0, 0, 0, 0]
    assert inputs.meta.slot_mapping.tolist() == [9, 10, 11, 15, -1, -1, -1, -1]
    assert inputs.meta.context_lens.tolist() == [6, 7, 8, 4, 0, 0, 0, 0]
    tables = inputs.meta.block_tables.tolist()
    assert tables[:4] == [[1, 2, -1, -1]] * 3 + [[3, -1, -1, -1]] and inputs.meta.several_rows_a_sequence
    assert "row_seqs" in uploads and "query_start_loc" not in uploads


def test_a_step_with_a_prompt_chunk_or_without_drafts_is_not_a_verify_step():
    builder = StepInputBuilder(4, 64, 4, 4, torch.device("cpu"), max_draft_tokens=3)
    a, b = decoding(0, 6, [1, 2]), decoding(1, 3, [3])
    b.num_computed_tokens = 0  # its prompt: a chunk of 3
    mixed = SchedulerOutput([a, b], [3, 3], True, [True, True], [(), ()], num_decodes=1, draft_tokens=((7, 8),))
    plain = SchedulerOutput([a], [1], False, [True], [()], num_decodes=1)
    assert not builder.can_fill_verify(mixed) and not builder.can_fill_verify(plain)
    assert not StepInputBuilder(4, 64, 4, 4, torch.device("cpu")).can_fill_verify(
        SchedulerOutput([a], [3], True, [True], [()], num_decodes=1, draft_tokens=((7, 8),)))


def test_the_step_input_budget_counts_a_verify_steps_rows():
    """Drafts add rows a sequence (tokens, context lengths, gathered tables) to the buffers."""
    plain, drafted = StepInputBuilder.num_bytes(4, 8, 16), StepInputBuilder.num_bytes(4, 8, 16, max_draft_tokens=3)
    assert drafted - plain >= 4 * 4 * (4 * 16 + 8)  # 16 rows, at least a table row and an index each


def uploaded(builder: StepInputBuilder, layout) -> dict[str, object]:
    inputs = builder.upload(layout)
    meta = inputs.meta
    fields = {"input_ids": inputs.input_ids, "positions": inputs.positions, "slot_mapping": meta.slot_mapping,
              "block_tables": meta.block_tables, "context_lens": meta.context_lens,
              "query_start_loc": meta.query_start_loc, "logits_indices": meta.logits_indices}
    return {name: None if t is None else (t.dtype, t.tolist()) for name, t in fields.items()}


def test_a_packed_upload_sends_what_one_copy_a_buffer_sends_in_one_transfer(uploads):
    """Decode (padded), verify and prefill steps: the packed builder's device tensors equal the
    one-copy-a-buffer builder's, in dtype and value, all in the packed buffer, and no buffer is
    copied on its own."""
    seqs = lambda: (decoding(0, 6, [1, 2]), decoding(1, 3, [3]))  # noqa: E731
    results = {}
    for packed in (False, True):
        builder = StepInputBuilder(4, 64, 4, 4, torch.device("cpu"), max_draft_tokens=3, pack_uploads=packed)
        assert (builder.packed is not None) == packed
        del uploads[:]
        a, b = seqs()
        decode = builder.fill_decode(SchedulerOutput([a, b], [1, 1], False, [True, True], [(), ()]), pad_to=4)
        got = [uploaded(builder, decode)]
        b.num_computed_tokens, b.num_pending_tokens = 3, 1
        verify = SchedulerOutput([a, b], [3, 1], True, [True, True], [(), ()], num_decodes=2,
                                 draft_tokens=((7, 8), ()))
        got.append(uploaded(builder, builder.fill_verify(verify, pad_to=8)))
        c = decoding(2, 9, [4, 5, 6])
        c.num_computed_tokens = 4  # a chunk of its prompt after a prefix
        got.append(uploaded(builder, builder.fill_prefill(SchedulerOutput([a, c], [1, 5], True, [True, True],
                                                                          [(), ()], num_decodes=1))))
        if packed:
            assert uploads == []  # not one buffer copied on its own
            storage = builder.packed.device_bytes.untyped_storage().data_ptr()
            inputs = builder.upload(builder.fill_decode(SchedulerOutput([a], [1], False, [True], [()]), pad_to=2))
            for t in (inputs.input_ids, inputs.positions, inputs.meta.slot_mapping, inputs.meta.context_lens,
                      inputs.meta.block_tables):
                assert t.untyped_storage().data_ptr() == storage
        results[packed] = got
    assert results[True] == results[False]
    assert results[True][1]["input_ids"][1] == [6, 7, 8, 0, 0, 0, 0, 0]  # the verify step, as laid out


def test_a_packed_decode_step_of_r_rows_reads_the_same_device_addresses_every_time(monkeypatch):
    """What a CUDA graph captured at R rows reads must be where every later step of R rows puts
    its inputs, whatever ran in between (other sizes, prefills), even once the memo of layouts
    started again (here after every new layout)."""
    monkeypatch.setattr(packed_upload, "MAX_LAYOUTS", 1)
    builder = StepInputBuilder(8, 64, 4, 4, torch.device("cpu"), pack_uploads=True)

    def addresses(rows: int, seqs) -> list[int]:
        inputs = builder.upload(builder.fill_decode(SchedulerOutput(seqs, [1] * len(seqs), False,
                                                                    [True] * len(seqs), [()] * len(seqs)),
                                                    pad_to=rows))
        meta = inputs.meta
        return [t.data_ptr() for t in (inputs.input_ids, inputs.positions, meta.slot_mapping, meta.context_lens,
                                       meta.block_tables)]

    first = addresses(4, [decoding(0, 6, [1, 2])])
    assert addresses(2, [decoding(1, 3, [3])]) != first
    prompt = decoding(2, 9, [4, 5, 6])
    prompt.num_computed_tokens = 0
    builder.upload(builder.fill_prefill(SchedulerOutput([prompt], [9], True, [True], [()])))
    assert addresses(4, [decoding(3, 5, [7, 8]), decoding(4, 2, [9])]) == first
    assert len(set(first)) == 5  # five pieces, none on top of another

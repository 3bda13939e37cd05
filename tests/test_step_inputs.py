"""Step inputs from the persistent buffers: block-table rows are cached per row, and a cached row
must never outlive the blocks it names."""

from __future__ import annotations

import torch

from fastgen.sampling_params import SamplingParams
from fastgen.scheduler import SchedulerOutput
from fastgen.sequence import Sequence
from fastgen.step_inputs import StepInputBuilder

BLOCK_SIZE = 4


def decoding(seq_id: int, num_tokens: int, block_table: list[int]) -> Sequence:
    seq = Sequence(seq_id, list(range(1, num_tokens + 1)), SamplingParams(max_tokens=8))
    seq.block_table = list(block_table)
    seq.num_computed_tokens = num_tokens - 1
    return seq


def decode_tables(builder: StepInputBuilder, seqs: list[Sequence], pad_to: int | None = None):
    inputs = builder.build_decode(SchedulerOutput(seqs, [1] * len(seqs), is_prefill=False), pad_to)
    return inputs.meta.block_tables.tolist(), inputs.meta.slot_mapping.tolist()


def test_a_preempted_sequence_back_in_its_old_row_gets_its_new_blocks():
    builder = StepInputBuilder(4, 64, 4, BLOCK_SIZE, torch.device("cpu"))
    a, b = decoding(0, 6, [1, 2]), decoding(1, 7, [5, 6])
    tables, _ = decode_tables(builder, [a, b])
    assert tables[1] == [5, 6, -1, -1]

    # b is preempted (blocks freed) and later recomputed into new blocks, as many as before: its
    # full block is a prefix-cache hit (5), the partial one is fresh (9).
    b.num_preemptions += 1
    b.block_table = [5, 9]
    decode_tables(builder, [a])  # a smaller batch in between leaves row 1 alone
    tables, slots = decode_tables(builder, [a, b])
    assert tables[1] == [5, 9, -1, -1]
    assert slots[1] == 9 * BLOCK_SIZE + 6 % BLOCK_SIZE


def test_rows_follow_the_sequences_whatever_the_previous_batch():
    builder = StepInputBuilder(4, 64, 4, BLOCK_SIZE, torch.device("cpu"))
    a, b, c = decoding(0, 6, [1, 2]), decoding(1, 3, [3]), decoding(2, 13, [4, 7, 8, 10])
    decode_tables(builder, [a, b, c])
    a.token_ids += [0, 0, 0]  # 9 tokens: a third block
    a.block_table.append(12)
    tables, _ = decode_tables(builder, [c, a], pad_to=4)
    assert tables == [[4, 7, 8, 10], [1, 2, 12, -1], [-1] * 4, [-1] * 4]

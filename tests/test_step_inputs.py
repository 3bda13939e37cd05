"""Step inputs from the persistent buffers: block-table rows are cached per row, and a cached row
must never outlive the blocks it names."""

from __future__ import annotations

import random

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


def expected_table(seqs: list[Sequence], rows: int, width: int) -> list[list[int]]:
    table = [seq.block_table + [-1] * (width - len(seq.block_table)) for seq in seqs]
    return table + [[-1] * width] * (rows - len(seqs))


def test_random_batches_always_see_exactly_their_tables():
    """Sequences grow, leave, come back preempted with new blocks, and batches are reordered,
    shrunk and padded; every step's table must equal a table built from scratch."""
    rng = random.Random(0)
    width, max_seqs = 6, 8
    builder = StepInputBuilder(max_seqs, 64, width, BLOCK_SIZE, torch.device("cpu"))
    next_block = iter(range(10**6))
    pool = [decoding(i, 1, [next(next_block)]) for i in range(12)]
    batch: list[Sequence] = []
    for _ in range(400):
        action = rng.random()
        if action < 0.15 and batch:
            batch.pop(rng.randrange(len(batch)))  # finished or preempted mid-batch
        elif action < 0.3:
            newcomer = rng.choice([s for s in pool if s not in batch])
            if rng.random() < 0.5:  # preempted earlier: same length, new blocks
                newcomer.num_preemptions += 1
                newcomer.block_table = [next(next_block) for _ in newcomer.block_table]
            if len(batch) < max_seqs:
                batch.append(newcomer)
        elif action < 0.35:
            rng.shuffle(batch)
        for seq in batch:  # every running sequence decodes a token
            if len(seq.block_table) < width and rng.random() < 0.3:
                seq.block_table.append(next(next_block))
        if not batch:
            continue
        pad_to = rng.choice([None, max_seqs])
        tables, _ = decode_tables(builder, batch, pad_to)
        assert tables == expected_table(batch, pad_to or len(batch), width)

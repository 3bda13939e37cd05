"""Block-table rows follow the scheduler's facts (new table, appended blocks, preempted,
finished) and the batch's order: every step's table must equal one built from scratch."""

from __future__ import annotations

import random

import numpy as np
import torch

from fastgen.sampling_params import SamplingParams
from fastgen.scheduler_output import SchedulerOutput
from fastgen.sequence import Sequence
from fastgen.worker.block_table import BlockTable
from fastgen.worker.step_inputs import StepInputBuilder

BLOCK_SIZE = 4


def decoding(seq_id: int, num_tokens: int, block_table: list[int]) -> Sequence:
    seq = Sequence(seq_id, list(range(1, num_tokens + 1)), SamplingParams(max_tokens=8))
    seq.block_table = list(block_table)
    seq.num_computed_tokens = num_tokens - 1
    return seq


class Facts:
    """Plays the scheduler's part: remembers what changed for each sequence since it last ran."""

    def __init__(self):
        self.new_table: set[int] = set()
        self.appended: dict[int, list[int]] = {}
        self.preempted: list[int] = []
        self.finished: list[int] = []

    def admit(self, seq: Sequence, blocks: list[int]) -> None:
        seq.block_table = list(blocks)
        self.new_table.add(seq.seq_id)
        self.appended.pop(seq.seq_id, None)

    def append(self, seq: Sequence, block: int) -> None:
        seq.block_table.append(block)
        if seq.seq_id not in self.new_table:
            self.appended.setdefault(seq.seq_id, []).append(block)

    def preempt(self, seq: Sequence) -> None:
        self.preempted.append(seq.seq_id)

    def step(self, seqs: list[Sequence]) -> SchedulerOutput:
        out = SchedulerOutput(
            seqs, [1] * len(seqs), False,
            [s.seq_id in self.new_table for s in seqs],
            [tuple(self.appended.get(s.seq_id, ())) for s in seqs],
            tuple(self.preempted), tuple(self.finished),
        )
        for s in seqs:
            self.new_table.discard(s.seq_id)
            self.appended.pop(s.seq_id, None)
        self.preempted, self.finished = [], []
        return out


def expected_table(seqs: list[Sequence], rows: int, width: int) -> list[list[int]]:
    table = np.full((rows, width), -1, dtype=np.int32)
    for i, seq in enumerate(seqs):
        table[i, : len(seq.block_table)] = seq.block_table
    return table.tolist()


def decode_tables(builder: StepInputBuilder, out: SchedulerOutput, pad_to: int | None = None):
    inputs = builder.build_decode(out, pad_to)
    return inputs.meta.block_tables.tolist(), inputs.meta.slot_mapping.tolist()


def test_a_preempted_sequence_back_in_its_old_row_gets_its_new_blocks():
    builder = StepInputBuilder(4, 64, 4, BLOCK_SIZE, torch.device("cpu"))
    facts = Facts()
    a, b = decoding(0, 6, []), decoding(1, 7, [])
    facts.admit(a, [1, 2])
    facts.admit(b, [5, 6])
    tables, _ = decode_tables(builder, facts.step([a, b]))
    assert tables[1] == [5, 6, -1, -1]

    # b is preempted (blocks freed) and later recomputed into new blocks, as many as before: its
    # full block is a prefix-cache hit (5), the partial one is fresh (9).
    facts.preempt(b)
    decode_tables(builder, facts.step([a]))  # a smaller batch in between leaves row 1 alone
    facts.admit(b, [5, 9])
    tables, slots = decode_tables(builder, facts.step([a, b]))
    assert tables[1] == [5, 9, -1, -1]
    assert slots[1] == 9 * BLOCK_SIZE + 6 % BLOCK_SIZE


def test_rows_follow_the_sequences_whatever_the_previous_batch():
    builder = StepInputBuilder(4, 64, 4, BLOCK_SIZE, torch.device("cpu"))
    facts = Facts()
    a, b, c = decoding(0, 6, []), decoding(1, 3, []), decoding(2, 13, [])
    for seq, blocks in ((a, [1, 2]), (b, [3]), (c, [4, 7, 8, 10])):
        facts.admit(seq, blocks)
    decode_tables(builder, facts.step([a, b, c]))
    a.token_ids += [0, 0, 0]  # 9 tokens: a third block
    facts.append(a, 12)
    tables, _ = decode_tables(builder, facts.step([c, a]), pad_to=4)
    assert tables == [[4, 7, 8, 10], [1, 2, 12, -1], [-1] * 4, [-1] * 4]


def test_a_row_taken_by_a_prefill_is_rewritten_when_its_sequence_returns():
    table = BlockTable(4, 3, torch.device("cpu"))
    facts = Facts()
    a, b, c = decoding(0, 2, []), decoding(1, 2, []), decoding(2, 2, [])
    facts.admit(a, [1])
    facts.admit(b, [2])
    table.arrange(facts.step([a, b]), 2)
    facts.admit(c, [3, 4])  # a prefill step of c alone takes row 0 from a
    table.arrange(facts.step([c]), 1)
    table.arrange(facts.step([a, b, c]), 3)
    assert table.rows[:3].tolist() == expected_table([a, b, c], 3, 3)


def test_random_batches_always_see_exactly_their_tables():
    """Sequences grow, leave, come back preempted with new blocks, and batches are reordered,
    shrunk and padded; every step's table must equal a table built from scratch."""
    rng = random.Random(0)
    width, max_seqs = 6, 8
    builder = StepInputBuilder(max_seqs, 64, width, BLOCK_SIZE, torch.device("cpu"))
    facts = Facts()
    next_block = iter(range(10**6))
    pool = [decoding(i, 1, []) for i in range(12)]
    for seq in pool:
        facts.admit(seq, [next(next_block)])
    batch: list[Sequence] = []
    for _ in range(400):
        action = rng.random()
        if action < 0.15 and batch:
            leaver = batch.pop(rng.randrange(len(batch)))
            if rng.random() < 0.5:  # preempted: comes back later with as many new blocks
                facts.preempt(leaver)
                facts.admit(leaver, [next(next_block) for _ in leaver.block_table])
        elif action < 0.3:
            newcomer = rng.choice([s for s in pool if s not in batch])
            if len(batch) < max_seqs:
                batch.append(newcomer)
        elif action < 0.35:
            rng.shuffle(batch)
        for seq in batch:  # every running sequence decodes a token
            if len(seq.block_table) < width and rng.random() < 0.3:
                facts.append(seq, next(next_block))
        if not batch:
            continue
        pad_to = rng.choice([None, max_seqs])
        tables, _ = decode_tables(builder, facts.step(batch), pad_to)
        assert tables == expected_table(batch, pad_to or len(batch), width)

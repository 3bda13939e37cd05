"""The step's block tables: one row a batch position, kept up to date from scheduler facts.

Rows persist across steps, so a sequence that stays in the batch costs nothing: its row is
written once when it gets its table (`add_row`), then changes only by the facts the scheduler
reports: a block appended (`append_row`), the sequence moved to another batch position because
one before it left (`move_rows`, all movers in one gather), or its blocks given back on
preemption or finish (the row is forgotten). A row is never trusted on anything but those
facts and this table's own record of which sequence it last wrote there.
"""

from __future__ import annotations

import torch

from fastgen.scheduler_output import SchedulerOutput
from fastgen.worker.buffers import CpuGpuBuffer


class BlockTable:
    """int32 [max_rows, width] (with a device twin unless the builder packs its uploads), -1 past
    each sequence's blocks and in padding."""

    def __init__(self, max_rows: int, width: int, device: torch.device):
        self.buffer = CpuGpuBuffer((max_rows, width), torch.int32, device, fill=-1)
        self.rows = self.buffer.np
        self.num_blocks = [0] * max_rows
        # seq_id whose blocks each row holds (None: all -1), and the reverse map for live rows.
        self.owner: list[int | None] = [None] * max_rows
        self.row_of: dict[int, int] = {}

    # ---- the primitives ------------------------------------------------------------------
    def add_row(self, row: int, seq_id: int, block_ids: list[int]) -> None:
        n = len(block_ids)
        self.rows[row, :n] = block_ids
        self.rows[row, n:] = -1
        self.num_blocks[row] = n
        self._own(row, seq_id)

    def append_row(self, row: int, block_ids: tuple[int, ...]) -> None:
        start = self.num_blocks[row]
        self.rows[row, start : start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)

    def move_rows(self, src: list[int], dst: list[int]) -> None:
        """Copy rows src[i] -> dst[i] (numpy gathers every source before writing)."""
        self.rows[dst] = self.rows[src]
        counts = [self.num_blocks[s] for s in src]
        owners = [self.owner[s] for s in src]
        for d, n, seq_id in zip(dst, counts, owners):
            self.num_blocks[d] = n
            self._own(d, seq_id)

    def clear_row(self, row: int) -> None:
        if self.owner[row] is not None or self.num_blocks[row]:
            self.rows[row] = -1
            self.num_blocks[row] = 0
            self._own(row, None)

    def forget(self, seq_id: int) -> None:
        """The sequence gave its blocks back: its row must never be read for it again."""
        self.row_of.pop(seq_id, None)

    def forget_all(self) -> None:
        """Trust no row: every sequence gets its whole table written again when it next runs."""
        self.row_of.clear()
        self.owner = [None] * len(self.owner)

    def _own(self, row: int, seq_id: int | None) -> None:
        old = self.owner[row]
        if old is not None and self.row_of.get(old) == row:
            del self.row_of[old]
        self.owner[row] = seq_id
        if seq_id is not None:
            self.row_of[seq_id] = row

    # ---- one step ------------------------------------------------------------------------
    def arrange(self, out: SchedulerOutput, rows: int) -> None:
        """Make rows [0, n) hold `out.seqs`' tables in batch order and rows [n, rows) padding.

        Rows past `rows` are not part of this step and keep their contents for later ones.
        """
        for seq_id in (*out.preempted_seq_ids, *out.finished_seq_ids):
            self.forget(seq_id)
        move_src, move_dst, appends, adds = [], [], [], []
        for i, seq in enumerate(out.seqs):
            src = self.row_of.get(seq.seq_id)
            if out.new_tables[i] or src is None:  # a new table, or its row was given to another
                adds.append(i)
                continue
            if src != i:
                move_src.append(src)
                move_dst.append(i)
            if out.new_block_ids[i]:
                appends.append(i)
        if move_src:
            self.move_rows(move_src, move_dst)
        for i in appends:
            self.append_row(i, out.new_block_ids[i])
        for i in adds:
            seq = out.seqs[i]
            self.add_row(i, seq.seq_id, seq.block_table)
        for i in range(len(out.seqs), rows):
            self.clear_row(i)

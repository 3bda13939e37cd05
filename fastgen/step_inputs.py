"""Builds a step's model inputs in persistent buffers instead of fresh Python lists.

Host buffers (pinned on CUDA) and their device twins are allocated once at start-up, sized for
the largest step. A step writes only its rows, copies them to the device in one transfer per
buffer, and hands out views. A block-table row is rewritten only when the sequence in that row
or its number of blocks changed since the previous step, or the sequence was preempted (and so
holds new blocks). Decode batches can be padded to a CUDA-graph size: padding rows get token 0,
position 0, slot -1 (never written), context length 0 and an all -1 block table, so nothing
stale from an earlier, larger batch survives.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fastgen.attention import AttentionMetadata
from fastgen.scheduler import SchedulerOutput
from fastgen.sequence import Sequence


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: list[int]  # which scheduled sequences sample a token this step
    num_rows: int  # real sequences (padding rows excluded)


class _Buffer:
    """A host numpy array and its device tensor of the same shape."""

    def __init__(self, shape, dtype: torch.dtype, device: torch.device, fill: int = 0):
        pin = device.type == "cuda"
        self.host_tensor = torch.full(shape, fill, dtype=dtype, pin_memory=pin)
        self.host = self.host_tensor.numpy()
        self.device = self.host_tensor if device.type == "cpu" else torch.full(shape, fill, dtype=dtype, device=device)

    def upload(self, rows: int) -> torch.Tensor:
        if self.device is not self.host_tensor:
            self.device[:rows].copy_(self.host_tensor[:rows], non_blocking=True)
        return self.device[:rows]


class StepInputBuilder:
    """Sized for the largest step: max_num_seqs rows, max(max_num_tokens, max_num_seqs) tokens and
    block tables max_blocks_per_seq wide."""

    def __init__(self, max_num_seqs: int, max_num_tokens: int, max_blocks_per_seq: int, block_size: int,
                 device: torch.device):
        self.block_size = block_size
        tokens = max(max_num_tokens, max_num_seqs)
        self.input_ids = _Buffer((tokens,), torch.int64, device)
        self.positions = _Buffer((tokens,), torch.int64, device)
        self.slot_mapping = _Buffer((tokens,), torch.int64, device, fill=-1)
        self.block_tables = _Buffer((max_num_seqs, max_blocks_per_seq), torch.int32, device, fill=-1)
        self.context_lens = _Buffer((max_num_seqs,), torch.int32, device)
        self.query_start_loc = _Buffer((max_num_seqs + 1,), torch.int32, device)
        self.logits_indices = _Buffer((max_num_seqs,), torch.int64, device)
        # Who each block-table row holds now, so that a row is only rewritten when it must be:
        # the sequence (None: padding), its preemption count then (a preempted sequence comes
        # back with new blocks) and its number of blocks (tables only grow while running).
        self._row_owner: list[Sequence | None] = [None] * max_num_seqs
        self._row_preemptions = [0] * max_num_seqs
        self._row_blocks = [0] * max_num_seqs
        self._row_of: dict[int, int] = {}  # seq_id -> the row it was last written to
        # Host-to-device copies are asynchronous and read the pinned buffers when they run. Most
        # steps sync anyway (sampling reads the tokens back), but a middle chunk of a long prompt
        # samples nothing, so the next build waits for this event before overwriting the buffers.
        self._uploaded = torch.cuda.Event() if device.type == "cuda" else None

    def _wait_for_previous_upload(self) -> None:
        if self._uploaded is not None:
            self._uploaded.synchronize()  # returns at once if never recorded

    def _finish(self, inputs: StepInputs) -> StepInputs:
        if self._uploaded is not None:
            self._uploaded.record()
        return inputs

    def _write_block_tables(self, seqs: list[Sequence], rows: int) -> None:
        """Bring host rows [0, rows) up to date: `seqs` in order, then padding rows of -1.

        A sequence still in the row it had is left alone, or gets only its new blocks written. A
        sequence that moved (someone before it left the batch) is copied from its old row, all
        movers in one gather. Only sequences new to the table are written from their lists.
        Rows past `rows` are not part of this step and keep their contents for later ones.
        """
        table = self.block_tables.host
        owners, preemptions, lengths, row_of = self._row_owner, self._row_preemptions, self._row_blocks, self._row_of
        move_to, move_from, grown, fresh = [], [], [], []
        for i, seq in enumerate(seqs):  # read the old bookkeeping only...
            src = row_of.get(seq.seq_id, -1)
            if src >= 0 and owners[src] is seq and preemptions[src] == seq.num_preemptions:
                if src != i:
                    move_to.append(i)
                    move_from.append(src)
                if lengths[src] != len(seq.block_table):
                    grown.append((i, lengths[src], seq))
            else:
                fresh.append((i, seq))
        if move_to:
            table[move_to] = table[move_from]  # numpy gathers the sources before writing
        for i, have, seq in grown:
            table[i, have : len(seq.block_table)] = seq.block_table[have:]
        for i, seq in fresh:
            n = len(seq.block_table)
            table[i, :n] = seq.block_table
            table[i, n:] = -1
        for i in range(len(seqs), rows):  # padding
            if owners[i] is not None:
                table[i] = -1
        for i in range(rows):  # ...then record the new
            seq = seqs[i] if i < len(seqs) else None
            old = owners[i]
            if old is not seq:
                if old is not None and row_of.get(old.seq_id) == i:
                    del row_of[old.seq_id]
                owners[i] = seq
            if seq is not None:
                row_of[seq.seq_id] = i
                preemptions[i] = seq.num_preemptions
                lengths[i] = len(seq.block_table)

    def build_decode(self, out: SchedulerOutput, pad_to: int | None = None) -> StepInputs:
        """One token a sequence; rows [n, pad_to) are padding."""
        self._wait_for_previous_upload()
        seqs, bs = out.seqs, self.block_size
        n = len(seqs)
        rows = pad_to or n
        lens = np.fromiter((len(s.token_ids) for s in seqs), dtype=np.int64, count=n)
        last_pos = lens - 1
        blocks = np.fromiter((s.block_table[p // bs] for s, p in zip(seqs, last_pos.tolist())), dtype=np.int64, count=n)
        self.input_ids.host[:n] = [s.token_ids[-1] for s in seqs]
        self.positions.host[:n] = last_pos
        self.slot_mapping.host[:n] = blocks * bs + last_pos % bs
        self.context_lens.host[:n] = lens
        self.input_ids.host[n:rows] = 0
        self.positions.host[n:rows] = 0
        self.slot_mapping.host[n:rows] = -1
        self.context_lens.host[n:rows] = 0
        self._write_block_tables(seqs, rows)
        self.query_start_loc.host[: rows + 1] = np.arange(rows + 1)
        self.logits_indices.host[:rows] = np.arange(rows)
        meta = AttentionMetadata(
            is_prefill=False,
            slot_mapping=self.slot_mapping.upload(rows),
            block_tables=self.block_tables.upload(rows),
            context_lens=self.context_lens.upload(rows),
            query_start_loc=self.query_start_loc.upload(rows + 1),
            max_query_len=1,
            max_context_len=int(lens.max()) if n else 0,
            logits_indices=self.logits_indices.upload(rows),
        )
        return self._finish(
            StepInputs(self.input_ids.upload(rows), self.positions.upload(rows), meta, list(range(n)), n)
        )

    def build_prefill(self, out: SchedulerOutput) -> StepInputs:
        """Each sequence computes tokens [num_computed, num_computed + num_new)."""
        self._wait_for_previous_upload()
        bs = self.block_size
        q_lens, ctx_lens, sample_rows, logits_idx = [], [], [], []
        start = 0
        for i, (seq, count) in enumerate(zip(out.seqs, out.num_new_tokens)):
            first = seq.num_computed_tokens
            end = first + count
            pos = np.arange(first, end)
            self.input_ids.host[start : start + count] = seq.token_ids[first:end]
            self.positions.host[start : start + count] = pos
            table = np.asarray(seq.block_table, dtype=np.int64)
            slots = table[pos // bs] * bs + pos % bs
            # Prefix-cached tokens are already in (possibly shared) blocks: never write them again.
            slots[pos < seq.num_cached_tokens] = -1
            self.slot_mapping.host[start : start + count] = slots
            q_lens.append(count)
            ctx_lens.append(end)
            start += count
            if end == len(seq.token_ids):
                sample_rows.append(i)
                logits_idx.append(start - 1)
        rows = len(out.seqs)
        self._write_block_tables(out.seqs, rows)
        self.context_lens.host[:rows] = ctx_lens
        self.query_start_loc.host[0] = 0
        self.query_start_loc.host[1 : rows + 1] = np.cumsum(q_lens)
        self.logits_indices.host[: len(logits_idx)] = logits_idx
        meta = AttentionMetadata(
            is_prefill=True,
            slot_mapping=self.slot_mapping.upload(start),
            block_tables=self.block_tables.upload(rows),
            context_lens=self.context_lens.upload(rows),
            query_start_loc=self.query_start_loc.upload(rows + 1),
            max_query_len=max(q_lens),
            max_context_len=max(ctx_lens),
            logits_indices=self.logits_indices.upload(len(logits_idx)),
            query_lens_host=tuple(q_lens),
            context_lens_host=tuple(ctx_lens),
        )
        return self._finish(
            StepInputs(self.input_ids.upload(start), self.positions.upload(start), meta, sample_rows, rows)
        )

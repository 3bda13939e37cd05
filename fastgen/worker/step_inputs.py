"""Builds a step's model inputs in persistent buffers instead of fresh Python lists.

Host buffers (pinned on CUDA) and their device twins are allocated once at start-up, sized for
the largest step. A step writes only its rows, copies them to the device in one transfer per
buffer, and hands out views. Block tables follow the scheduler's facts (`BlockTable`). Decode
batches can be padded to a CUDA-graph size: padding rows get token 0, position 0, slot -1
(never written), context length 0 and an all -1 block table, so nothing stale from an earlier,
larger batch survives.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fastgen.attention import AttentionMetadata
from fastgen.engine.scheduler import SchedulerOutput
from fastgen.worker.block_table import BlockTable
from fastgen.worker.buffers import CpuGpuBuffer


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: list[int]  # which scheduled sequences sample a token this step
    num_rows: int  # real sequences (padding rows excluded)


class StepInputBuilder:
    """Sized for the largest step: max_num_seqs rows, max(max_num_tokens, max_num_seqs) tokens and
    block tables max_blocks_per_seq wide."""

    def __init__(self, max_num_seqs: int, max_num_tokens: int, max_blocks_per_seq: int, block_size: int,
                 device: torch.device):
        self.block_size = block_size
        tokens = max(max_num_tokens, max_num_seqs)
        self.input_ids = CpuGpuBuffer((tokens,), torch.int64, device)
        self.positions = CpuGpuBuffer((tokens,), torch.int64, device)
        self.slot_mapping = CpuGpuBuffer((tokens,), torch.int64, device, fill=-1)
        self.block_table = BlockTable(max_num_seqs, max_blocks_per_seq, device)
        self.context_lens = CpuGpuBuffer((max_num_seqs,), torch.int32, device)
        self.query_start_loc = CpuGpuBuffer((max_num_seqs + 1,), torch.int32, device)
        self.logits_indices = CpuGpuBuffer((max_num_seqs,), torch.int64, device)
        # Host-to-device copies are asynchronous and read the pinned buffers when they run. Most
        # steps sync anyway (sampling reads the tokens back), but a middle chunk of a long prompt
        # samples nothing, so the next build waits for this event before overwriting the buffers.
        self._uploaded = torch.cuda.Event() if device.type == "cuda" else None

    @staticmethod
    def num_bytes(max_num_seqs: int, max_num_tokens: int, max_blocks_per_seq: int) -> int:
        """Bytes of one copy (host, or device) of the buffers a builder of these sizes allocates,
        with the block table's per-row Python records."""
        tokens = max(max_num_tokens, max_num_seqs)
        per_row = 4 + 8 + 4 + 4 * max_blocks_per_seq + 16  # context len, logits index, query start, table
        return 3 * 8 * tokens + max_num_seqs * per_row + 4

    def _wait_for_previous_upload(self) -> None:
        if self._uploaded is not None:
            self._uploaded.synchronize()  # returns at once if never recorded

    def _finish(self, inputs: StepInputs) -> StepInputs:
        if self._uploaded is not None:
            self._uploaded.record()
        return inputs

    def build_decode(self, out: SchedulerOutput, pad_to: int | None = None) -> StepInputs:
        """One token a sequence; rows [n, pad_to) are padding. Uploads five buffers: input ids,
        positions, slot mapping, context lengths and block tables."""
        self._wait_for_previous_upload()
        seqs, bs = out.seqs, self.block_size
        n = len(seqs)
        rows = pad_to or n
        lens = np.fromiter((len(s.token_ids) for s in seqs), dtype=np.int64, count=n)
        last_pos = lens - 1
        blocks = np.fromiter((s.block_table[p // bs] for s, p in zip(seqs, last_pos.tolist())), dtype=np.int64, count=n)
        self.input_ids.np[:n] = [s.token_ids[-1] for s in seqs]
        self.positions.np[:n] = last_pos
        self.slot_mapping.np[:n] = blocks * bs + last_pos % bs
        self.context_lens.np[:n] = lens
        self.input_ids.np[n:rows] = 0
        self.positions.np[n:rows] = 0
        self.slot_mapping.np[n:rows] = -1
        self.context_lens.np[n:rows] = 0
        self.block_table.arrange(out, rows)
        # Only what a decode step (and its graph) reads goes up: row i is sequence i's token,
        # so there are no query offsets or logits indices to send.
        meta = AttentionMetadata(
            is_prefill=False,
            slot_mapping=self.slot_mapping.copy_to_gpu(rows),
            block_tables=self.block_table.copy_to_gpu(rows),
            context_lens=self.context_lens.copy_to_gpu(rows),
            query_start_loc=None,
            max_query_len=1,
            max_context_len=int(lens.max()) if n else 0,
            logits_indices=None,
        )
        return self._finish(
            StepInputs(self.input_ids.copy_to_gpu(rows), self.positions.copy_to_gpu(rows), meta, list(range(n)), n)
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
            self.input_ids.np[start : start + count] = seq.token_ids[first:end]
            self.positions.np[start : start + count] = pos
            table = np.asarray(seq.block_table, dtype=np.int64)
            slots = table[pos // bs] * bs + pos % bs
            # Prefix-cached tokens are already in (possibly shared) blocks: never write them again.
            slots[pos < seq.num_cached_tokens] = -1
            self.slot_mapping.np[start : start + count] = slots
            q_lens.append(count)
            ctx_lens.append(end)
            start += count
            if end == len(seq.token_ids):
                sample_rows.append(i)
                logits_idx.append(start - 1)
        rows = len(out.seqs)
        self.block_table.arrange(out, rows)
        self.context_lens.np[:rows] = ctx_lens
        self.query_start_loc.np[0] = 0
        self.query_start_loc.np[1 : rows + 1] = np.cumsum(q_lens)
        self.logits_indices.np[: len(logits_idx)] = logits_idx
        meta = AttentionMetadata(
            is_prefill=True,
            slot_mapping=self.slot_mapping.copy_to_gpu(start),
            block_tables=self.block_table.copy_to_gpu(rows),
            context_lens=self.context_lens.copy_to_gpu(rows),
            query_start_loc=self.query_start_loc.copy_to_gpu(rows + 1),
            max_query_len=max(q_lens),
            max_context_len=max(ctx_lens),
            logits_indices=self.logits_indices.copy_to_gpu(len(logits_idx)),
            query_lens_host=tuple(q_lens),
            context_lens_host=tuple(ctx_lens),
        )
        return self._finish(
            StepInputs(self.input_ids.copy_to_gpu(start), self.positions.copy_to_gpu(start), meta, sample_rows, rows)
        )

"""How rank 0 hands each step to the other tensor-parallel ranks.

Rank 0 alone schedules, so only it can build a step's inputs. It fills its `StepInputBuilder`'s
host buffers as a single-device engine would, then broadcasts the filled rows over the step
group (gloo, CPU tensors); every other rank writes them into its own builder's host buffers, and
from there all ranks run the same code: upload, forward (eager, or the decode graph of that
padded size), with the model's collectives in lock step. Workers hold no Sequence, no block
manager and no sampler.

Per step, two broadcasts from rank 0:

1. header, int64[10]: command, is_prefill, num_tokens T, num_rows B (padding rows included),
   num_logits S, max_query_len, max_context_len, table_width W, num_block_copies K,
   num_logit_spans L. command STOP ends the worker's loop and nothing follows.
2. payload, int64[...], these host rows end to end:
   input_ids[T] positions[T] slot_mapping[T] context_lens[B]
   (prefill only) query_start_loc[B + 1] logits_indices[S]
   block_tables[B, W] row-major, W = the blocks max_context_len spans (columns beyond are never
   read this step; the receiver sets them to -1)
   block_copies[K, 2] (source, destination) logit_spans[L, 2] (first row, end row).
"""

from __future__ import annotations

import torch

from fastgen.worker.step_inputs import StepInputBuilder, StepLayout

STEP, STOP = 1, 2
HEADER_LEN = 10


def _row_sections(builder: StepInputBuilder, is_prefill: bool, tokens: int, rows: int, logits: int):
    """(host array, length) of each 1-D section of the payload, in order."""
    sections = [(builder.input_ids.np, tokens), (builder.positions.np, tokens), (builder.slot_mapping.np, tokens),
                (builder.context_lens.np, rows)]
    if is_prefill:
        sections += [(builder.query_start_loc.np, rows + 1), (builder.logits_indices.np, logits)]
    return sections


def _payload_buffer(builder: StepInputBuilder) -> torch.Tensor:
    """Room for the largest payload this builder's steps can have."""
    tokens, rows = builder.input_ids.np.shape[0], builder.context_lens.np.shape[0]
    width = builder.block_table.rows.shape[1]
    logits = builder.logits_indices.np.shape[0]  # a row a sequence, more with speculative drafts
    # A step forks at most `rows` children (one block copy each) and has at most a logit span
    # per sequence plus one per PROMPT_LOGPROB_ROWS tokens: 2 * (2 * rows + tokens) bounds both.
    return torch.zeros(5 * tokens + 6 * rows + 1 + logits + rows * width, dtype=torch.int64)


class StepSender:
    """Rank 0's end: `send(layout, builder)` after the builder's host buffers are filled."""

    def __init__(self, step_group, builder: StepInputBuilder):
        self.group = step_group
        self.header = torch.zeros(HEADER_LEN, dtype=torch.int64)
        self.payload = _payload_buffer(builder)

    def _broadcast(self, tensor: torch.Tensor) -> None:
        import torch.distributed as dist

        dist.broadcast(tensor, src=0, group=self.group)

    def send(self, layout: StepLayout, builder: StepInputBuilder) -> None:
        width = min(builder.block_table.rows.shape[1], -(-layout.max_context_len // builder.block_size))
        self.header.numpy()[:] = (STEP, layout.is_prefill, layout.num_tokens, layout.num_rows, layout.num_logits,
                                  layout.max_query_len, layout.max_context_len, width, len(layout.block_copies),
                                  len(layout.logit_spans))
        self._broadcast(self.header)
        out, at = self.payload.numpy(), 0
        for array, length in _row_sections(builder, layout.is_prefill, layout.num_tokens, layout.num_rows,
                                           layout.num_logits):
            out[at : at + length] = array[:length]
            at += length
        table = builder.block_table.rows[: layout.num_rows, :width]
        out[at : at + table.size].reshape(table.shape)[:] = table
        at += table.size
        for pairs in (layout.block_copies, layout.logit_spans):
            out[at : at + 2 * len(pairs)] = [value for pair in pairs for value in pair]
            at += 2 * len(pairs)
        self._broadcast(self.payload[:at])

    def stop(self) -> None:
        """Tell every worker to leave its loop."""
        self.header.numpy()[:] = 0
        self.header[0] = STOP
        self._broadcast(self.header)


class StepReceiver:
    """A worker's end: `receive(builder)` waits for rank 0's next step and fills `builder`."""

    def __init__(self, step_group, builder: StepInputBuilder):
        self.group = step_group
        self.header = torch.zeros(HEADER_LEN, dtype=torch.int64)
        self.payload = _payload_buffer(builder)

    def receive(self, builder: StepInputBuilder) -> StepLayout | None:
        """The next step's layout, its rows written into `builder`; None when told to stop.
        Raises ValueError for a header no sender writes."""
        import torch.distributed as dist

        dist.broadcast(self.header, src=0, group=self.group)
        command, is_prefill, tokens, rows, logits, max_query, max_context, width, copies, spans = self.header.tolist()
        if command == STOP:
            return None
        if command != STEP:
            raise ValueError(f"step header command={command} is neither STEP ({STEP}) nor STOP ({STOP})")
        is_prefill = bool(is_prefill)
        sections = _row_sections(builder, is_prefill, tokens, rows, logits)
        size = sum(length for _, length in sections) + rows * width + 2 * (copies + spans)
        dist.broadcast(self.payload[:size], src=0, group=self.group)
        builder.wait_for_previous_upload()  # the host rows may still be feeding the last upload
        data, at = self.payload.numpy(), 0
        for array, length in sections:
            array[:length] = data[at : at + length]
            at += length
        table = builder.block_table.rows
        table[:rows, :width] = data[at : at + rows * width].reshape(rows, width)
        table[:rows, width:] = -1
        at += rows * width
        pairs = data[at:size].reshape(-1, 2).tolist()
        return StepLayout(is_prefill, tokens, rows, logits, max_query, max_context,
                          block_copies=tuple(map(tuple, pairs[:copies])), logit_spans=tuple(map(tuple, pairs[copies:])))


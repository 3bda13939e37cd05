"""Builds a step's model inputs in persistent buffers instead of fresh Python lists.

Host buffers are allocated once at start-up, sized for the largest step. A step writes only its
rows and hands out device views of them: on CUDA each buffer has a pinned host side and a device
twin and is copied on its own, or all the step's rows are packed and sent in one transfer
(`PackedUpload`, the default on CUDA: see PACK_UPLOADS_ON_CUDA); on CPU the host buffers are the
device's. Block tables follow the scheduler's facts (`BlockTable`). Decode batches can be
padded to a CUDA-graph size: padding rows get token 0, position 0, slot -1 (never written),
context length 0 and an all -1 block table, so nothing stale from an earlier, larger batch
survives.

A step is built in two halves: `fill_prefill` / `fill_decode` write the host rows from the
scheduler's output and return a `StepLayout` (plain sizes); `upload` copies those rows to the
device and makes the `StepInputs`. Under tensor parallelism the other ranks receive rank 0's
filled rows instead of filling their own (`fastgen.distributed.step_protocol`) and upload them
the same way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from fastgen.attention import AttentionMetadata
from fastgen.scheduler_output import SchedulerOutput
from fastgen.worker.block_table import BlockTable
from fastgen.worker.buffers import CpuGpuBuffer
from fastgen.worker.packed_upload import ALIGN, PackedUpload

PrepareMeta = Callable[[AttentionMetadata], AttentionMetadata]

# One packed transfer a step instead of one per buffer (`benchmarks/gpu_decode.py
# --packed-uploads`); read when a builder is built. On an H200 it saves about 1% of the step at
# batch 1, 2, 8 and 256. An earlier batch-256 fault with it was the benchmark's own replay of a
# graph over another step's inputs; with that fixed, the batch-256 run passes.
PACK_UPLOADS_ON_CUDA = True


@dataclass(frozen=True)
class StepLayout:
    """What a builder's host buffers hold once a step is filled: the sizes `upload` reads.

    num_tokens: T rows of the token buffers; num_rows: B sequences, padding rows included;
    num_logits: rows of logits_indices (prefill; 0 in decode, where every row feeds the LM head).
    sample_rows: which scheduled sequences sample a token; num_seqs: real rows. Those two are
    known where the step was scheduled; a rank that received the step sees () and num_rows.
    block_copies: (source, destination) KV blocks copied after the forward (forks).
    logit_spans: hidden rows [a, b) whose logits are formed besides the sampling rows' (prompt
    logprobs). The runner adds those two; every rank runs them.
    pending_rows / pending_seq_ids: token rows whose input id is a token the previous step sampled
    and the host has not read (overlap scheduling), and whose token each is: the runner writes
    them on the device after the upload (the host rows hold 0 there).
    several_rows_a_sequence: a verify step laid out as decode rows (`fill_verify`): row r is one
    token of one sequence, with its own context length; num_seqs sequences' block tables are
    gathered to the rows on upload.
    """

    is_prefill: bool
    num_tokens: int
    num_rows: int
    num_logits: int
    max_query_len: int
    max_context_len: int
    sample_rows: tuple[int, ...] = ()
    num_seqs: int | None = None
    block_copies: tuple[tuple[int, int], ...] = ()
    logit_spans: tuple[tuple[int, int], ...] = ()
    pending_rows: tuple[int, ...] = ()
    pending_seq_ids: tuple[int, ...] = ()
    several_rows_a_sequence: bool = False


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: list[int]  # which scheduled sequences sample a token this step
    num_rows: int  # real sequences (padding rows excluded)
    upload: int = 0  # which of the builder's uploads made these (`StepInputBuilder.uploads`)


class StepInputBuilder:
    """Sized for the largest step: max_num_seqs rows, max(max_num_tokens, max_num_seqs) tokens and
    block tables max_blocks_per_seq wide. prepare_meta: the attention backend's `prepare`, applied
    to every step's metadata. max_draft_tokens: most draft tokens a sequence verifies in a step
    (speculative decoding), each a row of logits. pack_uploads: send a step's rows in one transfer
    (default: on CUDA when PACK_UPLOADS_ON_CUDA, which is on); off, each buffer is copied on its own."""

    def __init__(self, max_num_seqs: int, max_num_tokens: int, max_blocks_per_seq: int, block_size: int,
                 device: torch.device, prepare_meta: PrepareMeta = lambda meta: meta, max_draft_tokens: int = 0,
                 pack_uploads: bool | None = None):
        self.block_size = block_size
        self.prepare_meta = prepare_meta
        if pack_uploads is None:
            pack_uploads = device.type == "cuda" and PACK_UPLOADS_ON_CUDA
        # Packed, the buffers below are host rows only: the packed upload has the device side.
        rows_on = torch.device("cpu") if pack_uploads else device
        # A verify step laid out as decode rows (`fill_verify`) has up to 1 + max_draft_tokens
        # rows a sequence, each with its own context length and block-table row.
        self.max_verify_rows = max_num_seqs * (1 + max_draft_tokens) if max_draft_tokens else 0
        tokens = max(max_num_tokens, max_num_seqs, self.max_verify_rows)
        self.input_ids = CpuGpuBuffer((tokens,), torch.int64, rows_on)
        self.positions = CpuGpuBuffer((tokens,), torch.int64, rows_on)
        self.slot_mapping = CpuGpuBuffer((tokens,), torch.int64, rows_on, fill=-1)
        # Two columns at least (the spare one all -1): a compiled CPU graph traced over one-column
        # tables would hold that width as a constant (torch.compile specialises sizes of 1), and
        # graphs are shared between engines whose max_model_len gives other widths.
        width = max(2, max_blocks_per_seq)
        self.block_table = BlockTable(max_num_seqs, width, rows_on)
        self.context_lens = CpuGpuBuffer((max(max_num_seqs, self.max_verify_rows),), torch.int32, rows_on)
        if self.max_verify_rows:
            self.row_seqs = CpuGpuBuffer((self.max_verify_rows,), torch.int64, rows_on)
            # The rows' tables, gathered on the device from the sequences' at upload.
            self.row_block_tables = torch.full((self.max_verify_rows, width), -1, dtype=torch.int32, device=device)
        self.query_start_loc = CpuGpuBuffer((max_num_seqs + 1,), torch.int32, rows_on)
        self.logits_indices = CpuGpuBuffer((max_num_seqs * (1 + max_draft_tokens),), torch.int64, rows_on)
        self.packed = None
        if pack_uploads:
            # A step sends a piece of each buffer at most: room for all of them whole.
            pieces = [self.input_ids, self.positions, self.slot_mapping, self.context_lens, self.query_start_loc,
                      self.logits_indices, self.block_table.buffer] + ([self.row_seqs] if self.max_verify_rows else [])
            self.packed = PackedUpload(PackedUpload.room_for([b.cpu for b in pieces]), device)
        # Host-to-device copies are asynchronous and read the pinned host memory when they run.
        # Most steps sync anyway (sampling reads the tokens back), but a middle chunk of a long
        # prompt samples nothing, so the next build waits for this event before overwriting it.
        self._uploaded = torch.cuda.Event() if device.type == "cuda" else None
        self.uploads = 0  # steps uploaded so far: whether a step's inputs are still the last ones

    @staticmethod
    def num_bytes(max_num_seqs: int, max_num_tokens: int, max_blocks_per_seq: int, max_draft_tokens: int = 0) -> int:
        """Bytes of one copy (host, or device) of the buffers a builder of these sizes allocates,
        with the block table's per-row Python records (and a verify step's rows, with drafts)."""
        verify_rows = max_num_seqs * (1 + max_draft_tokens) if max_draft_tokens else 0
        tokens = max(max_num_tokens, max_num_seqs, verify_rows)
        per_row = 4 + 8 + 4 + 4 * max_blocks_per_seq + 16  # context len, logits index, query start, table
        # A verify row: its context length, sequence index, logits index and gathered table row.
        per_verify_row = 4 + 8 + 8 + 4 * max(2, max_blocks_per_seq)
        # Packed (`PackedUpload`), each of up to 8 pieces is rounded up to its alignment.
        return 3 * 8 * tokens + max_num_seqs * per_row + verify_rows * per_verify_row + 4 + 8 * ALIGN

    def wait_for_previous_upload(self) -> None:
        """Call before overwriting host memory an upload reads: the last upload's copy may still
        be reading it (the packed buffer, or with packing off the pinned host rows)."""
        if self._uploaded is not None:
            self._uploaded.synchronize()  # returns at once if never recorded

    def _finish(self, inputs: StepInputs) -> StepInputs:
        if self._uploaded is not None:
            self._uploaded.record()
        self.uploads += 1
        return dataclasses.replace(inputs, meta=self.prepare_meta(inputs.meta), upload=self.uploads)

    def build_decode(self, out: SchedulerOutput, pad_to: int | None = None) -> StepInputs:
        """`fill_decode` then `upload`."""
        return self.upload(self.fill_decode(out, pad_to))

    def build_prefill(self, out: SchedulerOutput) -> StepInputs:
        """`fill_prefill` then `upload`."""
        return self.upload(self.fill_prefill(out))

    def fill_decode(self, out: SchedulerOutput, pad_to: int | None = None) -> StepLayout:
        """One token a sequence; rows [n, pad_to) are padding. A sequence whose last token is
        still pending (overlap scheduling) gets 0 and a `pending_rows` entry."""
        self.wait_for_previous_upload()
        seqs, bs = out.seqs, self.block_size
        n = len(seqs)
        rows = pad_to or n
        starts = out.starts
        last_pos = np.array(starts, dtype=np.int64)
        lens = last_pos + 1
        ids, blocks, pending = [], [], []
        for i, (s, p) in enumerate(zip(seqs, starts)):
            tokens = s.token_ids
            if p < len(tokens):
                ids.append(tokens[p])
            else:
                ids.append(0)
                pending.append(i)
            blocks.append(s.block_table[p // bs])
        blocks = np.array(blocks, dtype=np.int64)
        self.input_ids.np[:n] = ids
        self.positions.np[:n] = last_pos
        self.slot_mapping.np[:n] = blocks * bs + last_pos % bs
        self.context_lens.np[:n] = lens
        self.input_ids.np[n:rows] = 0
        self.positions.np[n:rows] = 0
        self.slot_mapping.np[n:rows] = -1
        self.context_lens.np[n:rows] = 0
        self.block_table.arrange(out, rows)
        max_context = int(lens.max()) if n else 0
        return StepLayout(False, rows, rows, 0, 1, max_context, tuple(range(n)), n, pending_rows=tuple(pending),
                          pending_seq_ids=tuple(seqs[i].seq_id for i in pending))

    def fill_prefill(self, out: SchedulerOutput) -> StepLayout:
        """Each sequence computes tokens [num_computed, num_computed + num_new): its own tokens,
        then its draft tokens (speculative decoding), each of which samples: a drafted sequence
        appears in `sample_rows` once per position it samples at, its last token's first."""
        self.wait_for_previous_upload()
        bs = self.block_size
        q_lens, ctx_lens, sample_rows, logits_idx = [], [], [], []
        pending_rows, pending_seq_ids = [], []
        start = 0
        for i, (seq, first, count) in enumerate(zip(out.seqs, out.starts, out.num_new_tokens)):
            end = first + count
            pos = np.arange(first, end)
            draft = out.draft(i)
            known = len(seq.token_ids)
            if draft:
                own = known - first
                self.input_ids.np[start : start + own] = seq.token_ids[first:]
                self.input_ids.np[start + own : start + count] = draft
                sample_rows += [i] * (len(draft) + 1)
                logits_idx += range(start + own - 1, start + count)
            elif end > known:  # its last token is the previous step's pending sample
                assert end == known + 1, "one step ahead at most"
                self.input_ids.np[start : start + count - 1] = seq.token_ids[first:]
                self.input_ids.np[start + count - 1] = 0
                pending_rows.append(start + count - 1)
                pending_seq_ids.append(seq.seq_id)
            else:
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
            if out.sampling[i] and not draft:
                sample_rows.append(i)
                logits_idx.append(start - 1)
        rows = len(out.seqs)
        self.block_table.arrange(out, rows)
        self.context_lens.np[:rows] = ctx_lens
        self.query_start_loc.np[0] = 0
        self.query_start_loc.np[1 : rows + 1] = np.cumsum(q_lens)
        self.logits_indices.np[: len(logits_idx)] = logits_idx
        return StepLayout(True, start, rows, len(logits_idx), max(q_lens), max(ctx_lens), tuple(sample_rows), rows,
                          pending_rows=tuple(pending_rows), pending_seq_ids=tuple(pending_seq_ids))

    def can_fill_verify(self, out: SchedulerOutput, rows: int | None = None) -> bool:
        """Whether `out` is a verify step `fill_verify` lays out: every sequence decodes (its last
        token, then its draft tokens if it has some) and samples, nothing forks, and its rows
        (`rows`, padding included, else one a token) fit the buffers."""
        n = len(out.seqs)
        return (self.max_verify_rows > 0 and bool(out.draft_tokens) and out.num_decodes == n and not out.forks
                and all(out.sampling) and all(out.num_new_tokens[i] == 1 + len(out.draft(i)) for i in range(n))
                and (rows or out.num_tokens) <= self.max_verify_rows)

    def fill_verify(self, out: SchedulerOutput, pad_to: int | None = None) -> StepLayout:
        """A verify step as decode rows: sequence i's last token and then each of its draft tokens
        is a row of its own, whose context ends at that token (so the rows of one sequence see
        each other causally); rows [num_tokens, pad_to) are padding. Every row samples, in the
        order `fill_prefill` would give: what a decode CUDA graph of pad_to rows can run."""
        self.wait_for_previous_upload()
        seqs, bs = out.seqs, self.block_size
        rows = pad_to or out.num_tokens
        ids, positions, slots, row_seqs, sample_rows, pending = [], [], [], [], [], []
        for i, (seq, first, count) in enumerate(zip(seqs, out.starts, out.num_new_tokens)):
            draft = out.draft(i)
            known = seq.token_ids
            if first < len(known):
                ids.append(known[first])
            else:  # the previous step's sample, still on the device (overlap scheduling)
                assert not draft, "a drafted sequence's last token is known"
                pending.append(len(ids))
                ids.append(0)
            ids += draft
            pos = np.arange(first, first + count, dtype=np.int64)
            table = np.asarray(seq.block_table, dtype=np.int64)
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)
            row_seqs += [i] * count
            sample_rows += [i] * count
        n = len(ids)
        pos = np.concatenate(positions) if positions else np.zeros(0, dtype=np.int64)
        self.input_ids.np[:n] = ids
        self.positions.np[:n] = pos
        self.slot_mapping.np[:n] = np.concatenate(slots) if slots else pos
        self.context_lens.np[:n] = pos + 1
        self.row_seqs.np[:n] = row_seqs
        self.input_ids.np[n:rows] = 0
        self.positions.np[n:rows] = 0
        self.slot_mapping.np[n:rows] = -1
        self.context_lens.np[n:rows] = 0
        self.row_seqs.np[n:rows] = 0  # any table row: a context of 0 reads none of it
        self.block_table.arrange(out, len(seqs))
        max_context = int(pos.max()) + 1 if n else 0
        return StepLayout(False, rows, rows, 0, 1, max_context, tuple(sample_rows), len(seqs),
                          pending_rows=tuple(pending), pending_seq_ids=tuple(seqs[sample_rows[r]].seq_id
                                                                             for r in pending),
                          several_rows_a_sequence=True)

    def upload(self, layout: StepLayout) -> StepInputs:
        """Copy a filled step's host rows to the device and describe them. Decode uploads only
        what a decode step (and its graph) reads: row i is sequence i's token, so there are no
        query offsets or logits indices to send. The pieces a graph reads come first, so their
        device addresses depend on the row count alone (`PackedUpload`)."""
        rows, tokens = layout.num_rows, layout.num_tokens
        sample_rows = list(layout.sample_rows)
        num_seqs = rows if layout.num_seqs is None else layout.num_seqs
        if not layout.is_prefill:  # decode rows: a token each (a verify step's several a sequence)
            token_rows = [(self.input_ids, rows), (self.positions, rows), (self.slot_mapping, rows),
                          (self.context_lens, rows)]
            if layout.several_rows_a_sequence:
                # One table row at least: padding rows name row 0, even in an empty step.
                ids, positions, slots, context_lens, row_seqs, seq_tables = self._send(
                    token_rows + [(self.row_seqs, rows), (self.block_table.buffer, max(1, layout.num_seqs))])
                tables = self.row_block_tables[:rows]
                torch.index_select(seq_tables, 0, row_seqs, out=tables)
            else:
                ids, positions, slots, context_lens, tables = self._send(token_rows + [(self.block_table.buffer, rows)])
            meta = AttentionMetadata(
                is_prefill=False,
                slot_mapping=slots,
                block_tables=tables,
                context_lens=context_lens,
                query_start_loc=None,
                max_query_len=1,
                max_context_len=layout.max_context_len,
                logits_indices=None,
                several_rows_a_sequence=layout.several_rows_a_sequence,
            )
        else:
            ids, positions, slots, context_lens, query_start_loc, logits_indices, tables = self._send(
                [(self.input_ids, tokens), (self.positions, tokens), (self.slot_mapping, tokens),
                 (self.context_lens, rows), (self.query_start_loc, rows + 1), (self.logits_indices, layout.num_logits),
                 (self.block_table.buffer, rows)])
            meta = AttentionMetadata(
                is_prefill=True,
                slot_mapping=slots,
                block_tables=tables,
                context_lens=context_lens,
                query_start_loc=query_start_loc,
                max_query_len=layout.max_query_len,
                max_context_len=layout.max_context_len,
                logits_indices=logits_indices,
            )
        return self._finish(StepInputs(ids, positions, meta, sample_rows, num_seqs))

    def _send(self, pieces: list[tuple[CpuGpuBuffer, int]]) -> list[torch.Tensor]:
        """The first n rows of each buffer on the device: one transfer when packed, else one copy
        a buffer."""
        if self.packed is None:
            return [buffer.copy_to_gpu(n) for buffer, n in pieces]
        self.wait_for_previous_upload()  # the last transfer may still be reading the packed rows
        return self.packed.send([buffer.np[:n] for buffer, n in pieces])

"""The per-step facts every attention layer needs, handed down the model's forward explicitly."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    """Where this step's tokens sit in the paged cache.

    The batch is B sequences whose new tokens are laid end to end (T tokens in all).

    is_prefill: True for a prompt step (any number of new tokens a sequence), False for decode
        (exactly one new token a sequence, T == B).
    slot_mapping: int64 [T], cache slot of each new token (block_id * block_size + offset), or
        -1 for a token whose K/V must not be written (padding rows, prefix-cached tokens).
    block_tables: int32 [B, W], each sequence's blocks in order, padded with -1.
    context_lens: int32 [B], tokens each sequence attends to, the new ones included.
    query_start_loc: int32 [B + 1], offsets of each sequence's new tokens in the T tokens
        (prefill only: None in decode, where sequence i's token is row i).
    max_query_len, max_context_len: host-side maxima of the two (sizes for kernels).
    logits_indices: int64 [S], which of the T hidden states feed the LM head (the last token of
        each sequence that samples this step); None in decode, where every row does.
    backend_plan: what the step's attention backend worked out for itself, once for every layer,
        in its `prepare` (its own type; None before). Only that backend reads it.
    several_rows_a_sequence: decode rows of which several are consecutive tokens of one sequence
        (a speculative verify step laid out as decode rows, `StepInputBuilder.fill_verify`): each
        row has its own context length and block-table row, and reads the K/V that rows before
        it store in the same step, so every row's K/V is stored before any row attends.
    """

    is_prefill: bool
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_start_loc: torch.Tensor | None
    max_query_len: int
    max_context_len: int
    logits_indices: torch.Tensor | None
    backend_plan: object | None = None
    several_rows_a_sequence: bool = False

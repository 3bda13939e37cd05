"""How many slices the decode kernel cuts each sequence's context into (flash-decoding).

Two numbers, so that the launch stays capturable in a CUDA graph while the work follows the
real lengths:

* `grid_splits(...)`: the launch's split dimension, from shapes only (batch, KV heads, SMs):
  enough programs to give every SM about `PROGRAMS_PER_SM` of them when contexts are long.
  It is an upper bound, fixed when a graph is captured.
* `splits_for_lengths(...)`: what each sequence actually uses, computed inside the kernels from
  its context length (a device tensor, so a replay with new lengths re-decides): one split
  per `MIN_TOKENS_PER_SPLIT` tokens, at least 1, at most the grid's. Programs past a
  sequence's count exit at once; a sequence with one split is written straight to the output
  and skipped by the combine, and when the grid itself has one split there is no combine
  launch at all. This function is the torch mirror of that rule (tests and documentation).
"""

from __future__ import annotations

import functools

import torch
import triton

# An H100's SM count, used for CPU runs (interpreter tests) where there is no device to ask.
DEFAULT_NUM_SMS = 132
# Two programs per SM keep every SM busy when programs finish unevenly.
PROGRAMS_PER_SM = 2
# Fewer tokens than this per split costs more in the combine than it gains in parallelism. Read
# at each launch (`benchmarks/gpu_decode.py --min-tokens-per-split` tries others): at batch 1
# the split programs walk their tiles one after another, so shorter splits shorten that chain
# (a one-launch layer measured 2 us less at 64 on an H200).
MIN_TOKENS_PER_SPLIT = 128
# The combine holds all of a head's partials ([MAX_SPLITS, head_dim] fp32) in registers at once.
MAX_SPLITS = 64


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_NUM_SMS


def grid_splits(batch: int, num_kv_heads: int, max_context: int, sms: int) -> int:
    """The launch's split count: enough (batch x KV heads x splits) programs for
    `PROGRAMS_PER_SM` per SM, no more than a `max_context`-token sequence could use
    (`max_context` is the block table's reach), within [1, MAX_SPLITS]."""
    wanted = triton.cdiv(PROGRAMS_PER_SM * sms, max(batch * num_kv_heads, 1))
    usable = triton.cdiv(max(max_context, 1), MIN_TOKENS_PER_SPLIT)
    return max(1, min(wanted, usable, MAX_SPLITS))


def splits_for_lengths(context_lens: torch.Tensor, grid: int, min_tokens: int | None = None) -> torch.Tensor:
    """Splits each sequence uses (the kernels' `splits_for`): ceil(len / min_tokens) clamped to
    [1, grid] (min_tokens: MIN_TOKENS_PER_SPLIT as it is now by default). context_lens: int32
    [batch]; returns int32 [batch]."""
    min_tokens = MIN_TOKENS_PER_SPLIT if min_tokens is None else min_tokens
    wanted = (context_lens + min_tokens - 1) // min_tokens
    return wanted.clamp(1, grid).to(torch.int32)

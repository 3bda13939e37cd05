"""Log-probabilities as vLLM reports them: from the model's raw logits (log_softmax in float32,
before temperature, penalties or filtering), for the chosen token and the top k.

The device work is a few batched ops over the rows that asked; the host gets one small
transfer per step (the step already waits for its sampled tokens).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from fastgen.scheduler_output import SchedulerOutput
from fastgen.sequence import Sequence

# Prompt positions whose logits are formed at once for prompt_logprobs: a [rows, vocab] float32
# block, the size of what the sampler itself allocates for a batch of that many rows.
PROMPT_LOGPROB_ROWS = 256


@dataclass(frozen=True, slots=True)
class TopLogprobs:
    """One position's logprobs. token_ids[0] / logprobs[0]: the chosen token (the sampled one,
    or the prompt's next token) and its log-probability, `rank` its 1-based rank (the number of
    tokens at least as likely); then the top k, most likely first."""

    token_ids: list[int]
    logprobs: list[float]
    rank: int


def gather_logprobs(logits: torch.Tensor, chosen: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    """logits: [R, V] any float dtype; chosen: int64 [R]. Returns token ids int64 [R, 1 + k],
    their log-probabilities float32 [R, 1 + k] (chosen first, then the top k) and the chosen
    tokens' ranks int64 [R]."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen_logprobs = logprobs.gather(1, chosen.unsqueeze(1))
    ranks = (logprobs >= chosen_logprobs).sum(dim=-1)
    top_logprobs, top_ids = logprobs.topk(k, dim=-1)
    return torch.cat([chosen.unsqueeze(1), top_ids], 1), torch.cat([chosen_logprobs, top_logprobs], 1), ranks


def to_host(ids: torch.Tensor, logprobs: torch.Tensor, ranks: torch.Tensor, ks: Seq[int]) -> list[TopLogprobs]:
    """`gather_logprobs`' tensors as one TopLogprobs a row, row i keeping its top ks[i]."""
    rows = zip(ids.tolist(), logprobs.tolist(), ranks.tolist(), ks)
    return [TopLogprobs(i[: k + 1], lp[: k + 1], r) for i, lp, r, k in rows]


@dataclass(frozen=True, slots=True)
class SampledLogprobs:
    """A step's logprobs of its sampled tokens, computed on the device (`sampled_logprobs`) and
    read by `to_host` once the step's tokens are read. Split in two because the logits may be a
    CUDA graph's output, which the next step (launched before this one is read, with overlap
    scheduling) overwrites."""

    num_rows: int
    rows: list[int]
    ks: list[int]
    tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor]

    def to_host(self) -> list[TopLogprobs | None]:
        """One TopLogprobs for each row that asked, None for the others."""
        result: list[TopLogprobs | None] = [None] * self.num_rows
        for i, top in zip(self.rows, to_host(*self.tensors, self.ks)):
            result[i] = top
        return result


def sampled_logprobs(logits: torch.Tensor, seqs: Seq[Sequence], tokens: torch.Tensor) -> SampledLogprobs | None:
    """For each row of `seqs` whose request asked for logprobs, those of its sampled token
    (logits: the raw [B, V] the sampler got; tokens: int64 [B]), queued on the device; None when
    no row asked."""
    rows = [i for i, seq in enumerate(seqs) if seq.params.logprobs is not None]
    if not rows:
        return None
    ks = [seqs[i].params.logprobs for i in rows]
    index = torch.tensor(rows, dtype=torch.int64).to(logits.device, non_blocking=True)
    tensors = gather_logprobs(logits.index_select(0, index), tokens.index_select(0, index), max(ks))
    return SampledLogprobs(len(seqs), rows, ks, tensors)


@dataclass(frozen=True, slots=True)
class PromptLogprobChunk:
    """Hidden rows [rows[0], rows[1]) of a prefill step, whose logits score the prompt tokens
    `targets` (the first at prompt position `first_target`) of sequence `seq_id`, top k."""

    seq_id: int
    first_target: int
    rows: tuple[int, int]
    targets: list[int]
    k: int


def prompt_logprob_chunks(out: SchedulerOutput) -> list[PromptLogprobChunk]:
    """The prompt-logprob work of a step (sequences in batch order; none in decode), in chunks
    of at most PROMPT_LOGPROB_ROWS rows.

    The logits at position p score prompt token p + 1, so a chunk over positions [first, end)
    covers tokens first + 1 .. min(end, prompt length - 1). Only sequences that asked and have
    not produced a token yet (a recomputation after preemption would repeat what they have).
    """
    if not out.is_prefill:
        return []
    chunks: list[PromptLogprobChunk] = []
    start = 0
    for seq, first, count in zip(out.seqs, out.starts, out.num_new_tokens):
        k = seq.params.prompt_logprobs
        last = min(first + count, seq.num_prompt_tokens - 1)
        if k is not None and seq.num_output_tokens == 0 and last > first:
            for a in range(first, last, PROMPT_LOGPROB_ROWS):
                b = min(a + PROMPT_LOGPROB_ROWS, last)
                rows = (start + a - first, start + b - first)
                chunks.append(PromptLogprobChunk(seq.seq_id, a + 1, rows, seq.token_ids[a + 1 : b + 1], k))
        start += count
    return chunks


def add_prompt_logprobs(result: dict[int, tuple[int, list[TopLogprobs]]], chunks: Seq[PromptLogprobChunk],
                        index: int, logits: torch.Tensor) -> None:
    """Add chunk `index`'s logprobs (logits: its rows' [rows, V]) to `result`: seq_id -> (position
    of the first prompt token covered, one TopLogprobs a token). Chunks arrive in order."""
    chunk = chunks[index]
    targets = torch.tensor(chunk.targets, dtype=torch.int64).to(logits.device)
    tops = to_host(*gather_logprobs(logits, targets, chunk.k), [chunk.k] * len(chunk.targets))
    result.setdefault(chunk.seq_id, (chunk.first_target, []))[1].extend(tops)

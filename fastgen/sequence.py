"""One request's tokens and its place in the paged KV cache: a plain record the scheduler and
the block manager update (no tensors; sampling state lives in the worker's sampler)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from fastgen.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    PENDING_FORK = "pending_fork"  # one of n completions, waiting to start from its parent's prompt


class FinishReason(str, enum.Enum):
    STOP = "stop"  # end-of-sequence, a stop token or a stop string
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"  # aborted by its consumer or the application
    ERROR = "error"  # a step failed on this request alone (RequestOutput.error says how)


@dataclass(slots=True, eq=False)
class Sequence:
    """A request as the scheduler and block manager see it.

    `token_ids` holds the prompt followed by every generated token. `num_computed_tokens` counts
    the leading tokens whose K/V are in the cache; the next step computes from there.
    `num_cached_tokens` counts the leading tokens whose blocks came from the prefix cache (their
    slots are never written again, see the runner). `block_table` lists the cache blocks that hold
    the sequence, in order; `block_hashes` the chained keys of its full blocks, computed once.

    Overlap scheduling runs one step ahead of the host: a step is scheduled and launched before
    the previous one's tokens are read. `num_inflight_tokens` counts the tokens launched steps
    are computing (their K/V not yet confirmed in the cache), `num_pending_tokens` the tokens
    they sample whose ids the host has not read yet; pending tokens follow `token_ids`, so the
    sequence is `num_tokens` long as far as scheduling goes. Both are 0 between synchronous steps.
    """

    seq_id: int
    token_ids: list[int]
    params: SamplingParams
    num_prompt_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_keyed_blocks: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    num_inflight_tokens: int = 0
    num_pending_tokens: int = 0

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.token_ids)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def num_tokens(self) -> int:
        """Tokens known or being sampled: `token_ids` and the pending ones after them."""
        return len(self.token_ids) + self.num_pending_tokens

    @property
    def num_started_tokens(self) -> int:
        """Tokens computed or being computed: the position the next step computes from."""
        return self.num_computed_tokens + self.num_inflight_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens no step has computed or taken up yet (1: the sequence decodes next)."""
        return len(self.token_ids) + self.num_pending_tokens - self.num_computed_tokens - self.num_inflight_tokens

    @property
    def in_launched_step(self) -> bool:
        """Whether a launched step still computes or samples for it (it may not be re-admitted
        before that step's results are in)."""
        return bool(self.num_inflight_tokens or self.num_pending_tokens)

    def block_tokens(self, index: int, block_size: int) -> list[int]:
        return self.token_ids[index * block_size : (index + 1) * block_size]

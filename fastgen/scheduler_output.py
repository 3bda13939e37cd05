"""The scheduler's plan for one step (`SchedulerOutput`, with the forks it starts), as plain data.

It crosses every layer above the scheduler (the model runner, the CUDA graphs, the tensor-parallel
rank 0 runner), so it lives below all of them: they read it, only the scheduler writes it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastgen.sequence import Sequence

if TYPE_CHECKING:  # torch: not for `import fastgen`
    import torch


@dataclass(frozen=True, slots=True)
class GrammarBitmask:
    """Which tokens the step's constrained sequences may sample (structured outputs).

    seq_ids: the sequences, among those that sample in this step, whose output follows a grammar.
    fill: returns an int32 CPU tensor [len(seq_ids), ceil(vocab / 32)] whose bit t % 32 of word
        t // 32 in row i is set when sequence seq_ids[i] may sample token t (xgrammar's layout).
        The runner calls it once, after launching the forward: on a GPU the host computes the
        masks while the device runs the step (why this is a callable over the engine's matchers
        rather than the masks themselves).
    """

    seq_ids: tuple[int, ...]
    fill: Callable[[], "torch.Tensor"]


@dataclass(frozen=True, slots=True)
class Fork:
    """Children that start from `seqs[parent_index]` in this step (its prompt completes): after
    the forward, the worker copies each (source, destination) block of `block_copies`, and each
    child samples its first token from the parent's logits row."""

    parent_index: int
    children: tuple[Sequence, ...]
    block_copies: tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """The scheduler's decision for one step, handed to the runner as plain data.

    seqs: sequences in batch order. num_new_tokens: tokens each computes, starting at its
    `num_computed_tokens`. is_prefill: a step with prompt tokens (any number a sequence) or draft
    tokens, or a decode step (one token a sequence, the CUDA graphs' and compiled decode graphs'
    kind). num_decodes: the first num_decodes sequences decode (their last token, and their draft
    tokens when they have some), the rest compute prompt chunks (set by the scheduler; 0 in steps
    made by hand, such as graph capture's empty step). A prefill step with decodes is a mixed step.
    draft_tokens: speculative decoding's proposals, one tuple per decoding sequence (the first
    num_decodes; () for none, and () altogether in a step without any): sequence i computes its
    last token and then draft_tokens[i] (num_new_tokens[i] = 1 + len(draft_tokens[i])), and
    samples at each of those positions; the runner reports how many drafted tokens the samples
    accept (`fastgen.speculative.verify`).

    The facts the worker's per-sequence state follows (block-table rows, sampler generators),
    so that it never has to infer a change:
    new_tables[i]: sequence i got its block table in this step (admitted, or re-admitted after
        preemption): its whole `block_table` is new.
    new_block_ids[i]: blocks appended to sequence i's table in this step (a decode step that
        crossed into a new block); empty when the table is new or unchanged.
    preempted_seq_ids: sequences whose blocks were taken back since the previous output; they
        will be re-admitted later with new tables.
    finished_seq_ids: sequences that ended (finished or aborted) since the previous output.
    forks: children forked in this step (see `Fork`); they are not in `seqs` (they compute
        nothing), but they sample, after the sequences of `seqs`, in `forked_seqs` order.
    grammar: the token masks of the sampling sequences that follow a grammar (None: none does);
        set by the engine after scheduling, read by the sampler.
    starts[i]: the first position sequence i computes (its tokens up to there are computed, or
        being computed by a launched step). sampling[i]: whether sequence i reaches its last
        token (pending ones included), so a token is sampled for it. Both are worked out from
        the sequences when the output is made, before the scheduler marks the step's tokens as
        taken up (`Sequence.num_inflight_tokens`): read them here, not from the sequences.
    """

    seqs: list[Sequence]
    num_new_tokens: list[int]
    is_prefill: bool
    new_tables: list[bool]
    new_block_ids: list[tuple[int, ...]]
    preempted_seq_ids: tuple[int, ...] = ()
    finished_seq_ids: tuple[int, ...] = ()
    forks: tuple[Fork, ...] = ()
    num_decodes: int = 0
    grammar: GrammarBitmask | None = None
    draft_tokens: tuple[tuple[int, ...], ...] = ()
    starts: tuple[int, ...] | None = None
    sampling: tuple[bool, ...] | None = None

    def __post_init__(self) -> None:
        if self.starts is None:
            object.__setattr__(self, "starts", tuple(seq.num_started_tokens for seq in self.seqs))
        if self.sampling is None:
            object.__setattr__(self, "sampling", tuple(
                start + n - len(self.draft(i)) == seq.num_tokens
                for i, (seq, start, n) in enumerate(zip(self.seqs, self.starts, self.num_new_tokens))))

    @property
    def forked_seqs(self) -> tuple[Sequence, ...]:
        return tuple(child for fork in self.forks for child in fork.children)

    @classmethod
    def empty_decode(cls) -> "SchedulerOutput":
        """A decode step with no sequences: what graph capture and the memory profile pad out."""
        return cls([], [], False, [], [])

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt tokens this step computes (every token but the decodes' and their drafts')."""
        return self.num_tokens - self.num_decodes - self.num_draft_tokens

    @property
    def num_draft_tokens(self) -> int:
        return sum(len(draft) for draft in self.draft_tokens)

    def draft(self, index: int) -> tuple[int, ...]:
        """Sequence `index`'s draft tokens (() for none)."""
        return self.draft_tokens[index] if index < len(self.draft_tokens) else ()

    @property
    def sampling_seqs(self) -> list[Sequence]:
        """The sequences that sample a token in this step, in the sampler's order (the
        sequences of `seqs` that reach their last token, then the forked children)."""
        return [*(seq for i, seq in enumerate(self.seqs) if self.samples(i)), *self.forked_seqs]

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def samples(self, index: int) -> bool:
        """Whether sequence `index` reaches its last token this step, so a token is sampled."""
        return self.sampling[index]

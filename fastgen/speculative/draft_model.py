"""Draft-model proposals: a smaller model of the same vocabulary runs ahead of each drafting
sequence greedily, in a paged KV cache of its own.

Each drafting sequence has a twin here (a `Sequence` of the draft's cache: its tokens are the
target's, its blocks the draft cache's). A proposal first brings the twin up to the target's
tokens, computing only what its cache lacks: the whole prompt the first time (its full blocks
may come from the draft cache's own prefix cache), then the tokens the last verification kept
beyond what the draft had guessed, and always the last token, whose logits give the first
drafted token. Each further drafted token is one decode step of the draft model over every
sequence still drafting. So a step of B sequences drafting up to k tokens runs the draft model
k times, whatever B is: once over the catch-up rows, then k - 1 one-row-a-sequence decode steps
(the draft runner's CUDA graphs or compiled CPU step run them).

The drafted tokens' own K/V stay in the draft cache after the proposal: the twin remembers
which tokens it wrote past the target's (`written`), and the next proposal keeps as many of
them as the target accepted, so an accepted draft is never computed twice.

Drafts are the draft model's greedy choice, so a proposal is certain given the tokens before it,
and the verifier's rule (keep a drafted token iff the target's sample equals it) is rejection
sampling with a one-point proposal: the output keeps the target's distribution under any
sampling settings, and equals the target's greedy output under greedy ones.

A failure inside the draft model costs only this step's drafts: the proposer logs it, forgets
every twin (their cache rows are not trusted) and the step goes on without drafts.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable
from typing import TYPE_CHECKING

from fastgen.sampling_params import SamplingParams
from fastgen.scheduler_output import SchedulerOutput
from fastgen.sequence import Sequence

if TYPE_CHECKING:
    from fastgen.engine.block_manager import BlockManager
    from fastgen.step_runner import StepRunner

logger = logging.getLogger(__name__)

GREEDY = SamplingParams(temperature=0.0)
WARM_UP_SEQ_ID = -1  # no engine sequence has it (theirs count up from 0)


class _Twin:
    """A drafting sequence as the draft cache holds it: `seq` has the target's tokens up to the
    last proposal and the draft cache's blocks; `written` the drafted tokens whose K/V follow
    them in the cache."""

    __slots__ = ("seq", "written")

    def __init__(self, seq: Sequence):
        self.seq = seq
        self.written: tuple[int, ...] = ()

    def catch_up(self, token_ids: list[int]) -> bool:
        """Take the target's tokens (which extend the twin's): the cache stays valid up to the
        first drafted token the target did not keep. Whether more tokens came than a
        verification of the last draft can bring (its drafts and the sample after them): the
        sequence went on without drafting."""
        seq = self.seq
        old = len(seq.token_ids)
        fell_behind = len(token_ids) - old > len(self.written) + 2
        assert token_ids[:old] == seq.token_ids, "a target sequence's tokens only grow"
        valid = seq.num_computed_tokens
        if valid == old:  # the drafted tokens written past it count where the target kept them
            for drafted, kept in zip(self.written, token_ids[old:]):
                if drafted != kept:
                    break
                valid += 1
        seq.token_ids.extend(token_ids[old:])
        seq.num_computed_tokens = min(valid, len(token_ids) - 1)  # the last one gives the logits
        self.written = ()
        return fell_behind


class DraftModelProposer:
    """Proposes each drafting sequence's next tokens with a draft model.

    runner: a `StepRunner` over the draft model (its own KV cache), blocks: the `BlockManager` of
    that cache, max_num_batched_tokens: most tokens one of the runner's steps takes (a longer
    catch-up runs in chunks), vocab_size: the draft model's (a sequence holding a token past it
    never drafts: the draft model could not embed it)."""

    def __init__(self, runner: StepRunner, blocks: BlockManager, max_num_batched_tokens: int, vocab_size: int):
        self.runner = runner
        self.blocks = blocks
        self.max_num_batched_tokens = max_num_batched_tokens
        self.vocab_size = vocab_size
        self.twins: OrderedDict[int, _Twin] = OrderedDict()  # by seq_id, least recently drafted first
        self.undraftable: set[int] = set()  # seq_ids holding a token past the draft's vocabulary
        # Whether the last proposal computed a sequence's history (a first draft, or one after a
        # long pause): a prefill's cost, once a sequence, that says nothing of what drafting costs.
        self.prefilled_history = False

    # ---- proposals -------------------------------------------------------------------------
    def propose(self, seqs: list[Sequence], lengths: list[int]) -> list[tuple[int, ...]]:
        """Greedy drafts of lengths[i] tokens (fewer where the draft cache has no room) to follow
        each sequence's tokens."""
        try:
            return self._propose(seqs, lengths)
        except BaseException as exc:
            # Part-way, twins may hold drafted tokens and rows the runner never finished: none is
            # trusted again (each is rebuilt from the cache's prefix at its next draft).
            self.runner.recover(None)
            self.release(list(self.twins))
            if not isinstance(exc, Exception):
                raise
            logger.exception("the draft model failed; this step verifies no drafts")
            return [()] * len(seqs)

    def _propose(self, seqs: list[Sequence], lengths: list[int]) -> list[tuple[int, ...]]:
        keep = {seq.seq_id for seq in seqs}
        self.prefilled_history = False
        twins: list[_Twin | None] = []
        for seq, length in zip(seqs, lengths):
            twin = self._ready_twin(seq, length, keep)
            twins.append(twin)
            if twin is not None:
                self.twins.move_to_end(seq.seq_id)
        drafts: list[list[int]] = [[] for _ in seqs]
        wanted = [len(seq) + length - 1 if twin is not None else 0
                  for seq, length, twin in zip(seqs, lengths, twins)]
        live = [i for i, twin in enumerate(twins) if twin is not None]
        if not live:
            return [()] * len(seqs)
        self._catch_up([twins[i] for i in live], [drafts[i] for i in live])
        for i in live:
            self.blocks.cache_computed_blocks(twins[i].seq)
        # One decode step of the draft model for each further token, over the sequences that want
        # it (the cache holds their slots up to `wanted`, taken by `_ready_twin`).
        while live := [i for i in live if len(twins[i].seq.token_ids) < wanted[i]]:
            for i in live:
                twins[i].seq.token_ids.append(drafts[i][-1])
            batch = [twins[i].seq for i in live]
            sampled = self._run(SchedulerOutput(
                batch, [1] * len(batch), False, [False] * len(batch), [()] * len(batch),
                starts=tuple(len(seq.token_ids) - 1 for seq in batch), sampling=(True,) * len(batch)))
            for i, token in zip(live, sampled):
                twins[i].seq.num_computed_tokens += 1
                drafts[i].append(token)
        for seq, twin, draft in zip(seqs, twins, drafts):
            if twin is not None:  # back to the target's tokens; the drafted ones stay written
                twin.written = tuple(twin.seq.token_ids[len(seq):])
                del twin.seq.token_ids[len(seq):]
                twin.seq.num_computed_tokens = len(seq)
        return [tuple(draft) for draft in drafts]

    def _ready_twin(self, seq: Sequence, length: int, keep: set[int]) -> _Twin | None:
        """The sequence's twin caught up to its tokens, with cache slots for all but the last of
        its drafted tokens (the last is never fed to the draft model); None where the draft cache
        has no room even after dropping the twins of sequences not drafting now, or where the
        sequence holds a token the draft model cannot embed."""
        blocks = self.blocks
        if seq.seq_id in self.undraftable:
            return None
        twin = self.twins.get(seq.seq_id)
        new_tokens = seq.token_ids[len(twin.seq.token_ids):] if twin is not None else seq.token_ids
        if new_tokens and max(new_tokens) >= self.vocab_size:
            self.undraftable.add(seq.seq_id)
            self.release([seq.seq_id])
            return None
        if twin is None:
            twin_seq = Sequence(seq.seq_id, list(seq.token_ids), GREEDY)
            if not self._make_room(lambda: blocks.can_allocate(twin_seq), keep):
                return None
            blocks.allocate(twin_seq)
            twin = self.twins[seq.seq_id] = _Twin(twin_seq)
            self.prefilled_history = True  # its prompt and output, at least what no block holds
        elif twin.catch_up(seq.token_ids):
            self.prefilled_history = True
        needed = blocks.blocks_needed(len(seq) + length - 1) - len(twin.seq.block_table)
        if needed > 0 and not self._make_room(lambda: blocks.num_free_blocks >= needed, keep):
            self.release([seq.seq_id])
            return None
        blocks.append_slots(twin.seq, length - 1)
        return twin

    def _make_room(self, fits, keep: set[int]) -> bool:
        """Whether `fits()` once the least recently drafted twins not in `keep` are dropped as
        needed: a twin costs only a catch-up to rebuild, and the sequences drafting now are the
        ones whose twins pay."""
        while not fits():
            idle = next((seq_id for seq_id in self.twins if seq_id not in keep), None)
            if idle is None:
                return False
            self.release([idle])
        return True

    def _catch_up(self, twins: list[_Twin], drafts: list[list[int]]) -> None:
        """Compute each twin's tokens its cache lacks, in steps of at most max_num_batched_tokens
        tokens; the first drafted token of each comes from its last token's logits."""
        while todo := [k for k, twin in enumerate(twins) if twin.seq.num_computed_tokens < len(twin.seq.token_ids)]:
            budget = self.max_num_batched_tokens
            batch, counts = [], []
            for k in todo:
                if budget <= 0:
                    break
                seq = twins[k].seq
                n = min(len(seq.token_ids) - seq.num_computed_tokens, budget)
                batch.append(k)
                counts.append(n)
                budget -= n
            seqs = [twins[k].seq for k in batch]
            starts = tuple(seq.num_computed_tokens for seq in seqs)
            sampling = tuple(start + n == len(seq.token_ids) for seq, start, n in zip(seqs, starts, counts))
            # One token each (the target kept what was drafted, or only its own sample is new):
            # a decode step, which the runner's CUDA graphs and compiled CPU step take, unless a
            # token is in a prefix-cached block (only a prefill step leaves those slots unwritten).
            prefill = max(counts) > 1 or any(start < seq.num_cached_tokens for seq, start in zip(seqs, starts))
            sampled = self._run(SchedulerOutput(seqs, counts, prefill, [True] * len(seqs), [()] * len(seqs),
                                                starts=starts, sampling=sampling))
            for k, seq, n, token in zip(batch, seqs, counts, sampled):
                seq.num_computed_tokens += n
                if token is not None:
                    drafts[k].append(token)

    def _run(self, out: SchedulerOutput) -> list[int | None]:
        """One step of the draft model; the greedy token of each sequence that samples."""
        return self.runner.collect(self.runner.launch(out)).sampled

    def warm_up(self, num_tokens: int = 16) -> None:
        """One proposal for a throwaway sequence (its prompt's catch-up, then a decode step), so
        the draft model's one-time costs (its compiled CPU graph) are paid now, not in whichever
        step first drafts. Raises what the draft model raises."""
        seq = Sequence(WARM_UP_SEQ_ID, [1] * max(2, num_tokens), GREEDY)
        try:
            self._propose([seq], [2])
        finally:
            self.release([WARM_UP_SEQ_ID])

    # ---- bookkeeping -----------------------------------------------------------------------
    def release(self, seq_ids: Iterable[int]) -> None:
        """Free the twins of sequences that ended (or that the cache needs room from)."""
        freed = []
        for seq_id in seq_ids:
            twin = self.twins.pop(seq_id, None)
            if twin is not None:
                self.blocks.free(twin.seq)
                freed.append(seq_id)
        if freed:
            self.runner.forget((), freed)

    def forget(self, seq_ids: Iterable[int]) -> None:
        """Sequences that ended: their twins go, and nothing of them is kept."""
        seq_ids = tuple(seq_ids)
        self.release(seq_ids)
        self.undraftable.difference_update(seq_ids)

    def shutdown(self) -> None:
        self.runner.shutdown()

"""Continuous batching: which sequences run in the next step, and how many tokens each computes.

Policy: one step, one token budget (`max_num_batched_tokens`), decodes first. Every running
sequence whose prompt is computed gets its next token's slot; when one needs a new block and none
is free, the newest running sequence not yet given its slot is preempted: its blocks are freed and
it goes back to the front of the queue, to be recomputed later (its full blocks often come
straight back from the prefix cache). Prompt chunks fill what remains of the budget in the same
step: prompts already split into chunks first, then waiting sequences admitted in arrival order
while `max_num_seqs` and free blocks allow. A prompt longer than the budget is computed in chunks
over several steps, and while the step also decodes, its prompt chunks are at most
`long_prefill_token_threshold` tokens in all, the prompts with the fewest tokens left first: a
long prompt then costs each running stream several short steps instead of one long freeze, and
a short prompt arriving behind it is computed first. The step is a decode step when it has no
prompt tokens (CUDA graphs, the compiled CPU decode graphs), else a prefill step whose decode
rows are one-token queries.

Speculative decoding (a `Drafter`): once every decode has its slot, decoding sequences propose
draft tokens in batch order while the budget lasts, each within its max_tokens and
max_model_len; a draft gets blocks only from the free list, leaving a block free for each
decoding sequence (it never preempts anyone, now or in the next step), and is cut to the room
it has. After the step a sequence keeps the drafted tokens the samples accepted and
the sample after them; `num_computed_tokens` counts only those, so the cache slots of rejected
drafts are simply written again later, and only blocks of kept tokens are ever keyed in the
prefix cache.

Overlap scheduling: `schedule()` marks what the step takes up (`Sequence.num_inflight_tokens`,
`num_pending_tokens`) and `postprocess` settles it, so the next step may be scheduled before this
one's tokens are read: a decoding sequence whose token is still pending decodes again at the
position after it (the runner feeds that token on the device), unless its pending tokens already
reach max_tokens or max_model_len. A sequence that the late token finishes (end-of-sequence, a
stop token or string) has one step too many computed for it: `postprocess` drops that step's
token, and its K/V slot, never counted as computed, is never keyed in the prefix cache. A
sequence preempted while a launched step still works for it keeps the token that step brings,
and is re-admitted only once no launched step has it (`Sequence.in_launched_step`).

Parallel sampling (n > 1): the other completions of a prompt wait (`add_forks`) and fork from
the first once its prompt is computed (see `fastgen.engine.forks`).

Isolation: when a step fails, every sequence of its batch becomes a suspect (`isolate`). All
running sequences are preempted, suspects first, and until the last suspect finishes the
scheduler runs one sequence at a time; so a later failure happens to one sequence alone and is
that sequence's own, and a failure that came from batching (or was transient) costs nobody
their request.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING

from fastgen.engine.block_manager import BlockManager
from fastgen.engine.forks import PendingForks
from fastgen.scheduler_output import SchedulerOutput
from fastgen.sequence import FinishReason, Sequence, SequenceStatus

if TYPE_CHECKING:
    from fastgen.speculative.drafts import Drafter


# Capped steps in a row that may pass over a prompt under way before it goes first.
PASSED_OVER_LIMIT = 8


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: Iterable[int] = (),
        long_prefill_token_threshold: int = 0,
        drafter: Drafter | None = None,
    ):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.long_prefill_token_threshold = long_prefill_token_threshold  # 0: chunks are not capped
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # Facts for the next output (see SchedulerOutput); kept until a step is formed.
        self._preempted: list[int] = []
        self._finished: list[int] = []
        self.pending_forks = PendingForks()
        self.suspects: set[int] = set()  # seq_ids of sequences in a failed step (see `isolate`)
        # Prompts under way that capped steps passed over, and for how many steps in a row.
        self._passed_over: dict[int, int] = {}
        self._never_scheduled: set[int] = set()  # seq_ids added and not yet admitted
        self.drafter = drafter

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        self._never_scheduled.add(seq.seq_id)

    @property
    def num_new_waiting(self) -> int:
        """Requests waiting for their first schedule (what max_waiting_requests caps): not the
        preempted sequences and forked children that also wait in the queue."""
        return len(self._never_scheduled)

    def add_forks(self, parent: Sequence, children: list[Sequence]) -> None:
        """Queue `children` (same prompt as `parent`, which was added) to fork from `parent` once
        its prompt is computed."""
        self.pending_forks.add(parent, children)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- scheduling ----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput | None:
        """Pick the next step's batch; None when there is nothing to run."""
        out = self._schedule_step()
        if out is None:
            return None
        if self.pending_forks:
            forks, no_room = self.pending_forks.fork(out, self.running, self.seq_limit, self.block_manager)
            self._queue_first(no_room)
            out = dataclasses.replace(out, forks=forks)
        # Preemptions made just now, while forming a decode batch, are part of these facts.
        preempted, finished = self.pop_facts()
        out = dataclasses.replace(out, preempted_seq_ids=preempted, finished_seq_ids=finished)
        self._take_up(out)
        return out

    @staticmethod
    def _take_up(out: SchedulerOutput) -> None:
        """Mark the tokens the step computes as in flight, and those it samples as pending."""
        for seq, n, samples in zip(out.seqs, out.num_new_tokens, out.sampling):
            seq.num_inflight_tokens += n
            if samples:
                seq.num_pending_tokens += 1
        for seq in out.forked_seqs:
            seq.num_pending_tokens += 1

    def _settle(self, out: SchedulerOutput) -> None:
        """Undo `_take_up`: the step's results are in (or lost)."""
        for seq, n, samples in zip(out.seqs, out.num_new_tokens, out.sampling):
            seq.num_inflight_tokens -= n
            seq.num_pending_tokens -= samples
        for seq in out.forked_seqs:
            seq.num_pending_tokens -= 1

    def abandon(self, out: SchedulerOutput) -> None:
        """A scheduled step failed or was given up before its results were read: nothing of it
        was applied. Its sequences compute again what it would have (after a failure they are
        isolated too, see `isolate`); children it forked, whose prompt it was to copy, go back to
        the queue to compute their prompt themselves."""
        self._settle(out)
        for seq in out.forked_seqs:
            if seq.status is SequenceStatus.RUNNING:
                self._preempt(seq)

    def pop_facts(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The preempted and finished seq_ids not yet handed out, which the caller now owns."""
        facts = tuple(self._preempted), tuple(self._finished)
        self._preempted.clear()
        self._finished.clear()
        return facts

    @property
    def seq_limit(self) -> int:
        """Most sequences running at once: one while any suspect is left (see `isolate`)."""
        return 1 if self.suspects else self.max_num_seqs

    def isolate(self, seqs: Iterable[Sequence]) -> None:
        """A step over `seqs` failed (nothing of it was applied): make them suspects and preempt
        every running sequence, the suspects to the front of the queue in batch order, so that
        each runs alone until it finishes."""
        # A sequence that ended meanwhile (the step before, read after this one was scheduled,
        # finished it) is no suspect: nothing would ever clear it.
        seqs = [seq for seq in seqs if seq.status is not SequenceStatus.FINISHED]
        self.suspects.update(seq.seq_id for seq in seqs)
        others = [seq for seq in self.running if seq.seq_id not in self.suspects]
        for seq in reversed(seqs + others):  # each goes to the front: the first ends up first
            if seq.status is SequenceStatus.RUNNING:
                self._preempt(seq)

    def _schedule_step(self) -> SchedulerOutput | None:
        """Decodes, then prompt chunks in what the budget leaves (capped while there are decodes):
        a prefill step when any prompt token runs, else a decode step; None when nothing runs."""
        decodes, new_blocks = self._schedule_decodes()
        drafts = self._schedule_drafts(decodes, new_blocks) if self.drafter is not None and decodes else ()
        decode_counts = [1 + len(draft) for draft in drafts] if drafts else [1] * len(decodes)
        cap = self.long_prefill_token_threshold if decodes and self.long_prefill_token_threshold else None
        prompts, counts, new_tables = self._schedule_prompt_chunks(self.max_num_batched_tokens - sum(decode_counts),
                                                                   cap)
        n = len(decodes)
        if not prompts and not drafts:
            if not decodes:
                return None
            # Every decode computes its last token (pending or known) and samples the next.
            starts = tuple([seq.num_tokens - 1 for seq in decodes])
            return SchedulerOutput(decodes, [1] * n, False, [False] * n, new_blocks, num_decodes=n, starts=starts,
                                   sampling=(True,) * n)
        return SchedulerOutput(decodes + prompts, decode_counts + counts, True, [False] * n + new_tables,
                               new_blocks + [()] * len(prompts), num_decodes=n, draft_tokens=drafts)

    def _schedule_decodes(self) -> tuple[list[Sequence], list[tuple[int, ...]]]:
        """A slot for the next token of every running sequence whose prompt is computed (one
        token left to compute), preempting as blocks run out; the sequences and their new blocks.

        Runs every step for every running sequence, so the usual case (the slot is in the
        sequence's last block, or a free block gives it one) is written out inline."""
        scheduled: list[Sequence] = []
        new_blocks: list[tuple[int, ...]] = []
        bm = self.block_manager
        bs = bm.block_size
        # `num_uncomputed_tokens == 1`, spelled out: this runs for every running sequence.
        queue = deque([seq for seq in self.running
                       if len(seq.token_ids) + seq.num_pending_tokens - seq.num_computed_tokens
                       - seq.num_inflight_tokens == 1 and not (seq.num_pending_tokens and self._ends_pending(seq))])
        while queue:
            seq = queue.popleft()
            # Blocks the sequence needs for its tokens, the pending ones included.
            needed = -(-(len(seq.token_ids) + seq.num_pending_tokens) // bs)
            if len(seq.block_table) >= needed:
                new_blocks.append(())
                scheduled.append(seq)
                continue
            while not bm.num_free_blocks:
                # The newest running sequence not given its slot yet (a later decode or a prompt
                # in progress), else this one.
                victim = next((s for s in reversed(self.running) if s is not seq and s not in scheduled), seq)
                if victim in queue:
                    queue.remove(victim)
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                new_blocks.append(bm.append_slot(seq))
                scheduled.append(seq)
        return scheduled, new_blocks

    def _ends_pending(self, seq: Sequence) -> bool:
        """Whether the sequence's pending tokens take it to max_tokens or max_model_len, so it
        ends once they are read and has nothing left to decode (overlap scheduling)."""
        return seq.num_pending_tokens > 0 and (
            seq.num_output_tokens + seq.num_pending_tokens >= seq.params.max_tokens
            or seq.num_tokens >= self.max_model_len)

    def _schedule_drafts(self, decodes: list[Sequence], new_blocks: list[tuple[int, ...]]
                         ) -> tuple[tuple[int, ...], ...]:
        """Draft tokens for the scheduled decodes (each within the budget, its limits and the
        blocks it can get without preempting); () when none drafts. Blocks taken for a draft are
        added to that decode's new blocks."""
        limit = self.drafter.config.disable_by_batch_size
        if limit is not None and len(decodes) >= limit:
            return ()
        bm = self.block_manager

        def slots(seq: Sequence) -> int:
            # Positions len(seq) .. len(seq) + k - 1 hold the drafts' K/V. A free block for each
            # decoding sequence stays free: the next step's decodes may each need one, and a
            # draft that took it would make that step preempt someone.
            spare = max(0, bm.num_free_blocks - len(decodes))
            return (len(seq.block_table) + spare) * bm.block_size - len(seq)

        # The sample after the last drafted token is an output token too: k drafts make up to
        # k + 1 tokens, all within max_tokens and max_model_len; and none past the slots the
        # sequence could get now (so a draft model computes no draft that cannot be verified;
        # the cut below shares the spare blocks out).
        rooms = [min(seq.params.max_tokens - seq.num_output_tokens - 1, self.max_model_len - len(seq) - 1, slots(seq))
                 for seq in decodes]
        proposed = self.drafter.propose_batch(decodes, rooms, self.max_num_batched_tokens - len(decodes))
        drafts: list[tuple[int, ...]] = []
        for i, (seq, draft) in enumerate(zip(decodes, proposed)):
            if draft:
                if slots(seq) < len(draft):
                    draft = draft[: max(0, slots(seq))]
                    self.drafter.drafts_cut = True
                new_blocks[i] += bm.append_slots(seq, len(draft))
            drafts.append(draft)
        return tuple(drafts) if any(drafts) else ()

    def _schedule_prompt_chunks(self, budget: int, cap: int | None) -> tuple[list[Sequence], list[int], list[bool]]:
        """Prompt chunks within `budget` tokens. Returns the sequences, their token counts and
        whether each got its block table now.

        cap None (no sequence decodes, or no threshold): prompts in progress first, then waiting
        ones admitted in order, as many as the budget holds. Else the step decodes, and its
        prompt tokens are at most `cap` in all: so no step carries more than one cap of prompt
        work beside the streams, however many prompts are under way (a cap a prompt let several
        prompts' chunks share a step, each as costly as the last at a long context). The cap goes
        to the prompts with the fewest tokens left first, a waiting prompt admitted when it is
        shorter than those in progress: a short prompt arriving behind a long one is not held
        up for the whole of it."""
        if cap is not None:
            return self._capped_prompt_chunks(min(budget, cap))
        self._passed_over = {}
        seqs, counts, new_tables = [], [], []
        for seq in self.running:
            if budget <= 0:
                break
            remaining = seq.num_uncomputed_tokens
            if remaining > 1:  # one left is a decode (`_schedule_decodes`)
                n = min(remaining, budget)
                seqs.append(seq)
                counts.append(n)
                new_tables.append(False)
                budget -= n
        while budget > 0 and (seq := self._admissible()) is not None:
            self._admit(seq)
            n = min(seq.num_uncomputed_tokens, budget)
            seqs.append(seq)
            counts.append(n)
            new_tables.append(True)
            budget -= n
        return seqs, counts, new_tables

    def _capped_prompt_chunks(self, budget: int) -> tuple[list[Sequence], list[int], list[bool]]:
        """`_schedule_prompt_chunks` while sequences decode: shortest remaining prompt first, but
        a prompt under way that PASSED_OVER_LIMIT capped steps in a row gave nothing goes first
        (so a stream of short arrivals cannot hold a long prompt back for good)."""
        seqs, counts, new_tables = [], [], []
        passed = self._passed_over
        in_progress = sorted((seq for seq in self.running if seq.num_uncomputed_tokens > 1),
                             key=lambda seq: (passed.get(seq.seq_id, 0) < PASSED_OVER_LIMIT,
                                              seq.num_uncomputed_tokens))
        overdue = bool(in_progress) and passed.get(in_progress[0].seq_id, 0) >= PASSED_OVER_LIMIT
        i = 0
        while budget > 0:
            head = None if overdue and i == 0 else self._admissible()
            shortest = in_progress[i] if i < len(in_progress) else None
            if head is not None and (shortest is None or self.block_manager.tokens_to_compute(head)
                                     < shortest.num_uncomputed_tokens):
                self._admit(head)
                seq, new = head, True
            elif shortest is not None:
                seq, new = shortest, False
                i += 1
            else:
                break
            n = min(seq.num_uncomputed_tokens, budget)
            seqs.append(seq)
            counts.append(n)
            new_tables.append(new)
            budget -= n
        served = {seq.seq_id for seq in seqs}
        self._passed_over = {seq.seq_id: passed.get(seq.seq_id, 0) + 1 for seq in in_progress
                             if seq.seq_id not in served}
        return seqs, counts, new_tables

    def _admissible(self) -> Sequence | None:
        """The first waiting sequence, if it may start now (a free place, blocks for all its
        tokens, no launched step still working for it)."""
        if not self.waiting or len(self.running) >= self.seq_limit:
            return None
        seq = self.waiting[0]
        if seq.in_launched_step or not self.block_manager.can_allocate(seq):
            return None
        return seq

    def _admit(self, seq: Sequence) -> None:
        """Start the first waiting sequence: its blocks (prefix-cache hits included), running."""
        self.waiting.popleft()
        self.block_manager.allocate(seq)
        self._never_scheduled.discard(seq.seq_id)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        self.running.remove(seq)
        seq.status = SequenceStatus.WAITING
        self.num_preemptions += 1
        self._preempted.append(seq.seq_id)
        self.waiting.appendleft(seq)

    # ---- after the step ------------------------------------------------------------------
    def postprocess(self, output: SchedulerOutput, sampled: list[int | None],
                    num_accepted: list[int] | None = None) -> None:
        """Advance the scheduled sequences by the step's result, finishing those that hit EOS, a
        stop token or their length limit.

        sampled[i] is the token sampled for sequence i, or None when its chunk did not reach the
        end of its prompt. num_accepted[i]: how many of sequence i's draft tokens were accepted
        (they come before sampled[i]); None when the step had no drafts.

        With overlap scheduling the sequences may have changed since the step was scheduled: one
        that finished since (a stop found in the previous step's token, an abort) drops its token;
        one preempted since keeps its token but none of the step's K/V (its blocks are gone).
        """
        if not output.is_prefill and not output.forks:
            return self._postprocess_decodes(output.seqs, sampled)
        self._settle(output)
        for i, (seq, n, token) in enumerate(zip(output.seqs, output.num_new_tokens, sampled)):
            if seq.is_finished:
                continue
            draft = output.draft(i)
            running = seq.status is SequenceStatus.RUNNING
            if not draft:
                if running:
                    seq.num_computed_tokens += n
                    self.block_manager.cache_computed_blocks(seq)
                if token is None:
                    continue
                seq.token_ids.append(token)
                reason = self._finish_reason(seq, token)
                if reason is not None:
                    self.finish(seq, reason)
                continue
            accepted = num_accepted[i]
            reason = None
            for new in (*draft[:accepted], token):
                seq.token_ids.append(new)
                reason = self._finish_reason(seq, new)
                if reason is not None:
                    break
            # The step computed the last token and the drafts: those kept are in the cache now
            # (all of them when the sequence ends inside its accepted drafts); the sample after
            # them is computed next step.
            seq.num_computed_tokens = min(seq.num_computed_tokens + 1 + accepted, len(seq) - (reason is None))
            self.block_manager.cache_computed_blocks(seq)
            if reason is not None:
                self.finish(seq, reason)
        for seq, token in zip(output.forked_seqs, sampled[len(output.seqs):]):
            if seq.is_finished:
                continue
            seq.token_ids.append(token)
            reason = self._finish_reason(seq, token)
            if reason is not None:
                self.finish(seq, reason)

    def _postprocess_decodes(self, seqs: list[Sequence], sampled: list[int | None]) -> None:
        """`postprocess` of a decode step (one token computed and one sampled a sequence, no
        forks): the same rules, written out for the step that runs most, every sequence every
        step."""
        bm = self.block_manager
        caching, bs = bm.enable_prefix_caching, bm.block_size
        eos, max_model_len = self.eos_token_ids, self.max_model_len
        running, finished = SequenceStatus.RUNNING, SequenceStatus.FINISHED
        for seq, token in zip(seqs, sampled):
            seq.num_inflight_tokens -= 1
            seq.num_pending_tokens -= 1
            status = seq.status
            if status is finished:
                continue
            if status is running:
                computed = seq.num_computed_tokens = seq.num_computed_tokens + 1
                if caching and computed // bs > seq.num_keyed_blocks:
                    bm.cache_computed_blocks(seq)
            ids = seq.token_ids
            ids.append(token)
            p = seq.params
            num_output = len(ids) - seq.num_prompt_tokens
            if num_output > p.min_tokens and ((not p.ignore_eos and token in eos) or token in p.stop_token_ids):
                self.finish(seq, FinishReason.STOP)
            elif num_output >= p.max_tokens or len(ids) >= max_model_len:
                self.finish(seq, FinishReason.LENGTH)

    def _finish_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        params = seq.params
        stops = seq.num_output_tokens > params.min_tokens  # until then the sampler bans stop tokens
        if stops and not params.ignore_eos and token in self.eos_token_ids:
            return FinishReason.STOP
        if stops and token in params.stop_token_ids:
            return FinishReason.STOP
        if seq.num_output_tokens >= params.max_tokens or len(seq) >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def drop(self, seq: Sequence) -> None:
        """Last resort when `finish` itself failed: forget the sequence without the block books
        (its blocks are lost), so that it is never scheduled again."""
        for queue in (self.running, self.waiting):
            if seq in queue:
                queue.remove(seq)
        if self.drafter is not None:
            self.drafter.release((seq.seq_id,))
        self.suspects.discard(seq.seq_id)
        self._never_scheduled.discard(seq.seq_id)
        seq.status = SequenceStatus.FINISHED

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End a sequence wherever it is (running or waiting) and free its blocks at once."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.block_manager.free(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SequenceStatus.PENDING_FORK:
            self.pending_forks.drop(seq)
        self._queue_first(self.pending_forks.orphans(seq))
        if self.drafter is not None:
            self.drafter.release((seq.seq_id,))
        if seq.status is not SequenceStatus.FINISHED:
            self._finished.append(seq.seq_id)
        self.suspects.discard(seq.seq_id)
        self._never_scheduled.discard(seq.seq_id)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def _queue_first(self, seqs: list[Sequence]) -> None:
        """Put sequences at the front of the queue, in their order."""
        for seq in reversed(seqs):
            seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(seq)

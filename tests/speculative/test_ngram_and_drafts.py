"""Prompt lookup, the drafter's choices (who drafts, how much, the back-off) and what a
verification keeps."""

from __future__ import annotations

import numpy as np
import pytest

from fastgen import SamplingParams
from fastgen.sequence import Sequence, SequenceStatus
from fastgen.speculative.config import SpeculativeConfig, check_speculative_config
from fastgen.speculative.drafts import (
    FIRST_BACKOFF,
    MIN_STEPS,
    MISSES_BEFORE_WAITING,
    STEP_WINDOW,
    Drafter,
    pay_threshold,
    paying_length,
)
from fastgen.speculative.ngram import NEAR_AHEAD, lookup_draft
from fastgen.speculative.verify import accepted_prefix


def draft(tokens, num=3, n_max=3, n_min=1, extra=None, cursor=None):
    return lookup_draft(np.asarray(tokens), None if extra is None else np.asarray(extra), num, n_max, n_min,
                        cursor)[0]


def test_lookup_continues_after_the_latest_earlier_match():
    #        0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 9, 1, 2, 3, 8, 7, 1, 2, 3]
    assert draft(tokens) == [8, 7, 1]  # the match at 4..6 is later than 0..2


def test_in_a_loop_shorter_than_a_draft_lookup_takes_a_match_with_a_whole_draft_after_it():
    # The latest [1, 1] starts at 5, followed by one token before the end; the one at 3 by three.
    assert draft([5, 1, 1, 1, 1, 1, 1, 1], n_max=2) == [1, 1, 1]
    # A loop of two: the latest [4, 6] (at 3) leaves [4, 6]; the one at 1 continues for three.
    assert draft([9, 4, 6, 4, 6, 4, 6], n_max=2) == [4, 6, 4]
    # No match leaves a whole draft: the latest one, cut by the end.
    assert draft([3, 8, 3], n_max=1) == [8, 3]


def test_lookup_prefers_the_longest_n_gram():
    # The 1-gram [3] last occurred at 5 (followed by 6); the 2-gram [2, 3] at 1 (followed by 4).
    tokens = [1, 2, 3, 4, 0, 3, 6, 2, 3]
    assert draft(tokens, n_max=2) == [4, 0, 3]
    assert draft(tokens, n_max=1) == [6, 2, 3]


def test_lookup_stops_below_the_shortest_n_gram_and_at_the_end():
    assert draft([1, 2, 3, 4], n_min=1) == []
    assert draft([5, 1, 2, 5, 1], n_min=3) == []
    assert draft([5, 1, 2, 5, 1], n_min=2) == [2, 5, 1]
    assert draft([7, 7], n_max=1, n_min=1) == [7]  # what is left after the match, no more


def test_lookup_takes_the_match_nearest_the_cursor_where_one_is_near_it():
    #        0  1  2  3  4  5  6  7  8  9 10 11 12
    tokens = [9, 2, 4, 0, 2, 5, 0, 0, 2, 6, 0, 0, 2]
    assert draft(tokens, n_max=1) == [6, 0, 0]  # no cursor: the latest match (at 8)
    assert draft(tokens, n_max=1, cursor=5) == [5, 0, 0]  # the match at 4 goes on at 5
    assert draft(tokens, n_max=1, cursor=4) == [5, 0, 0]
    assert draft(tokens, n_max=1, cursor=7) == [6, 0, 0]  # 2 behind and 2 ahead: ahead wins
    assert draft(tokens, n_max=1, cursor=3) == [4, 0, 2]  # the match at 1 goes on at 2: nearer
    far = [7, 2, 4] + [0] * 40 + [2, 5, 0, 2]
    assert draft(far, n_max=1, cursor=3) == [4, 0, 0]
    # The matches go on 6 behind the cursor and 36 ahead of it: none near, so the latest.
    assert 44 - 8 > NEAR_AHEAD and draft(far, n_max=1, cursor=8) == [5, 0, 2]
    assert lookup_draft(np.asarray(tokens), None, 3, 1, 1, 5) == ([5, 0, 0], 5)  # and where it starts


def test_near_the_cursor_only_matches_with_a_whole_draft_after_them_count():
    """A loop shorter than a draft, every draft kept: the cursor lands just before the end, where
    a match's draft is cut short; drafts still grow to their whole length (a period earlier)."""
    assert draft([5, 7, 7, 7, 7, 7, 7], n_max=1, cursor=7) == [7, 7, 7]
    drafter = Drafter(SpeculativeConfig(num_speculative_tokens=4), row_cost=0.1)
    tokens, lengths = [1, 2, 3, 7, 7], []
    while len(tokens) < 60:
        made = drafter.propose(sequence(tokens, 3), 8)
        drafter.record(sequence(tokens, 3), len(made), len(made))
        tokens += [*made, 7]
        lengths.append(len(made))
    assert drafter.seqs[0].cursor is not None and lengths[4:] == [4] * len(lengths[4:]), lengths


def test_after_an_edit_the_copy_goes_on_where_it_was_left():
    """A sequence copies its prompt, writes a token of its own in place of one (9 for 3), and
    comes back on a token that occurs all over the prompt (50): its draft goes on from where the
    copy was, not from the token's latest occurrence."""
    prompt = [1, 50, 2, 3, 50, 4, 5, 6, 50, 7, 8]
    drafter = Drafter(SpeculativeConfig(num_speculative_tokens=3), row_cost=0.1)
    assert drafter.propose(sequence(prompt + [1, 50], 11), 8) == (2, 3, 50)
    drafter.record(sequence(prompt + [1, 50], 11), 3, 1)  # 2 kept; the model wrote 9
    assert drafter.propose(sequence(prompt + [1, 50, 2, 9, 50], 11), 8) == (4, 5, 6)
    fresh = Drafter(SpeculativeConfig(num_speculative_tokens=3), row_cost=0.1)
    assert fresh.propose(sequence(prompt + [1, 50, 2, 9, 50], 11), 8) == (2, 9, 50)


def test_lookup_searches_the_prediction_first():
    tokens = [1, 2, 3, 5, 1, 2]
    assert draft(tokens, n_max=2) == [3, 5, 1]
    assert draft(tokens, n_max=2, extra=[9, 1, 2, 4, 4]) == [4, 4]


def test_config_defaults_and_refusals():
    assert check_speculative_config("speculative_config", {"method": "ngram"}) == {
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1,
        "disable_by_batch_size": None, "model": None, "quantization": None}
    assert check_speculative_config("c", SpeculativeConfig(num_speculative_tokens=2))["num_speculative_tokens"] == 2
    for value, message in [
        ("ngram", r"must be a dict"),
        ({"method": "eagle"}, r"\['method'\]='eagle' is not one of \['ngram', 'draft_model'\]"),
        ({"num_speculative_tokens": 0}, r"\['num_speculative_tokens'\]=0 must be >= 1"),
        ({"num_speculative_tokens": 17}, r"\['num_speculative_tokens'\]=17 must be < 17"),
        ({"prompt_lookup_max": 2, "prompt_lookup_min": 3}, r"prompt_lookup_min'\]=3 must be <= prompt_lookup_max=2"),
        ({"num_speculative_token": 3}, r"unknown keys \['num_speculative_token'\]"),
        ({"disable_by_batch_size": 1}, r"\['disable_by_batch_size'\]=1 must be >= 2"),
    ]:
        with pytest.raises(ValueError, match=message):
            check_speculative_config("c", value)


def sequence(tokens, num_prompt, **params):
    seq = Sequence(0, list(tokens[:num_prompt]), SamplingParams(max_tokens=64, **params))
    seq.token_ids += tokens[num_prompt:]
    return seq


def test_only_requests_verified_exactly_draft():
    tokens = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    drafter = Drafter(SpeculativeConfig(num_speculative_tokens=3))
    assert drafter.propose(sequence(tokens, 6), 8) == (3, 4, 1)
    assert drafter.propose(sequence(tokens, 6), 2) == (3, 4)  # the caller's limit
    for params in ({"presence_penalty": 0.5}, {"logprobs": 1}, {"min_tokens": 5},
                   {"structured_outputs": {"regex": "[0-9]+"}}):
        assert drafter.propose(sequence(tokens, 6, **params), 8) == (), params


def test_a_prediction_is_followed_from_the_start_while_the_output_matches_it():
    drafter = Drafter(SpeculativeConfig(num_speculative_tokens=3), prediction_of=lambda seq: [7, 8, 9, 10, 11])
    assert drafter.propose(sequence([1, 2, 3, 7, 8], 3), 8) == (9, 10, 11)
    drafter = Drafter(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=2),
                      prediction_of=lambda seq: [7, 8, 9, 10, 11])
    # Off the prediction: its n-grams are still looked up.
    assert drafter.propose(sequence([1, 2, 3, 5, 9], 3), 8) == ()
    assert drafter.propose(sequence([1, 2, 3, 5, 9, 10], 3), 8) == (11,)
    # With prompt_lookup_min 1, its one-token matches too.
    drafter = Drafter(SpeculativeConfig(num_speculative_tokens=3), prediction_of=lambda seq: [7, 8, 9, 10, 11])
    assert drafter.propose(sequence([1, 2, 3, 5, 9], 3), 8) == (10, 11)


def test_drafts_are_as_long_as_their_acceptance_pays_for_at_the_batch_size():
    drafter = Drafter(SpeculativeConfig(num_speculative_tokens=6), row_cost=0.1)
    seq = sequence([4, 5, 6, 7, 8, 9, 10, 11, 4, 5], 2)
    assert paying_length(0.6, 0.1, 6) == 4 and paying_length(0.6, 0.4, 6) == 1 and paying_length(0.6, 0.8, 6) == 0
    assert [round(pay_threshold(0.1, b), 2) for b in (1, 4, 16)] == [0.1, 0.33, 0.8]
    assert drafter.propose(seq, 8) == (6, 7, 8)  # the prior rate (a half), alone in its step
    assert drafter.propose(seq, 8, batch_size=4) == (6,)
    assert drafter.propose(seq, 8, batch_size=16) == ()
    assert drafter.propose(seq, 2) == (6, 7)  # the caller's limit
    for _ in range(4):
        drafter.record(seq, 4, 4)  # copied text: every draft kept
    assert drafter.propose(seq, 8) == (6, 7, 8, 9, 10, 11)
    assert len(drafter.propose(seq, 8, batch_size=4)) >= 3


def test_drafts_after_a_one_token_match_learn_a_rate_of_their_own():
    """Only the prompt's token 3 matches the output's last token: its draft is a one-token
    match's, which the sequence makes while their own rate pays (failing, they stop) and which
    leaves the rate of its longer matches as it was; prompt_lookup_min 2 never makes one."""
    prompt = [1, 2, 3, 4, 5, 6]
    drafter = Drafter(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1), row_cost=0.1)
    lengths = []
    for _ in range(10):
        made = drafter.propose(sequence(prompt + [9, 3], 6), 8)
        if not made:
            break
        assert made == (4, 5, 6)[:len(made)]
        lengths.append(len(made))
        drafter.record(sequence(prompt + [9, 3], 6), len(made), 0)
    assert lengths == [3, 1, 1]  # the prior's three tokens, then what a falling rate pays for
    state = drafter.seqs[0]
    weak = state.weak_rate
    assert state.rate == 0.5 and weak < pay_threshold(0.1, 1)
    # A match of three tokens (3, 4, 5) drafts at the sequence's own rate, still the prior's.
    assert drafter.propose(sequence(prompt + [9, 3, 4, 5], 6), 8) == (6, 9, 3)
    assert not state.weak
    drafter.record(sequence(prompt + [9, 3, 4, 5], 6), 3, 2)  # 6, 9 kept; the model wrote 8 for 3
    # Copying again: the one-token rate goes back towards the prior, and pays for one token at
    # the next edit (back on 3 after the 8).
    assert state.rate > 0.5 and weak < state.weak_rate < 0.5
    assert drafter.propose(sequence(prompt + [9, 3, 4, 5, 6, 9, 8, 3], 6), 8) == (4,) and state.weak
    drafter.record(sequence(prompt + [9, 3, 4, 5, 6, 9, 8, 3], 6), 1, 1)
    recovered = state.weak_rate
    # A longer match's draft that keeps nothing leaves the one-token rate as it is.
    made = drafter.propose(sequence(prompt + [9, 3, 4, 5], 6), 8)
    assert made[:1] == (6,) and not state.weak
    drafter.record(sequence(prompt + [9, 3, 4, 5], 6), len(made), 0)
    assert state.weak_rate == recovered
    # A one-token rate above the prior stays where its own drafts put it.
    state.weak_kept, state.weak_checked = 0.9, 1.0
    made = drafter.propose(sequence(prompt + [9, 3, 4, 5], 6), 8)
    assert made and not state.weak
    drafter.record(sequence(prompt + [9, 3, 4, 5], 6), len(made), len(made))
    assert state.weak_rate == 0.9
    strict = Drafter(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=2), row_cost=0.1)
    assert strict.propose(sequence(prompt + [9, 3], 6), 8) == ()


def test_drafts_that_keep_failing_stop_and_are_tried_again_later():
    drafter = Drafter(SpeculativeConfig(num_speculative_tokens=4), row_cost=0.1)
    seq = sequence([4, 5, 4, 5, 4, 5, 4], 2)
    for _ in range(20):
        draft = drafter.propose(seq, 8)
        if not draft:
            break
        drafter.record(seq, len(draft), 0)
    else:
        raise AssertionError("drafts that are never kept went on")
    empties = 1  # the step that stopped the loop
    for wait in (FIRST_BACKOFF, 2 * FIRST_BACKOFF):
        # `wait` - 1 steps without a draft, then a one-token try; a failed try doubles the wait.
        while not (draft := drafter.propose(seq, 8)):
            empties += 1
        assert (empties, draft) == (wait - 1, (5,))
        drafter.record(seq, 1, 0)
        empties = 0
    drafter.release([seq.seq_id])
    assert not drafter.seqs


def test_text_with_nothing_to_look_up_waits_like_text_whose_drafts_fail():
    """A rate that pays but lookups that find nothing: after MISSES_BEFORE_WAITING of them the
    sequence looks up only on tries (and may_draft says so, so steps may overlap), each try that
    finds nothing doubling the wait."""
    drafter = Drafter(SpeculativeConfig(num_speculative_tokens=4), row_cost=0.1)
    seq = sequence(list(range(10, 40)), 5)
    for _ in range(MISSES_BEFORE_WAITING):
        assert drafter.may_draft([seq], 1)
        assert drafter.propose(seq, 8) == ()
    assert not drafter.may_draft([seq], 1)
    waits = []
    for wait in (FIRST_BACKOFF, 2 * FIRST_BACKOFF):
        steps = 0
        while not drafter.may_draft([seq], 1):
            assert drafter.propose(seq, 8) == ()
            steps += 1
        assert drafter.propose(seq, 8) == ()  # the try: nothing to look up either
        waits.append(steps + 1)
    assert waits == [FIRST_BACKOFF, 2 * FIRST_BACKOFF]


def test_may_draft_changes_nothing_and_skips_what_the_scheduler_would_not_draft_for():
    drafter = Drafter(SpeculativeConfig(num_speculative_tokens=3, disable_by_batch_size=4), row_cost=0.1)
    seq = sequence([1, 2, 3, 1, 2], 2)
    assert drafter.may_draft([seq], 1) and not drafter.seqs  # the prior pays; no state made
    assert not drafter.may_draft([seq], 4)  # disabled at this batch size
    assert not drafter.may_draft([sequence([1, 2, 3, 1, 2], 2, logprobs=1)], 1)  # not verified exactly
    seq.status = SequenceStatus.FINISHED
    assert not drafter.may_draft([seq], 1)


def test_verification_keeps_drafts_up_to_the_first_difference():
    assert accepted_prefix((5, 6, 7), (5, 6, 7, 8)) == 3
    assert accepted_prefix((5, 6, 7), (5, 9, 7, 8)) == 1
    assert accepted_prefix((5, 6, 7), (1, 6, 7, 8)) == 0


def test_the_threshold_is_measured_once_steps_with_and_without_drafts_were_seen():
    drafter = Drafter(SpeculativeConfig(), row_cost=0.1)
    assert drafter.threshold(4) == pay_threshold(0.1, 4)  # the model, before any measurement
    for _ in range(MIN_STEPS):
        drafter.observe_step(4, 0, 0.020)  # 4 sequences, no drafts: 5 ms a token
    assert drafter.threshold(4) == pay_threshold(0.1, 4)
    for _ in range(MIN_STEPS - 1):
        drafter.observe_step(4, 8, 0.028)  # 8 drafted tokens cost 1 ms each
        assert drafter.threshold(4) == pay_threshold(0.1, 4)  # too few steps with drafts yet
    drafter.observe_step(4, 8, 0.028)
    assert drafter.threshold(4) == pytest.approx(0.2)
    assert drafter.threshold(3) == pay_threshold(0.1, 3)  # another batch size: not measured yet
    for _ in range(MIN_STEPS):
        drafter.observe_step(12, 0, 0.05)
    for _ in range(MIN_STEPS):
        drafter.observe_step(16, 10, 0.15)  # a dear draft in the 16 bucket: never pays
    assert drafter.threshold(13) == 1.0


def test_the_threshold_follows_the_recent_steps():
    """Steps measured more than STEP_WINDOW steps ago no longer count: a verify step that turns
    dearer sets the threshold once it fills the window's majority."""
    drafter = Drafter(SpeculativeConfig(), row_cost=0.1)
    for _ in range(STEP_WINDOW):
        drafter.observe_step(1, 0, 0.004)
        drafter.observe_step(1, 4, 0.0044)  # 0.1 ms a drafted token
    assert drafter.threshold(1) == pytest.approx(0.025)
    for _ in range(STEP_WINDOW // 2 + 1):
        drafter.observe_step(1, 4, 0.0052)  # 0.3 ms a drafted token
    assert drafter.threshold(1) == pytest.approx(0.075)


def test_one_slow_step_does_not_set_the_threshold():
    """A collection, a page fault or the first step of a shape: one step many times slower (or a
    step with drafts that came out faster than the steps without) moves the measurement little."""
    drafter = Drafter(SpeculativeConfig(), row_cost=0.1)
    drafter.observe_step(1, 0, 0.050)  # the slow first step, without drafts
    for _ in range(MIN_STEPS):
        drafter.observe_step(1, 0, 0.004)
    drafter.observe_step(1, 4, 0.003)  # faster than a step without drafts: no extra time at all
    for _ in range(MIN_STEPS):
        drafter.observe_step(1, 4, 0.0052)  # 0.3 ms a drafted token
    assert drafter.threshold(1) == pytest.approx(0.075)
    drafter.observe_step(1, 0, 0.100)
    drafter.observe_step(1, 4, 0.200)
    assert drafter.threshold(1) == pytest.approx(0.075)


class _AlwaysDrafts:
    """A drafter that proposes three tokens for every sequence (scheduler tests)."""

    class config:  # noqa: N801 - stands in for a SpeculativeConfig
        disable_by_batch_size = None

    def propose_batch(self, seqs, rooms, budget):
        drafts = []
        for room in rooms:
            drafts.append((5, 6, 7)[:max(0, min(room, budget))])
            budget -= len(drafts[-1])
        return drafts

    def release(self, seq_ids):
        pass


@pytest.mark.parametrize(("num_blocks", "drafted"), [(4, [(), ()]), (5, [(5, 6, 7), ()]), (8, [(5, 6, 7)] * 2)])
def test_drafts_leave_a_free_block_for_each_decode(num_blocks, drafted):
    """Two sequences decode, each with its last block full after this step's token: a draft takes
    a block only where one stays free for each of them, so the next step's decodes never have to
    preempt anyone for a slot a draft took."""
    from fastgen.engine.block_manager import BlockManager
    from fastgen.engine.scheduler import Scheduler

    s = Scheduler(BlockManager(num_blocks, 4), 8, 64, 64, eos_token_ids=[0], drafter=_AlwaysDrafts())
    a = Sequence(0, [1, 2, 3], SamplingParams(max_tokens=20, ignore_eos=True))
    b = Sequence(1, [4, 5, 6], SamplingParams(max_tokens=20, ignore_eos=True))
    s.add(a)
    s.add(b)
    out = s.schedule()  # both prompts: a block each
    s.postprocess(out, [9, 9])
    out = s.schedule()  # both decode in their first block, which their next token fills
    assert list(out.draft_tokens or [(), ()]) == drafted
    assert s.block_manager.num_free_blocks >= 2

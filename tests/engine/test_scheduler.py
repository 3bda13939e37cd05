"""Scheduler: prefill-first batching, token and sequence budgets, chunking, preemption, and
random workloads that must always drain with the block manager's books balanced."""

from __future__ import annotations

import random

import pytest

# A dev extra: a machine with only the runtime packages (a GPU box running `-m cuda`) skips this
# file instead of failing the whole collection.
pytest.importorskip("hypothesis")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fastgen.engine.block_manager import BlockManager
from fastgen.sampling_params import SamplingParams
from fastgen.engine.scheduler import Scheduler
from fastgen.engine.sequence import FinishReason, Sequence, SequenceStatus


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, max_tokens=64, max_model_len=128):
    bm = BlockManager(num_blocks, block_size)
    return Scheduler(bm, max_num_seqs, max_tokens, max_model_len, eos_token_ids=[0])


def seq(seq_id, n, max_tokens=4, prefix=()):
    return Sequence(seq_id, list(prefix) + [10 + (seq_id + i) % 90 for i in range(n)], SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def run_step(s: Scheduler, rng=None):
    out = s.schedule()
    assert out is not None
    tokens = [(rng.randrange(1, 100) if rng else 7) if out.samples(i) else None for i in range(len(out.seqs))]
    s.postprocess(out, tokens)
    return out


def test_prefill_first_then_decode():
    s = make_scheduler()
    s.add(seq(0, 10))
    s.add(seq(1, 6))
    out = run_step(s)
    assert out.is_prefill and out.num_new_tokens == [10, 6]
    out = run_step(s)
    assert not out.is_prefill and out.num_new_tokens == [1, 1]


def test_token_budget_chunks_long_prompt():
    s = make_scheduler(max_tokens=8)
    long = seq(0, 20)
    s.add(long)
    counts = []
    while long.num_computed_tokens < 20:
        out = run_step(s)
        counts.append(out.num_new_tokens[0])
    assert counts == [8, 8, 4]
    assert long.num_output_tokens == 1  # only the last chunk samples


def test_max_num_seqs_caps_admission():
    s = make_scheduler(max_num_seqs=2)
    for i in range(3):
        s.add(seq(i, 4))
    out = run_step(s)
    assert len(out.seqs) == 2 and len(s.waiting) == 1


def test_preempts_newest_when_blocks_run_out():
    s = make_scheduler(num_blocks=6, block_size=2, max_model_len=12)
    a, b = seq(0, 6, max_tokens=5), seq(1, 6, max_tokens=5)
    s.add(a)
    s.add(b)
    run_step(s)  # both prefilled: 3 blocks each, no block left, 7 tokens each
    out = run_step(s)  # a's 7th token needs a 4th block: b (newest) is preempted
    assert s.num_preemptions == 1 and b.status is SequenceStatus.WAITING and s.waiting[0] is b
    assert out.seqs == [a] and not b.block_table
    s.block_manager.check_invariants(s.running)


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=12),
    outputs=st.lists(st.integers(1, 12), min_size=12, max_size=12),
    block_size=st.integers(1, 8),
    extra_blocks=st.integers(0, 30),
    budget=st.integers(1, 64),
    max_num_seqs=st.integers(1, 6),
    shared=st.integers(0, 20),
    seed=st.integers(0, 1000),
)
def test_random_workloads_drain_with_balanced_books(
    lengths, outputs, block_size, extra_blocks, budget, max_num_seqs, shared, seed
):
    max_model_len = 64
    num_blocks = -(-max_model_len // block_size) + extra_blocks  # always fits one longest request
    bm = BlockManager(num_blocks, block_size)
    s = Scheduler(bm, max_num_seqs, budget, max_model_len, eos_token_ids=[0])
    rng = random.Random(seed)
    prefix = [5] * shared
    seqs = []
    for i, (n, m) in enumerate(zip(lengths, outputs)):
        n = min(n + shared, max_model_len - m) - shared
        if n < 1:
            continue
        sq = Sequence(i, prefix + [rng.randrange(1, 100) for _ in range(n)], SamplingParams(max_tokens=m, ignore_eos=i % 3 != 0))
        seqs.append(sq)
        s.add(sq)
    steps = 0
    while s.has_unfinished():
        out = s.schedule()
        assert out is not None, "scheduler stalled with work left"
        assert len(out.seqs) <= max_num_seqs
        if out.is_prefill:
            assert out.num_tokens <= budget
        tokens = [rng.randrange(0, 100) if out.samples(i) else None for i in range(len(out.seqs))]
        s.postprocess(out, tokens)
        bm.check_invariants(s.running)
        if rng.random() < 0.05 and s.running:  # an abort mid-flight
            s.finish(s.running[-1], FinishReason.ABORT)
            bm.check_invariants(s.running)
        steps += 1
        assert steps < 10_000
    assert bm.num_free_blocks == num_blocks
    for sq in seqs:
        assert sq.is_finished
        if sq.finish_reason.value == "length":
            assert sq.num_output_tokens == sq.params.max_tokens

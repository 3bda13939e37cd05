"""BlockManager: allocation, prefix-cache keys and reference counts, checked by examples and by
hypothesis-driven random programs with the invariant check after every operation."""

from __future__ import annotations

import pytest

# A dev extra: a machine with only the runtime packages (a GPU box running `-m cuda`) skips this
# file instead of failing the whole collection.
pytest.importorskip("hypothesis")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fastgen.engine.block_manager import NO_HASH, BlockManager, chain_hash
from fastgen.sampling_params import SamplingParams
from fastgen.sequence import Sequence

PARAMS = SamplingParams(temperature=0.0)


def make_seq(seq_id: int, tokens: list[int]) -> Sequence:
    return Sequence(seq_id, list(tokens), PARAMS)


def compute_all(bm: BlockManager, seq: Sequence) -> None:
    """Pretend the model computed every token of the sequence."""
    seq.num_computed_tokens = len(seq)
    bm.cache_computed_blocks(seq)


def test_chain_hash_folds_in_predecessor():
    a = chain_hash(-1, [1, 2, 3])
    assert chain_hash(a, [4, 5, 6]) != chain_hash(chain_hash(-1, [9, 9, 9]), [4, 5, 6])
    assert chain_hash(-1, [1, 2, 3]) == a


def test_second_sequence_with_same_prefix_shares_blocks():
    bm = BlockManager(num_blocks=16, block_size=4)
    first = make_seq(0, list(range(10)))
    bm.allocate(first)
    assert first.num_cached_tokens == 0
    compute_all(bm, first)
    second = make_seq(1, list(range(8)) + [99, 98, 97])
    bm.allocate(second)
    assert second.num_cached_tokens == 8
    assert second.block_table[:2] == first.block_table[:2]
    assert bm.blocks[first.block_table[0]].ref_count == 2
    bm.check_invariants([first, second])


def test_full_hit_leaves_last_token_to_compute():
    bm = BlockManager(num_blocks=8, block_size=4)
    first = make_seq(0, list(range(8)))
    bm.allocate(first)
    compute_all(bm, first)
    second = make_seq(1, list(range(8)))
    bm.allocate(second)
    assert second.num_cached_tokens == 8 and second.num_computed_tokens == 7


def test_freed_blocks_stay_findable_until_reused():
    bm = BlockManager(num_blocks=4, block_size=2)
    seq = make_seq(0, [5, 6, 7, 8])
    bm.allocate(seq)
    compute_all(bm, seq)
    bm.free(seq)
    again = make_seq(1, [5, 6, 7, 8, 9])
    bm.allocate(again)
    assert again.num_cached_tokens == 4
    bm.check_invariants([again])


def test_hash_collision_is_caught_by_token_check():
    bm = BlockManager(num_blocks=8, block_size=2)
    seq = make_seq(0, [1, 2, 3])
    bm.allocate(seq)
    compute_all(bm, seq)
    # Forge a collision: point the key of [7, 8] at the block holding [1, 2].
    bm.hash_to_block_id[chain_hash(-1, [7, 8])] = seq.block_table[0]
    other = make_seq(1, [7, 8, 9])
    bm.allocate(other)
    assert other.num_cached_tokens == 0
    assert other.block_table[0] != seq.block_table[0]


def test_no_prefix_caching_never_hits():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    a, b = make_seq(0, [1, 2, 3, 4]), make_seq(1, [1, 2, 3, 4])
    bm.allocate(a)
    compute_all(bm, a)
    bm.allocate(b)
    assert b.num_cached_tokens == 0 and not bm.hash_to_block_id


# ---- random programs ---------------------------------------------------------------------

ops = st.lists(
    st.tuples(
        st.sampled_from(["add", "grow", "free", "abort_new", "abort_partial"]),
        st.integers(0, 3),  # which shared prefix (0 = none)
        st.integers(1, 40),  # length / growth
        st.integers(0, 10**6),  # picks a sequence
    ),
    min_size=1,
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(block_size=st.integers(1, 8), num_blocks=st.integers(4, 40), program=ops, caching=st.booleans())
def test_random_programs_keep_invariants(block_size, num_blocks, program, caching):
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
    prefixes = {0: [], 1: [1] * 13, 2: list(range(100, 120)), 3: [1] * 13 + [2] * 7}
    live: list[Sequence] = []
    next_id = 0
    for kind, prefix, n, pick in program:
        if kind == "add":
            seq = make_seq(next_id, prefixes[prefix] + [1000 + (next_id * 7 + i) % 50 for i in range(n)])
            next_id += 1
            if bm.can_allocate(seq):
                free_before = bm.num_free_blocks
                bm.allocate(seq)
                assert bm.num_free_blocks <= free_before
                assert seq.num_computed_tokens < len(seq)
                compute_all(bm, seq)
                live.append(seq)
        elif kind == "grow" and live:
            seq = live[pick % len(live)]
            for i in range(n % 5 + 1):
                seq.token_ids.append(2000 + i)
                if not bm.can_append(seq):
                    seq.token_ids.pop()  # no slot for it: the scheduler would preempt instead
                    break
                bm.append_slot(seq)
                compute_all(bm, seq)
        elif kind == "free" and live:
            bm.free(live.pop(pick % len(live)))
        elif kind in ("abort_new", "abort_partial"):
            # Aborted between allocation and the end of its prefill: none, or only the first
            # chunk, of its tokens computed. Nothing it never computed may stay keyed.
            seq = make_seq(next_id, prefixes[prefix] + [3000 + (next_id * 3 + i) % 40 for i in range(n)])
            next_id += 1
            if bm.can_allocate(seq):
                bm.allocate(seq)
                if kind == "abort_partial":
                    seq.num_computed_tokens += (len(seq) - seq.num_computed_tokens) // 2
                    bm.cache_computed_blocks(seq)
                computed = max(seq.num_computed_tokens, seq.num_cached_tokens) // block_size
                table = list(seq.block_table)
                bm.free(seq)
                for block_id in table[computed:]:
                    assert bm.blocks[block_id].hash == NO_HASH, "a block never computed is keyed"
        bm.check_invariants(live)
        for seq in live:
            assert len(seq.block_table) >= bm.blocks_needed(seq.num_computed_tokens)
    for seq in live:
        bm.free(seq)
    bm.check_invariants([])
    assert bm.num_free_blocks == num_blocks

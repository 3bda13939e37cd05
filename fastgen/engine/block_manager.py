"""Paged KV-cache blocks: a free list, reference counts and a prefix cache.

A full block is keyed by a chained xxhash64: the key of block i folds in the key of block i-1 and
the block's own token ids, so equal keys mean equal prefixes (checked against the stored tokens,
since a 64-bit hash can collide). A block is keyed only once its K/V have been computed, so a hit
never points at a block whose contents are still being written. Freed blocks keep their key and
stay findable until the free list hands them out again, oldest-freed first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import xxhash

from fastgen.sequence import Sequence

NO_HASH = -1


def chain_hash(prev_hash: int, token_ids: list[int]) -> int:
    """Key of a full block: xxhash64 over the previous block's key and this block's tokens."""
    hasher = xxhash.xxh64()
    if prev_hash != NO_HASH:
        hasher.update(prev_hash.to_bytes(8, "little"))
    hasher.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return hasher.intdigest()


def hit_rate(hit_tokens: int, queried_tokens: int) -> float:
    """Share of the prompt tokens looked up in the prefix cache that it served (0 when none)."""
    return hit_tokens / queried_tokens if queried_tokens else 0.0


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int = NO_HASH
    token_ids: tuple[int, ...] = ()


class BlockManager:
    """Owns the cache's blocks; hands them to sequences and takes them back."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        assert num_blocks > 0 and block_size > 0
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # An ordered set: O(1) removal of a block revived by a cache hit, and O(1) access to the
        # oldest-freed block (a plain dict's first key gets slower as deletions pile up in front).
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.used_block_ids: set[int] = set()
        self.hash_to_block_id: dict[int, int] = {}
        self.num_hit_tokens = 0
        self.num_queried_tokens = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache lookup -------------------------------------------------------------
    def _full_block_hashes(self, seq: Sequence) -> list[int]:
        """Keys of the sequence's full blocks, extending the sequence's memo."""
        hashes = seq.block_hashes
        num_full = len(seq) // self.block_size
        prev = hashes[-1] if hashes else NO_HASH
        for i in range(len(hashes), num_full):
            prev = chain_hash(prev, seq.block_tokens(i, self.block_size))
            hashes.append(prev)
        return hashes

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids holding the longest cached prefix of the sequence (verified token by token).

        Nothing for a request that wants its prompt's logprobs and has no output yet: they come
        from computing the prompt, so it reads no cached block (as in vLLM; it still keys its own)."""
        if not self.enable_prefix_caching:
            return []
        if seq.params.prompt_logprobs is not None and seq.num_output_tokens == 0:
            return []
        hits = []
        for i, key in enumerate(self._full_block_hashes(seq)):
            block_id = self.hash_to_block_id.get(key)
            if block_id is None:
                break
            if self.blocks[block_id].token_ids != tuple(seq.block_tokens(i, self.block_size)):
                break
            hits.append(block_id)
        return hits

    # ---- allocation ----------------------------------------------------------------------
    def tokens_to_compute(self, seq: Sequence) -> int:
        """How many of a waiting sequence's tokens its admission would leave to compute (its
        longest cached prefix served, its last token always computed)."""
        return len(seq) - min(len(self._cached_prefix(seq)) * self.block_size, len(seq) - 1)

    def can_allocate(self, seq: Sequence) -> bool:
        hits = self._cached_prefix(seq)
        # A hit on a block that is in use costs nothing; a hit on a free block still takes it.
        shared = sum(1 for b in hits if b in self.used_block_ids)
        return self.blocks_needed(len(seq)) - shared <= self.num_free_blocks

    def allocate(self, seq: Sequence) -> None:
        """Give a waiting sequence blocks for all its tokens, reusing cached prefix blocks.

        Sets `num_cached_tokens` and `num_computed_tokens`. At least the last token is always
        left to compute, because its logits are needed to sample the next one.
        """
        assert not seq.block_table, "sequence already holds blocks"
        hits = self._cached_prefix(seq)
        for block_id in hits:
            self._take(block_id)
            seq.block_table.append(block_id)
        for _ in range(self.blocks_needed(len(seq)) - len(hits)):
            seq.block_table.append(self._take_fresh())
        cached = len(hits) * self.block_size
        self.num_queried_tokens += len(seq)
        self.num_hit_tokens += cached
        seq.num_cached_tokens = cached
        seq.num_keyed_blocks = len(hits)
        seq.num_computed_tokens = min(cached, len(seq) - 1)

    def can_append(self, seq: Sequence) -> bool:
        """Whether the sequence's next token has a slot, or a free block can give it one."""
        return len(seq.block_table) >= self.blocks_needed(seq.num_tokens) or self.num_free_blocks > 0

    def append_slot(self, seq: Sequence) -> tuple[int, ...]:
        """Make sure the block table covers every token of the sequence, pending ones included
        (one new block at most); return the blocks appended."""
        needed = self.blocks_needed(seq.num_tokens)
        if len(seq.block_table) >= needed:  # more only where rejected drafts left blocks beyond
            return ()
        appended = (self._take_fresh(),)
        seq.block_table.extend(appended)
        assert len(seq.block_table) >= needed
        return appended

    def append_slots(self, seq: Sequence, num_tokens: int) -> tuple[int, ...]:
        """Blocks for `num_tokens` positions past the sequence's tokens (speculative drafts),
        taken from the free list (the caller checked there are enough); the blocks appended.
        Blocks a rejected draft leaves beyond the sequence are used by its next tokens."""
        missing = self.blocks_needed(len(seq) + num_tokens) - len(seq.block_table)
        appended = tuple(self._take_fresh() for _ in range(max(0, missing)))
        seq.block_table.extend(appended)
        return appended

    def can_fork(self, parent: Sequence) -> bool:
        return len(parent) % self.block_size == 0 or self.num_free_blocks > 0

    def fork(self, parent: Sequence, child: Sequence) -> tuple[int, int] | None:
        """Start `child` (the same prompt as `parent`, whose prompt this step computes) from the
        parent's blocks: the full ones shared (reference-counted; keyed by the parent), the
        partial last one, if any, a fresh block that the worker fills by copying the parent's
        after the step. Returns that copy as (source, destination), or None."""
        assert not child.block_table and len(child) == len(parent) == parent.num_prompt_tokens
        num_full = len(parent) // self.block_size
        for block_id in parent.block_table[:num_full]:
            self._take(block_id)
            child.block_table.append(block_id)
        copy = None
        if len(parent) % self.block_size:
            copy = (parent.block_table[num_full], self._take_fresh())
            child.block_table.append(copy[1])
        child.block_hashes = list(parent.block_hashes[:num_full])
        child.num_keyed_blocks = num_full
        child.num_cached_tokens = parent.num_cached_tokens
        child.num_computed_tokens = len(child)  # once this step (and the copy) ran
        return copy

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Key the sequence's blocks whose tokens are now all in the cache."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        if num_full <= seq.num_keyed_blocks:
            return
        hashes = self._full_block_hashes(seq)
        for i in range(seq.num_keyed_blocks, num_full):
            block = self.blocks[seq.block_table[i]]
            if block.hash != NO_HASH:
                continue
            key = hashes[i]
            if key in self.hash_to_block_id:
                continue  # an identical block computed in the same step is already keyed
            block.hash = key
            block.token_ids = tuple(seq.block_tokens(i, self.block_size))
            self.hash_to_block_id[key] = block.block_id
        seq.num_keyed_blocks = num_full

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks; the last blocks go to the end of the free list."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.used_block_ids.remove(block_id)
                self.free_block_ids[block_id] = None
        seq.block_table.clear()
        seq.num_computed_tokens = 0
        seq.num_cached_tokens = 0
        seq.num_keyed_blocks = 0

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_block_ids[block_id]
            self.used_block_ids.add(block_id)
        block.ref_count += 1

    def _take_fresh(self) -> int:
        block_id = next(iter(self.free_block_ids))
        block = self.blocks[block_id]
        if block.hash != NO_HASH:  # evict the old key: the block is about to be overwritten
            if self.hash_to_block_id.get(block.hash) == block_id:
                del self.hash_to_block_id[block.hash]
            block.hash = NO_HASH
            block.token_ids = ()
        self._take(block_id)
        return block_id

    # ---- checks and stats ----------------------------------------------------------------
    @property
    def hit_rate(self) -> float:
        return hit_rate(self.num_hit_tokens, self.num_queried_tokens)

    def check_invariants(self, seqs: Iterable[Sequence]) -> None:
        """Raise AssertionError unless the manager's books balance against the given sequences
        (which must be every sequence currently holding blocks)."""
        free, used = set(self.free_block_ids), self.used_block_ids
        assert not (free & used), f"blocks both free and used: {sorted(free & used)}"
        assert free | used == set(range(self.num_blocks)), "blocks neither free nor used"
        holders = [0] * self.num_blocks
        for seq in seqs:
            assert len(set(seq.block_table)) == len(seq.block_table), "block twice in one table"
            for block_id in seq.block_table:
                holders[block_id] += 1
        for block in self.blocks:
            assert block.ref_count == holders[block.block_id], (
                f"block {block.block_id}: ref_count {block.ref_count} != {holders[block.block_id]} tables"
            )
            assert (block.ref_count > 0) == (block.block_id in used), f"block {block.block_id} misfiled"
            if block.hash != NO_HASH:
                assert self.hash_to_block_id.get(block.hash) == block.block_id, "keyed block not mapped"
                assert len(block.token_ids) == self.block_size
        for key, block_id in self.hash_to_block_id.items():
            assert self.blocks[block_id].hash == key, f"key {key} maps to block {block_id} keyed otherwise"

"""Block-manager cost of one long request, without and with a prefix-cache hit (group
`block-manager`).

Each round is one request's whole life in the block manager apart from decode appends, as the
scheduler and engine drive it: can_allocate + allocate (hashing its 128 full blocks, looking them
up), cache_computed_blocks once its prompt is computed (keying the blocks it filled), and free.
So a round's time is the per-sequence cost. Every round brings fresh random tokens, so the
no-hit case never hits; in the hit case a running sequence holds a 1792-token shared prefix
(112 blocks), and only the last 256 tokens (16 blocks) of each new prompt are its own.
"""

from __future__ import annotations

import numpy as np
import pytest

from fastgen.engine.block_manager import BlockManager
from fastgen.sampling_params import SamplingParams
from fastgen.sequence import Sequence

PROMPT_LEN = 2048
SHARED_PREFIX_LEN = 1792
BLOCK_SIZE = 16
NUM_BLOCKS = 4096  # 32 prompts' worth: freed keyed blocks linger, then get evicted, as in serving
VOCAB = 151_936
ROUNDS = 300
WARMUP_ROUNDS = 10


class PromptStream:
    """Fresh requests for each round; in the shared case, a sequence holding the prefix."""

    def __init__(self, shared_prefix: bool, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        self.manager = BlockManager(NUM_BLOCKS, BLOCK_SIZE, enable_prefix_caching=True)
        self.params = SamplingParams(temperature=0.0, max_tokens=16)
        self.next_id = 0
        self.prefix: list[int] = []
        if shared_prefix:
            self.prefix = self.rng.integers(1, VOCAB, SHARED_PREFIX_LEN).tolist()
            self.holder = self.new_sequence()
            self._admit(self.holder)

    def new_sequence(self) -> Sequence:
        own = self.rng.integers(1, VOCAB, PROMPT_LEN - len(self.prefix)).tolist()
        seq = Sequence(self.next_id, self.prefix + own, self.params)
        self.next_id += 1
        return seq

    def setup(self):
        """pedantic() setup: a request nobody has hashed yet."""
        return (self.new_sequence(),), {}

    def _admit(self, seq: Sequence) -> None:
        manager = self.manager
        assert manager.can_allocate(seq)
        manager.allocate(seq)
        seq.num_computed_tokens = len(seq)  # as after its prefill steps
        manager.cache_computed_blocks(seq)

    def lifecycle(self, seq: Sequence) -> int:
        self._admit(seq)
        cached = seq.num_cached_tokens
        self.manager.free(seq)
        return cached


@pytest.mark.benchmark(group="block-manager")
@pytest.mark.parametrize(
    "shared_prefix", [pytest.param(False, id="no-prefix-hit"), pytest.param(True, id="1792-token-prefix-hit")]
)
def test_allocate_and_free_2048_token_prompt(benchmark, shared_prefix):
    stream = PromptStream(shared_prefix)
    benchmark.extra_info.update(
        prompt_len=PROMPT_LEN, block_size=BLOCK_SIZE, shared_prefix_len=len(stream.prefix), num_blocks=NUM_BLOCKS,
        unit="one sequence per round",
    )
    cached = benchmark.pedantic(stream.lifecycle, setup=stream.setup, rounds=ROUNDS, warmup_rounds=WARMUP_ROUNDS)
    assert cached == (SHARED_PREFIX_LEN if shared_prefix else 0)
    stream.manager.check_invariants([stream.holder] if shared_prefix else [])

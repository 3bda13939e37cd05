"""The synthetic benchmark workload: random token-id prompts with chosen lengths.

Every prompt is `prefix_len` tokens shared by all prompts (to exercise the prefix cache)
followed by its own random tokens; input and output lengths are drawn uniformly from inclusive
ranges. Every request sets ignore_eos and max_tokens = its output length, so the number of
tokens generated is known in advance and a run is comparable with any other run of the same
workload. The same (sizes, seed, vocabulary) always gives the same workload, in any process.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastgen.sampling_params import SamplingParams

# Special tokens sit at the ends of the vocabulary in the families served: SmolLM2's are its
# first 17 ids, Qwen2/Qwen3's its last ~300 (151643 upward, vocab 151936), Llama 3's its last
# 256. Drawing from between the margins keeps special tokens out of real-weight runs.
_LOW_MARGIN = 100
_HIGH_MARGIN = 300


@dataclass(frozen=True)
class IntRange:
    """An inclusive range of integers, [low, high]; a single value has low == high."""

    low: int
    high: int

    def __str__(self) -> str:
        return str(self.low) if self.low == self.high else f"{self.low}:{self.high}"


@dataclass(frozen=True)
class WorkloadSpec:
    """What to generate. input_len counts the tokens after the shared prefix."""

    num_prompts: int
    input_len: IntRange
    output_len: IntRange
    prefix_len: int = 0
    seed: int = 0

    @property
    def max_seq_len(self) -> int:
        """The longest sequence (prompt + output) the workload can contain."""
        return self.prefix_len + self.input_len.high + self.output_len.high

    def to_json(self) -> dict:
        return {
            "num_prompts": self.num_prompts,
            "input_len": [self.input_len.low, self.input_len.high],
            "output_len": [self.output_len.low, self.output_len.high],
            "prefix_len": self.prefix_len,
            "seed": self.seed,
        }


@dataclass(frozen=True)
class Workload:
    """The drawn requests: prompts[i] (token ids) generates exactly output_lens[i] tokens."""

    spec: WorkloadSpec
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    def sampling_params(self, temperature: float) -> list[SamplingParams]:
        return [SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True) for n in self.output_lens]


def token_id_range(vocab_size: int) -> tuple[int, int]:
    """[low, high) of the ids prompts are drawn from: the vocabulary minus its special ends,
    or all of it for vocabularies too small to spare the margins (tiny test models)."""
    low, high = _LOW_MARGIN, vocab_size - _HIGH_MARGIN
    if high - low < vocab_size // 2:
        return 0, vocab_size
    return low, high


def build_workload(spec: WorkloadSpec, vocab_size: int) -> Workload:
    """Draw the workload's prompts and output lengths (numpy PCG64 seeded with spec.seed)."""
    import numpy as np  # here, not at the top: `fastgen --help` reads this module's IntRange

    if vocab_size < 1:
        raise ValueError(f"vocab_size={vocab_size} must be >= 1")
    rng = np.random.default_rng(spec.seed)
    low, high = token_id_range(vocab_size)
    prefix = rng.integers(low, high, size=spec.prefix_len).tolist()
    input_lens = rng.integers(spec.input_len.low, spec.input_len.high + 1, size=spec.num_prompts)
    output_lens = rng.integers(spec.output_len.low, spec.output_len.high + 1, size=spec.num_prompts)
    prompts = [prefix + rng.integers(low, high, size=int(n)).tolist() for n in input_lens]
    return Workload(spec, prompts, [int(n) for n in output_lens])


def with_fresh_tokens(workload: Workload, seed: int, vocab_size: int) -> Workload:
    """The same requests (prompt and output lengths, shared prefix length) with token ids drawn
    anew with `seed`: another round of one workload, none of whose prompts the prefix cache holds
    from the round before, and whose numbers compare with it (the lengths set the work)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    low, high = token_id_range(vocab_size)
    prefix_len = workload.spec.prefix_len
    prefix = rng.integers(low, high, size=prefix_len).tolist()
    prompts = [prefix + rng.integers(low, high, size=len(p) - prefix_len).tolist() for p in workload.prompts]
    return Workload(workload.spec, prompts, list(workload.output_lens))

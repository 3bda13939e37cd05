"""A snapshot of an engine's load and lifetime counters, taken by the thread that drives it and
read by any other (the server's /metrics): a frozen record, so a reader never sees half a step."""

from __future__ import annotations

from dataclasses import dataclass

from fastgen.engine.block_manager import hit_rate


@dataclass(frozen=True)
class EngineStats:
    """num_running / num_waiting: sequences scheduled / queued. num_kv_blocks: the KV cache's
    blocks; num_used_kv_blocks: those held by sequences (free blocks that still carry a
    prefix-cache key count as free). prefix_hit_tokens / prefix_queried_tokens: prompt tokens
    served from the prefix cache / looked up, since start. num_preemptions, num_steps: since
    start. decode_tokens / prompt_tokens: tokens computed by kind since start; mixed_steps:
    steps that decoded and computed prompt chunks together. draft_tokens / accepted_draft_tokens:
    speculative decoding's proposed tokens verified, and those accepted, since start;
    accepted_per_position[i]: verifications that accepted draft position i (0 the first)."""

    num_running: int = 0
    num_waiting: int = 0
    num_kv_blocks: int = 0
    num_used_kv_blocks: int = 0
    prefix_hit_tokens: int = 0
    prefix_queried_tokens: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    decode_tokens: int = 0
    prompt_tokens: int = 0
    mixed_steps: int = 0
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    accepted_per_position: tuple[int, ...] = ()

    @property
    def prefix_hit_rate(self) -> float:
        return hit_rate(self.prefix_hit_tokens, self.prefix_queried_tokens)

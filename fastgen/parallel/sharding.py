"""How a model's dimensions split across tensor-parallel ranks: plain arithmetic, no torch, so
`EngineConfig` can validate a size before anything loads.

Attention heads and the MLP's inner width split evenly. KV heads split evenly when there are at
least as many as ranks; with fewer, each rank holds the one KV head its query heads read, so a
KV head is replicated on `tp_size / num_kv_heads` consecutive ranks. The vocabulary splits into
equal, padded pieces (the last rank's may hold padding rows), so any vocabulary size works.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fastgen.models.config import ModelConfig


@dataclass(frozen=True)
class OutputShard:
    """The rows of one projection's output that a rank holds: `size` rows from row `start` of
    the projection's `full` rows."""

    full: int
    start: int
    size: int


def even_shard(full: int, rank: int, tp_size: int) -> OutputShard:
    """Rank `rank`'s equal share of `full` rows (the caller checked divisibility)."""
    size = full // tp_size
    return OutputShard(full, rank * size, size)


def kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    return max(1, num_kv_heads // tp_size)


def kv_head_shard(num_kv_heads: int, head_dim: int, rank: int, tp_size: int) -> OutputShard:
    """The K (or V) projection rows rank `rank` holds: its share of the KV heads, or, with fewer
    KV heads than ranks, the one head its query heads are grouped onto."""
    per_rank = kv_heads_per_rank(num_kv_heads, tp_size)
    first = rank * per_rank if num_kv_heads >= tp_size else rank * num_kv_heads // tp_size
    return OutputShard(num_kv_heads * head_dim, first * head_dim, per_rank * head_dim)


def vocab_rows_per_rank(vocab_size: int, tp_size: int) -> int:
    """Rows of the embedding / LM head each rank holds (the vocabulary rounded up to tp_size)."""
    return -(-vocab_size // tp_size)


def check_tensor_parallel(mc: ModelConfig, tp_size: int) -> None:
    """ValueError naming tensor_parallel_size, the value and the dimension it cannot split."""
    name = f"tensor_parallel_size={tp_size}"
    if mc.num_heads % tp_size:
        raise ValueError(f"{name} must divide the model's {mc.num_heads} attention heads")
    if mc.num_kv_heads % tp_size and tp_size % mc.num_kv_heads:
        raise ValueError(f"{name} must divide the model's {mc.num_kv_heads} KV heads, or be a multiple of "
                         "them (each KV head is then replicated on several ranks)")
    if mc.intermediate_size % tp_size:
        raise ValueError(f"{name} must divide the model's MLP width intermediate_size={mc.intermediate_size}")

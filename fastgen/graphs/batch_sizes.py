"""Which decode batch sizes get a CUDA graph, and which graph a batch of n runs in."""

from __future__ import annotations

import bisect


def default_capture_sizes(max_num_seqs: int, cap: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 64 and every 16 beyond, ending exactly at
    min(max_num_seqs, cap) so that every decode batch the scheduler can form has a graph.

    Finer steps at small sizes keep padding waste low where a step is cheapest; every size costs
    capture time and a little graph memory, so the steps widen as batches grow.
    """
    top = min(max_num_seqs, cap)
    sizes = [1, 2, 4, 8, *range(16, 65, 8), *range(80, top + 1, 16)]
    return sorted({s for s in sizes if s <= top} | {top})


def padded_size(n: int, sizes: list[int]) -> int:
    """The smallest captured size >= n (sizes sorted ascending; n <= sizes[-1])."""
    return sizes[bisect.bisect_left(sizes, n)]

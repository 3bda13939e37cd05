"""Random paged caches for the attention-kernel tests.

Blocks are shuffled across the pool and every slot outside the live contexts (unused blocks,
the tail of each last block) holds NaN, so a kernel that reads one wrong slot produces NaN
instead of a small numeric error.
"""

from __future__ import annotations

import importlib

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 2e-3, torch.bfloat16: 3e-2, torch.float16: 5e-3}


def paged_cache(context_lens, num_kv_heads, head_dim, block_size, max_blocks, dtype, gen, spare_blocks=3):
    """(k_cache, v_cache, block_tables int32 [batch, max_blocks]) on DEVICE holding random K/V for
    each row's first context_lens[row] tokens and NaN everywhere else."""
    batch = len(context_lens)
    blocks_per_row = [-(-n // block_size) for n in context_lens]
    assert max(blocks_per_row, default=0) <= max_blocks
    num_blocks = sum(blocks_per_row) + spare_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"))
    v_cache = torch.full(shape, float("nan"))
    block_tables = torch.full((batch, max_blocks), -1, dtype=torch.int32)
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    for row, (n_tokens, n_blocks) in enumerate(zip(context_lens, blocks_per_row)):
        ids = [pool.pop() for _ in range(n_blocks)]
        block_tables[row, :n_blocks] = torch.tensor(ids, dtype=torch.int32)
        token_block = torch.tensor(ids, dtype=torch.long).repeat_interleave(block_size)[:n_tokens]
        token_offset = torch.arange(n_tokens) % block_size
        k_cache[token_block, token_offset] = torch.randn(n_tokens, num_kv_heads, head_dim, generator=gen)
        v_cache[token_block, token_offset] = torch.randn(n_tokens, num_kv_heads, head_dim, generator=gen)
    return k_cache.to(dtype).to(DEVICE), v_cache.to(dtype).to(DEVICE), block_tables.to(DEVICE)


def int32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def record_decode_launches(monkeypatch, keyword: str, kernels: tuple[str, ...] = ("decode_split_kernel",),
                           run: bool = True) -> list:
    """The value of `keyword` each launch of decode attention's `kernels` is given from now on,
    in launch order: what reached the kernel, where the result alone cannot tell. With `run`
    False the launches are only recorded (a launch the interpreter cannot run)."""
    launcher = importlib.import_module("fastgen.kernels.paged_decode_attention")
    seen = []

    class Recorded:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.append(kwargs[keyword])
                return self.kernel[grid](*args, **kwargs) if run else None
            return launch

    for name in kernels:
        monkeypatch.setattr(launcher, name, Recorded(getattr(launcher, name)))
    return seen

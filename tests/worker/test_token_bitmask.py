"""The sampler's bitmask application equals xgrammar's own (`apply_token_bitmask_inplace`) on
random masks, vocabularies that are not a multiple of 32, any row subset and any dtype; on CUDA
it equals the CPU's."""

from __future__ import annotations

import pytest
import torch

from fastgen.worker.token_bitmask import mask_disallowed


@pytest.mark.parametrize("vocab", [32, 100, 49152, 151936])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mask_equals_xgrammars(vocab, dtype):
    xgr = pytest.importorskip("xgrammar")  # absent on the GPU machine
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=generator).to(dtype)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, words), dtype=torch.int32, generator=generator)
    rows = torch.tensor([4, 0, 2])
    placed = torch.full((5, words), -1, dtype=torch.int32)  # xgrammar indexes logits and mask by one row
    placed[rows] = bitmask
    expected = logits.float().clone()
    xgr.apply_token_bitmask_inplace(expected, placed, indices=rows.tolist())
    got = mask_disallowed(logits, rows, bitmask)
    assert torch.equal(got, expected) and got.dtype == torch.float32
    every = torch.randint(-2**31, 2**31 - 1, (5, words), dtype=torch.int32, generator=generator)
    expected = logits.float().clone()
    xgr.apply_token_bitmask_inplace(expected, every)
    assert torch.equal(mask_disallowed(logits, None, every), expected)
    assert not torch.equal(logits.float(), expected)  # the inputs are left as they were


@pytest.mark.cuda
def test_cuda_mask_equals_the_cpus():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 151936, generator=generator).to(torch.bfloat16)
    bitmask = torch.randint(-2**31, 2**31 - 1, (4, 151936 // 32), dtype=torch.int32, generator=generator)
    rows = torch.tensor([5, 1, 0, 3])
    expected = mask_disallowed(logits, rows, bitmask)
    got = mask_disallowed(logits.cuda(), rows.cuda(), bitmask.cuda())
    assert torch.equal(got.cpu(), expected)

"""store_kvcache (Triton) writes exactly the slots it is given, and nothing for slot -1."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from fastgen.kernels import store_kvcache, store_kvcache_torch  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytestmark = pytest.mark.triton


def _random_caches(num_blocks, block_size, num_kv_heads, head_dim, dtype, seed):
    """Caches full of random values with no zeros, so an unwanted zero write would show."""
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k = (torch.rand(shape, generator=gen) + 1.0).to(dtype).to(DEVICE)
    v = -(torch.rand(shape, generator=gen) + 1.0).to(dtype).to(DEVICE)
    return k, v


def _random_step(num_tokens, num_slots, num_kv_heads, head_dim, dtype, seed, index_dtype):
    """New K/V for `num_tokens` tokens, distinct random slots, every third slot -1."""
    gen = torch.Generator().manual_seed(seed + 1)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    slots = torch.randperm(num_slots, generator=gen)[:num_tokens]
    slots[::3] = -1
    return key, value, slots.to(index_dtype).to(DEVICE)


def _expected(k_cache, v_cache, key, value, slot_mapping):
    """Independent oracle: a Python loop over tokens on copies of the caches."""
    k_exp, v_exp = k_cache.clone(), v_cache.clone()
    block_size = k_cache.shape[1]
    for token, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            k_exp[slot // block_size, slot % block_size] = key[token]
            v_exp[slot // block_size, slot % block_size] = value[token]
    return k_exp, v_exp


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size, num_blocks", [(1, 24), (16, 3), (256, 2)],
                         ids=["bs1", "bs16", "bs256"])
@pytest.mark.parametrize("store", [store_kvcache, store_kvcache_torch], ids=["triton", "torch"])
def test_writes_given_slots_and_leaves_every_other_slot_bit_identical(store, block_size, num_blocks, dtype):
    num_kv_heads, head_dim, num_tokens = 2, 32, 13
    k_cache, v_cache = _random_caches(num_blocks, block_size, num_kv_heads, head_dim, dtype, seed=block_size)
    key, value, slots = _random_step(num_tokens, num_blocks * block_size, num_kv_heads, head_dim, dtype,
                                     seed=block_size, index_dtype=torch.int64)
    k_exp, v_exp = _expected(k_cache, v_cache, key, value, slots)

    store(key, value, k_cache, v_cache, slots)

    assert torch.equal(k_cache, k_exp)
    assert torch.equal(v_cache, v_exp)


def test_triton_matches_torch_twin_with_int32_slots_and_strided_inputs():
    # K and V as views into one fused [tokens, 3, heads, dim] projection, like a QKV split.
    num_kv_heads, head_dim, block_size, num_blocks, num_tokens = 3, 48, 5, 7, 11
    k_a, v_a = _random_caches(num_blocks, block_size, num_kv_heads, head_dim, torch.float16, seed=7)
    k_b, v_b = k_a.clone(), v_a.clone()
    qkv = torch.randn(num_tokens, 3, num_kv_heads, head_dim).half().to(DEVICE)
    key, value = qkv[:, 1], qkv[:, 2]
    slots = torch.randperm(num_blocks * block_size)[:num_tokens].int().to(DEVICE)
    slots[[0, 5]] = -1

    store_kvcache(key, value, k_a, v_a, slots)
    store_kvcache_torch(key, value, k_b, v_b, slots)

    assert torch.equal(k_a, k_b)
    assert torch.equal(v_a, v_b)


def test_all_padding_slots_write_nothing():
    k_cache, v_cache = _random_caches(2, 16, 2, 32, torch.float32, seed=3)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    key = torch.zeros(4, 2, 32, device=DEVICE)
    slots = torch.full((4,), -1, dtype=torch.int64, device=DEVICE)

    store_kvcache(key, key, k_cache, v_cache, slots)

    assert torch.equal(k_cache, k_before)
    assert torch.equal(v_cache, v_before)


def test_zero_tokens_is_a_no_op():
    k_cache, v_cache = _random_caches(2, 4, 1, 16, torch.float32, seed=4)
    k_before = k_cache.clone()
    empty = torch.empty(0, 1, 16, device=DEVICE)
    store_kvcache(empty, empty, k_cache, v_cache, torch.empty(0, dtype=torch.int64, device=DEVICE))
    assert torch.equal(k_cache, k_before)


def test_rejects_mismatched_head_dim():
    k_cache, v_cache = _random_caches(2, 4, 1, 16, torch.float32, seed=5)
    key = torch.zeros(3, 1, 32, device=DEVICE)
    with pytest.raises(ValueError, match="head_dim"):
        store_kvcache(key, key, k_cache, v_cache, torch.zeros(3, dtype=torch.int64, device=DEVICE))


@pytest.mark.cuda
@requires_cuda
def test_store_is_cuda_graph_capturable():
    k_cache, v_cache = _random_caches(64, 16, 8, 128, torch.bfloat16, seed=6)
    key = torch.randn(32, 8, 128, device="cuda").bfloat16()
    value = torch.randn(32, 8, 128, device="cuda").bfloat16()
    slots = torch.full((32,), -1, dtype=torch.int64, device="cuda")
    store_kvcache(key, value, k_cache, v_cache, slots)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        store_kvcache(key, value, k_cache, v_cache, slots)

    new_slots = torch.randperm(64 * 16, device="cuda")[:32]
    new_slots[-4:] = -1
    slots.copy_(new_slots)
    k_exp, v_exp = _expected(k_cache, v_cache, key, value, slots)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(k_cache, k_exp)
    assert torch.equal(v_cache, v_exp)

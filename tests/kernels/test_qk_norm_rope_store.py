"""qk_norm_rope_store (one Triton launch) equals the unfused torch path it replaces: per-head
RMSNorm of q and k (Qwen3), RoPE, then the KV store (`TorchPagedBackend.rope_and_store`)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from fastgen.kernels import qk_norm_rope_store  # noqa: E402

from fastgen.attention.metadata import AttentionMetadata  # noqa: E402
from fastgen.attention.torch_paged import TorchPagedBackend  # noqa: E402
from fastgen.compile import build_op_set  # noqa: E402
from fastgen.layers.rotary import RotaryEmbedding  # noqa: E402
from tests.kernels.paged_cases import DEVICE  # noqa: E402

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytestmark = pytest.mark.triton
# (rtol, atol). fp32: equal up to summation order. bf16: a few units in the last place of the
# larger RoPE product, since each of the norm, weight, product and sum steps rounds (and the
# interpreter rounds fp32 -> bf16 by truncation where torch and GPUs round to nearest). A wrong
# half, sign, weight or position is off by O(1).
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (3e-2, 5e-2)}


def store_meta(slots: torch.Tensor) -> AttentionMetadata:
    """The metadata the torch backend's store reads: only the slots (a one-row decode shape)."""
    empty = slots.new_zeros(0, dtype=torch.int32)
    return AttentionMetadata(False, slots, empty, empty, None, 1, 1, None)


def make_step(tokens, heads, kv_heads, head_dim, dtype, block_size=16, num_blocks=8, seed=0):
    """Views into one fused QKV output (as the model makes them), random positions, slots with
    some -1, a NaN-free random cache."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype).to(DEVICE)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = (t.view(tokens, -1, head_dim) for t in (q, k, v))
    positions = torch.randint(0, 500, (tokens,), generator=gen).to(DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[::3] = -1
    cache_shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=gen).to(dtype).to(DEVICE)
    v_cache = torch.randn(cache_shape, generator=gen).to(dtype).to(DEVICE)
    weights = [(torch.rand(head_dim, generator=gen) + 0.5).to(dtype).to(DEVICE) for _ in range(2)]
    return q, k, v, positions, slots.to(DEVICE), k_cache, v_cache, weights


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("qk_norm", [True, False], ids=["qk-norm", "no-norm"])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(16, 8, 128), (4, 1, 64), (6, 2, 32)])
def test_equals_unfused_torch_path(dtype, qk_norm, heads, kv_heads, head_dim):
    q, k, v, positions, slots, k_cache, v_cache, (q_w, k_w) = make_step(9, heads, kv_heads, head_dim, dtype)
    cos_sin = RotaryEmbedding(head_dim, 512, 1e6, None).cos_sin.to(DEVICE)
    weights = (q_w, k_w) if qk_norm else (None, None)
    k_cache_ref, v_cache_ref = k_cache.clone(), v_cache.clone()
    want_q, want_k = TorchPagedBackend(build_op_set(False), k_cache.shape[1]).rope_and_store(
        positions, q.clone(), k.clone(), v, cos_sin, *weights, 1e-6, k_cache_ref, v_cache_ref, store_meta(slots))

    got_q, got_k = qk_norm_rope_store(q, k, v, positions, cos_sin, *weights, 1e-6, k_cache, v_cache, slots)
    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(got_q, want_q, rtol=rtol, atol=atol)
    torch.testing.assert_close(got_k, want_k, rtol=rtol, atol=atol)
    torch.testing.assert_close(k_cache, k_cache_ref, rtol=rtol, atol=atol)
    assert torch.equal(v_cache, v_cache_ref), "v is copied bit for bit"
    assert got_q.data_ptr() == q.data_ptr(), "q is rewritten in place, inside the QKV buffer"


def test_slot_minus_one_writes_nothing():
    q, k, v, positions, slots, k_cache, v_cache, _ = make_step(5, 2, 1, 16, torch.float32)
    slots.fill_(-1)
    before = k_cache.clone(), v_cache.clone()
    cos_sin = RotaryEmbedding(16, 512, 1e4, None).cos_sin.to(DEVICE)
    qk_norm_rope_store(q, k, v, positions, cos_sin, None, None, 1e-6, k_cache, v_cache, slots)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


def test_rejects_one_norm_weight_without_the_other():
    q, k, v, positions, slots, k_cache, v_cache, (q_w, _) = make_step(3, 2, 1, 16, torch.float32)
    cos_sin = RotaryEmbedding(16, 512, 1e4, None).cos_sin.to(DEVICE)
    with pytest.raises(ValueError, match="together"):
        qk_norm_rope_store(q, k, v, positions, cos_sin, q_w, None, 1e-6, k_cache, v_cache, slots)


@pytest.mark.cuda
@requires_cuda
def test_fused_store_is_cuda_graph_capturable():
    q, k, v, positions, slots, k_cache, v_cache, (q_w, k_w) = make_step(32, 16, 8, 128, torch.bfloat16,
                                                                        num_blocks=64)
    cos_sin = RotaryEmbedding(128, 4096, 1e6, None).cos_sin.cuda()
    q0, k0 = q.clone(), k.clone()
    args = (q, k, v, positions, cos_sin, q_w, k_w, 1e-6, k_cache, v_cache, slots)
    qk_norm_rope_store(*args)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        qk_norm_rope_store(*args)
    q.copy_(q0), k.copy_(k0)
    k_cache_ref, v_cache_ref = k_cache.clone(), v_cache.clone()
    want_q, want_k = TorchPagedBackend(build_op_set(False), k_cache.shape[1]).rope_and_store(
        positions, q0, k0, v, cos_sin, q_w, k_w, 1e-6, k_cache_ref, v_cache_ref, store_meta(slots))
    graph.replay()
    torch.cuda.synchronize()
    rtol, atol = TOLERANCE[torch.bfloat16]
    torch.testing.assert_close(q, want_q, rtol=rtol, atol=atol)
    torch.testing.assert_close(k_cache, k_cache_ref, rtol=rtol, atol=atol)

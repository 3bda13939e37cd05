"""Write one step's new keys and values into the paged KV cache.

The cache of one layer is split into `k_cache` and `v_cache`, each
`[num_blocks, block_size, num_kv_heads, head_dim]` and contiguous. A token's *slot* is
`block_id * block_size + offset_in_block`, so the two leading dims flatten into one slot axis
and a store is a row scatter: `k_cache.view(-1, H, D)[slot] = key[token]`.

A slot of -1 means "no token here" (the padded rows of a CUDA-graph batch); nothing is written
for it.
"""

import torch
import triton
import triton.language as tl


def check_store_args(key, value, k_cache, v_cache, slot_mapping) -> None:
    """Validate shapes and dtypes at the boundary (cheap: no device sync)."""
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(
            f"key and value must both be [num_tokens, num_kv_heads, head_dim], got "
            f"key {tuple(key.shape)} and value {tuple(value.shape)}"
        )
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if k_cache.shape[2:] != key.shape[1:]:
        raise ValueError(
            f"cache heads/head_dim {tuple(k_cache.shape[2:])} do not match "
            f"key heads/head_dim {tuple(key.shape[1:])}"
        )
    if slot_mapping.shape != (key.shape[0],):
        raise ValueError(
            f"slot_mapping must be [num_tokens]={key.shape[0]}, got {tuple(slot_mapping.shape)}"
        )
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    if key.dtype != k_cache.dtype or value.dtype != v_cache.dtype:
        raise ValueError(
            f"key/value dtypes ({key.dtype}, {value.dtype}) must match the cache "
            f"({k_cache.dtype}, {v_cache.dtype})"
        )
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")


@triton.jit
def _store_kvcache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    num_kv_heads, head_dim,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # One program per token; it moves all of that token's heads in one [BLOCK_H, BLOCK_D] tile.
    token = tl.program_id(0)
    # int64 so slot * row_size cannot overflow on caches with more than 2**31 elements.
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    # A -1 slot masks the whole tile (zero heads to move), so a padded row neither reads nor
    # writes. Folding it into the head bound rather than and-ing a scalar bool into the mask
    # also sidesteps a Triton-interpreter bug that turns such a mask into int32.
    heads_to_move = tl.where(slot >= 0, num_kv_heads, 0)
    mask = (offs_h[:, None] < heads_to_move) & (offs_d[None, :] < head_dim)

    k = tl.load(key_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd,
                mask=mask)
    v = tl.load(value_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd,
                mask=mask)
    # The cache is contiguous: a slot's row is num_kv_heads * head_dim elements long.
    cache_offs = slot * (num_kv_heads * head_dim) + offs_h[:, None] * head_dim + offs_d[None, :]
    tl.store(k_cache_ptr + cache_offs, k, mask=mask)
    tl.store(v_cache_ptr + cache_offs, v, mask=mask)


def store_kvcache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter each token's K and V into its cache slot (Triton; CUDA-graph capturable).

    Args:
        key, value: `[num_tokens, num_kv_heads, head_dim]`, same float dtype as the cache;
            any strides (e.g. views into a fused QKV projection).
        k_cache, v_cache: `[num_blocks, block_size, num_kv_heads, head_dim]`, contiguous;
            modified in place. `block_size` may be any positive int.
        slot_mapping: `[num_tokens]` int32 or int64; slot = block_id * block_size + offset.
            A slot of -1 is skipped: nothing is read or written for that token.

    The launch depends only on shapes (one program per token), never on slot values, so it
    can be captured in a CUDA graph.
    """
    check_store_args(key, value, k_cache, v_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _store_kvcache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2),
        num_kv_heads, head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


def store_kvcache_torch(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    skip_invalid: bool = True,
) -> None:
    """Plain-torch twin of `store_kvcache` (same contract), for CPU and as a test oracle.

    skip_invalid=False is for a caller that knows no slot is -1 (the compiled CPU steps,
    `fastgen.cpu.compiled_decode`, which never pad their batch and run a prefill step with a -1
    slot eagerly): the -1 filter's data-dependent shape cannot be in a graph, and without it the
    store compiles into an in-place scatter into the cache. A -1 there would write the cache's
    last slot.
    """
    check_store_args(key, value, k_cache, v_cache, slot_mapping)
    num_kv_heads, head_dim = key.shape[1:]
    if not skip_invalid:
        slots = slot_mapping.long()
    else:
        valid = slot_mapping >= 0
        slots, key, value = slot_mapping[valid].long(), key[valid], value[valid]
    # `.view` (not reshape) so a non-contiguous cache fails loudly instead of writing a copy.
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, key)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, value)

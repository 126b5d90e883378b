"""Triton KV-cache write: scatter each token's K/V rows into the paged cache at its slot.

In: key/value `[num_tokens, num_kv_heads, head_dim]` (row stride free, e.g. views of a fused
qkv output), `slot_mapping[num_tokens]`. Out: the caches updated in place. Slot -1 marks a
padded row (CUDA-graph padding) and is skipped, so padding costs no cache traffic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch import aligned


@triton.jit
def _write_kv_cache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_k_tok,
    stride_v_tok,
    ROW: tl.constexpr,  # num_kv_heads * head_dim
    BLOCK: tl.constexpr,
):
    _store_kv_row(tl.program_id(0), key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, stride_k_tok, stride_v_tok,
                  ROW, BLOCK)


@triton.jit
def _store_kv_row(tok, key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, stride_k_tok, stride_v_tok,
                  ROW: tl.constexpr, BLOCK: tl.constexpr):
    """Token `tok`'s K and V rows into the cache at its slot (nothing for slot -1)."""
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot < 0:  # padded row: nothing to store
        return
    offs = tl.arange(0, BLOCK)
    mask = offs < ROW
    k = tl.load(key_ptr + tok.to(tl.int64) * stride_k_tok + offs, mask=mask)
    v = tl.load(value_ptr + tok.to(tl.int64) * stride_v_tok + offs, mask=mask)
    # The cache is contiguous: slot s starts at s * ROW in both [num_blocks, block_size, ...] views.
    tl.store(k_cache_ptr + slot * ROW + offs, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + slot * ROW + offs, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def check_kv_write(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> int:
    """The K/V write's input contract (shared with the fused RoPE + write); returns the token count."""
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape, (value.shape, key.shape)
    assert k_cache.shape == v_cache.shape and k_cache.shape[2:] == (num_kv_heads, head_dim)
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    for t in (key, value):
        assert t.stride(2) == 1 and t.stride(1) == head_dim, "K/V rows must be contiguous per token"
    assert slot_mapping.shape == (num_tokens,) and slot_mapping.dtype in (torch.int32, torch.int64)
    return num_tokens


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
) -> None:
    """Store each token's K/V row at its slot; rows with slot -1 are skipped.

    Shapes: key/value [T, KVH, D] with unit stride over (KVH, D); caches [NB, BS, KVH, D]
    contiguous; slot_mapping [T] int32/int64.
    """
    num_tokens = check_kv_write(key, value, k_cache, v_cache, slot_mapping)
    if num_tokens == 0:
        return
    row = key.shape[1] * key.shape[2]
    _write_kv_cache_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        aligned(slot_mapping),
        key.stride(0),
        value.stride(0),
        ROW=row,
        BLOCK=triton.next_power_of_2(row),
        num_warps=4,
    )

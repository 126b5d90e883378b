"""Triton rotary embedding, neox style (rotate-half), applied to q and k in place.

In: `positions[num_tokens]`, q `[T, H*D]` or `[T, H, D]`, k likewise with KV heads, and a
`cos_sin_cache[max_position, rot_dim]` (cos first half, sin second; any Llama-3 frequency
scaling is baked into the cache by its builder). One program per token rotates all its heads.
`rotary_and_write_kv` also stores the token's rotated K and its V in the paged cache, in the same
program (what a layer does every step: one launch and one pass over K instead of two).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.cache_ops import _store_kv_row, check_kv_write
from kernels.launch import aligned
from kernels.pdl import launch_options, release_dependents, wait_upstream


@triton.jit
def rotate_pair(x1, x2, cos, sin):
    """One rotate-half pair in fp32: (x1 cos - x2 sin, x2 cos + x1 sin), each with one explicit FMA, so
    every kernel that rotates (this one, `kernels/paged_decode_attention.py` with a `DecodeRope`) rounds
    alike however its compiler would contract the plain expressions."""
    return tl.fma(x1, cos, -(x2 * sin)), tl.fma(x2, cos, x1 * sin)


@triton.jit
def _rotate_heads(base_ptr, cos, sin, offs_h, offs_r, mask, HEAD_DIM: tl.constexpr, HALF: tl.constexpr):
    ptrs = base_ptr + offs_h[:, None] * HEAD_DIM + offs_r[None, :]  # [BLOCK_HEADS, BLOCK_HALF]
    x1 = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
    o1, o2 = rotate_pair(x1, x2, cos[None, :], sin[None, :])
    tl.store(ptrs, o1.to(base_ptr.dtype.element_ty), mask=mask)
    tl.store(ptrs + HALF, o2.to(base_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,
    q_ptr,
    k_ptr,
    cache_ptr,
    stride_q_tok,
    stride_k_tok,
    stride_cache,
    NUM_Q_HEADS: tl.constexpr,
    NUM_K_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_Q_HEADS: tl.constexpr,
    BLOCK_K_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    _rotate_token(tl.program_id(0).to(tl.int64), positions_ptr, q_ptr, k_ptr, cache_ptr, stride_q_tok, stride_k_tok,
                  stride_cache, NUM_Q_HEADS, NUM_K_HEADS, HEAD_DIM, HALF, BLOCK_Q_HEADS, BLOCK_K_HEADS, BLOCK_HALF)


@triton.jit
def _rotate_token(tok, positions_ptr, q_ptr, k_ptr, cache_ptr, stride_q_tok, stride_k_tok, stride_cache,
                  NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
                  BLOCK_Q_HEADS: tl.constexpr, BLOCK_K_HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Token `tok`'s query and key heads, rotated in place."""
    pos = tl.load(positions_ptr + tok).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_HALF)
    mask_r = offs_r < HALF
    cos = tl.load(cache_ptr + pos * stride_cache + offs_r, mask=mask_r, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + pos * stride_cache + HALF + offs_r, mask=mask_r, other=0.0).to(tl.float32)
    offs_qh = tl.arange(0, BLOCK_Q_HEADS)
    _rotate_heads(q_ptr + tok * stride_q_tok, cos, sin, offs_qh, offs_r,
                  (offs_qh[:, None] < NUM_Q_HEADS) & mask_r[None, :], HEAD_DIM, HALF)
    offs_kh = tl.arange(0, BLOCK_K_HEADS)
    _rotate_heads(k_ptr + tok * stride_k_tok, cos, sin, offs_kh, offs_r,
                  (offs_kh[:, None] < NUM_K_HEADS) & mask_r[None, :], HEAD_DIM, HALF)


def _num_heads(t: torch.Tensor, head_dim: int) -> int:
    # Each token's heads must be packed: [T, H*D] with unit stride, or [T, H, D] with stride D.
    if t.dim() == 2:
        assert t.stride(1) == 1 and t.shape[1] % head_dim == 0, (t.shape, t.stride())
        return t.shape[1] // head_dim
    assert t.dim() == 3 and t.shape[2] == head_dim and t.stride(2) == 1 and t.stride(1) == head_dim
    return t.shape[1]


@triton.jit
def _rotary_and_write_kv_kernel(
    positions_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    cache_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_q_tok,
    stride_k_tok,
    stride_v_tok,
    stride_cache,
    NUM_Q_HEADS: tl.constexpr,
    NUM_K_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_Q_HEADS: tl.constexpr,
    BLOCK_K_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    ROW: tl.constexpr,
    BLOCK_ROW: tl.constexpr,
    PDL: tl.constexpr,  # launched with programmatic dependent launch (kernels/pdl.py)
):
    release_dependents(PDL)
    wait_upstream(PDL)
    tok = tl.program_id(0).to(tl.int64)
    _rotate_token(tok, positions_ptr, q_ptr, k_ptr, cache_ptr, stride_q_tok, stride_k_tok, stride_cache,
                  NUM_Q_HEADS, NUM_K_HEADS, HEAD_DIM, HALF, BLOCK_Q_HEADS, BLOCK_K_HEADS, BLOCK_HALF)
    tl.debug_barrier()  # the rotated key row, stored by this program's threads, is read back whole below
    _store_kv_row(tok, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, stride_k_tok, stride_v_tok, ROW, BLOCK_ROW)


def _launch_shape(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor,
                  head_dim: int) -> dict:
    """The RoPE contract's checks, and the constexprs of one token's program."""
    num_tokens = positions.shape[0]
    assert query.shape[0] == num_tokens and key.shape[0] == num_tokens
    assert query.dtype == key.dtype, (query.dtype, key.dtype)
    num_q_heads = _num_heads(query, head_dim)
    num_k_heads = _num_heads(key, head_dim)
    rot_dim = cos_sin_cache.shape[1]
    assert rot_dim % 2 == 0 and rot_dim <= head_dim and cos_sin_cache.stride(1) == 1
    half = rot_dim // 2
    return dict(NUM_Q_HEADS=num_q_heads, NUM_K_HEADS=num_k_heads, HEAD_DIM=head_dim, HALF=half,
                BLOCK_Q_HEADS=triton.next_power_of_2(num_q_heads), BLOCK_K_HEADS=triton.next_power_of_2(num_k_heads),
                BLOCK_HALF=triton.next_power_of_2(half))


def rotary_and_write_kv(
    positions: torch.Tensor,  # [num_tokens] int64
    query: torch.Tensor,  # [num_tokens, num_heads * head_dim] (or [T, H, D]), rotated in place
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], rotated in place, then stored
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], stored
    cos_sin_cache: torch.Tensor,  # [max_position, rot_dim]
    head_dim: int,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens], -1 = not stored
) -> None:
    """`rotary_embedding` then `write_kv_cache` in one launch (one program per token): a layer's
    step writes its K/V without a second kernel reading the rotated key back from memory."""
    shape = _launch_shape(positions, query, key, cos_sin_cache, head_dim)
    num_tokens = check_kv_write(key, value, k_cache, v_cache, slot_mapping)
    if num_tokens == 0:
        return
    row = key.shape[1] * head_dim
    pdl = launch_options(query)
    _rotary_and_write_kv_kernel[(num_tokens,)](
        aligned(positions), query, key, value, cos_sin_cache, k_cache, v_cache, aligned(slot_mapping),
        query.stride(0), key.stride(0), value.stride(0), cos_sin_cache.stride(0),
        **shape, ROW=row, BLOCK_ROW=triton.next_power_of_2(row), num_warps=4, **pdl,
    )


def rotary_embedding(
    positions: torch.Tensor,  # [num_tokens] int64
    query: torch.Tensor,  # [num_tokens, num_heads * head_dim] (or [T, H, D]), rotated in place
    key: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim] (or [T, KVH, D]), in place
    cos_sin_cache: torch.Tensor,  # [max_position, rot_dim]: cos in the first half, sin second
    head_dim: int,
) -> None:
    """Neox-style (rotate-half) RoPE on the first rot_dim dims of each head, in place.

    Shapes: positions [T]; query/key with packed heads per token (row stride free, so views of a
    fused qkv tensor work); cos_sin_cache [P, rot_dim] with unit stride, rot_dim <= head_dim.
    """
    shape = _launch_shape(positions, query, key, cos_sin_cache, head_dim)
    num_tokens = positions.shape[0]
    if num_tokens == 0:
        return
    _rotary_kernel[(num_tokens,)](
        aligned(positions),
        query,
        key,
        cos_sin_cache,
        query.stride(0),
        key.stride(0),
        cos_sin_cache.stride(0),
        **shape,
        num_warps=4,
    )

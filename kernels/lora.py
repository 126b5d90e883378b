"""Triton batched multi-LoRA: shrink (x · A[slot]ᵀ) and expand (y += · B[slot]ᵀ), rows grouped by slot.

Every token row carries an adapter slot (-1: the base model, untouched). `lora_segments`
(kernels/reference.py, plain torch, no host sync) orders the rows by slot once per step:
`sorted_rows[seg_starts[s] : seg_starts[s] + seg_counts[s]]` are the rows of slot s. Both
kernels run one program per (block of LORA_BLOCK_M rows of one slot, ...), from the block table
`lora_segments` also builds (min(T, cdiv(T, 16) + slots) entries, unused ones return at once), so
each slot's A/B tiles are read once per row block rather than once per row (a per-row gather
would read a rank-16 8B adapter ~40 MB per token). The grid depends only on the shapes, so
both launches are CUDA-graph capturable.

Shrink splits K over programs (decode has few rows: parallelism comes from K) and writes
float32 partial sums `[num_splits, T, R]`; expand adds those partials while loading them, so
no atomics, no zeroing and the result is deterministic. Packed outputs (q|k|v, gate|up) are up
to three slices: slice p reads partial columns [p*r, (p+1)*r) and writes its own output columns.

The engine runs the shrink on a side stream, concurrent with the base GEMM, and the expand
after the join (`serving.executor.lora`, LORA_VARIANT "stream"). A fused shrink->expand kernel
(one launch, the rank-r shrink recomputed per output column block) was tried and removed: on an
H200 it added 70-371 us per Llama-3-8B layer at T=1..256 against stream's 17-83 and split's
36-87 (bench/RESULTS.md; likely its serial loop over all of K in every program costs
more than the launch it saves).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.reference import LORA_BLOCK_M

_SHRINK_BLOCK_K = 128
_SHRINK_K_PER_SPLIT = 512  # K elements per shrink program (4 iterations of BLOCK_K)
_EXPAND_BLOCK_N = 128


@triton.jit
def _block_rows(rows_ptr, starts_ptr, counts_ptr, block_slot_ptr, block_m0_ptr, b, BLOCK_M: tl.constexpr):
    """Block b's slot (-1: none), its rows (int64) and which of them exist."""
    s = tl.load(block_slot_ptr + b)
    m0 = tl.load(block_m0_ptr + b)
    count = tl.where(s >= 0, tl.load(counts_ptr + tl.maximum(s, 0)), 0)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_mask = offs_m < count
    rows = tl.load(rows_ptr + tl.load(starts_ptr + tl.maximum(s, 0)) + offs_m, mask=m_mask, other=0).to(tl.int64)
    return s, rows, m_mask


@triton.jit
def _shrink_rows(x_ptr, a_rows, rows, m_mask, r_mask, k_begin, k_end, stride_xt, stride_xk, stride_ak,
                 BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    """Σ over k in [k_begin, k_end) of x[rows, k] · A[r, k] (`a_rows`: A's rows' pointers) ->
    float32 [BLOCK_M, BLOCK_R]."""
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k in range(k_begin, k_end, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_end
        xt = tl.load(x_ptr + rows[:, None] * stride_xt + offs_k[None, :] * stride_xk,
                     mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        at = tl.load(a_rows + offs_k[None, :] * stride_ak, mask=r_mask[:, None] & k_mask[None, :],
                     other=0.0)  # [BLOCK_R, BLOCK_K]
        if IEEE:
            acc += tl.dot(xt, tl.trans(at), input_precision="ieee")
        else:
            acc += tl.dot(xt, tl.trans(at))
    return acc


@triton.jit
def _slice_block(pid, n0, n1, n2, num_n_blocks, BLOCK_N: tl.constexpr):
    """Program pid's packed slice, its first column in the slice, the slice's size and first output column."""
    part = pid // num_n_blocks
    n_start = (pid % num_n_blocks) * BLOCK_N
    size = n0 * (part == 0) + n1 * (part == 1) + n2 * (part == 2)
    col0 = n0 * (part > 0) + n1 * (part > 1)
    return part, n_start, size, col0


@triton.jit
def _expand_into(y_ptr, b_ptr, h, s, rows, m_mask, offs_r, r_mask, n_start, size, col0,
                 stride_yt, stride_yn, stride_bs, stride_bn, stride_br, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    """y[rows, col0 + n_start ..+ BLOCK_N] += h [BLOCK_M, BLOCK_R] · B[s, those columns]ᵀ."""
    offs_n = n_start + tl.arange(0, BLOCK_N)
    n_mask = offs_n < size
    bt = tl.load(b_ptr + s.to(tl.int64) * stride_bs + (col0 + offs_n)[:, None] * stride_bn
                 + offs_r[None, :] * stride_br, mask=n_mask[:, None] & r_mask[None, :], other=0.0)  # [BLOCK_N, BLOCK_R]
    if IEEE:
        acc = tl.dot(h.to(bt.dtype), tl.trans(bt), input_precision="ieee")
    else:
        acc = tl.dot(h.to(bt.dtype), tl.trans(bt))  # [BLOCK_M, BLOCK_N]
    y_tile = y_ptr + rows[:, None] * stride_yt + (col0 + offs_n)[None, :] * stride_yn
    mn_mask = m_mask[:, None] & n_mask[None, :]
    y = tl.load(y_tile, mask=mn_mask, other=0.0).to(tl.float32)
    tl.store(y_tile, (y + acc).to(y_ptr.dtype.element_ty), mask=mn_mask)


@triton.jit
def _lora_shrink_kernel(
    x_ptr, a_ptr, out_ptr, rows_ptr, starts_ptr, counts_ptr, block_slot_ptr, block_m0_ptr,
    K, R, k_per_split,
    stride_xt, stride_xk, stride_as, stride_ar, stride_ak, stride_op, stride_ot,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
):
    s, rows, m_mask = _block_rows(rows_ptr, starts_ptr, counts_ptr, block_slot_ptr, block_m0_ptr,
                                  tl.program_id(0), BLOCK_M)
    if s < 0:
        return
    split = tl.program_id(1)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < R
    k_begin = split * k_per_split
    a_rows = a_ptr + s.to(tl.int64) * stride_as + offs_r[:, None] * stride_ar
    acc = _shrink_rows(x_ptr, a_rows, rows, m_mask, r_mask, k_begin, tl.minimum(k_begin + k_per_split, K),
                       stride_xt, stride_xk, stride_ak, BLOCK_M, BLOCK_R, BLOCK_K, IEEE)
    out = out_ptr + split.to(tl.int64) * stride_op + rows[:, None] * stride_ot + offs_r[None, :]
    tl.store(out, acc, mask=m_mask[:, None] & r_mask[None, :])


@triton.jit
def _lora_expand_kernel(
    y_ptr, p_ptr, b_ptr, rows_ptr, starts_ptr, counts_ptr, block_slot_ptr, block_m0_ptr,
    n0, n1, n2, R, num_partials, num_n_blocks,
    stride_yt, stride_yn, stride_pp, stride_pt, stride_bs, stride_bn, stride_br,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
    IEEE: tl.constexpr,
):
    part, n_start, size, col0 = _slice_block(tl.program_id(1), n0, n1, n2, num_n_blocks, BLOCK_N)
    if n_start >= size:
        return
    s, rows, m_mask = _block_rows(rows_ptr, starts_ptr, counts_ptr, block_slot_ptr, block_m0_ptr,
                                  tl.program_id(0), BLOCK_M)
    if s < 0:
        return
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < R
    # All partials in one [BLOCK_P, BLOCK_M, BLOCK_R] load (not one dependent load per split).
    offs_p = tl.arange(0, BLOCK_P)
    p_tile = (p_ptr + offs_p[:, None, None] * stride_pp + rows[None, :, None] * stride_pt
              + (part * R + offs_r)[None, None, :])
    pmask = (offs_p < num_partials)[:, None, None] & (m_mask[:, None] & r_mask[None, :])[None, :, :]
    h = tl.sum(tl.load(p_tile, mask=pmask, other=0.0), axis=0)  # [BLOCK_M, BLOCK_R]
    _expand_into(y_ptr, b_ptr, h, s, rows, m_mask, offs_r, r_mask, n_start, size, col0,
                 stride_yt, stride_yn, stride_bs, stride_bn, stride_br, BLOCK_N, IEEE)


def _block(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def lora_shrink(
    x: torch.Tensor,  # [T, K]
    a_stacked: torch.Tensor,  # [num_slots, R, K]: per slot, the slices' A rows stacked (R = slices * r)
    sorted_rows: torch.Tensor,  # [>= T] int32: rows grouped by slot (lora_segments)
    seg_starts: torch.Tensor,  # [num_slots] int32
    seg_counts: torch.Tensor,  # [num_slots] int32
    block_slot: torch.Tensor,  # [NB] int32: the row blocks to run (lora_segments)
    block_m0: torch.Tensor,  # [NB] int32
) -> torch.Tensor:
    """Per row of slot s: x[t] · a_stacked[s]ᵀ, as float32 partial sums [num_splits, T, R] (sum over
    dim 0); rows of no slot are left unwritten (expand never reads them)."""
    assert x.dim() == 2 and a_stacked.dim() == 3 and a_stacked.shape[2] == x.shape[1], (x.shape, a_stacked.shape)
    assert a_stacked.dtype == x.dtype, (a_stacked.dtype, x.dtype)
    assert seg_starts.shape == seg_counts.shape == (a_stacked.shape[0],) and block_slot.shape == block_m0.shape
    num_tokens, k = x.shape
    r = a_stacked.shape[1]
    num_splits = triton.cdiv(k, _SHRINK_K_PER_SPLIT)
    out = torch.empty((num_splits, num_tokens, r), dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return out
    _lora_shrink_kernel[(block_slot.shape[0], num_splits)](
        x, a_stacked, out, sorted_rows, seg_starts, seg_counts, block_slot, block_m0,
        k, r, _SHRINK_K_PER_SPLIT,
        x.stride(0), x.stride(1), a_stacked.stride(0), a_stacked.stride(1), a_stacked.stride(2),
        out.stride(0), out.stride(1),
        BLOCK_M=LORA_BLOCK_M, BLOCK_R=_block(r), BLOCK_K=_SHRINK_BLOCK_K, IEEE=x.dtype == torch.float32,
    )
    return out


def lora_expand(
    y: torch.Tensor,  # [T, N], updated in place
    partials: torch.Tensor,  # [P, T, slices * r] float32 (lora_shrink's output)
    b_stacked: torch.Tensor,  # [num_slots, N, r]: the slices' B rows one after another
    slice_sizes: tuple[int, ...],  # output columns of each slice (1 to 3 of them), summing to N
    sorted_rows: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_counts: torch.Tensor,
    block_slot: torch.Tensor,
    block_m0: torch.Tensor,
) -> None:
    """Per row of slot s and slice p: y[t, cols(p)] += (Σ partials)[t, p*r:(p+1)*r] · B[s, cols(p)]ᵀ."""
    assert y.dim() == 2 and y.stride(1) == 1 and b_stacked.dim() == 3, (y.shape, y.stride(), b_stacked.shape)
    assert 1 <= len(slice_sizes) <= 3 and sum(slice_sizes) == y.shape[1] == b_stacked.shape[1]
    r = b_stacked.shape[2]
    assert partials.shape[1:] == (y.shape[0], len(slice_sizes) * r) and partials.stride(2) == 1
    if y.shape[0] == 0:
        return
    sizes = tuple(slice_sizes) + (0,) * (3 - len(slice_sizes))
    num_n_blocks = triton.cdiv(max(slice_sizes), _EXPAND_BLOCK_N)
    _lora_expand_kernel[(block_slot.shape[0], len(slice_sizes) * num_n_blocks)](
        y, partials, b_stacked, sorted_rows, seg_starts, seg_counts, block_slot, block_m0,
        sizes[0], sizes[1], sizes[2], r, partials.shape[0], num_n_blocks,
        y.stride(0), y.stride(1), partials.stride(0), partials.stride(1),
        b_stacked.stride(0), b_stacked.stride(1), b_stacked.stride(2),
        BLOCK_M=LORA_BLOCK_M, BLOCK_N=_EXPAND_BLOCK_N, BLOCK_R=_block(r),
        BLOCK_P=triton.next_power_of_2(partials.shape[0]), IEEE=b_stacked.dtype == torch.float32,
    )


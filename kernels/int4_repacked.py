"""Int4 linear on the repacked layout (`quant_reference.repack_int4`): y = x @ W (+ bias), every M.

In: `x [M, K]`, `packed` int32 `[K, N // 8]` (nibble j of word `[k, c]` = code of column 8c + j),
`scales`/`zeros [G, N]` (group `k // group_size`: a power of two, or one group). Out: `[M, N]` in
x's dtype. The weight is never expanded to a bf16 copy: both kernels dequantise it in registers
from words read once.

- M == 1, `_int4_gemv_kernel` (CUDA cores): a `[BLOCK_K, BLOCK_C]` tile of words keeps its rows in
  one thread (each thread reads one word per row, a warp 4 runs of 32 bytes), so the sum over k
  is thread-local. Per weight: a mask and a shift-add (one LEA) make the fp32 f = 1 + q / 16 (exact),
  one FMA adds f * x; per tile and column, s (16 sum x f - (16 + z) sum x) applies
  the group's scale and zero. x is loaded once per row for 8 columns.
- M >= 2, `_int4_gemm_kernel` (tensor cores): the `[BLOCK_K, BLOCK_N // 8]` word tile is unpacked
  into `[BLOCK_K, BLOCK_N]` in natural column order (8 fields, joined), dequantised with one FMA per
  weight (w = f * 16 s - (16 + z) s) into x's dtype and fed to `tl.dot`.
Both split K when the column tiles alone cannot fill the GPU (`kernels/int4_common.finish_tile`:
fp32 partials, a self-resetting counter; deterministic, CUDA-graph capturable).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.int4_common import finish_tile, grouped_pids, join8, nibble_float, unpack_nibbles
from kernels.int4_matmul import _num_sms, _split_for, split_k_workspace


class Int4Config(NamedTuple):
    """One tiling. `block_m` 1 selects the GEMV (`block_n` = 256 * num_warps * v: v adjacent words a thread, 1 or 2)."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int  # 1: no workspace
    num_warps: int
    num_stages: int
    asm: bool = True  # dequantise with an inline-PTX lop3 (CUDA only; the interpreter runs the plain form)


@triton.jit
def _gemv_slot(words, x, xs, s_row, z_row, mask_c, J: tl.constexpr, ASM: tl.constexpr):
    # Column 8c + J's share of this tile: s (16 sum_k x f - (16 + z) sum_k x), [1, BLOCK_C] fp32
    # (2-D, in the words' layout: scales, sums and accumulators then share one layout).
    d = tl.sum(nibble_float(words, J, ASM) * x[:, None], axis=0, keep_dims=True)
    s = tl.load(s_row + J, mask=mask_c, other=0.0).to(tl.float32)
    z = tl.load(z_row + J, mask=mask_c, other=0.0).to(tl.float32)
    return s * (16.0 * d - (z + 16.0) * xs)


@triton.jit(do_not_specialize=["tiles_per_split", "split_k"])
def _int4_gemv_kernel(
    x_ptr,  # [1, K]
    w_ptr,  # [K, N // 8] int32
    scales_ptr,  # [G, N]
    zeros_ptr,  # [G, N]
    bias_ptr,  # [N] (only read with HAS_BIAS)
    out_ptr,  # [1, N]
    partial_ptr,  # [split_k, 1, N] fp32 (only with USE_SPLIT)
    counter_ptr,  # [>= tiles] int32, zero between launches (only with USE_SPLIT)
    N, K, group_shift, tiles_per_split, split_k, stride_wk, stride_sg, stride_om,
    HAS_BIAS: tl.constexpr,
    USE_SPLIT: tl.constexpr,
    BLOCK_C: tl.constexpr,  # words (8 columns each) per program: 32 * num_warps * VEC
    BLOCK_K: tl.constexpr,  # rows per tile; divides the group (or one group)
    VEC: tl.constexpr,  # adjacent words per thread and row: 1 or 2
    ASM: tl.constexpr,  # one lop3 per weight through inline PTX (CUDA only; not in the interpreter)
):
    pid_c = tl.program_id(0)
    split = tl.program_id(1)
    num_words = N // 8
    # Element e of the tile row is word c0 + e % VEC + ((e // VEC) % P) * (BLOCK_C // P) + (e // 4) * VEC
    # (P = 4 // VEC): runs of exactly VEC adjacent words, so each thread loads VEC words per row
    # (4- or 8-byte vectors; 16-byte ones would spread a tile's rows over warps and threads), while
    # a warp reads P runs of 32 * VEC / P contiguous words.
    P: tl.constexpr = 4 // VEC
    e = tl.arange(0, BLOCK_C)
    offs_c = pid_c * BLOCK_C + e % VEC + ((e // VEC) % P) * (BLOCK_C // P) + (e // 4) * VEC
    mask_c = offs_c < num_words
    offs_k = tl.arange(0, BLOCK_K)
    num_k_tiles = tl.cdiv(K, BLOCK_K)
    t_start = split * tiles_per_split
    t_end = tl.minimum(t_start + tiles_per_split, num_k_tiles)
    zero = tl.zeros([1, BLOCK_C], dtype=tl.float32)
    acc0 = zero
    acc1 = zero
    acc2 = zero
    acc3 = zero
    acc4 = zero
    acc5 = zero
    acc6 = zero
    acc7 = zero
    rows = t_start * BLOCK_K + offs_k
    words_next = tl.load(w_ptr + rows[:, None] * stride_wk + offs_c[None, :],
                         mask=((rows < K) & (t_start < t_end))[:, None] & mask_c[None, :], other=0,
                         eviction_policy="evict_first")
    for t in range(t_start, t_end):
        words = words_next.to(tl.uint32, bitcast=True)  # the next tile's words are in flight meanwhile
        rows = t * BLOCK_K + offs_k
        nxt = rows + BLOCK_K
        words_next = tl.load(w_ptr + nxt[:, None] * stride_wk + offs_c[None, :],
                             mask=((nxt < K) & (t + 1 < t_end))[:, None] & mask_c[None, :], other=0,
                             eviction_policy="evict_first")
        x = tl.load(x_ptr + rows, mask=rows < K, other=0.0).to(tl.float32)  # [BLOCK_K]
        xs = tl.sum(x, axis=0)
        g_row = ((t * BLOCK_K) >> group_shift) * stride_sg  # the tile lies in one group
        s_row = scales_ptr + g_row + offs_c[None, :] * 8
        z_row = zeros_ptr + g_row + offs_c[None, :] * 8
        acc0 += _gemv_slot(words, x, xs, s_row, z_row, mask_c[None, :], 0, ASM)
        acc1 += _gemv_slot(words, x, xs, s_row, z_row, mask_c[None, :], 1, ASM)
        acc2 += _gemv_slot(words, x, xs, s_row, z_row, mask_c[None, :], 2, ASM)
        acc3 += _gemv_slot(words, x, xs, s_row, z_row, mask_c[None, :], 3, ASM)
        acc4 += _gemv_slot(words, x, xs, s_row, z_row, mask_c[None, :], 4, ASM)
        acc5 += _gemv_slot(words, x, xs, s_row, z_row, mask_c[None, :], 5, ASM)
        acc6 += _gemv_slot(words, x, xs, s_row, z_row, mask_c[None, :], 6, ASM)
        acc7 += _gemv_slot(words, x, xs, s_row, z_row, mask_c[None, :], 7, ASM)
    acc = tl.reshape(join8(acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7), [BLOCK_C * 8])
    col = offs_c[None, :] * 8
    offs_n = tl.reshape(join8(col, col + 1, col + 2, col + 3, col + 4, col + 5, col + 6, col + 7), [BLOCK_C * 8])
    # finish_tile takes a 2-row tile; row 1 repeats row 0 and its mask drops it.
    offs_m = tl.arange(0, 2)
    tile = tl.broadcast_to(acc[None, :], [2, BLOCK_C * 8])
    finish_tile(tile, offs_m, offs_n, offs_m < 1, offs_n < N, split, split_k, pid_c, 1, N, bias_ptr, out_ptr,
                partial_ptr, counter_ptr, stride_om, HAS_BIAS, USE_SPLIT)


@triton.jit(do_not_specialize=["M", "tiles_per_split", "split_k"])
def _int4_gemm_kernel(
    x_ptr, w_ptr, scales_ptr, zeros_ptr, bias_ptr, out_ptr, partial_ptr, counter_ptr,  # as the GEMV's, M rows
    M, N, K, group_shift, tiles_per_split, split_k, stride_xm, stride_wk, stride_sg, stride_om,
    HAS_BIAS: tl.constexpr,
    USE_SPLIT: tl.constexpr,
    ROW_GROUPS: tl.constexpr,  # groups smaller than BLOCK_K: scales per row of the tile
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ASM: tl.constexpr,
):
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    BLOCK_C: tl.constexpr = BLOCK_N // 8
    pid = tl.program_id(0)
    split = tl.program_id(1)
    # Grouped ordering: GROUP_M row tiles walk the same column tiles while their weights sit in L2.
    pid_m, pid_n = grouped_pids(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)  # the split-K counter of tile (pid_m, pid_n), below

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_c = pid_n * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_m = offs_m < M
    mask_n = offs_n < N
    mask_c = offs_c < N // 8
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm  # [BLOCK_M, 1]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    num_k_tiles = tl.cdiv(K, BLOCK_K)
    t_start = split * tiles_per_split
    t_end = tl.minimum(t_start + tiles_per_split, num_k_tiles)
    for t in range(t_start, t_end):
        offs_k = t * BLOCK_K + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # [BM, BK]
        words = tl.load(w_ptr + offs_k[:, None] * stride_wk + offs_c[None, :],
                        mask=mask_k[:, None] & mask_c[None, :], other=0)  # [BK, BC]
        f = unpack_nibbles(words.to(tl.uint32, bitcast=True), ASM)  # [BK, BN]; rows past K multiply x's zeros
        if ROW_GROUPS:
            sg = (offs_k >> group_shift)[:, None] * stride_sg + offs_n[None, :]
            sg_mask = mask_k[:, None] & mask_n[None, :]
            s = tl.load(scales_ptr + sg, mask=sg_mask, other=0.0).to(tl.float32)
            z = tl.load(zeros_ptr + sg, mask=sg_mask, other=0.0).to(tl.float32)
            w = (f * (s * 16.0) - (z + 16.0) * s).to(DTYPE)
        else:
            g_row = ((t * BLOCK_K) >> group_shift) * stride_sg  # the tile lies in one group
            s = tl.load(scales_ptr + g_row + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            z = tl.load(zeros_ptr + g_row + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            w = (f * (s * 16.0)[None, :] - ((z + 16.0) * s)[None, :]).to(DTYPE)
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
    finish_tile(acc, offs_m, offs_n, mask_m, mask_n, split, split_k, pid_m * num_pid_n + pid_n, M, N, bias_ptr,
                out_ptr, partial_ptr, counter_ptr, stride_om, HAS_BIAS, USE_SPLIT)


def _fit_block_k(block_k: int, group_size: int, K: int) -> int:
    """The largest block <= block_k whose tiles never straddle a group (>= 16; else per-row groups)."""
    if group_size >= K:
        return block_k
    while block_k > 16 and group_size % block_k:
        block_k //= 2
    return block_k


def pick_int4_config(M: int, N: int, K: int, group_size: int, num_sms: int) -> Int4Config:
    """The tiling for one call, from shapes alone (fixed per M bucket: no recompiles as M varies).

    First guesses for H100/H200 at the 8B shapes, to be replaced by `bench/quant_speed.py --sweep`'s
    findings: M == 1 the GEMV (4 warps, 32-row tiles: 123 registers for sm_90, split-K to ~2 programs per SM); M <= 16 a
    16-row tensor-core tile with split-K; then 64- and 128-row tiles.
    """
    if M == 1:
        warps, bk = 4, 32
        bn = 8 * 32 * warps
        bk = _fit_block_k(bk, group_size, K)
        tiles = triton.cdiv(N, bn)
        return Int4Config(1, bn, bk, _split_for(tiles, triton.cdiv(K, bk), 2 * num_sms), warps, 1)
    # Register counts from a static sm_90 compile (Triton 3.7): 144, 98 and 191, no spills (128 x 256
    # tiles spill, as do 64 x 128 ones on 4 warps).
    if M <= 16:
        bm, bn, bk, warps, stages, target = 16, 64, 128, 4, 4, 2 * num_sms
    elif M <= 64:
        bm, bn, bk, warps, stages, target = 64, 128, 64, 8, 4, 2 * num_sms
    elif M <= 256:
        bm, bn, bk, warps, stages, target = 128, 128, 64, 8, 3, num_sms
    else:
        bm, bn, bk, warps, stages, target = 128, 128, 64, 8, 3, 0
    bk = _fit_block_k(bk, group_size, K)
    # Row tiles of the bucket's largest M: one split (and one compiled variant) for the whole bucket.
    tiles = triton.cdiv(16 if M <= 16 else 64 if M <= 64 else 256 if M <= 256 else M, bm) * triton.cdiv(N, bn)
    return Int4Config(bm, bn, bk, _split_for(tiles, triton.cdiv(K, bk), target), warps, stages)


def int4_linear_impl(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    config: Int4Config | None = None,
) -> torch.Tensor:
    """`int4_linear` with an explicit tiling (tests and the sweep pass their own)."""
    M, K = x.shape
    N = packed.shape[1] * 8
    assert packed.dtype == torch.int32 and packed.shape[0] == K and packed.stride(1) == 1
    assert x.stride(1) == 1 and scales.shape == zeros.shape and scales.shape[1] == N
    assert scales.stride(1) == 1 and zeros.stride() == scales.stride()
    assert scales.shape[0] == triton.cdiv(K, group_size), (scales.shape, K, group_size)
    out = torch.empty((M, N), device=x.device, dtype=x.dtype)
    if M == 0:
        return out
    if config is None:
        config = pick_int4_config(M, N, K, group_size, _num_sms(x.device.index or 0) if x.is_cuda else 132)
    gemv = config.block_m == 1
    one_group = group_size >= K
    row_groups = not one_group and group_size % config.block_k != 0
    # group k >> group_shift: a shift, not a division per tile (one group: every k < 2**31 gives 0)
    if one_group:
        group_shift = 31
    elif group_size & (group_size - 1) == 0:
        group_shift = group_size.bit_length() - 1
    else:
        raise ValueError(f"int4_linear needs a power-of-two group size or one group, got {group_size} for K={K}")
    assert not (gemv and row_groups), "the GEMV needs block_k to divide group_size"
    vec = config.block_n // (256 * config.num_warps)
    assert not gemv or (vec in (1, 2) and config.block_n == 256 * config.num_warps * vec), config
    asm = config.asm and x.is_cuda  # the interpreter runs on CPU tensors, and has no PTX
    split = config.split_k
    if gemv:
        grid_tiles = triton.cdiv(N, config.block_n)
    else:
        grid_tiles = triton.cdiv(M, config.block_m) * triton.cdiv(N, config.block_n)
    partial, counters = split_k_workspace(out, split, grid_tiles)
    bias_arg = bias if bias is not None else scales
    tiles_per_split = triton.cdiv(triton.cdiv(K, config.block_k), split)
    if gemv:
        _int4_gemv_kernel[(grid_tiles, split)](
            x, packed, scales, zeros, bias_arg, out, partial, counters,
            N, K, group_shift, tiles_per_split, split, packed.stride(0), scales.stride(0), out.stride(0),
            HAS_BIAS=bias is not None, USE_SPLIT=split > 1, BLOCK_C=config.block_n // 8, BLOCK_K=config.block_k,
            VEC=vec, ASM=asm, num_warps=config.num_warps, num_stages=config.num_stages,
        )
        return out
    _int4_gemm_kernel[(grid_tiles, split)](
        x, packed, scales, zeros, bias_arg, out, partial, counters,
        M, N, K, group_shift, tiles_per_split, split, x.stride(0), packed.stride(0), scales.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, USE_SPLIT=split > 1, ROW_GROUPS=row_groups,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=8,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", ASM=asm,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out


def int4_linear(
    x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The public op (shapes in `kernels/__init__.py`): y = x @ dequantised W + bias, tiling by M."""
    return int4_linear_impl(x, packed, scales, zeros, group_size, bias)

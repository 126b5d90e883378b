"""Triton GEMV for GPTQ-packed int4 / int8 weights at decode sizes (M <= 4), on CUDA cores.

In: `x [M, K]` (M <= ROWS), `qweight` int32 `[K * bits // 32, N]`, `scales`/`zeros [G, N]`. Out:
the `[M, N]` tile written by `finish_tile` (split-K through the shared workspace). Launched by
`kernels/int4_matmul.py`, which picks this kernel for M <= 4 without act-order.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.int4_common import finish_tile, stack_rows, unit_float


@triton.jit
def _fma_row(f, x, d, FMA_TILE: tl.constexpr):
    # One packed slot's contribution of one row of x ([BLOCK_K // PACK], fp32): d += f * x over k.
    if FMA_TILE:
        d += f * x[:, None]  # plain FMAs; the k sum waits for the end of the tile
    else:
        d += tl.sum(f * x[:, None], axis=0)
    return d


@triton.jit(do_not_specialize=["M", "tiles_per_split", "split_k"])
def int_gemv_kernel(
    x_ptr,  # [M, K], M <= ROWS
    qw_ptr,  # [K // PACK, N] int32
    scales_ptr,  # [G, N]
    zeros_ptr,  # [G, N]
    bias_ptr,  # [N] (only read with HAS_BIAS)
    out_ptr,  # [M, N]
    partial_ptr,  # [split_k, M, N] fp32 (only with USE_SPLIT)
    counter_ptr,  # [>= tiles] int32, zero between launches (only with USE_SPLIT)
    M, N, K, group_size, tiles_per_split, split_k, stride_xm, stride_qk, stride_sg, stride_om,
    BITS: tl.constexpr,
    ROWS: tl.constexpr,  # 1, 2 or 4 rows of x per program
    HAS_BIAS: tl.constexpr,
    USE_SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # divides group_size: one group per tile
    FMA_TILE: tl.constexpr,  # accumulate FMAs in a 2-D tile, reduce over k once per tile
):
    # Decode (M <= 4): CUDA-core FMAs, no tensor cores. A [BLOCK_K / PACK, BLOCK_N] tile of words
    # keeps its rows inside each thread (num_warps = BLOCK_N / 128), so the sums over k are
    # thread-local. Per group: sum_k x (q - z) s = s (2**B sum_k x f - (2**B + z) sum_k x) with
    # f = 1 + q / 2**B. The next tile's words are loaded before this tile is used (latency hiding).
    PACK: tl.constexpr = 32 // BITS
    UNIT: tl.constexpr = 1 << BITS
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_i = tl.arange(0, BLOCK_K // PACK)
    num_words = K // PACK
    # NOTE: rows past M re-read row M - 1 (always valid memory); the epilogue drops them.
    acc0 = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_N], dtype=tl.float32)
    num_k_tiles = tl.cdiv(K, BLOCK_K)
    t_start = split * tiles_per_split
    t_end = tl.minimum(t_start + tiles_per_split, num_k_tiles)
    rows_i = t_start * (BLOCK_K // PACK) + offs_i
    rows_end = tl.minimum(num_words, t_end * (BLOCK_K // PACK))  # this split's last word row + 1
    w_mask = (rows_i < rows_end)[:, None] & mask_n[None, :]
    words_next = tl.load(qw_ptr + rows_i[:, None] * stride_qk + offs_n[None, :], mask=w_mask, other=0,
                         eviction_policy="evict_first")
    for t in range(t_start, t_end):
        words = words_next
        rows_i = t * (BLOCK_K // PACK) + offs_i
        mask_i = rows_i < num_words
        nxt = rows_i + BLOCK_K // PACK
        w_mask = (nxt < rows_end)[:, None] & mask_n[None, :]
        words_next = tl.load(qw_ptr + nxt[:, None] * stride_qk + offs_n[None, :], mask=w_mask, other=0,
                             eviction_policy="evict_first")
        # d*: this tile's sum_k x f per row ([BLOCK_N]; with FMA_TILE the un-reduced
        # [BLOCK_K // PACK, BLOCK_N] FMA tile, summed over k once per tile); xs*: sum_k x.
        if FMA_TILE:
            d0 = tl.zeros([BLOCK_K // PACK, BLOCK_N], dtype=tl.float32)
            d1 = tl.zeros([BLOCK_K // PACK, BLOCK_N], dtype=tl.float32)
            d2 = tl.zeros([BLOCK_K // PACK, BLOCK_N], dtype=tl.float32)
            d3 = tl.zeros([BLOCK_K // PACK, BLOCK_N], dtype=tl.float32)
        else:
            d0 = tl.zeros([BLOCK_N], dtype=tl.float32)
            d1 = tl.zeros([BLOCK_N], dtype=tl.float32)
            d2 = tl.zeros([BLOCK_N], dtype=tl.float32)
            d3 = tl.zeros([BLOCK_N], dtype=tl.float32)
        xs0 = 0.0
        xs1 = 0.0
        xs2 = 0.0
        xs3 = 0.0
        for j in tl.static_range(PACK):
            f = unit_float(words, j, BITS)  # [BLOCK_K // PACK, BLOCK_N]
            cols = rows_i * PACK + j
            x0 = tl.load(x_ptr + cols, mask=mask_i, other=0.0).to(tl.float32)
            d0 = _fma_row(f, x0, d0, FMA_TILE)
            xs0 += tl.sum(x0, axis=0)
            if ROWS > 1:
                x1 = tl.load(x_ptr + tl.minimum(M - 1, 1) * stride_xm + cols, mask=mask_i, other=0.0).to(tl.float32)
                d1 = _fma_row(f, x1, d1, FMA_TILE)
                xs1 += tl.sum(x1, axis=0)
            if ROWS > 2:
                x2 = tl.load(x_ptr + tl.minimum(M - 1, 2) * stride_xm + cols, mask=mask_i, other=0.0).to(tl.float32)
                d2 = _fma_row(f, x2, d2, FMA_TILE)
                xs2 += tl.sum(x2, axis=0)
                x3 = tl.load(x_ptr + tl.minimum(M - 1, 3) * stride_xm + cols, mask=mask_i, other=0.0).to(tl.float32)
                d3 = _fma_row(f, x3, d3, FMA_TILE)
                xs3 += tl.sum(x3, axis=0)
        if FMA_TILE:
            d0 = tl.sum(d0, axis=0)
            if ROWS > 1:
                d1 = tl.sum(d1, axis=0)
            if ROWS > 2:
                d2 = tl.sum(d2, axis=0)
                d3 = tl.sum(d3, axis=0)
        g_row = (t * BLOCK_K // group_size) * stride_sg
        s = tl.load(scales_ptr + g_row + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        zu = tl.load(zeros_ptr + g_row + offs_n, mask=mask_n, other=0.0).to(tl.float32) + UNIT
        acc0 += s * (UNIT * d0 - zu * xs0)
        if ROWS > 1:
            acc1 += s * (UNIT * d1 - zu * xs1)
        if ROWS > 2:
            acc2 += s * (UNIT * d2 - zu * xs2)
            acc3 += s * (UNIT * d3 - zu * xs3)
    acc, offs_m = stack_rows(acc0, acc1, acc2, acc3, ROWS)
    finish_tile(acc, offs_m, offs_n, offs_m < M, mask_n, split, split_k, pid_n, M, N, bias_ptr, out_ptr,
                 partial_ptr, counter_ptr, stride_om, HAS_BIAS, USE_SPLIT)

"""Int4 linear on the k-chunk layout (`quant_reference.repack_int4_kchunk`), made for decode: y = x @ W (+ bias).

In: `x [M, K]`, `packed` int32 `[K // 32, N, 4]` (the 32 rows 32c.. of column n in the 16-byte
vector `packed[c, n, :]`, nibble j of word w = row 32c + 4j + w), `scales`/`zeros [G, N]` (group
`k // group_size`, or one group). Out: `[M, N]` in x's dtype. Seven paths, picked by `KChunkConfig`:

- `block_m` 1, 2 or 4: `_kchunk_gemv_kernel` (CUDA cores). A `[BLOCK_K // 32, BLOCK_N, 4]` word tile
  keeps each column's words in one thread (one 16-byte load per 32 weights; `COLS` columns a thread,
  so one activation vector serves COLS columns), so the sum over k never leaves the thread. Per
  weight: a shift and a lop3 give the exact fp32 f = 1 + q / 16, one FMA per row adds f * x; per
  group and column, s (16 sum x f - (16 + z) sum x) applies the scale and zero point.
- `block_m` >= 16: `_kchunk_dot_kernel` (tensor cores): per nibble j, the tile's `[BLOCK_K // 8,
  BLOCK_N]` weights are dequantised with one FMA (w = f * 16 s - (16 + z) s) into x's dtype and
  multiplied by the matching x columns in `tl.dot`.
- `gemm` set (many rows): `kernels/int4_kchunk_gemm.py`, tensor cores with the dequantised weights
  as the MMA's register operand (out^T = W^T x^T), no copy of the weight.
- `gemm` GEMM_MMA (up to 64 rows, picked to 24; CUDA sm_80+, bf16/fp16 x, K and the group multiples of 128):
  `kernels/int4_kchunk_mma.py` (Gluon), mma.sync with the words loaded straight into the A operand's
  registers and dequantised two per instruction; the picker takes it where `mma` says it can run.
- `gemm` GEMM_WGMMA (sm_90, bf16/fp16 x, K and the group multiples of 128): `kernels/int4_kchunk_wgmma.py`
  (Gluon), Hopper's wgmma with the dequantised weights as its register operand and x's rows in shared
  memory; the picker takes it at 9-128 rows where `wgmma` says it can run (before GEMM_MMA).
- `gemm` GEMM_WS (sm_90, bf16/fp16 x with scales of its type, TMA-aligned operands): `kernels/int4_kchunk_ws.py`
  (Gluon), warp-specialised: TMA loader warps, dequantising partitions writing each weight tile to shared memory,
  a wgmma warp group; the picker takes it at 33-512 rows on wide weights (the packed gate|up), at 33-128 rows on
  the other weights of at least 4096 x 4096, and at 129-256 and 321-512 rows on long K (the down projection), where
  it can run.
- `block_m` 0 (`DENSE`, prefill): `dequantize_kchunk` writes the dense weight once and cuBLAS multiplies.
The GEMV and the tiles split K when the column tiles alone cannot fill the GPU (`kernels/int4_common.finish_tile`).
With `gated` (a SwiGLU MLP's packed [gate | up] columns) the GEMV and GEMM_MMA write silu(gate) * up from
their epilogue (`kernels/int4_common.finish_gemv_tile`, `int4_kchunk_mma.store_tile`); the other paths run
`kernels/activation.py` after.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.activation import silu_and_mul
from kernels.int4_common import (finish_gemv_tile, finish_tile, gemv_rows, grouped_tile, nibble_float,
                                 nibble_pair_floats, stack_rows)
from kernels import int4_kchunk_mma, int4_kchunk_wgmma, int4_kchunk_ws
from kernels.int4_kchunk_gemm import _kchunk_gemm_kernel
from kernels.int4_matmul import _num_sms, _split_for, gated_workspace, split_k_workspace
from kernels.pdl import launch_options, release_dependents, wait_upstream


GEMM_JOIN = 1  # `int4_kchunk_gemm`: one dot per K tile on the weights put back in natural row order
GEMM_NIBBLES = 2  # `int4_kchunk_gemm`: one dot per nibble, each on an elementwise function of the words
GEMM_MMA = 3  # `int4_kchunk_mma` (<= 64 rows, CUDA, bf16/fp16): mma.sync on words loaded in the operand's layout
GEMM_WGMMA = 4  # `int4_kchunk_wgmma` (sm_90, bf16/fp16): wgmma on weights dequantised in registers, x in smem
GEMM_WS = 5  # `int4_kchunk_ws` (sm_90, bf16/fp16): dequantising warps feed a wgmma warp group through smem


class KChunkConfig(NamedTuple):
    """One tiling. `block_m` 1, 2 or 4 selects the GEMV (`block_n` = 32 * num_warps * columns a
    thread), 16 or more the tensor-core kernel, 0 the dequantise-then-cuBLAS path (the rest unused)."""

    block_m: int
    block_n: int
    block_k: int  # a multiple of 32 (the GEMV: dividing the group; tensor cores: >= 128)
    split_k: int  # 1: no workspace
    num_warps: int
    num_stages: int = 1
    asm: bool = True  # dequantise with an inline-PTX lop3 (CUDA only; the interpreter runs the plain form)
    pairs: bool = True  # GEMV: two nibbles per shift (`int4_common.nibble_pair_floats`)
    reduce_each: bool = False  # GEMV: sum each nibble's products at once instead of an FMA tile
    group_m: int = 1  # tensor cores: row tiles per band of the program order (L2 reuse of weight tiles)
    gemm: int = 0  # tensor cores: `int4_kchunk_gemm` (W^T x^T) with GEMM_JOIN or GEMM_NIBBLES; GEMM_MMA; GEMM_WGMMA
    # (block_m rows of x a program, num_stages K tiles of x in shared memory); GEMM_WS; else 0
    dq_parts: int = 0  # GEMM_WS: dequantising partitions (of num_warps warps each)
    row_chunk: int = 0  # GEMM_WS: rows a launch (0: all); the rows left after whole chunks take `_ws_config`'s pick


@triton.jit
def _x_chunk(x_ptr, row, kk, K, stride_xm, EVEN_K: tl.constexpr):
    # One row of x at columns kk ([R, 1, 4]) as fp32, zeros past K.
    if EVEN_K:
        x = tl.load(x_ptr + row * stride_xm + kk)
    else:
        x = tl.load(x_ptr + row * stride_xm + kk, mask=kk < K, other=0.0)
    return x.to(tl.float32)


@triton.jit
def _fma(d, f, x, FIRST: tl.constexpr, REDUCE_EACH: tl.constexpr):
    # d + f * x: an FMA tile ([R, BLOCK_N, 4], summed once per group), or with REDUCE_EACH the
    # thread-local sum over the tile's rows at once ([BLOCK_N]; the adds contract into FMA chains).
    if REDUCE_EACH:
        p = tl.sum(tl.sum(f * x, axis=2), axis=0)
    else:
        p = f * x
    if FIRST:
        out = p
    else:
        out = d + p
    return out


@triton.jit
def _row_step(x_ptr, row, kk_lo, kk_hi, K, stride_xm, f_lo, f_hi, d_lo, d_hi, xs_lo, xs_hi,
              FIRST: tl.constexpr, REDUCE_EACH: tl.constexpr, EVEN_K: tl.constexpr):
    # One row of x against two nibbles' weights: accumulate x f and the sums of x per accumulator.
    x_lo = _x_chunk(x_ptr, row, kk_lo, K, stride_xm, EVEN_K)
    x_hi = _x_chunk(x_ptr, row, kk_hi, K, stride_xm, EVEN_K)
    d_lo = _fma(d_lo, f_lo, x_lo, FIRST, REDUCE_EACH)
    d_hi = _fma(d_hi, f_hi, x_hi, FIRST, REDUCE_EACH)
    if FIRST:
        xs_lo = x_lo
        xs_hi = x_hi
    else:
        xs_lo += x_lo
        xs_hi += x_hi
    return d_lo, d_hi, xs_lo, xs_hi


@triton.jit
def _apply_group(acc, d_lo, d_hi, xs_lo, xs_hi, s, z, LO_UNIT: tl.constexpr, REDUCE_EACH: tl.constexpr):
    # acc += s (sum_k x q - z sum_k x) from the sums of x f, f = 1 + q / UNIT per accumulator
    # (hi: UNIT 16; lo: LO_UNIT): sum x q = UNIT (sum x f - sum x).
    # NOTE: the x sums are never reduced over their size-1 axis: it spans the threads, and a
    # reduction over it would cost shuffles and a barrier; the [1] sums broadcast against the columns.
    if not REDUCE_EACH:
        d_lo = tl.sum(tl.sum(d_lo, axis=2), axis=0)
        d_hi = tl.sum(tl.sum(d_hi, axis=2), axis=0)
    x_lo = tl.sum(tl.sum(xs_lo, axis=2), axis=0)
    x_hi = tl.sum(tl.sum(xs_hi, axis=2), axis=0)
    return acc + s * (LO_UNIT * d_lo + 16.0 * d_hi - (LO_UNIT + z) * x_lo - (16.0 + z) * x_hi)


@triton.jit(do_not_specialize=["M", "tiles_per_split", "split_k"])
def _kchunk_gemv_kernel(
    x_ptr,  # [M, K], M <= ROWS
    w_ptr,  # [K // 32, N, 4] int32
    scales_ptr,  # [G, N]
    zeros_ptr,  # [G, N]
    bias_ptr,  # [N] (only read with HAS_BIAS)
    out_ptr,  # [M, N]
    partial_ptr,  # [split_k, M, N] fp32 (only with USE_SPLIT)
    counter_ptr,  # [>= tiles] int32, zero between launches (only with USE_SPLIT)
    M, N, K, group_size, tiles_per_split, split_k, stride_xm, stride_wc, stride_sg, stride_om,
    ROWS: tl.constexpr,  # 1, 2 or 4 rows of x per program
    HAS_BIAS: tl.constexpr,
    USE_SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr,  # 32 * num_warps * columns per thread
    BLOCK_K: tl.constexpr,  # a multiple of 32 that divides the group: one group per tile
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: x is read without masks
    PAIRS: tl.constexpr,  # two nibbles per shift (`nibble_pair_floats`), else one (`nibble_float`)
    REDUCE_EACH: tl.constexpr,  # reduce each nibble's products at once (no FMA tile)
    ASM: tl.constexpr,
    GATED: tl.constexpr,  # W is [gate | up] (N = 2 I columns): write silu(gate) * up [M, I] (`finish_gated_tile`)
    PDL: tl.constexpr,  # launched with programmatic dependent launch (kernels/pdl.py)
):
    release_dependents(PDL)
    R: tl.constexpr = BLOCK_K // 32
    LO_UNIT: tl.constexpr = 256.0 if PAIRS else 16.0
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    offs_n, mask_n = gemv_rows(pid_n, N, BLOCK_N, GATED)
    offs_r = tl.arange(0, R)
    offs_w = tl.arange(0, 4)
    col_w = (offs_n * 4)[None, :, None] + offs_w[None, None, :]  # [1, BLOCK_N, 4]
    mask_nw = mask_n[None, :, None]
    # NOTE: scale and zero offsets that Triton cannot prove contiguous: their loads then take one
    # column a thread, the columns' own layout, instead of a vector layout that every tile would
    # convert (through shared memory, with a barrier) to meet the sums.
    offs_s = tl.where(mask_n, offs_n, 0)
    num_chunks = K // 32
    num_k_tiles = tl.cdiv(K, BLOCK_K)
    t_start = split * tiles_per_split
    t_end = tl.minimum(t_start + tiles_per_split, num_k_tiles)
    chunks_end = tl.minimum(num_chunks, t_end * R)  # this split's last chunk + 1
    # NOTE: rows past M re-read row M - 1 (always valid memory); the epilogue drops them.
    row1 = tl.minimum(M - 1, 1)
    row2 = tl.minimum(M - 1, 2)
    row3 = tl.minimum(M - 1, 3)
    acc0 = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_N], dtype=tl.float32)
    c = t_start * R + offs_r
    words_next = tl.load(w_ptr + c[:, None, None] * stride_wc + col_w, mask=(c < chunks_end)[:, None, None] & mask_nw,
                         other=0, eviction_policy="evict_first")
    wait_upstream(PDL)  # the first tile's words were requested before the previous kernel ended
    for t in range(t_start, t_end):
        words = words_next.to(tl.uint32, bitcast=True)  # the next tile's words are in flight meanwhile
        c = t * R + offs_r
        nxt = c + R
        words_next = tl.load(w_ptr + nxt[:, None, None] * stride_wc + col_w,
                             mask=(nxt < chunks_end)[:, None, None] & mask_nw, other=0, eviction_policy="evict_first")
        k_base = (c * 32)[:, None, None] + offs_w[None, None, :]  # [R, 1, 4]: nibble j adds 4 j
        # Per row i: d{i}l / d{i}h the x f sums of the lo / hi accumulators, s{i}l / s{i}h the x sums.
        # The first nibble pair starts them (no zeroing); ROWS picks the rows traced.
        d0l, d0h, s0l, s0h = 0.0, 0.0, 0.0, 0.0
        d1l, d1h, s1l, s1h = 0.0, 0.0, 0.0, 0.0
        d2l, d2h, s2l, s2h = 0.0, 0.0, 0.0, 0.0
        d3l, d3h, s3l, s3h = 0.0, 0.0, 0.0, 0.0
        for i in tl.static_range(4):
            if PAIRS:
                f_lo, f_hi = nibble_pair_floats(words, i, ASM)  # nibbles 2i (1 + q / 256), 2i + 1 (1 + q / 16)
            else:
                f_lo = nibble_float(words, 2 * i, ASM)
                f_hi = nibble_float(words, 2 * i + 1, ASM)
            kk_lo = k_base + 8 * i
            kk_hi = kk_lo + 4
            d0l, d0h, s0l, s0h = _row_step(x_ptr, 0, kk_lo, kk_hi, K, stride_xm, f_lo, f_hi, d0l, d0h, s0l, s0h,
                                           i == 0, REDUCE_EACH, EVEN_K)
            if ROWS > 1:
                d1l, d1h, s1l, s1h = _row_step(x_ptr, row1, kk_lo, kk_hi, K, stride_xm, f_lo, f_hi, d1l, d1h, s1l,
                                               s1h, i == 0, REDUCE_EACH, EVEN_K)
            if ROWS > 2:
                d2l, d2h, s2l, s2h = _row_step(x_ptr, row2, kk_lo, kk_hi, K, stride_xm, f_lo, f_hi, d2l, d2h, s2l,
                                               s2h, i == 0, REDUCE_EACH, EVEN_K)
                d3l, d3h, s3l, s3h = _row_step(x_ptr, row3, kk_lo, kk_hi, K, stride_xm, f_lo, f_hi, d3l, d3h, s3l,
                                               s3h, i == 0, REDUCE_EACH, EVEN_K)
        g_row = (t * BLOCK_K // group_size) * stride_sg
        s = tl.load(scales_ptr + g_row + offs_s, mask=mask_n, other=0.0).to(tl.float32)
        z = tl.load(zeros_ptr + g_row + offs_s, mask=mask_n, other=0.0).to(tl.float32)
        acc0 = _apply_group(acc0, d0l, d0h, s0l, s0h, s, z, LO_UNIT, REDUCE_EACH)
        if ROWS > 1:
            acc1 = _apply_group(acc1, d1l, d1h, s1l, s1h, s, z, LO_UNIT, REDUCE_EACH)
        if ROWS > 2:
            acc2 = _apply_group(acc2, d2l, d2h, s2l, s2h, s, z, LO_UNIT, REDUCE_EACH)
            acc3 = _apply_group(acc3, d3l, d3h, s3l, s3h, s, z, LO_UNIT, REDUCE_EACH)
    acc, offs_m = stack_rows(acc0, acc1, acc2, acc3, ROWS)
    finish_gemv_tile(acc, offs_m, offs_n, offs_m < M, mask_n, split, split_k, pid_n, M, N, bias_ptr, out_ptr,
                     partial_ptr, counter_ptr, stride_om, out_ptr, counter_ptr, 0, 0, HAS_BIAS, USE_SPLIT, GATED,
                     BLOCK_N, 0)


@triton.jit(do_not_specialize=["M", "tiles_per_split", "split_k"])
def _kchunk_dot_kernel(
    x_ptr, w_ptr, scales_ptr, zeros_ptr, bias_ptr, out_ptr, partial_ptr, counter_ptr,  # as the GEMV's, M rows
    M, N, K, group_size, tiles_per_split, split_k, stride_xm, stride_wc, stride_sg, stride_om,
    HAS_BIAS: tl.constexpr,
    USE_SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # >= 128: each nibble's sub-dot has BLOCK_K // 8 >= 16 rows
    GROUP_M: tl.constexpr,  # row tiles per band of the program order (1: row-major)
    DOT_PRECISION: tl.constexpr,
    ASM: tl.constexpr,
):
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    R: tl.constexpr = BLOCK_K // 32
    pid = tl.program_id(0)
    split = tl.program_id(1)
    offs_m, offs_n, mask_m, mask_n = grouped_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_r = tl.arange(0, R)
    offs_w = tl.arange(0, 4)
    # [R, 4, BLOCK_N] word tiles: merging (r, w) gives the sub-dot's rows 32 r + 4 j + w.
    word_offs = offs_w[None, :, None] + (offs_n * 4)[None, None, :]
    sub = tl.arange(0, BLOCK_K // 8)
    sub_k = (sub // 4) * 32 + sub % 4  # [BLOCK_K // 8]: sub-dot row i is tile row sub_k[i] + 4 j
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    num_chunks = K // 32
    num_k_tiles = tl.cdiv(K, BLOCK_K)
    t_start = split * tiles_per_split
    t_end = tl.minimum(t_start + tiles_per_split, num_k_tiles)
    for t in range(t_start, t_end):
        c = t * R + offs_r
        mask_c = c < num_chunks
        words = tl.load(w_ptr + c[:, None, None] * stride_wc + word_offs,
                        mask=mask_c[:, None, None] & mask_n[None, None, :], other=0).to(tl.uint32, bitcast=True)
        sg = ((c * 32) // group_size)[:, None] * stride_sg + offs_n[None, :]  # each chunk lies in one group
        sg_mask = mask_c[:, None] & mask_n[None, :]
        s = tl.load(scales_ptr + sg, mask=sg_mask, other=0.0).to(tl.float32)
        z = tl.load(zeros_ptr + sg, mask=sg_mask, other=0.0).to(tl.float32)
        su = (s * 16.0)[:, None, :]  # [R, 1, BLOCK_N]
        cz = ((z + 16.0) * s)[:, None, :]
        for j in tl.static_range(8):
            w = (nibble_float(words, j, ASM) * su - cz).to(DTYPE)  # [R, 4, BLOCK_N]
            w = tl.reshape(w, [BLOCK_K // 8, BLOCK_N])
            kk = t * BLOCK_K + sub_k + 4 * j
            xj = tl.load(x_rows + kk[None, :], mask=mask_m[:, None] & (kk < K)[None, :], other=0.0)
            acc = tl.dot(xj, w, acc, input_precision=DOT_PRECISION)
    finish_tile(acc, offs_m, offs_n, mask_m, mask_n, split, split_k, pid, M, N, bias_ptr, out_ptr, partial_ptr,
                counter_ptr, stride_om, HAS_BIAS, USE_SPLIT)


@triton.jit
def _kchunk_dequant_kernel(
    w_ptr,  # [K // 32, N, 4] int32
    scales_ptr,  # [G, N]
    zeros_ptr,  # [G, N]
    out_ptr,  # [K, N], the output dtype
    N, group_size, stride_wc, stride_sg, stride_ok,
    BLOCK_N: tl.constexpr,
    ASM: tl.constexpr,
):
    # The whole weight in x's dtype, one 32-row chunk per program row (large M: cuBLAS multiplies it).
    c = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_w = tl.arange(0, 4)
    words = tl.load(w_ptr + c * stride_wc + (offs_n * 4)[:, None] + offs_w[None, :], mask=mask_n[:, None],
                    other=0).to(tl.uint32, bitcast=True)  # [BLOCK_N, 4]
    g_row = (c * 32 // group_size) * stride_sg  # a chunk lies in one group
    s = tl.load(scales_ptr + g_row + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
    z = tl.load(zeros_ptr + g_row + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
    rows = (c * 32 + offs_w).to(tl.int64)[None, :] * stride_ok  # [1, 4]: nibble j adds 4 j rows
    for j in tl.static_range(8):
        w = nibble_float(words, j, ASM) * (s * 16.0) - (z + 16.0) * s
        tl.store(out_ptr + rows + 4 * j * stride_ok + offs_n[:, None], w.to(out_ptr.dtype.element_ty),
                 mask=mask_n[:, None])


def dequantize_kchunk(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                      dtype: torch.dtype) -> torch.Tensor:
    """The dense `[K, N]` weight in `dtype` (one launch; large M multiplies it with cuBLAS)."""
    chunks, n, _ = packed.shape
    w = torch.empty((chunks * 32, n), device=packed.device, dtype=dtype)
    block_n = 128
    _kchunk_dequant_kernel[(chunks, triton.cdiv(n, block_n))](
        packed, scales, zeros, w, n, group_size, packed.stride(0), scales.stride(0), w.stride(0),
        BLOCK_N=block_n, ASM=packed.is_cuda, num_warps=4,
    )
    return w


DENSE = KChunkConfig(0, 0, 0, 1, 0)  # dequantise the whole weight once, then cuBLAS


def _many_rows_config(M: int, N: int, K: int, num_sms: int) -> KChunkConfig:
    """M > 16: `int4_kchunk_gemm` (GEMM_JOIN) where it beat dequantise + cuBLAS in `bench/int4_sweep.py
    --large` on an H100 (RESULTS run 41, the 8B shapes, group 128), else DENSE. µs, k-chunk GEMM / dequantise +
    cuBLAS / bf16 cuBLAS (qkv 4096 x 6144, o 4096 x 4096, gate_up 4096 x 28672, down 14336 x 4096):
    M = 64, 64-row tiles of 128 columns: 32.8 / 41.8 / 24.4, 24.7 / 23.7 / 15.2, 87.4 / 196.5 / 90.2,
    62.7 / 101.6 / 47.7 (the 8-sub-dot kernel it replaces: 49.0, 31.5, 163.6, -); M = 128: 45.1 / 44.6,
    32.7 / 27.3 (o: dequantise wins), 104.4 (128-row tiles, 8 warps) / 199.8, 94.6 / 108.6; M = 256 only
    gate_up's 203 / 213 (qkv 84 / 49, o 47 / 30, down 136 / 111); from 512 up dequantise + cuBLAS, as
    prefill (M = 2048: 1.12-1.17x bf16, the GEMM 2.2x: ~350 TFLOP/s against cuBLAS's ~780). On an H200 (run 68,
    `.gpu/big.py`, whose 4.8 TB/s make the dense copy cheaper) dequantise + cuBLAS wins where the H100 had them
    nearly tied, and so takes them on both: gate_up at 144 / 192 / 256 rows 145.9 / 156.2 / 170.7 against the
    GEMM's 199.1 / 201.9 / 202.8 (H100 at 256: 213 / 203), qkv at 80 rows 31.3 against 45.1 (H100 at 128: 44.6 /
    45.1); gate_up at 80 rows keeps the GEMM (103.0 against 143.5)."""
    wide = N >= 16384
    if M <= 64:
        top, bm, bn, warps = 64, 64, 128, 4
    elif M <= 128 and N * K > 6144 * 4096:  # larger than the 8B qkv
        top, bm, bn, warps = 128, (128 if wide else 64), 128, (8 if wide else 4)
    else:
        return DENSE
    # Row tiles of the bucket's largest M: one split (and one compiled variant) for the whole bucket.
    tiles = triton.cdiv(N, bn) * triton.cdiv(top, bm)
    return KChunkConfig(bm, bn, 64, _split_for(tiles, triton.cdiv(K, 64), num_sms), warps, 3, gemm=GEMM_JOIN)


def _mma_config(M: int, N: int, K: int, group_size: int, num_sms: int, gated: bool = False) -> KChunkConfig | None:
    """`int4_kchunk_mma` where it beat the GEMV and the tensor-core tiles in `bench/int4_sweep.py` and `.gpu`-style
    A/B calls on an H200 (bench/RESULTS.md runs 62 and 66, the 8B shapes, group 128, us):
    - 1-8 rows: 128 columns a program and 4 warps, K split to ~4 programs per SM; on wide weights (N >= 16384,
      the packed gate|up) 256 columns, 8 warps (4 from 5 rows), ~1 program per SM (run 66, the kernel with its
      zero points and scales one tile ahead; M = 1 qkv 8.9 -> 7.8, o 7.0 -> 6.5, down 17.4 -> 14.6; M = 4
      8.8 -> 8.6, 7.7 -> 7.3, gate_up 29.2 -> 27.3, down 15.8 -> 15.1);
    - one row on a wide or a gated weight keeps the GEMV (gate_up 25.7 against 26.3, and its epilogue writes
      silu(gate) * up, which saves the activation's launch);
    - 2-8 rows on the gated wide gate|up: the kernel writes silu(gate) * up itself (`int4_kchunk_mma.store_tile`),
      256 columns, 4 warps, ~2 programs per SM (run 68: M = 2 31.9 -> 27.4 us, 4 33.8 -> 28.5, 8 38.6 -> 30.0,
      against 256 / 8 / ~1 with the same epilogue; the GEMV 26.0 at one row, 46.2 at two);
    - 9-16 rows: 128 columns, 4 warps, except on weights up to 4096 x 4096, which keep the 16-row tiles (run 62
      with 256 columns, M = 16: qkv 17.2 -> 16.6, gate_up 57.8 -> 46.4, down 32.5 -> 30.2; o 12.9 against 16.6;
      256 columns spill since the next tile's zero points and scales are held too, fp16 under Triton 3.6);
    - 17-24 rows (x padded to 32): 128 columns, 4 warps; 256 and 8 warps on long weights (run 62, M = 17: qkv
      31.4 -> 18.8, o 22.4 -> 15.2, gate_up 91.2 -> 72.5, down 61.8 -> 44.4; M = 24: 32.4 -> 21.8, 22.8 ->
      17.3, 90.8 -> 87.0, 63.4 -> 52.0); from 25 rows re-reading x per column tile costs more than it saves.
    On sm_90 `_wgmma_config` takes 9 rows and up first."""
    if not int4_kchunk_mma.fits(K, group_size):
        return None
    wide, long_k = N >= 16384, K >= 8192
    if M > 24 or (M == 1 and (wide or gated)) or (9 <= M <= 16 and N * K <= 4096 * 4096):
        return None
    if M <= 8 and wide:
        bn, warps, per_sm = (256, 4, 2) if gated else (256, 8 if M <= 4 else 4, 1)
    elif M <= 8:
        bn, warps, per_sm = 128, 4, 4
    else:
        bn, warps = (256, 8) if M > 16 and long_k else (128, 4)
        per_sm = 1 if wide else 2
    tiles = triton.cdiv(N, bn)
    split = _split_for(tiles, K // int4_kchunk_mma.BLOCK_K, per_sm * num_sms)
    return KChunkConfig(16, bn, int4_kchunk_mma.BLOCK_K, split, warps, gemm=GEMM_MMA)


def _wgmma_config(M: int, N: int, K: int, group_size: int, num_sms: int) -> KChunkConfig | None:
    """`int4_kchunk_wgmma` where it beat the other paths on an H200 (bench/RESULTS.md run 65: `bench/int4_sweep.py
    --large --wgmma-only` and A/B timings of its variants, the 8B shapes, group 128, us, today's pick -> this;
    4 warps a program, 4 stages):
    - 9-16 rows, 16-row programs of 64 columns (128 on the wide and the long weights), K split to ~4 programs
      per SM (~2 on long weights): M = 16 qkv 16.8 -> 13.3, o 13.0 -> 10.3, gate_up 47.5 -> 40.0, down 30.0
      -> 23.9 (a layer 107 -> 88 us, bf16 ~120); M = 9 99 -> 84;
    - 17-64 rows, 32-row programs of 128 columns (64 rows on the wide gate|up weight above 32 rows), split to
      ~2 programs per SM up to 32 rows (~4 on long weights), ~1 above: M = 32 qkv 32.0 -> 15.4, o 22.9 ->
      13.7, gate_up 88.8 -> 45.0, down 62.4 -> 32.0 (206 -> 106, bf16 124); M = 64 32.7 -> 26.5, 24.5 -> 18.7,
      88.5 -> 69.4, 62.1 -> 48.9 (208 -> 164, bf16 131); at 17-24 rows it also beats `int4_kchunk_mma`
      (qkv 18.8, o 15.2, gate_up 72.5, down 44.4 at 17);
    - 65-128 rows on long weights only (down 95.9 -> 70.5; gate_up keeps the GEMM, 103.5 against 110.3, o its
      dequantise + cuBLAS, 24.7 against 28.7; qkv's 40.4 against the GEMM's 45.7 came from 64-row programs
      with x in the sub-dot order and K split in 2 (run 66), a variant that spills registers in its split-K
      epilogue, so qkv keeps the GEMM too).
    Below 9 rows `int4_kchunk_mma` (x from global memory, no shared memory) and the GEMV stay ahead."""
    if not int4_kchunk_wgmma.fits(K, group_size) or not 9 <= M <= 128:
        return None
    wide, long_k = N >= 16384, K >= 8192
    if M > 64 and not long_k:
        return None
    if M <= 16:
        top, bm, bn, per_sm = 16, 16, 128 if wide or long_k else 64, 2 if long_k else 4
    else:
        top = 32 if M <= 32 else 64 if M <= 64 else 128  # one split (one compiled variant) per bucket
        bm, bn = 64 if wide and M > 32 else 32, 128
        per_sm = (4 if long_k else 2) if M <= 32 else 1
    split = _split_for(triton.cdiv(N, bn) * triton.cdiv(top, bm), K // int4_kchunk_wgmma.BLOCK_K, per_sm * num_sms)
    return KChunkConfig(bm, bn, int4_kchunk_wgmma.BLOCK_K, split, 4, 4, gemm=GEMM_WGMMA)


def _ws_config(M: int, N: int, K: int, group_size: int, num_sms: int) -> KChunkConfig | None:
    """`int4_kchunk_ws` where it beat every other path on an H200 (`bench/int4_ws_scan.py`, the 8B shapes, group 128,
    us; bench/RESULTS.md runs 81, 84), K split to fill one wave (`int4_kchunk_ws.one_wave_split`):
    - the wide gate|up weight (N >= 16384) at 33-512 rows, whose 128-column tiles fill the SMs without a K split:
      64-row programs with two dequantising partitions up to 64 rows (M = 40 67.3 -> 53.6, bf16 70.2; 64 70.3 ->
      55.8, bf16 65.4), 128-row programs with three to 128 rows (96 102.6 -> 69.7, bf16 65.5; 128 103.8 -> 70.0,
      bf16 69.5), then 256-row programs (two MMA warp groups, one dequantising partition: each weight tile
      dequantised once for twice the rows; 129 177.2 -> 146.2, 192 140.1 -> 113.0, 256 135.1 -> 113.2, bf16 95.1),
      above 256 rows a launch per 256 rows and one for the rest, picked for its own count (320 rows as one launch of
      128- or 256-row programs: 202 / 270 us, where a second wave of programs runs mostly idle);
    - long K (>= 8192, the 8B down) at 129-256 and 321-512 rows (run 84, dequantise + cuBLAS -> this: 129 82.8 ->
      68.5, 192 88.0 -> 63.9, 256 89.4 -> 63.9, 384 118.7 -> 103.1, 512 114.6 -> 106.4; at 320 97.1 against 104.5,
      kept).
    - other weights of at least 4096 x 4096 (qkv, o, down) at 33-128 rows: 64-row programs, 128-row ones on long K
      above 64 rows (run 84, the pick before -> this: qkv 40 rows 24.3 -> 18.4, 64 24.2 -> 20.0, 96 32.2 -> 25.5,
      128 34.3 -> 27.6; o 17.8 -> 15.0, 17.9 -> 16.9, 25.6 -> 20.8, 24.5 -> 20.7; down 45.8 -> 29.0, 46.6 -> 31.3,
      68.1 -> 40.5, 65.9 -> 43.3; bf16 down 34.9-39.5).
    qkv and o stay with dequantise + cuBLAS above 128 rows (run 84: this kernel 10 % faster at 192-256 rows, 15-40 %
    slower at 129 and 320-512)."""
    if not 33 <= M <= 512 or K % int4_kchunk_ws.BLOCK_K or (group_size < K and group_size % int4_kchunk_ws.BLOCK_K):
        return None
    chunk = 0
    if N >= 16384:
        block_m, parts = _ws_rows(M)
        chunk = 256 if M > 256 else 0
    elif M <= 128 and N * K >= 4096 * 4096:  # 128-row programs on long K above 64 rows, else 64-row ones
        block_m, parts = (128, 3) if M > 64 and K >= 8192 else (64, 2)
    elif K >= 8192 and (129 <= M <= 256 or 321 <= M):
        block_m, parts = (128, 3) if 192 < M <= 256 else (256, 1)
    else:
        return None
    tiles = triton.cdiv(min(M, chunk or M), block_m) * triton.cdiv(N, int4_kchunk_ws.BLOCK_N)
    split = int4_kchunk_ws.one_wave_split(tiles, K // int4_kchunk_ws.BLOCK_K, num_sms)
    return KChunkConfig(block_m, int4_kchunk_ws.BLOCK_N, int4_kchunk_ws.BLOCK_K, split, 4, 4, gemm=GEMM_WS,
                        dq_parts=parts, row_chunk=chunk)


def _ws_rows(M: int) -> tuple[int, int]:
    """(rows a program, dequantising partitions) of `int4_kchunk_ws` for M rows of a wide weight (any M >= 1)."""
    return (64, 2) if M <= 64 else (128, 3) if M <= 128 else (256, 1)


def _ws_launch(x, packed, scales, zeros, group_size, bias, out, config: KChunkConfig) -> None:
    # GEMM_WS into out, in launches of config.row_chunk rows (the rows left after the whole chunks: their own tiling)
    start, M = 0, x.shape[0]
    while start < M:
        rows = min(M - start, config.row_chunk or M)
        cfg = config
        if rows < config.row_chunk:  # the rest after the whole chunks (of a wide weight: K splits stay 1)
            block_m, parts = _ws_rows(rows)
            cfg = config._replace(block_m=block_m, dq_parts=parts)
        wbuf, raw = int4_kchunk_ws.buffers(cfg.dq_parts)
        int4_kchunk_ws.launch(x[start:start + rows], packed, scales, zeros, group_size, bias, out[start:start + rows],
                              cfg.block_m, cfg.num_stages, wbuf, cfg.num_warps, cfg.split_k, raw, cfg.dq_parts)
        start += rows


@functools.cache
def _has_mma_sync(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 8


def _device_index(x: torch.Tensor) -> int:
    return x.device.index if x.device.index is not None else torch.cuda.current_device()


def mma_runs_on(x: torch.Tensor) -> bool:
    """Whether `int4_kchunk_mma` can take x: a bf16/fp16 CUDA tensor on sm_80+ (mma.sync, packed FMAs)."""
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and _has_mma_sync(_device_index(x))


@functools.cache
def _has_wgmma(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) == (9, 0)


def wgmma_runs_on(x: torch.Tensor) -> bool:
    """Whether `int4_kchunk_wgmma` can take x: a bf16/fp16 CUDA tensor on sm_90 (Hopper's wgmma)."""
    return mma_runs_on(x) and _has_wgmma(_device_index(x))


def pick_kchunk_config(M: int, N: int, K: int, group_size: int, num_sms: int, mma: bool = False,
                       wgmma: bool = False, gated: bool = False, ws: bool = False) -> KChunkConfig:
    """The tiling for one call, from shapes alone (fixed per M bucket: no recompiles as M varies).

    From `bench/int4_sweep.py` on an H100 (bench/RESULTS.md run 36, the 8B shapes, group 128): M <= 2
    the GEMV with M rows, 256 columns and 128-row tiles split to ~2 programs per SM, or for very wide
    N (gate_up, 28,672) 512 columns and 64-row tiles split to ~4 per SM (M = 1: qkv 11.0, o 8.9,
    gate_up 28.1, down 19.9 us; the general kernel 13.7 / 11.2 / 35.9 / 23.7); M = 3-16 16-row
    tensor-core tiles of 64 columns split to ~4 programs per SM, 3 stages from M = 5 (M = 16: 17.0 /
    12.6 / 54.8 / 31.1 us against 23.2 / 19.7 / 72.5 / 41.5); above, `_many_rows_config`: the
    k-chunk GEMM up to 64 rows, to 128 rows on weights larger than the 8B qkv, else the weight
    dequantised once for cuBLAS (there, prefill, that cost is amortised over the rows). With `mma` (the
    caller's x can take it: `mma_runs_on`), `_mma_config` first, up to 24 rows; with `wgmma` (sm_90:
    `wgmma_runs_on`) `_wgmma_config` before it, at 9-128 rows; with `ws` (sm_90 and operands TMA can copy:
    `int4_kchunk_ws.fits`) `_ws_config` before both. `gated`: the call writes silu(gate) * up (one row keeps the
    GEMV, whose epilogue does it)."""
    if ws:
        cfg = _ws_config(M, N, K, group_size, num_sms)
        if cfg is not None:
            return cfg
    if wgmma:
        cfg = _wgmma_config(M, N, K, group_size, num_sms)
        if cfg is not None:
            return cfg
    if mma:
        cfg = _mma_config(M, N, K, group_size, num_sms, gated)
        if cfg is not None:
            return cfg
    if M > 16:
        return _many_rows_config(M, N, K, num_sms)
    stages = 1
    if M <= 2:
        wide = N >= 16384
        bm, bn, bk, warps, target = M, 512 if wide else 256, 64 if wide else 128, 4, (4 if wide else 2) * num_sms
    else:
        bm, bn, bk, warps, target = 16, 64, 128, 4, 4 * num_sms
        stages = 1 if M <= 4 else 3
    if bm < 16:
        while bk > 32 and group_size < K and group_size % bk:
            bk //= 2
    # Row tiles of the bucket's largest M: one split (and one compiled variant) for the whole bucket.
    tiles = triton.cdiv(N, bn)  # one row tile
    return KChunkConfig(bm, bn, bk, _split_for(tiles, triton.cdiv(K, bk), target), warps, stages)


def int4_kchunk_linear_impl(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    config: KChunkConfig | None = None,
    gated: bool = False,
) -> torch.Tensor:
    """`int4_kchunk_linear` with an explicit tiling (tests and the sweep pass their own). `gated`: the
    columns are a packed [gate | up] (2 I) and the result silu(gate) * up `[M, I]`: the GEMV and GEMM_MMA write
    it from their epilogue (the tiling N = 2 I takes), the other paths through `kernels/activation.py`."""
    M, K = x.shape
    chunks, N, four = packed.shape
    assert packed.dtype == torch.int32 and four == 4 and chunks * 32 == K and packed.is_contiguous()
    assert x.stride(1) == 1 and scales.shape == zeros.shape and scales.shape[1] == N
    assert scales.stride(1) == 1 and zeros.stride() == scales.stride()
    assert scales.shape[0] == triton.cdiv(K, group_size), (scales.shape, K, group_size)
    if x.dtype in (torch.bfloat16, torch.float16) and scales.dtype != x.dtype:
        # The Gluon paths read scales and zero points as x's type (the inline PTX multiplies bf16x2 / f16x2 pairs;
        # GEMM_WS copies them by TMA). Serving casts them at load; a direct call with other types gets the cast here.
        scales, zeros = scales.to(x.dtype), zeros.to(x.dtype)
    mma_ok = mma_runs_on(x)
    wgmma_ok = mma_ok and _has_wgmma(_device_index(x))  # `wgmma_runs_on`, mma_runs_on read once
    if config is None:
        # `pick_kchunk_config` with ws: GEMM_WS first where the shape takes it; its operand checks only there (they
        # cost microseconds a call)
        num_sms = _num_sms(x.device.index or 0) if x.is_cuda else 132
        config = _ws_config(M, N, K, group_size, num_sms) if wgmma_ok else None
        if config is None or not int4_kchunk_ws.fits(x, packed, scales, zeros, group_size):
            config = pick_kchunk_config(M, N, K, group_size, num_sms, mma=mma_ok, wgmma=wgmma_ok, gated=gated)
    elif config.gemm == GEMM_WS and not (wgmma_ok and int4_kchunk_ws.fits(x, packed, scales, zeros, group_size)):
        raise ValueError(f"GEMM_WS takes bf16/fp16 CUDA x on sm_90 with scales and zero points of its type, every "
                         f"operand 16-byte aligned (N a multiple of 8), K a multiple of 64 and groups of a multiple "
                         f"of 64 rows; got {M} x {K} {x.dtype} on {x.device}, scales {scales.dtype}, N {N}, "
                         f"group {group_size}")
    wgmma = config.gemm == GEMM_WGMMA
    if wgmma and not (wgmma_ok and int4_kchunk_wgmma.fits(K, group_size)):
        raise ValueError(f"GEMM_WGMMA takes bf16/fp16 CUDA x on sm_90, K and the group multiples of "
                         f"{int4_kchunk_wgmma.BLOCK_K}; got {M} x {K} {x.dtype} on {x.device}, group {group_size}")
    mma = config.gemm == GEMM_MMA
    if mma and (M > int4_kchunk_mma.MAX_ROWS or not mma_ok or not int4_kchunk_mma.fits(K, group_size)):
        raise ValueError(f"GEMM_MMA takes 1-{int4_kchunk_mma.MAX_ROWS} rows of bf16/fp16 CUDA x (sm_80+), K and the "
                         f"group multiples of {int4_kchunk_mma.BLOCK_K}; got {M} x {K} {x.dtype} on {x.device}, "
                         f"group {group_size}: {config}")
    if gated:
        if N % 2:
            raise ValueError(f"a gated int4 weight needs an even column count, got {N}")
        if not (0 < config.block_m < 16 or mma) or M == 0:
            return silu_and_mul(int4_kchunk_linear_impl(x, packed, scales, zeros, group_size, bias, config))
    out = torch.empty((M, N // 2 if gated else N), device=x.device, dtype=x.dtype)
    if M == 0:
        return out
    one_group = group_size >= K
    if not one_group and group_size % 32:
        raise ValueError(f"the k-chunk layout needs groups of a multiple of 32 rows, got {group_size}")
    if config.block_m == 0:  # DENSE: dequantise, then cuBLAS (large M: the dequantise is amortised)
        w = dequantize_kchunk(packed, scales, zeros, group_size, x.dtype)
        return torch.addmm(bias, x, w) if bias is not None else torch.mm(x, w)
    if mma:
        assert config.block_m == 16 and config.block_n % (16 * config.num_warps) == 0, config
        int4_kchunk_mma.launch(x, packed, scales, zeros, group_size, bias, out, config.block_n, config.split_k,
                               config.num_warps, gated)
        return out
    if config.gemm == GEMM_WS:  # a gated call ran the activation above, on this path's result
        _ws_launch(x, packed, scales, zeros, group_size, bias, out, config)
        return out
    if wgmma:  # block_m >= 16: a gated call ran the activation above, on this path's result
        int4_kchunk_wgmma.launch(x, packed, scales, zeros, group_size, bias, out, config.block_n, config.block_m,
                                 config.split_k, config.num_warps, config.num_stages)
        return out
    gemv = config.block_m < 16
    if config.block_k % 32:
        raise ValueError(f"block_k must be a multiple of 32, got {config}")
    if gemv:
        assert M <= config.block_m and config.block_m in (1, 2, 4), (M, config)
        assert config.block_n % (32 * config.num_warps) == 0, config
        if not one_group and group_size % config.block_k:
            raise ValueError(f"the k-chunk GEMV needs block_k dividing group_size {group_size}: {config}")
    elif config.gemm:
        assert config.gemm in (GEMM_JOIN, GEMM_NIBBLES) and config.block_m >= 16 and config.group_m >= 1, config
        assert config.gemm == GEMM_JOIN or config.block_k % 128 == 0, config
    else:
        assert config.block_k >= 128 and config.group_m >= 1, config
    asm = config.asm and x.is_cuda  # the interpreter runs on CPU tensors, and has no PTX
    split = config.split_k
    if gated:
        tiles, partial, counters = gated_workspace(out, split, config.block_n)
    else:
        tiles = triton.cdiv(N, config.block_n) * (1 if gemv else triton.cdiv(M, config.block_m))
        partial, counters = split_k_workspace(out, split, tiles)
    bias_arg = bias if bias is not None else scales
    tiles_per_split = triton.cdiv(triton.cdiv(K, config.block_k), split)
    args = (x, packed, scales, zeros, bias_arg, out, partial, counters,
            M, N, K, group_size, tiles_per_split, split, x.stride(0), packed.stride(0), scales.stride(0), out.stride(0))
    if gemv:
        pdl = launch_options(x)
        _kchunk_gemv_kernel[(tiles, split)](
            *args, ROWS=config.block_m, HAS_BIAS=bias is not None, USE_SPLIT=split > 1,
            BLOCK_N=config.block_n, BLOCK_K=config.block_k, EVEN_K=K % config.block_k == 0, PAIRS=config.pairs,
            REDUCE_EACH=config.reduce_each, ASM=asm, GATED=gated, num_warps=config.num_warps,
            num_stages=config.num_stages, **pdl,
        )
    elif config.gemm:
        _kchunk_gemm_kernel[(tiles, split)](
            *args, HAS_BIAS=bias is not None, USE_SPLIT=split > 1,
            BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
            NIBBLES=config.gemm == GEMM_NIBBLES, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", ASM=asm,
            num_warps=config.num_warps, num_stages=config.num_stages,
        )
    else:
        _kchunk_dot_kernel[(tiles, split)](
            *args, HAS_BIAS=bias is not None, USE_SPLIT=split > 1,
            BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
            DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", ASM=asm,
            num_warps=config.num_warps, num_stages=config.num_stages,
        )
    return out


def int4_kchunk_linear(
    x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
    bias: torch.Tensor | None = None, gated: bool = False,
) -> torch.Tensor:
    """The public op (shapes in `kernels/__init__.py`): y = x @ dequantised W + bias, tiling by M;
    `gated`: silu(gate) * up of a packed [gate | up] W."""
    return int4_kchunk_linear_impl(x, packed, scales, zeros, group_size, bias, gated=gated)

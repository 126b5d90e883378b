"""Quantized linear for GPTQ-packed int4 / int8 weights: y = x @ W (+ bias), three paths by M.

In: activations `x [M, K]`, `qweight` int32 `[K * bits // 32, N]` (row k at bits
`bits * (k % (32 // bits))` of packed row `k // (32 // bits)`), `scales`/`zeros [num_groups, N]`,
optional act-order `g_idx [K]`. Out: `[M, N]` in x's dtype. The host picks a `MatmulConfig` from
shapes alone (fixed per M bucket, so no recompiles as M varies): M <= 4 runs the CUDA-core GEMV
(`kernels/int4_gemv.py`, bandwidth-bound); larger M the tensor-core tile kernel here, which
dequantises a `[BLOCK_K, BLOCK_N]` tile into x's dtype (w = f * 2**B s - (2**B + z) s with the exact
f = 1 + q / 2**B from integer ops, one FMA per weight) and accumulates inside `tl.dot`; or the
whole weight is dequantised once and cuBLAS multiplies (large prefill). Split-K partials meet in an
fp32 workspace (`kernels/int4_common.py`): one launch, deterministic, no host sync, shape-only
launch parameters (CUDA-graph capturable).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.int4_common import finish_tile, grouped_tile, unit_float
from kernels.int4_gemv import int_gemv_kernel


class MatmulConfig(NamedTuple):
    """One tiling. `block_m` < 16 selects the GEMV kernel with that many rows (1, 2 or 4); 0 the
    dequantise-then-cuBLAS path (the other fields unused)."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int  # 1: no workspace
    num_warps: int
    num_stages: int
    split_unpack: bool = False  # tile kernel: one sub-dot per packed slot (no redundant loads)
    fma_tile: bool = False  # GEMV: 2-D FMA accumulator, one k reduction per tile (not yet timed)


@triton.jit(do_not_specialize=["M", "tiles_per_split", "split_k"])
def _int_matmul_kernel(
    # as int_gemv_kernel's, plus g_idx [K] int32 (only read with HAS_G_IDX)
    x_ptr, qw_ptr, scales_ptr, zeros_ptr, g_idx_ptr, bias_ptr, out_ptr, partial_ptr, counter_ptr,
    M, N, K, group_size, tiles_per_split, split_k, stride_xm, stride_qk, stride_sg, stride_om,
    BITS: tl.constexpr,
    HAS_G_IDX: tl.constexpr,  # per-row groups (act-order, or groups smaller than BLOCK_K)
    HAS_BIAS: tl.constexpr,
    USE_SPLIT: tl.constexpr,
    SPLIT_UNPACK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # Tensor-core tiles: dequantise a [BLOCK_K, BLOCK_N] weight tile into x's dtype with one FMA per
    # weight, w = f * (2**B s) - (2**B + z) s (f = 1 + q / 2**B), and accumulate inside tl.dot.
    PACK: tl.constexpr = 32 // BITS
    UNIT: tl.constexpr = 1 << BITS
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    pid = tl.program_id(0)
    split = tl.program_id(1)
    # Grouped ordering: GROUP_M row tiles walk the same column tiles while their weights sit in L2.
    offs_m, offs_n, mask_m, mask_n = grouped_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm  # [BLOCK_M, 1]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)

    num_k_tiles = tl.cdiv(K, BLOCK_K)
    t_start = split * tiles_per_split
    t_end = tl.minimum(t_start + tiles_per_split, num_k_tiles)
    for t in range(t_start, t_end):
        k0 = t * BLOCK_K
        if SPLIT_UNPACK:
            # One sub-dot per slot j of the packed words: rows k0 + PACK * i + j. Each word is
            # loaded once; x's columns are gathered to match (a sum over k ignores its order).
            offs_i = k0 // PACK + tl.arange(0, BLOCK_K // PACK)
            mask_i = offs_i < K // PACK
            words = tl.load(qw_ptr + offs_i[:, None] * stride_qk + offs_n[None, :],
                            mask=mask_i[:, None] & mask_n[None, :], other=0)  # [BLOCK_K // PACK, BLOCK_N]
            g_row = (k0 // group_size) * stride_sg  # the tile lies in one group
            s = tl.load(scales_ptr + g_row + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            z = tl.load(zeros_ptr + g_row + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            su = (s * UNIT)[None, :]
            c = ((z + UNIT) * s)[None, :]
            for j in tl.static_range(PACK):
                xj = tl.load(x_rows + (offs_i * PACK + j)[None, :], mask=mask_m[:, None] & mask_i[None, :], other=0.0)
                wj = (unit_float(words, j, BITS) * su - c).to(DTYPE)
                acc = tl.dot(xj, wj, acc, input_precision=DOT_PRECISION)
        else:
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            x = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # [BM, BK]
            # Each word is read by the PACK rows it holds (L1 hits after the first).
            words = tl.load(qw_ptr + (offs_k // PACK)[:, None] * stride_qk + offs_n[None, :],
                            mask=mask_k[:, None] & mask_n[None, :], other=0)  # [BLOCK_K, BLOCK_N]
            fields = (words >> ((offs_k % PACK) * BITS)[:, None]) << (23 - BITS)
            f = ((fields & (((1 << BITS) - 1) << (23 - BITS))) | 0x3F800000).to(tl.float32, bitcast=True)
            if HAS_G_IDX:
                g = tl.load(g_idx_ptr + offs_k, mask=mask_k, other=0)
                sg_offs = g[:, None] * stride_sg + offs_n[None, :]
                sg_mask = mask_k[:, None] & mask_n[None, :]
                s = tl.load(scales_ptr + sg_offs, mask=sg_mask, other=0.0).to(tl.float32)
                z = tl.load(zeros_ptr + sg_offs, mask=sg_mask, other=0.0).to(tl.float32)
                w = (f * (s * UNIT) - (z + UNIT) * s).to(DTYPE)
            else:
                g_row = (k0 // group_size) * stride_sg  # the tile lies in one group
                s = tl.load(scales_ptr + g_row + offs_n, mask=mask_n, other=0.0).to(tl.float32)
                z = tl.load(zeros_ptr + g_row + offs_n, mask=mask_n, other=0.0).to(tl.float32)
                w = (f * (s * UNIT)[None, :] - ((z + UNIT) * s)[None, :]).to(DTYPE)
            acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)

    finish_tile(acc, offs_m, offs_n, mask_m, mask_n, split, split_k, pid, M, N, bias_ptr,
                 out_ptr, partial_ptr, counter_ptr, stride_om, HAS_BIAS, USE_SPLIT)


@triton.jit
def _dequant_kernel(
    qw_ptr,  # [K // PACK, N] int32
    scales_ptr,  # [G, N]
    zeros_ptr,  # [G, N]
    g_idx_ptr,  # [K] int32 (only read with HAS_G_IDX)
    w_ptr,  # [K, N] out, x's dtype
    N, K, group_size, stride_qk, stride_sg, stride_wk,
    BITS: tl.constexpr,
    HAS_G_IDX: tl.constexpr,
    BLOCK_R: tl.constexpr,  # packed rows per program
    BLOCK_N: tl.constexpr,
):
    # The whole weight in x's dtype, for large M (prefill): then cuBLAS does the multiply.
    PACK: tl.constexpr = 32 // BITS
    UNIT: tl.constexpr = 1 << BITS
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_r < K // PACK)[:, None] & (offs_n < N)[None, :]
    words = tl.load(qw_ptr + offs_r[:, None] * stride_qk + offs_n[None, :], mask=mask, other=0)
    for j in tl.static_range(PACK):
        rows = offs_r * PACK + j
        if HAS_G_IDX:
            g = tl.load(g_idx_ptr + rows, mask=rows < K, other=0)
        else:
            g = rows // group_size
        sg = g[:, None] * stride_sg + offs_n[None, :]
        s = tl.load(scales_ptr + sg, mask=mask, other=0.0).to(tl.float32)
        z = tl.load(zeros_ptr + sg, mask=mask, other=0.0).to(tl.float32)
        w = unit_float(words, j, BITS) * (s * UNIT) - (z + UNIT) * s
        tl.store(w_ptr + rows.to(tl.int64)[:, None] * stride_wk + offs_n[None, :], w.to(w_ptr.dtype.element_ty),
                 mask=mask)


def dequantize(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor | None, bits: int,
    group_size: int, dtype: torch.dtype,
) -> torch.Tensor:
    """The dense `[K, N]` weight in `dtype` (one launch; the large-M path multiplies it with cuBLAS)."""
    num_words, N = qweight.shape
    K = num_words * (32 // bits)
    w = torch.empty((K, N), device=qweight.device, dtype=dtype)
    block_r, block_n = 8, 256
    grid = (triton.cdiv(num_words, block_r), triton.cdiv(N, block_n))
    _dequant_kernel[grid](
        qweight, scales, zeros, g_idx if g_idx is not None else qweight, w,
        N, K, group_size, qweight.stride(0), scales.stride(0), w.stride(0),
        BITS=bits, HAS_G_IDX=g_idx is not None, BLOCK_R=block_r, BLOCK_N=block_n, num_warps=4,
    )
    return w


_NUM_COUNTERS = 1 << 16
_counters: dict[torch.device, torch.Tensor] = {}


def _tile_counters(device: torch.device) -> torch.Tensor:
    # NOTE: one self-resetting buffer per device, so launches on one device must not overlap
    # (one stream per device, as the engine runs). Created on the first eager call: a buffer
    # first made inside a CUDA-graph capture would never be zeroed outside the graph.
    buf = _counters.get(device)
    if buf is None:
        assert not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()), "call once before capture"
        buf = _counters[device] = torch.zeros(_NUM_COUNTERS, dtype=torch.int32, device=device)
    return buf


def split_k_workspace(out: torch.Tensor, split: int, tiles: int, width: int | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial sums, tile counters) of a split-K launch over `tiles` output tiles: fp32 partials
    [split, M, width] (width: out's N unless given) and the device's self-resetting counters; without
    a split neither is read (`out` stands in for both)."""
    if split <= 1:
        return out, out
    assert tiles <= _NUM_COUNTERS
    m, n = out.shape
    return torch.empty((split, m, n if width is None else width), device=out.device, dtype=torch.float32), \
        _tile_counters(out.device)


def gated_workspace(out: torch.Tensor, split: int, block_n: int) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(tiles, partials, counters) of a gated GEMV (`int4_common.gemv_rows`) writing `out` [M, I]: tiles
    of block_n / 2 output columns, each summing block_n rows, whose split-K partials sit at the tile's
    own block_n columns."""
    tiles = triton.cdiv(out.shape[1], block_n // 2)
    return (tiles, *split_k_workspace(out, split, tiles, tiles * block_n))


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _largest_dividing_block(block_k: int, group_size: int) -> int:
    while block_k > 16 and group_size % block_k:
        block_k //= 2
    return block_k


def _split_for(tiles: int, num_k_tiles: int, target_programs: int) -> int:
    """Split K so that tiles * split reaches target_programs, with no empty split."""
    if tiles >= target_programs:
        return 1
    split = max(1, min(num_k_tiles, triton.cdiv(target_programs, tiles), 32))
    return triton.cdiv(num_k_tiles, triton.cdiv(num_k_tiles, split))


def pick_config(M: int, N: int, K: int, group_size: int, bits: int, has_g_idx: bool, num_sms: int) -> MatmulConfig:
    """The tiling for one call, from shapes alone (fixed per M bucket: no recompiles as M varies).

    Chosen by `bench/quant_kernels.py --sweep` on an H200 at the Llama-3-8B shapes (group 128; see
    bench/RESULTS.md): M == 1 runs the GEMV; 2..64 the tensor-core tile kernel with split-K; above
    64 the weight is dequantised once and cuBLAS multiplies (2-4x faster there than our tiles).
    """
    if M > 64:
        return MatmulConfig(0, 0, 0, 1, 0, 0)
    if M == 1 and not has_g_idx:
        bm, bn, bk, warps, stages, unpack, target = 1, 512, 64, 4, 1, False, 8 * num_sms
    elif M <= 4:
        bm, bn, bk, warps, stages, unpack, target = 16, 64, 128, 4, 3, True, 4 * num_sms
    elif M <= 16:
        bm, bn, bk, warps, stages, unpack, target = 16, 128, 128, 4, 3, True, 4 * num_sms
    else:
        bm, bn, bk, warps, stages, unpack, target = 64, 64, 128, 4, 3, False, 4 * num_sms
    if not has_g_idx:
        bk = _largest_dividing_block(bk, group_size)
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    split = _split_for(tiles, triton.cdiv(K, bk), target)
    return MatmulConfig(bm, bn, bk, split, warps, stages, unpack)


def quant_linear_impl(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    g_idx: torch.Tensor | None,
    bits: int,
    group_size: int,
    bias: torch.Tensor | None = None,
    config: MatmulConfig | None = None,
) -> torch.Tensor:
    """`quant_linear` with an explicit tiling (tests and the config sweep pass their own)."""
    M, K = x.shape
    N = qweight.shape[1]
    assert bits in (4, 8) and qweight.dtype == torch.int32 and qweight.shape[0] * (32 // bits) == K
    assert x.stride(1) == 1 and qweight.is_contiguous()
    assert scales.shape == zeros.shape and scales.shape[1] == N and scales.stride(1) == 1
    assert zeros.stride() == scales.stride()
    out = torch.empty((M, N), device=x.device, dtype=x.dtype)
    if M == 0:
        return out
    if config is None:
        num_sms = _num_sms(x.device.index or 0) if x.is_cuda else 132
        config = pick_config(M, N, K, group_size, bits, g_idx is not None, num_sms)
    if config.block_m == 0:  # dequantise, then cuBLAS (large M: the dequantise is amortised)
        w = dequantize(qweight, scales, zeros, g_idx, bits, group_size, x.dtype)
        return torch.addmm(bias, x, w) if bias is not None else torch.mm(x, w)
    gemv = config.block_m < 16
    assert not gemv or (M <= config.block_m and g_idx is None and group_size % config.block_k == 0)
    if g_idx is None and group_size % config.block_k:
        # Groups smaller than the tile: per-row groups, as with act-order.
        g_idx = torch.arange(K, device=x.device, dtype=torch.int32) // group_size
    if g_idx is not None:
        assert g_idx.shape == (K,) and g_idx.dtype == torch.int32
    split = config.split_k
    grid_tiles = triton.cdiv(M, config.block_m) * triton.cdiv(N, config.block_n)
    partial, counters = split_k_workspace(out, split, grid_tiles)
    bias_arg = bias if bias is not None else scales
    tiles_per_split = triton.cdiv(triton.cdiv(K, config.block_k), split)
    common = (M, N, K, group_size, tiles_per_split, split, x.stride(0), qweight.stride(0), scales.stride(0),
              out.stride(0))
    if gemv:
        int_gemv_kernel[(grid_tiles, split)](
            x, qweight, scales, zeros, bias_arg, out, partial, counters, *common,
            BITS=bits, ROWS=config.block_m, HAS_BIAS=bias is not None, USE_SPLIT=split > 1,
            BLOCK_N=config.block_n, BLOCK_K=config.block_k, FMA_TILE=config.fma_tile,
            num_warps=config.num_warps, num_stages=config.num_stages,
        )
        return out
    split_unpack = config.split_unpack and g_idx is None and config.block_k // (32 // bits) >= 16
    _int_matmul_kernel[(grid_tiles, split)](
        x, qweight, scales, zeros, g_idx if g_idx is not None else qweight, bias_arg, out, partial, counters,
        *common,
        BITS=bits, HAS_G_IDX=g_idx is not None, HAS_BIAS=bias is not None,
        USE_SPLIT=split > 1, SPLIT_UNPACK=split_unpack,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=8,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out


def quant_linear(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor | None,
    bits: int, group_size: int, bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The public op (shapes in `kernels/__init__.py`): y = x @ dequantised W + bias, tiling by M."""
    return quant_linear_impl(x, qweight, scales, zeros, g_idx, bits, group_size, bias)

"""Triton dequantise-and-multiply for GPTQ-packed int4 / int8 weights: y = x @ W (+ bias).

In: activations `x [M, K]`, `qweight` int32 `[K * bits // 32, N]` (row k at bits
`bits * (k % (32 // bits))` of packed row `k // (32 // bits)`), `scales`/`zeros [num_groups, N]`,
optional act-order `g_idx [K]`. Out: `[M, N]` in x's dtype. One kernel serves every M: the host
picks the tiling by M bucket (16-row tiles with split-K for decode, where the op is bandwidth-bound;
128-row tiles for prefill, where it is compute-bound). Codes become 16-bit floats with the magic
trick (`0x4300 | q` is the bf16 `128 + q`, `0x6400 | q` the fp16 `1024 + q`), go through `tl.dot`
unscaled, and the per-group scale and zero point are applied to the tile's partial sum:
`sum_k x (q - z) s = s * (dot(x, 128 + q) - (128 + z) * sum_k x)`, so dequantising costs two
integer ops per weight. Split-K partials meet in an fp32 workspace; the last program of each
tile (a self-resetting per-tile counter) sums them in order and writes the output: one launch,
deterministic, no host sync, shapes-only launch parameters (CUDA-graph capturable).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl


class MatmulConfig(NamedTuple):
    """One tiling of the kernel; `split_k` 1 means no workspace."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int
    split_unpack: bool = False  # one sub-dot per packed slot (no redundant qweight loads)


@triton.jit
def _codes_to_float(q, MODE: tl.constexpr, DTYPE: tl.constexpr):
    # q: unsigned codes (int32) -> 16-bit floats equal to OFFSET + q (MODE 1: bf16 128 + q,
    # MODE 2: fp16 1024 + q), or q converted exactly (MODE 0, OFFSET 0).
    if MODE == 1:
        return (q | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)
    elif MODE == 2:
        return (q | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
    else:
        return q.to(DTYPE)


@triton.jit(do_not_specialize=["M"])
def _int_matmul_kernel(
    x_ptr,  # [M, K]
    qw_ptr,  # [K // PACK, N] int32
    scales_ptr,  # [G, N]
    zeros_ptr,  # [G, N]
    g_idx_ptr,  # [K] int32 (only read with HAS_G_IDX)
    bias_ptr,  # [N] (only read with HAS_BIAS)
    out_ptr,  # [M, N]
    partial_ptr,  # [split_k, M, N] fp32 (only with USE_SPLIT)
    counter_ptr,  # [>= tiles] int32, zero between launches (only with USE_SPLIT)
    M,
    N,
    K,
    group_size,
    tiles_per_split,
    split_k,
    stride_xm,
    stride_qk,
    stride_sg,
    stride_om,
    BITS: tl.constexpr,
    MODE: tl.constexpr,
    OFFSET: tl.constexpr,
    HAS_G_IDX: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    USE_SPLIT: tl.constexpr,
    SPLIT_UNPACK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    PACK: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    pid = tl.program_id(0)
    split = tl.program_id(1)
    # Grouped ordering: GROUP_M row tiles walk the same column tiles while their weights sit in L2.
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (pid // num_pid_in_group) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % num_pid_in_group) % group_rows
    pid_n = (pid % num_pid_in_group) // group_rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm  # [BLOCK_M, 1]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)

    num_k_tiles = tl.cdiv(K, BLOCK_K)
    t_start = split * tiles_per_split
    t_end = tl.minimum(t_start + tiles_per_split, num_k_tiles)
    for t in range(t_start, t_end):
        k0 = t * BLOCK_K
        if SPLIT_UNPACK:
            # One sub-dot per slot j of the packed int32: rows k0 + PACK * i + j. Each qweight word
            # is loaded once; the x columns are gathered to match (a sum over k ignores its order).
            offs_i = k0 // PACK + tl.arange(0, BLOCK_K // PACK)
            mask_i = offs_i < K // PACK
            qw = tl.load(qw_ptr + offs_i[:, None] * stride_qk + offs_n[None, :],
                         mask=mask_i[:, None] & mask_n[None, :], other=0)  # [BLOCK_K // PACK, BLOCK_N]
            part = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            x_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
            for j in tl.static_range(PACK):
                xj = tl.load(x_rows + (offs_i * PACK + j)[None, :], mask=mask_m[:, None] & mask_i[None, :], other=0.0)
                wj = _codes_to_float((qw >> (j * BITS)) & MASK, MODE, DTYPE)
                part += tl.dot(xj, wj, input_precision=DOT_PRECISION)
                x_sum += tl.sum(xj.to(tl.float32), axis=1)
        else:
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            x = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # [BM, BK]
            # Each word is read by the PACK rows it holds (L1 hits after the first).
            qw = tl.load(qw_ptr + (offs_k // PACK)[:, None] * stride_qk + offs_n[None, :],
                         mask=mask_k[:, None] & mask_n[None, :], other=0)  # [BLOCK_K, BLOCK_N]
            q = (qw >> ((offs_k % PACK) * BITS)[:, None]) & MASK
            if HAS_G_IDX:
                # Act-order: every row has its own group, so dequantise the whole tile.
                g = tl.load(g_idx_ptr + offs_k, mask=mask_k, other=0)
                sg_offs = g[:, None] * stride_sg + offs_n[None, :]
                sg_mask = mask_k[:, None] & mask_n[None, :]
                s = tl.load(scales_ptr + sg_offs, mask=sg_mask, other=0.0).to(tl.float32)
                z = tl.load(zeros_ptr + sg_offs, mask=sg_mask, other=0.0).to(tl.float32)
                w = ((q.to(tl.float32) - z) * s).to(DTYPE)
                acc += tl.dot(x, w, input_precision=DOT_PRECISION)
            else:
                part = tl.dot(x, _codes_to_float(q, MODE, DTYPE), input_precision=DOT_PRECISION)
                x_sum = tl.sum(x.to(tl.float32), axis=1)
        if not HAS_G_IDX:
            # The tile lies inside one group (the host makes group_size a multiple of BLOCK_K).
            g_row = (k0 // group_size) * stride_sg
            s = tl.load(scales_ptr + g_row + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            z = tl.load(zeros_ptr + g_row + offs_n, mask=mask_n, other=0.0).to(tl.float32) + OFFSET
            acc += (part - x_sum[:, None] * z[None, :]) * s[None, :]

    out_offs = offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    out_mask = mask_m[:, None] & mask_n[None, :]
    if not USE_SPLIT:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        part_offs = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
        tl.store(partial_ptr + split.to(tl.int64) * M * N + part_offs, acc, mask=out_mask)
        # NOTE: the barrier orders every thread's partial store before the release below.
        tl.debug_barrier()
        tile = pid_m * num_pid_n + pid_n
        arrived = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel")
        if arrived == split_k - 1:
            # Last split of this tile: sum the partials in split order (deterministic).
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s_i in range(split_k):
                total += tl.load(partial_ptr + s_i * M * N + part_offs, mask=out_mask, other=0.0,
                                 cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptr + out_offs, total.to(out_ptr.dtype.element_ty), mask=out_mask)
            tl.store(counter_ptr + tile, 0)  # ready for the next launch


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


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _largest_dividing_block(block_k: int, group_size: int) -> int:
    while block_k > 16 and group_size % block_k:
        block_k //= 2
    return block_k


def pick_config(M: int, N: int, K: int, group_size: int, bits: int, has_g_idx: bool, num_sms: int) -> MatmulConfig:
    """The tiling for one call, from shapes alone (fixed per M bucket: no recompiles as M varies)."""
    if M <= 16:
        bm, bn, bk, warps, stages = 16, 64, 256, 4, 3
    elif M <= 64:
        bm, bn, bk, warps, stages = 64, 64, 128, 4, 3
    else:
        bm, bn, bk, warps, stages = 128, 128, 64, 8, 3
    if not has_g_idx:
        bk = _largest_dividing_block(bk, group_size)
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    num_k_tiles = triton.cdiv(K, bk)
    split = 1
    if tiles < 2 * num_sms:  # too few programs to fill the GPU: split K (up to ~4 per SM)
        split = max(1, min(num_k_tiles, (4 * num_sms) // tiles, 16))
        split = triton.cdiv(num_k_tiles, triton.cdiv(num_k_tiles, split))  # no empty splits
    return MatmulConfig(bm, bn, bk, split, warps, stages)


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
    assert scales.shape == zeros.shape and scales.shape[1] == N and scales.stride(1) == 1 and zeros.stride() == scales.stride()
    out = torch.empty((M, N), device=x.device, dtype=x.dtype)
    if M == 0:
        return out
    if config is None:
        num_sms = _num_sms(x.device.index or 0) if x.is_cuda else 132
        config = pick_config(M, N, K, group_size, bits, g_idx is not None, num_sms)
    if g_idx is None and group_size % config.block_k:
        # A group smaller than any tile the dot accepts: fall back to per-row groups.
        g_idx = torch.arange(K, device=x.device, dtype=torch.int32) // group_size
    if g_idx is not None:
        assert g_idx.shape == (K,) and g_idx.dtype == torch.int32
    if x.dtype == torch.bfloat16 and bits == 4:
        mode, offset = 1, 128.0
    elif x.dtype == torch.float16:
        mode, offset = 2, 1024.0
    else:
        mode, offset = 0, 0.0
    split = config.split_k
    grid_tiles = triton.cdiv(M, config.block_m) * triton.cdiv(N, config.block_n)
    if split > 1:
        assert grid_tiles <= _NUM_COUNTERS
        partial = torch.empty((split, M, N), device=x.device, dtype=torch.float32)
        counters = _tile_counters(x.device)
    else:
        partial = counters = out  # never read
    split_unpack = config.split_unpack and g_idx is None and config.block_k // (32 // bits) >= 16
    _int_matmul_kernel[(grid_tiles, split)](
        x, qweight, scales, zeros,
        g_idx if g_idx is not None else qweight,
        bias if bias is not None else scales,
        out, partial, counters,
        M, N, K, group_size, triton.cdiv(triton.cdiv(K, config.block_k), split), split,
        x.stride(0), qweight.stride(0), scales.stride(0), out.stride(0),
        BITS=bits, MODE=mode, OFFSET=offset,
        HAS_G_IDX=g_idx is not None, HAS_BIAS=bias is not None,
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

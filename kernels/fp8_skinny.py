"""FP8 (e4m3) weights at small M: one launch, weights converted in registers, activations unquantised.

In: `x [M, K]` (bf16/fp16; fp32 in the CPU interpreter), `weight` float8_e4m3fn `[N, K]`,
`weight_scale` fp32 scalar or `[N]`. Out: `[M, N]` in x's dtype, y = x @ (weight * scale).T + bias.
At decode sizes the cost is reading the weight (1 byte per weight, half of bf16's); quantising
the activations first (a second launch) and a skinny `_scaled_mm` gain nothing there. So:
- M == 1, `_fp8_gemv_kernel` (CUDA cores): `[BLOCK_N, BLOCK_K]` tiles of weight rows, 16-byte
  loads along k, one fp32 FMA per weight into a 2-D accumulator reduced over k once at the end.
- M >= 2, `_fp8_tile_kernel` (tensor cores): the `[BLOCK_K, BLOCK_N]` weight tile converted to x's
  dtype feeds `tl.dot`. Both apply the per-channel scale to the fp32 sums and may split K
  (`kernels/int4_common.finish_tile`). `kernels/fp8_matmul.py` picks this path for M <= 16.
The result is x times the dequantised weight (`quant_reference.fp8_linear`) up to fp32 summation
order and, in the tile kernel, x's rounding of each weight (e4m3 values are exact in bf16/fp16).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.int4_common import finish_tile
from kernels.int4_matmul import _num_sms, _split_for, split_k_workspace


class FP8Config(NamedTuple):
    """One tiling; `block_m` 1 selects the GEMV."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int


@triton.jit(do_not_specialize=["tiles_per_split", "split_k"])
def _fp8_gemv_kernel(
    x_ptr,  # [1, K]
    w_ptr,  # [N, K] float8e4nv
    scale_ptr,  # [N] fp32 (stride 0: one per tensor)
    bias_ptr, out_ptr, partial_ptr, counter_ptr,  # as kernels/int4_common.finish_tile's
    N, K, tiles_per_split, split_k, stride_wn, stride_scale, stride_om,
    HAS_BIAS: tl.constexpr,
    USE_SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    num_k_tiles = tl.cdiv(K, BLOCK_K)
    t_start = split * tiles_per_split
    t_end = tl.minimum(t_start + tiles_per_split, num_k_tiles)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    cols = t_start * BLOCK_K + offs_k
    w_next = tl.load(w_rows + cols[None, :], mask=mask_n[:, None] & ((cols < K) & (t_start < t_end))[None, :],
                     other=0.0, eviction_policy="evict_first")
    for t in range(t_start, t_end):
        w = w_next  # the next tile is in flight while this one is used
        cols = t * BLOCK_K + offs_k
        nxt = cols + BLOCK_K
        w_next = tl.load(w_rows + nxt[None, :], mask=mask_n[:, None] & ((nxt < K) & (t + 1 < t_end))[None, :],
                         other=0.0, eviction_policy="evict_first")
        x = tl.load(x_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
        acc += w.to(tl.float32) * x[None, :]
    scale = tl.load(scale_ptr + offs_n * stride_scale, mask=mask_n, other=0.0)
    y = tl.sum(acc, axis=1) * scale  # [BLOCK_N]
    offs_m = tl.arange(0, 2)  # finish_tile takes a 2-row tile; row 1 repeats row 0, masked off
    finish_tile(tl.broadcast_to(y[None, :], [2, BLOCK_N]), offs_m, offs_n, offs_m < 1, mask_n, split, split_k, pid_n,
                1, N, bias_ptr, out_ptr, partial_ptr, counter_ptr, stride_om, HAS_BIAS, USE_SPLIT)


@triton.jit(do_not_specialize=["M", "tiles_per_split", "split_k"])
def _fp8_tile_kernel(
    x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, partial_ptr, counter_ptr,  # as the GEMV's, M rows
    M, N, K, tiles_per_split, split_k, stride_xm, stride_wn, stride_scale, stride_om,
    HAS_BIAS: tl.constexpr,
    USE_SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m = tl.program_id(0) // num_pid_n
    pid_n = tl.program_id(0) % num_pid_n
    split = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm  # [BM, 1]
    w_cols = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn  # [1, BN]: weight row n is column n here
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    num_k_tiles = tl.cdiv(K, BLOCK_K)
    t_start = split * tiles_per_split
    t_end = tl.minimum(t_start + tiles_per_split, num_k_tiles)
    for t in range(t_start, t_end):
        offs_k = t * BLOCK_K + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_cols + offs_k[:, None], mask=mask_k[:, None] & mask_n[None, :], other=0.0)  # [BK, BN]
        acc = tl.dot(x, w.to(DTYPE), acc, input_precision=DOT_PRECISION)
    scale = tl.load(scale_ptr + offs_n * stride_scale, mask=mask_n, other=0.0)
    finish_tile(acc * scale[None, :], offs_m, offs_n, mask_m, mask_n, split, split_k, tl.program_id(0), M, N,
                bias_ptr, out_ptr, partial_ptr, counter_ptr, stride_om, HAS_BIAS, USE_SPLIT)


def pick_fp8_config(M: int, N: int, K: int, num_sms: int) -> FP8Config:
    """First guesses for H100/H200 (shapes only: fixed per M bucket), for `bench/quant_speed.py --sweep`
    to replace: M == 1 the GEMV with 16 rows x 256 columns a tile; larger M 16-row tensor-core tiles."""
    if M == 1:
        bn, bk, warps = 16, 256, 4
        tiles = triton.cdiv(N, bn)
        return FP8Config(1, bn, bk, _split_for(tiles, triton.cdiv(K, bk), 4 * num_sms), warps, 1)
    bm = 16 if M <= 16 else 32 if M <= 32 else 64
    bn, bk, warps, stages = 64, 128, 4, 4
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    return FP8Config(bm, bn, bk, _split_for(tiles, triton.cdiv(K, bk), 2 * num_sms), warps, stages)


def fp8_skinny_linear_impl(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None,
    config: FP8Config | None = None,
) -> torch.Tensor:
    """`fp8_skinny_linear` with an explicit tiling (tests and the sweep pass their own)."""
    M, K = x.shape
    N = weight.shape[0]
    assert weight.dtype == torch.float8_e4m3fn and weight.shape[1] == K and weight.stride(1) == 1
    assert x.stride(1) == 1 and weight_scale.dtype == torch.float32 and weight_scale.numel() in (1, N)
    scale = weight_scale.reshape(-1)
    out = torch.empty((M, N), device=x.device, dtype=x.dtype)
    if M == 0:
        return out
    if config is None:
        config = pick_fp8_config(M, N, K, _num_sms(x.device.index or 0) if x.is_cuda else 132)
    split = config.split_k
    gemv = config.block_m == 1
    tiles = triton.cdiv(N, config.block_n) * (1 if gemv else triton.cdiv(M, config.block_m))
    partial, counters = split_k_workspace(out, split, tiles)
    bias_arg = bias if bias is not None else scale
    tiles_per_split = triton.cdiv(triton.cdiv(K, config.block_k), split)
    stride_scale = 1 if scale.numel() > 1 else 0
    if gemv:
        _fp8_gemv_kernel[(tiles, split)](
            x, weight, scale, bias_arg, out, partial, counters,
            N, K, tiles_per_split, split, weight.stride(0), stride_scale, out.stride(0),
            HAS_BIAS=bias is not None, USE_SPLIT=split > 1, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
            num_warps=config.num_warps, num_stages=config.num_stages,
        )
        return out
    _fp8_tile_kernel[(tiles, split)](
        x, weight, scale, bias_arg, out, partial, counters,
        M, N, K, tiles_per_split, split, x.stride(0), weight.stride(0), stride_scale, out.stride(0),
        HAS_BIAS=bias is not None, USE_SPLIT=split > 1, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out


def fp8_skinny_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x @ (weight * weight_scale).T + bias for small M, one launch (shapes as `kernels.fp8_linear`)."""
    return fp8_skinny_linear_impl(x, weight, weight_scale, bias)

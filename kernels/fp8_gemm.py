"""FP8 (e4m3) GEMM on tensor cores for per-token-quantised activations: y = (x_q * x_scale) @ (w * w_scale)^T + bias.

In: `x_q` float8_e4m3fn `[M, K]` with fp32 `x_scale [M, 1]` (`kernels.fp8_rows.quantize_rows_fp8`),
`weight` float8_e4m3fn `[N, K]` (torch Linear orientation, K contiguous: the K-major B operand
Hopper's FP8 MMA wants) with fp32 `w_scale [N]`, optional `bias [N]`. Out: `[M, N]` in `out_dtype`.
The torch reference with the same signature is `quant_reference.fp8_scaled_matmul`.

What it is for: the rows between the decode GEMV (`kernels/fp8_gemv.py`, M <= 16) and prefill. There
the weight stream, not the multiply, sets the time, and `torch._scaled_mm`'s rowwise kernels run
far from the copy bandwidth (bench/RESULTS.md run 42: 45-70 % at M = 64-256 on an H100). One
program owns a `[BLOCK_M, BLOCK_N]` output tile and walks K in BLOCK_K steps, Triton pipelining the
loads `num_stages` deep; both scales are applied once to the fp32 accumulator; when the tiles alone
cannot fill the GPU, K is split over programs that meet through `kernels/int4_common.finish_tile`
(fp32 partials summed in split order by the last one: deterministic). `pick_fp8_gemm_config` picks
the tiling from the shapes (fixed per M bucket, so M moving inside a bucket never recompiles);
`use_fp8_gemm` says where it beat `_scaled_mm` (`kernels/fp8_matmul.scaled_mm_linear` asks it).

A variant that quantised x itself, each row's 128-column block as it loaded it (one launch, no FP8
copy of x; `dad4311`), lost to quantise + this kernel at every M measured (bench/RESULTS.md run 59,
H200: 8B step linears 4.39 against 3.67 ms at 17 rows, 5.85 against 3.19 at 64) and was removed;
the activations' FP8 rows now come from the op before the linear (`kernels/fp8_rows.py`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.int4_common import finish_tile, grouped_tile
from kernels.int4_matmul import _num_sms, _split_for, split_k_workspace


class Fp8GemmConfig(NamedTuple):
    """One tiling of `_fp8_gemm_kernel` (split_k 1: no workspace)."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8  # row tiles per band of the program order (L2 reuse of weight tiles)


@triton.jit(do_not_specialize=["M", "tiles_per_split", "split_k"])
def _fp8_gemm_kernel(
    a_ptr,  # [M, K] fp8
    b_ptr,  # [N, K] fp8
    a_scale_ptr,  # [M] fp32
    b_scale_ptr,  # [N] fp32
    bias_ptr,  # [N] (only read with HAS_BIAS)
    out_ptr,  # [M, N]
    partial_ptr,  # [split_k, M, N] fp32 (only with USE_SPLIT)
    counter_ptr,  # [>= tiles] int32, zero between launches (only with USE_SPLIT)
    M, N, K, tiles_per_split, split_k, stride_am, stride_bn, stride_om,
    HAS_BIAS: tl.constexpr,
    USE_SPLIT: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no K masks
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    offs_m, offs_n, mask_m, mask_n = grouped_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    # NOTE: rows and columns past the edge re-read the last valid one (always valid memory, no masks
    # in the loop); the epilogue drops them.
    rows = tl.minimum(offs_m, M - 1).to(tl.int64)
    cols = tl.minimum(offs_n, N - 1).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + cols[:, None] * stride_bn + offs_k[None, :]
    num_k_tiles = tl.cdiv(K, BLOCK_K)
    t_start = split * tiles_per_split
    t_end = tl.minimum(t_start + tiles_per_split, num_k_tiles)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for t in range(t_start, t_end):
        k0 = t * BLOCK_K
        if EVEN_K:
            a = tl.load(a_ptrs + k0)
            b = tl.load(b_ptrs + k0, eviction_policy="evict_first")
        else:
            k_ok = (k0 + offs_k) < K
            a = tl.load(a_ptrs + k0, mask=k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs + k0, mask=k_ok[None, :], other=0.0, eviction_policy="evict_first")
        acc = tl.dot(a, tl.trans(b), acc)
    a_s = tl.load(a_scale_ptr + rows)
    b_s = tl.load(b_scale_ptr + cols)
    acc = acc * a_s[:, None] * b_s[None, :]
    finish_tile(acc, offs_m, offs_n, mask_m, mask_n, split, split_k, pid, M, N, bias_ptr, out_ptr, partial_ptr,
                counter_ptr, stride_om, HAS_BIAS, USE_SPLIT)


TRITON_MAX_ROWS = 128  # above, `torch._scaled_mm` (compute-bound from ~512 rows, where it matches the best tiling)
WIDE_N = 16384  # a wide weight (a SwiGLU MLP's [gate | up]): `_scaled_mm` already wins above 64 rows


def use_fp8_gemm(M: int, N: int, K: int) -> bool:
    """Whether `fp8_gemm` beat `torch._scaled_mm` at this shape (bench/fp8_gemm_sweep.py on an H200,
    bench/RESULTS.md run 57: 16 < M <= 128, except wide N above 64 rows)."""
    return 16 < M <= TRITON_MAX_ROWS and not (M > 64 and N >= WIDE_N)


def pick_fp8_gemm_config(M: int, N: int, K: int, num_sms: int) -> Fp8GemmConfig:
    """The tiling for one call, from shapes alone (one per M bucket: 17-32, 33-64, 65-128 rows, and
    above), from bench/fp8_gemm_sweep.py on an H200 (bench/RESULTS.md run 57, 8B shapes): 16-row
    tiles (32 on wide N) of 64 columns (128 on wide N) split to ~2 programs per SM up to 32 rows;
    64-row tiles split to ~1 program per SM up to 128; 128 x 256 tiles above (where `_scaled_mm`
    runs in serving). K steps of 128, 4 warps and 4 stages below 128 rows."""
    wide = N >= WIDE_N
    if M <= 32:
        top, bm, bn, bk, warps, stages, per_sm = 32, (32 if wide else 16), (128 if wide else 64), 128, 4, 4, 2
    elif M <= 64:
        top, bm, bn, bk, warps, stages, per_sm = 64, 64, (128 if wide else 64), 128, 4, 4, 1
    elif M <= 128:
        top, bm, bn, bk, warps, stages, per_sm = 128, 64, (128 if wide else 64), 128, 4, 4, 1
    else:
        top, bm, bn, bk, warps, stages, per_sm = max(256, triton.next_power_of_2(M)), 128, 256, 128, 8, 3, 1
    tiles = triton.cdiv(N, bn) * triton.cdiv(top, bm)
    return Fp8GemmConfig(bm, bn, bk, _split_for(tiles, triton.cdiv(K, bk), per_sm * num_sms), warps, stages)


def fp8_gemm(
    x_q: torch.Tensor,  # [M, K] float8_e4m3fn
    x_scale: torch.Tensor,  # [M, 1] or [M] fp32
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    w_scale: torch.Tensor,  # [N] fp32
    bias: torch.Tensor | None = None,  # [N]
    out_dtype: torch.dtype = torch.bfloat16,
    config: Fp8GemmConfig | None = None,
) -> torch.Tensor:
    """y = (x_q * x_scale) @ (weight * w_scale)^T + bias -> `[M, N]` in out_dtype (tiling by M, or `config`)."""
    M, K = x_q.shape
    N, K2 = weight.shape
    assert K == K2 and x_q.dtype == weight.dtype == torch.float8_e4m3fn, (x_q.shape, weight.shape, x_q.dtype)
    assert x_q.stride(1) == 1 and weight.stride(1) == 1
    assert x_scale.numel() == M and w_scale.numel() == N and x_scale.dtype == w_scale.dtype == torch.float32
    out = torch.empty((M, N), device=x_q.device, dtype=out_dtype)
    if M == 0:
        return out
    if config is None:
        config = pick_fp8_gemm_config(M, N, K, _num_sms(x_q.device.index or 0) if x_q.is_cuda else 132)
    split = config.split_k
    tiles = triton.cdiv(M, config.block_m) * triton.cdiv(N, config.block_n)
    partial, counters = split_k_workspace(out, split, tiles)
    tiles_per_split = triton.cdiv(triton.cdiv(K, config.block_k), split)
    _fp8_gemm_kernel[(tiles, split)](
        x_q, weight, x_scale.reshape(M), w_scale.reshape(N), bias if bias is not None else w_scale, out, partial,
        counters, M, N, K, tiles_per_split, split, x_q.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, USE_SPLIT=split > 1, EVEN_K=K % config.block_k == 0,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out

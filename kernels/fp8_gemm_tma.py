"""FP8 (e4m3) GEMM for many rows on Hopper: operands by TMA, programs persistent over the output tiles.

Same op and operands as `kernels/fp8_gemm.py` (`x_q [M, K]` e4m3 with fp32 per-token `x_scale`, the
weight `[N, K]` e4m3 with fp32 per-channel `w_scale`, optional bias): y = (x_q * x_scale) @ (w * w_scale)^T
+ bias, both scales applied once to the fp32 accumulator. Torch reference: `quant_reference.fp8_scaled_matmul`.

Why a second kernel: above 128 rows serving called `torch._scaled_mm`, which at the reference
workload's ~256-300-row steps runs the 8B linears at ~45 % of the card's FP8 rate and ~41 % of its
bandwidth (bench/RESULTS.md runs 57, 70, 72), while those steps are where FP8's workload time goes.
`kernels/fp8_gemm.py` loads its tiles through pointers (`cp.async`: every thread computes addresses
and issues 16-byte copies) and launches one program per tile; here the tensor memory accelerator
copies whole [rows, 128-byte] boxes (out-of-range rows and K columns arrive as zeros, so the loop
has no masks), and `grid` programs walk the output tiles in an order that keeps the row tiles of one
weight slab running at once (the weight is read from HBM once, its other uses hit L2). No split K: at
the 8B shapes a split never won (bench/RESULTS.md run 76), so every output element is one program's
sum in K order.

Where it runs (`kernels/fp8_matmul.scaled_mm_linear`): Hopper, 129-2048 rows. `_scaled_mm`'s time is a sawtooth
in the rows (cuBLAS's heuristic: on the 8B step's linears 4.01 ms at 256 rows, 6.82 at 272, 5.20 at 384, 8.29
at 400), this kernel's a staircase of waves that `pick_fp8_tma_config` predicts: with the tilings it picks the 8B
step's linears take 0.71-0.97x `_scaled_mm`'s time at every 16 rows from 129 to 512, 0.92-0.94x at 640, 1024 and
2048 (run 76).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels.int4_common import finish_tile
from kernels.int4_matmul import _num_sms


class Fp8TmaConfig(NamedTuple):
    """One tiling of `_fp8_gemm_tma_kernel`: a program's output tile, its K step, warps, pipeline stages,
    programs per SM (the persistent grid is per_sm x SMs, at most one per tile), and whether the tile loop and
    the K loop are pipelined as one (`flatten`: the next tile's first K steps load during this tile's epilogue)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    per_sm: int = 1
    flatten: bool = False


@triton.jit(do_not_specialize=["M"])
def _fp8_gemm_tma_kernel(
    a_desc,  # x_q [M, K] fp8 in [BLOCK_M, BLOCK_K] boxes
    b_desc,  # weight [N, K] fp8 in [BLOCK_N, BLOCK_K] boxes
    a_scale_ptr,  # [M] fp32
    b_scale_ptr,  # [N] fp32
    bias_ptr,  # [N] (only read with HAS_BIAS)
    out_ptr,  # [M, N]
    M, N, K, stride_om,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FLATTEN: tl.constexpr,
):
    num_m = tl.cdiv(M, BLOCK_M)
    num_k_tiles = tl.cdiv(K, BLOCK_K)
    tiles = num_m * tl.cdiv(N, BLOCK_N)
    # Tile u: row tile fastest, then the weight slab. Programs p, p + grid, ... take consecutive tiles at once
    # across the GPU, so the row tiles sharing a weight slab run together (its later reads hit L2).
    for u in tl.range(tl.program_id(0), tiles, tl.num_programs(0), flatten=FLATTEN):
        pid_m = u % num_m
        pid_n = u // num_m
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for t in range(num_k_tiles):
            a = a_desc.load([pid_m * BLOCK_M, t * BLOCK_K])
            b = b_desc.load([pid_n * BLOCK_N, t * BLOCK_K])
            acc = tl.dot(a, b.T, acc)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_m = offs_m < M
        mask_n = offs_n < N
        a_s = tl.load(a_scale_ptr + offs_m, mask=mask_m, other=0.0)
        b_s = tl.load(b_scale_ptr + offs_n, mask=mask_n, other=0.0)
        acc = acc * a_s[:, None] * b_s[None, :]
        # the int4 / FP8 GEMMs' epilogue without its split K (+ bias, rounded once to out's dtype)
        finish_tile(acc, offs_m, offs_n, mask_m, mask_n, 0, 1, u, M, N, bias_ptr, out_ptr, out_ptr, out_ptr, stride_om,
                    HAS_BIAS, False)


class _Tiling(NamedTuple):
    """A candidate of `pick_fp8_tma_config` and its cost: a program's tile takes `fixed_us` + its FLOPs at
    `tflops` (one program's rate) per wave of `per_sm` x SMs programs."""

    config: Fp8TmaConfig
    fixed_us: float
    tflops: float


# Fitted by least squares to `python3 bench/fp8_gemm_scan.py --more` on an H200 (bench/RESULTS.md run 76: the 8B
# projections at every 16 rows from 129 to 512 and at 640, 1024, 2048; median error 3-7 %). Of the ten tilings timed,
# these three with the wave model lose 0.5 % to the fastest of the ten per shape over the whole scan, and are never
# slower than `_scaled_mm` (0.71-0.97x its time for the step's linears at every M scanned).
_TILINGS = (
    _Tiling(Fp8TmaConfig(128, 256, 128, 8, 4, 1, flatten=True), 5.76, 14.27),
    _Tiling(Fp8TmaConfig(64, 256, 128, 8, 4, 1, flatten=True), 1.43, 10.85),
    _Tiling(Fp8TmaConfig(128, 128, 128, 4, 5, 1, flatten=True), 2.32, 12.07),
)
MIN_ROWS = 129  # below, `kernels/fp8_gemm.py` (17-128 rows) and the skinny kernels (1-16)
MAX_ROWS = 2048  # measured up to here (0.94x `_scaled_mm` at 2048); larger prefills keep `_scaled_mm`


def estimate_us(tiling: _Tiling, M: int, N: int, K: int, num_sms: int) -> float:
    """The cost model's time for one call: waves of programs x (fixed cost + a tile's FLOPs at the tiling's rate)."""
    c = tiling.config
    units = triton.cdiv(M, c.block_m) * triton.cdiv(N, c.block_n)
    waves = triton.cdiv(units, c.per_sm * num_sms)
    return waves * (tiling.fixed_us + 2 * c.block_m * c.block_n * K / (tiling.tflops * 1e6))


def pick_fp8_tma_config(M: int, N: int, K: int, num_sms: int) -> Fp8TmaConfig:
    """The tiling for one call: the candidate the wave model (`estimate_us`) says is fastest (ties: the first).
    From shapes and the SM count alone, so a given step size always runs the same tiling (same sums)."""
    return min(_TILINGS, key=lambda t: estimate_us(t, M, N, K, num_sms)).config


def use_fp8_gemm_tma(M: int, N: int, K: int) -> bool:
    """Whether `kernels/fp8_matmul.scaled_mm_linear` sends these shapes here on Hopper (the caller checks the
    device, and `tma_ready` the operands)."""
    return MIN_ROWS <= M <= MAX_ROWS and N >= 16 and K % 16 == 0


def tma_ready(*operands: torch.Tensor) -> bool:
    """Whether each 2-D operand can be a TMA box source: rows contiguous, base and row pitch 16-byte aligned
    (FP8 rows handed over by the op before may be views of a larger buffer)."""
    return all(t.stride(1) == 1 and t.data_ptr() % 16 == 0 and t.stride(0) % 16 == 0 for t in operands)


def fp8_gemm_tma(
    x_q: torch.Tensor,  # [M, K] float8_e4m3fn, rows contiguous, 16-byte aligned
    x_scale: torch.Tensor,  # [M, 1] or [M] fp32
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    w_scale: torch.Tensor,  # [N] fp32
    bias: torch.Tensor | None,  # [N]
    out_dtype: torch.dtype,
    config: Fp8TmaConfig,
) -> torch.Tensor:
    """y = (x_q * x_scale) @ (weight * w_scale)^T + bias -> `[M, N]` in out_dtype, tiled as `config`."""
    M, K = x_q.shape
    N, K2 = weight.shape
    assert K == K2 and x_q.dtype == weight.dtype == torch.float8_e4m3fn, (x_q.shape, weight.shape, x_q.dtype)
    assert x_q.stride(1) == 1 and weight.stride(1) == 1 and K % 16 == 0, (x_q.stride(), weight.stride(), K)
    assert x_scale.numel() == M and w_scale.numel() == N and x_scale.dtype == w_scale.dtype == torch.float32
    out = torch.empty((M, N), device=x_q.device, dtype=out_dtype)
    if M == 0:
        return out
    c = config
    tiles = triton.cdiv(M, c.block_m) * triton.cdiv(N, c.block_n)
    num_sms = _num_sms(x_q.device.index or 0) if x_q.is_cuda else 4
    a_desc = TensorDescriptor.from_tensor(x_q, [c.block_m, c.block_k])
    b_desc = TensorDescriptor.from_tensor(weight, [c.block_n, c.block_k])
    _fp8_gemm_tma_kernel[(min(tiles, c.per_sm * num_sms),)](
        a_desc, b_desc, x_scale.reshape(M), w_scale.reshape(N), bias if bias is not None else w_scale, out,
        M, N, K, out.stride(0), HAS_BIAS=bias is not None, BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k,
        FLATTEN=c.flatten, num_warps=c.num_warps, num_stages=c.num_stages,
    )
    return out

"""FP8 (e4m3) linear on the GPU: per-token activation quantisation in Triton + torch._scaled_mm.

In: activations `x [M, K]` (bf16/fp16), `weight` float8_e4m3fn `[N, K]`, `weight_scale` fp32
scalar or `[N]`. Out: `[M, N]` in x's dtype. On Hopper (sm_90+) each row of x gets its own scale
(dynamic, rowwise) and cuBLAS/CUTLASS multiplies with both scales applied in the epilogue
(torch 2.11 accepts rowwise scales with a bf16 output only, so fp16 callers get a cast). On
sm_89 a per-tensor activation scale is used, with a per-tensor weight scale only. Elsewhere, and
for shapes `_scaled_mm` refuses (K or N not a multiple of 16), the torch reference runs.
The activations' FP8 rows come with x where the op that wrote x made them (`kernels/fp8_rows.py`:
the RMSNorm before qkv / gate_up, the SwiGLU before down), else from a launch of their own.
From 17 to 128 rows on Hopper, where `kernels.fp8_gemm.use_fp8_gemm` says so, the activations'
FP8 rows go to `kernels/fp8_gemm.py` (our tiles; the weight stream sets the time there) instead, and
from 129 to 2048 rows to `kernels/fp8_gemm_tma.py` (TMA tiles picked by a wave model: cuBLAS's choice
there is a sawtooth in the rows, up to 1.5x slower just above multiples of 128).
Up to 16 rows (decode) on sm_89+, where `kernels.skinny_linear.use_skinny` says so for the shape,
`kernels/skinny_linear.py` runs instead: one launch, weights converted in registers, activations
not quantised (bandwidth-bound there).
No host sync and shape-only allocations, so the op can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools

import torch

from kernels import quant_reference
from kernels.activation import silu_and_mul
from kernels.fp8_gemm import fp8_gemm, use_fp8_gemm
from kernels.fp8_gemm_tma import fp8_gemm_tma, pick_fp8_tma_config, tma_ready, use_fp8_gemm_tma
from kernels.int4_matmul import _num_sms
from kernels.fp8_rows import attached, quantize_rows_fp8, wanted
from kernels.skinny_linear import skinny_linear, use_skinny

FP8_MAX = quant_reference.FP8_MAX


@functools.cache
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def fp8_linear(
    x: torch.Tensor,  # [M, K] bf16 / fp16
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    weight_scale: torch.Tensor,  # fp32 scalar or [N]
    bias: torch.Tensor | None = None,  # [N]
    gated: bool = False,  # weight = [gate | up]: return silu(gate) * up [M, N / 2]
    fp8_rows: bool = False,  # gated: the SwiGLU also writes its FP8 rows, where they serve (kernels/fp8_rows.py)
) -> torch.Tensor:
    """y = x @ (weight * weight_scale).T + bias -> `[M, N]` in x's dtype."""
    N, K = weight.shape
    if (x.dtype in (torch.bfloat16, torch.float16) and weight_scale.dtype == torch.float32
            and weight.stride(1) == 1 and use_skinny(x.shape[0], N, K, weight.dtype, x.device)):
        return skinny_linear(x, weight, weight_scale, bias, gated=gated)
    y = scaled_mm_linear(x, weight, weight_scale, bias)
    return silu_and_mul(y, fp8_rows=fp8_rows and wanted(y)) if gated else y


def scaled_mm_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None,
    own_tiles: bool = True,
) -> torch.Tensor:
    """`fp8_linear` through activation quantisation + `torch._scaled_mm` at any M (the path above 16 rows),
    or `kernels/fp8_gemm.py` where `use_fp8_gemm` says it wins (`own_tiles` False: never; benches' baseline)."""
    N, K = weight.shape
    cap = _capability(x.device.index or 0)
    per_channel = weight_scale.numel() > 1
    fits = K % 16 == 0 and N % 16 == 0 and x.dtype in (torch.bfloat16, torch.float16)
    if not fits or cap < (8, 9) or (cap < (9, 0) and per_channel):
        return quant_reference.fp8_linear(x, weight, weight_scale, bias)
    x = x if x.stride(-1) == 1 else x.contiguous()
    if cap >= (9, 0):
        rows = attached(x)  # written by the RMSNorm / SwiGLU that produced x (kernels/fp8_rows.py)
        x_q, x_scale = rows[:2] if rows is not None else quantize_rows_fp8(x)  # [M, K], [M, 1]
        w_scale = weight_scale.float().reshape(1, -1)
        if not per_channel:
            w_scale = w_scale.expand(1, N).contiguous()  # [1, N]
        out_dtype = torch.bfloat16
        if own_tiles and cap[0] == 9 and use_fp8_gemm(x.shape[0], N, K) and weight.stride(1) == 1:
            # Hopper, 17-128 rows: the weight stream sets the time; our tiles beat `_scaled_mm` there
            return fp8_gemm(x_q, x_scale, weight, w_scale.reshape(N), bias, x.dtype)
        if own_tiles and cap[0] == 9 and use_fp8_gemm_tma(x.shape[0], N, K) and tma_ready(x_q, weight):
            # Hopper, 129-2048 rows: TMA tiles the wave model picks (never slower than `_scaled_mm` there, run 76)
            config = pick_fp8_tma_config(x.shape[0], N, K, _num_sms(x.device.index or 0))
            return fp8_gemm_tma(x_q, x_scale, weight, w_scale.reshape(N), bias, x.dtype, config)
    else:
        # sm_89: tensorwise scales only. One scale for the whole activation (no host sync).
        x_scale = (x.abs().amax().float() / FP8_MAX).clamp_min(1e-12)
        x_q = (x.float() / x_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        w_scale = weight_scale.float().reshape(())
        out_dtype = x.dtype
    out = torch._scaled_mm(x_q, weight.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=out_dtype)
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out.to(x.dtype)

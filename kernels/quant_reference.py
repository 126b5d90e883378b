"""Pure-torch quantized linear ops: the CPU path, the test oracle and the fallback.

Each function has exactly the signature of its public op in `kernels/__init__.py`. Layouts:
- int weights (GPTQ's native packing): `qweight` int32 `[K * bits // 32, N]`, row k of the
  `[K, N]` weight sits at bits `[bits * j, bits * j + bits)` of `qweight[k // (32 // bits), n]`
  with `j = k % (32 // bits)`; `scales`, `zeros` `[num_groups, N]` in x's dtype (float zero
  points); row k belongs to group `g_idx[k]` when given, else `k // group_size`;
  `w[k, n] = (q[k, n] - zeros[g, n]) * scales[g, n]` and `y = x @ w (+ bias)`.
- fp8 weights: `weight` float8_e4m3fn `[N, K]` (torch Linear orientation), `weight_scale` fp32
  scalar (per-tensor) or `[N]` (per-channel): `w = weight * weight_scale`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def unpack_int_weight(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 `[K * bits // 32, N]` -> the unsigned integer values `[K, N]` (int32)."""
    pack = 32 // bits
    shifts = torch.arange(pack, device=qweight.device, dtype=torch.int32) * bits  # [pack]
    q = (qweight[:, None, :] >> shifts[None, :, None]) & ((1 << bits) - 1)  # [K // pack, pack, N]
    return q.reshape(-1, qweight.shape[1])


def dequantize_int_weight(
    qweight: torch.Tensor,  # [K * bits // 32, N] int32
    scales: torch.Tensor,  # [num_groups, N]
    zeros: torch.Tensor,  # [num_groups, N]
    g_idx: torch.Tensor | None,  # [K] int32 or None
    bits: int,
    group_size: int,
) -> torch.Tensor:
    """The fp32 `[K, N]` weight that `quant_linear` multiplies by."""
    q = unpack_int_weight(qweight, bits)  # [K, N]
    num_rows = q.shape[0]
    if g_idx is None:
        groups = torch.arange(num_rows, device=q.device) // group_size
    else:
        groups = g_idx.long()
    return (q.float() - zeros.float()[groups]) * scales.float()[groups]


def quant_linear(
    x: torch.Tensor,  # [M, K] bf16 / fp16 / fp32
    qweight: torch.Tensor,  # [K * bits // 32, N] int32
    scales: torch.Tensor,  # [num_groups, N], x's dtype
    zeros: torch.Tensor,  # [num_groups, N], x's dtype
    g_idx: torch.Tensor | None,  # [K] int32 or None
    bits: int,
    group_size: int,
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:
    """y = x @ dequantize(qweight) + bias -> `[M, N]` in x's dtype (computed in fp32)."""
    w = dequantize_int_weight(qweight, scales, zeros, g_idx, bits, group_size)  # [K, N] fp32
    y = x.float() @ w
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def dequantize_fp8_weight(weight: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float8 `[N, K]` times its per-tensor or per-channel `[N]` scale -> `[N, K]` in `dtype`."""
    scale = weight_scale.float()
    if scale.numel() > 1:
        scale = scale.reshape(-1, 1)  # [N, 1]
    return (weight.float() * scale).to(dtype)


def fp8_linear(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    weight_scale: torch.Tensor,  # fp32 scalar or [N]
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:
    """y = x @ (weight * weight_scale).T + bias -> `[M, N]` in x's dtype (weights dequantised)."""
    return F.linear(x, dequantize_fp8_weight(weight, weight_scale, x.dtype), bias)


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel FP8: `[N, K]` float -> (float8_e4m3fn `[N, K]`, fp32 scale `[N]`).

    Each output row's scale maps its largest magnitude to the largest finite e4m3 value.
    """
    w = weight.float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp_min(1e-12)  # [N]
    q = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale

"""Pure-torch quantized linear ops: the CPU path, the test oracle and the fallback.

Each function has exactly the signature of its public op in `kernels/__init__.py`. Layouts:
- int weights (GPTQ's native packing): `qweight` int32 `[K * bits // 32, N]`, row k of the
  `[K, N]` weight sits at bits `[bits * j, bits * j + bits)` of `qweight[k // (32 // bits), n]`
  with `j = k % (32 // bits)`; `scales`, `zeros` `[num_groups, N]` in x's dtype (float zero
  points); row k belongs to group `g_idx[k]` when given, else `k // group_size`;
  `w[k, n] = (q[k, n] - zeros[g, n]) * scales[g, n]` and `y = x @ w (+ bias)`.
- int4 weights repacked for the fast kernels (`repack_int4`, once at load): `packed` int32
  `[K, N // 8]`, packed along N: nibble j (bits `[4 * j, 4 * j + 4)`) of `packed[k, c]` holds the
  code of column `8 * c + j`; groups are `k // group_size` (act-order rows are sorted at load);
  the same `w[k, n] = (q[k, n] - zeros[g, n]) * scales[g, n]`.
- int4 weights in k-chunks for the decode kernels (`repack_int4_kchunk`, once at load): `packed` int32
  `[K // 32, N, 4]`: the 32 rows `32 c .. 32 c + 31` of column n sit in the 4 words `packed[c, n, :]`
  (one 16-byte vector), nibble j of word w holding row `32 c + 4 j + w`; groups and dequantisation
  as above.
- fp8 weights: `weight` float8_e4m3fn `[N, K]` (torch Linear orientation), `weight_scale` fp32
  scalar (per-tensor) or `[N]` (per-channel): `w = weight * weight_scale`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import reference

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


def repack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """GPTQ-order int4 `[K // 8, N]` (packed along K) -> the fast kernels' `[K, N // 8]` (packed along N).

    One load-time pass: a tile of the new layout is a contiguous block of rows, and one int32 word
    holds 8 neighbouring columns of one row, so a kernel reads each byte once with wide loads and
    unpacks with constant shifts."""
    assert qweight.dtype == torch.int32 and qweight.dim() == 2
    n = qweight.shape[1]
    if n % 8:
        raise ValueError(f"int4 repack needs a multiple of 8 output columns, got {n}")
    out = torch.empty((qweight.shape[0] * 8, n // 8), dtype=torch.int32, device=qweight.device)
    shifts = torch.arange(0, 32, 4, device=qweight.device, dtype=torch.int64)  # [8]
    step = 512  # packed rows at a time: int64 temporaries of 4096 x N, not K x N
    for r in range(0, qweight.shape[0], step):
        q = unpack_int_weight(qweight[r: r + step], 4).to(torch.int64)  # [8 * rows, N]
        words = (q.reshape(q.shape[0], n // 8, 8) << shifts).sum(-1)  # disjoint fields: sum == or
        out[8 * r: 8 * r + q.shape[0]] = torch.where(words >= 2**31, words - 2**32, words)  # int32 bits
    return out


def unpack_int4_repacked(packed: torch.Tensor) -> torch.Tensor:
    """`[K, N // 8]` int32 (`repack_int4`'s layout) -> the codes `[K, N]` (int32)."""
    shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)  # [8]
    q = (packed[:, :, None] >> shifts) & 0xF  # [K, N // 8, 8]
    return q.reshape(packed.shape[0], -1)


def int4_linear(
    x: torch.Tensor,  # [M, K] bf16 / fp16 / fp32
    packed: torch.Tensor,  # [K, N // 8] int32 (repack_int4)
    scales: torch.Tensor,  # [num_groups, N], x's dtype
    zeros: torch.Tensor,  # [num_groups, N], x's dtype
    group_size: int,  # >= K means one group (per channel)
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:
    """y = x @ ((q - zeros[k // G]) * scales[k // G]) + bias -> `[M, N]` in x's dtype (fp32 math)."""
    return _codes_linear(x, unpack_int4_repacked(packed), scales, zeros, group_size, bias)


def _codes_linear(
    x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """x @ ((q - zeros[k // G]) * scales[k // G]) + bias in fp32 for codes q [K, N] -> x's dtype."""
    groups = torch.arange(q.shape[0], device=q.device) // group_size
    w = (q.float() - zeros.float()[groups]) * scales.float()[groups]
    y = x.float() @ w
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def repack_int4_kchunk(qweight: torch.Tensor) -> torch.Tensor:
    """GPTQ-order int4 `[K // 8, N]` -> the k-chunk layout `[K // 32, N, 4]` (K a multiple of 32).

    One load-time pass. A thread that owns one column reads 32 of its rows with one 16-byte load and
    sums over them on its own; nibble j of the 4 words holds 4 consecutive rows, so the activations
    it multiplies are one 4-element vector per nibble."""
    assert qweight.dtype == torch.int32 and qweight.dim() == 2
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    if k % 32:
        raise ValueError(f"the int4 k-chunk layout needs a multiple of 32 input rows, got {k}")
    out = torch.empty((k // 32, n, 4), dtype=torch.int32, device=qweight.device)
    step = 128  # chunks at a time: int64 temporaries of 4096 x N
    for c in range(0, k // 32, step):
        q = unpack_int_weight(qweight[4 * c: 4 * (c + step)], 4).to(torch.int64)  # [32 chunks, N]
        q = q.reshape(-1, 8, 4, n)  # [chunk, j, w, n]: row 32 c + 4 j + w
        words = (q << (4 * torch.arange(8, device=q.device)).reshape(1, 8, 1, 1)).sum(1)  # [chunk, w, n]
        words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
        out[c: c + words.shape[0]] = words.transpose(1, 2)
    return out


def unpack_int4_kchunk(packed: torch.Tensor) -> torch.Tensor:
    """`[K // 32, N, 4]` int32 (`repack_int4_kchunk`'s layout) -> the codes `[K, N]` (int32)."""
    chunks, n, _ = packed.shape
    shifts = (4 * torch.arange(8, device=packed.device, dtype=torch.int32)).reshape(1, 8, 1, 1)
    q = (packed.transpose(1, 2)[:, None] >> shifts) & 0xF  # [chunk, j, w, n]
    return q.reshape(chunks * 32, n)


def int4_kchunk_linear(
    x: torch.Tensor,  # [M, K] bf16 / fp16 / fp32
    packed: torch.Tensor,  # [K // 32, N, 4] int32 (repack_int4_kchunk)
    scales: torch.Tensor,  # [num_groups, N], x's dtype
    zeros: torch.Tensor,  # [num_groups, N], x's dtype
    group_size: int,  # >= K means one group (per channel)
    bias: torch.Tensor | None = None,  # [N]
    gated: bool = False,  # N = [gate | up]: return silu(gate) * up `[M, N / 2]`
) -> torch.Tensor:
    """y = x @ ((q - zeros[k // G]) * scales[k // G]) + bias -> `[M, N]` in x's dtype (fp32 math)."""
    return _gated(_codes_linear(x, unpack_int4_kchunk(packed), scales, zeros, group_size, bias), gated)


def _gated(y: torch.Tensor, gated: bool) -> torch.Tensor:
    # the ops' `gated` option: y = [gate | up] -> silu(gate) * up, rounded as `reference.silu_and_mul`
    return reference.silu_and_mul(y) if gated else y


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
    gated: bool = False,  # N = [gate | up]: return silu(gate) * up `[M, N / 2]`
    fp8_rows: bool = False,  # the Triton path's FP8 rows for the next linear (kernels/fp8_rows.py); none here
) -> torch.Tensor:
    """y = x @ (weight * weight_scale).T + bias -> `[M, N]` in x's dtype (weights dequantised)."""
    return _gated(F.linear(x, dequantize_fp8_weight(weight, weight_scale, x.dtype), bias), gated)


def fp8_scaled_matmul(
    x_q: torch.Tensor,  # [M, K] float8_e4m3fn
    x_scale: torch.Tensor,  # [M, 1] or [M] fp32
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    w_scale: torch.Tensor,  # [N] fp32
    bias: torch.Tensor | None = None,  # [N]
    out_dtype: torch.dtype = torch.bfloat16,
    config: object = None,  # the Triton kernel's tiling (unused here)
) -> torch.Tensor:
    """`kernels/fp8_gemm.py`'s op: (x_q * x_scale) @ (weight * w_scale)^T + bias in fp32, in out_dtype."""
    x = x_q.float() * x_scale.float().reshape(-1, 1)
    y = x @ (weight.float() * w_scale.float().reshape(-1, 1)).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def skinny_linear(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K] bf16 / fp16 / float8_e4m3fn
    scale: torch.Tensor | None = None,  # None (float weight) or fp32 scalar / [N] (FP8)
    bias: torch.Tensor | None = None,  # [N]
    gated: bool = False,  # N = [gate | up]: return silu(gate) * up `[M, N / 2]`
) -> torch.Tensor:
    """`kernels/skinny_linear.py`'s op: y = x @ (weight * scale).T + bias in fp32, returned in x's dtype."""
    w = weight.float()
    if scale is not None:
        w = w * (scale.float().reshape(-1, 1) if scale.numel() > 1 else scale.float().reshape(()))
    y = x.float() @ w.t()
    if bias is not None:
        y = y + bias.float()
    return _gated(y.to(x.dtype), gated)


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel FP8: `[N, K]` float -> (float8_e4m3fn `[N, K]`, fp32 scale `[N]`).

    Each output row's scale maps its largest magnitude to the largest finite e4m3 value.
    """
    w = weight.float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp_min(1e-12)  # [N]
    q = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale

"""Triton RMSNorm, optionally fused with the residual add that precedes it in each layer.

In: `x[num_tokens, hidden]`, `weight[hidden]` (and `residual[num_tokens, hidden]`). Out: the
normed rows (and the new residual `x + residual`), one program per row, fp32 statistics.
Rounding follows the reference: the sum is rounded to the input dtype before it is normed.
`unit_offset` (Gemma): the weight is stored as w - 1, the row is scaled by 1 + w in float32 and
cast once at the end (Llama rounds the normed row before the weight multiplies it).
`fp8_rows=True`: the normed rows' per-token FP8 copy too, attached to the result for the FP8 linear
after it (`kernels/fp8_rows.py`; `kernels.rms_norm` asks for it where `fp8_rows.wanted`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import fp8_rows as rows_fp8
from kernels.fp8_rows import store_fp8_row
from kernels.pdl import launch_options, release_dependents, wait_upstream


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    q_ptr,  # [num_tokens, N] float8e4nv: the normed rows' FP8 copy (FP8_ROWS)
    scale_ptr,  # [num_tokens] fp32: its per-row scales (FP8_ROWS)
    stride_x,
    stride_r,
    eps,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    UNIT_OFFSET: tl.constexpr,
    FP8_ROWS: tl.constexpr,
    PDL: tl.constexpr,  # launched with programmatic dependent launch (kernels/pdl.py)
):
    release_dependents(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0)  # a weight: read before the previous kernel ends
    wait_upstream(PDL)
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * N + offs, s, mask=mask)
        x = s.to(tl.float32)
    y = normed_row(x, w, out_ptr.dtype.element_ty, eps, N, UNIT_OFFSET)
    tl.store(out_ptr + row * N + offs, y, mask=mask)
    if FP8_ROWS:
        store_fp8_row(q_ptr + row * N, scale_ptr, row, y, offs, mask)


@triton.jit
def normed_row(x, w, DTYPE: tl.constexpr, eps, N: tl.constexpr, UNIT_OFFSET: tl.constexpr):
    """One row's RMSNorm (x: fp32 [BLOCK], zeros past N; w: the weight row) in DTYPE, rounded as
    `reference.rms_norm` rounds."""
    var = tl.sum(x * x, 0) / N
    rstd = 1.0 / tl.sqrt(var + eps)
    w = w.to(tl.float32)
    if UNIT_OFFSET:
        y = x * rstd * (1.0 + w)
    else:
        y = (x * rstd).to(DTYPE).to(tl.float32) * w
    return y.to(DTYPE)


def rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [num_tokens, hidden]
    unit_offset: bool = False,  # Gemma: scale by 1 + weight in float32, cast once
    fp8_rows: bool = False,  # also the normed rows' FP8 copy, attached to the result (kernels/fp8_rows.py)
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm; with `residual`, first x = x + residual and return (normed, x).

    Shapes: x [T, N] with unit stride over N (row stride free); weight [N] of x's dtype;
    residual [T, N]. Outputs are new contiguous tensors; inputs are not modified.
    """
    assert x.dim() == 2 and x.stride(1) == 1, x.stride()
    num_tokens, hidden = x.shape
    assert weight.shape == (hidden,) and weight.is_contiguous()
    assert weight.dtype == x.dtype, (weight.dtype, x.dtype)
    out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    residual_out = out
    if residual is not None:
        assert residual.shape == x.shape and residual.stride(1) == 1 and residual.dtype == x.dtype
        residual_out = torch.empty_like(out)
    fp8 = rows_fp8.empty_rows(num_tokens, hidden, x.device) if fp8_rows else None
    if num_tokens > 0:
        block = triton.next_power_of_2(hidden)
        pdl = launch_options(x)
        _rms_norm_kernel[(num_tokens,)](
            x,
            residual if residual is not None else x,
            weight,
            out,
            residual_out,
            fp8.q if fp8 is not None else out,
            fp8.scale if fp8 is not None else out,
            x.stride(0),
            residual.stride(0) if residual is not None else 0,
            eps,
            N=hidden,
            BLOCK=block,
            HAS_RESIDUAL=residual is not None,
            UNIT_OFFSET=unit_offset,
            FP8_ROWS=fp8 is not None,
            num_warps=min(16, max(1, block // 256)),
            **pdl,
        )
    if fp8 is not None:
        rows_fp8.attach(out, fp8)
    if residual is not None:
        return out, residual_out
    return out

"""Triton SwiGLU activation: `x = [gate | up]` along the last dim -> `silu(gate) * up`.

In: `x[..., 2 * d]` (rows with unit inner stride). Out: a new contiguous `[..., d]`.
Rounding follows the reference: silu is rounded to the input dtype before the multiply.
`fp8_rows=True` (rows `[M, 2 * d]`, d up to ROW_BLOCK_MAX): one program a row, the row held whole, writes
the result and its per-token FP8 copy, attached for the FP8 down projection after it (`kernels/fp8_rows.py`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import fp8_rows as rows_fp8
from kernels.fp8_rows import ROW_BLOCK_MAX, row_warps, store_fp8_row
from kernels.pdl import launch_options, release_dependents, wait_upstream


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, D: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    release_dependents(PDL)
    wait_upstream(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < D
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + D + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * D + offs, swiglu(gate, up, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def swiglu(gate, up, DTYPE: tl.constexpr):
    """silu(gate) * up in DTYPE from fp32 gate / up, silu rounded to DTYPE first (the reference's rounding)."""
    act = (gate / (1.0 + tl.exp(-gate))).to(DTYPE).to(tl.float32)
    return (act * up).to(DTYPE)


@triton.jit
def _silu_and_mul_rows_kernel(x_ptr, out_ptr, q_ptr, scale_ptr, stride_x, D: tl.constexpr, BLOCK: tl.constexpr,
                              PDL: tl.constexpr):
    """One row a program, the whole row at once (BLOCK >= D): the activation, stored, then its FP8 copy
    and scale (`kernels/fp8_rows.store_fp8_row`)."""
    release_dependents(PDL)
    wait_upstream(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + D + offs, mask=mask, other=0.0).to(tl.float32)
    y = swiglu(gate, up, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * D + offs, y, mask=mask)
    store_fp8_row(q_ptr + row * D, scale_ptr, row, y, offs, mask)


def silu_and_mul(x: torch.Tensor, fp8_rows: bool = False) -> torch.Tensor:
    """SwiGLU activation: x = [gate | up] along the last dim -> silu(gate) * up.

    Shapes: x [..., 2d] with unit stride on the last dim; returns [..., d] contiguous. `fp8_rows`
    (x [M, 2d]): the result's per-token FP8 copy is written and attached too (`kernels/fp8_rows.py`).
    """
    assert x.stride(-1) == 1 and x.shape[-1] % 2 == 0, (x.shape, x.stride())
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])  # a view when rows are evenly strided
    assert x2.stride(1) == 1
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    num_rows = x2.shape[0]
    if num_rows == 0 or d == 0:
        return out
    block = min(1024, triton.next_power_of_2(d))
    pdl = launch_options(x)
    if fp8_rows and triton.next_power_of_2(d) <= ROW_BLOCK_MAX:  # wider rows: the plain kernel
        assert x.dim() == 2, x.shape
        fp8 = rows_fp8.empty_rows(num_rows, d, x.device)
        row_block = triton.next_power_of_2(d)
        _silu_and_mul_rows_kernel[(num_rows,)](x2, out, fp8.q, fp8.scale, x2.stride(0), D=d, BLOCK=row_block,
                                               num_warps=row_warps(row_block), **pdl)
        rows_fp8.attach(out, fp8)
        return out
    _silu_and_mul_kernel[(num_rows, triton.cdiv(d, block))](x2, out, x2.stride(0), D=d, BLOCK=block, num_warps=4,
                                                           **pdl)
    return out

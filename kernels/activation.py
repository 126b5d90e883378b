"""Triton SwiGLU activation: `x = [gate | up]` along the last dim -> `silu(gate) * up`.

In: `x[..., 2 * d]` (rows with unit inner stride). Out: a new contiguous `[..., d]`.
Rounding follows the reference: silu is rounded to the input dtype before the multiply.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

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
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * D + offs, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU activation: x = [gate | up] along the last dim -> silu(gate) * up.

    Shapes: x [..., 2d] with unit stride on the last dim; returns [..., d] contiguous.
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
    _silu_and_mul_kernel[(num_rows, triton.cdiv(d, block))](x2, out, x2.stride(0), D=d, BLOCK=block, num_warps=4,
                                                           **pdl)
    return out

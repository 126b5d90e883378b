"""Per-token FP8 rows of an activation, written by the op that produced it.

Why: above 16 rows an FP8 linear multiplies FP8 activations with one scale per row
(`kernels/fp8_matmul.scaled_mm_linear`), and quantising x takes a launch of its own before each linear.
Writing the rows from the op before it takes 3-5 % off a layer's FP8 linears at 17-2048 rows
(bench/RESULTS.md run 59, H200, `bench/fp8_rows.py`: 64 rows 88.4 -> 85.2 us). The RMSNorm before
qkv / gate_up and the SwiGLU before down already hold each row: asked to (`fp8_rows=True`), they
also write the row's e4m3 values and its scale (`Fp8Rows`) and attach them to the bf16 result
(`attach`); the linear then takes them (`attached`) instead of quantising again. The values are
bitwise what `quantize_rows_fp8` gives for the bf16 result (`store_fp8_row` is its arithmetic), so
the tokens do not change.

The rows travel on the result tensor object itself: views and copies of it carry none (the linear then
quantises as before). A result changed in place before the linear reads it would leave them stale, and
inference tensors keep no version counter to tell: the ops that write rows are those whose result goes
to the linear unchanged (`serving/executor/quant/fp8.link_fp8_rows` picks them from the run order).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.quant_reference import FP8_MAX

MIN_ROWS = 17  # up to 16 rows the GEMVs read bf16 (`use_skinny`): no FP8 rows are written for them
ROW_BLOCK_MAX = 32768  # the widest row a program holds whole (64 fp32 values a thread at 16 warps)
_ATTR = "_open_lmi_fp8_rows"


def row_warps(block: int) -> int:
    """Warps for a program holding a row of `block` (a power of two) values: 4 to 16, ~32-64 values a thread."""
    return min(16, max(4, block // 1024))


@functools.cache
def _hopper_or_later(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


class Fp8Rows(NamedTuple):
    """The FP8 copy of an activation `x [M, K]` that an FP8 linear reads: what it travels as from the
    op that wrote x to that linear (see the module docstring)."""

    q: torch.Tensor  # [M, K] float8_e4m3fn: x / scale, clamped to +-448
    scale: torch.Tensor  # [M, 1] fp32: max |x| of the row / 448 (1e-12 / 448 for an all-zero row)


def wanted(x: torch.Tensor) -> bool:
    """Whether an op writing the rows of `x` (or rows shaped like it) should also write `Fp8Rows`:
    a CUDA tensor of Hopper or later (rowwise scales), bf16 / fp16, more than 16 rows."""
    return (x.is_cuda and x.dim() == 2 and x.shape[0] >= MIN_ROWS and x.dtype in (torch.bfloat16, torch.float16)
            and _hopper_or_later(x.device.index if x.device.index is not None else torch.cuda.current_device()))


def empty_rows(rows: int, cols: int, device: torch.device) -> Fp8Rows:
    """Uninitialised `Fp8Rows` for `rows x cols`, for a kernel to fill."""
    return Fp8Rows(torch.empty((rows, cols), device=device, dtype=torch.float8_e4m3fn),
                   torch.empty((rows, 1), device=device, dtype=torch.float32))


def attach(x: torch.Tensor, rows: Fp8Rows) -> None:
    """Record `rows` as the FP8 copy of `x`."""
    assert rows.q.shape == x.shape and rows.scale.shape == (x.shape[0], 1), (rows.q.shape, x.shape)
    setattr(x, _ATTR, rows)


def attached(x: torch.Tensor) -> Fp8Rows | None:
    """The `Fp8Rows` attached to `x` (not to a view or copy of it), or None."""
    return getattr(x, _ATTR, None)


@triton.jit
def store_fp8_row(q_row_ptr, scale_ptr, row, y, offs, mask):
    """Quantise one row `y` (its values as stored, any float dtype; `mask` its columns) to e4m3 at
    q_row_ptr + offs, its scale at scale_ptr + row: `_quantize_rows_kernel`'s arithmetic."""
    y = tl.where(mask, y.to(tl.float32), 0.0)
    scale = tl.maximum(tl.max(tl.abs(y), axis=0), 1e-12) / 448.0
    tl.store(scale_ptr + row, scale)
    q = tl.minimum(tl.maximum(y * (1.0 / scale), -448.0), 448.0)
    tl.store(q_row_ptr + offs, q.to(q_row_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _quantize_rows_kernel(
    x_ptr,  # [M, K]
    q_ptr,  # [M, K] float8e4nv
    scale_ptr,  # [M] fp32
    K,
    stride_xm,
    stride_qm,
    BLOCK: tl.constexpr,
    WHOLE: tl.constexpr,  # BLOCK >= K: the row is read once and held
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    if WHOLE:
        offs = tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < K, other=0.0)
        store_fp8_row(q_ptr + row * stride_qm, scale_ptr, row, x, offs, offs < K)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            offs = k0 + tl.arange(0, BLOCK)
            x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.max(amax, axis=0), 1e-12) / 448.0
        tl.store(scale_ptr + row, scale)
        inv = 1.0 / scale
        for k0 in range(0, K, BLOCK):
            offs = k0 + tl.arange(0, BLOCK)
            x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
            q = tl.minimum(tl.maximum(x * inv, -448.0), 448.0)
            tl.store(q_ptr + row * stride_qm + offs, q.to(q_ptr.dtype.element_ty), mask=offs < K)


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token FP8 in a launch of its own: `[M, K]` -> (float8_e4m3fn `[M, K]`, fp32 scale `[M, 1]`).
    One program a row: rows up to ROW_BLOCK_MAX wide read once, wider ones in two passes of 4,096."""
    M, K = x.shape
    assert x.stride(1) == 1
    q, scale = empty_rows(M, K, x.device)[:2]
    if M:
        whole = triton.next_power_of_2(K) <= ROW_BLOCK_MAX
        block = triton.next_power_of_2(K) if whole else 4096
        _quantize_rows_kernel[(M,)](x, q, scale, K, x.stride(0), q.stride(0), BLOCK=block, WHOLE=whole,
                                    num_warps=row_warps(block))
    return q, scale


assert FP8_MAX == 448.0  # the kernels above spell it out

"""Device helpers shared by the quantized-linear kernels: code-to-float and the split-K epilogue.

`unit_float` turns one packed field into the exact fp32 1 + q / 2**bits with integer ops only;
`finish_tile` writes an fp32 accumulator tile to the output, or meets the other split-K programs
of its tile through an fp32 workspace and a self-resetting counter (the last one sums in order).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def unit_float(words, J: tl.constexpr, BITS: tl.constexpr):
    # Field J of each packed word as the fp32 1 + q / 2**BITS (exact): the field is moved to the
    # top of the mantissa and the exponent of 1.0 is or-ed in. One shift + one and/or per weight,
    # no int-to-float conversion (those issue at 1/8 the FMA rate).
    SHIFT: tl.constexpr = 23 - BITS - BITS * J
    if SHIFT >= 0:
        moved = words << SHIFT
    else:
        moved = words >> (-SHIFT)
    return ((moved & (((1 << BITS) - 1) << (23 - BITS))) | 0x3F800000).to(tl.float32, bitcast=True)


@triton.jit
def finish_tile(
    acc, offs_m, offs_n, mask_m, mask_n, split, split_k, tile, M, N, bias_ptr, out_ptr, partial_ptr,
    counter_ptr, stride_om, HAS_BIAS: tl.constexpr, USE_SPLIT: tl.constexpr,
):
    # acc [BM, BN] fp32 -> out (+ bias). With split-K: store this split's partial; the last split
    # of the tile (per-tile counter) sums all partials in split order and resets the counter.
    out_offs = offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    out_mask = mask_m[:, None] & mask_n[None, :]
    if USE_SPLIT:
        part_offs = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
        tl.store(partial_ptr + split.to(tl.int64) * M * N + part_offs, acc, mask=out_mask)
        # NOTE: the barrier orders every thread's partial store before the release below.
        tl.debug_barrier()
        arrived = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel")
        if arrived == split_k - 1:
            total = tl.zeros_like(acc)
            for s_i in range(split_k):
                total += tl.load(partial_ptr + s_i * M * N + part_offs, mask=out_mask, other=0.0,
                                 cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptr + out_offs, total.to(out_ptr.dtype.element_ty), mask=out_mask)
            tl.store(counter_ptr + tile, 0)  # ready for the next launch
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)

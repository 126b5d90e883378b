"""Compile `kernels/int4_kchunk_mma.py` and `kernels/int4_kchunk_wgmma.py` (Gluon) for sm_90 without a GPU.

CI has no GPU, so `tests/kernels/test_int4_kchunk.py` runs this in a subprocess (no TRITON_INTERPRET)
over every variant `pick_kchunk_config(..., mma=True)` returns at 1-64 rows on the 8B shapes and their
TP=2/4 slices (gate|up also gated), in bf16 and fp16, launched with PDL as the decode step launches it: each must compile
without spilling, and keep `kernels/pdl.py`'s contract (release before wait, no store before the wait,
its first words requested before the wait); then every `int4_kchunk_wgmma` variant the picker returns at
9-128 rows (`wgmma=True`), which must compile without spilling. Prints `ok <variant> regs=<n> loads_before_wait=<n>` or
`FAIL <variant> <error>` per variant; exit status 1 if any failed.
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.dirname(os.path.abspath(__file__))]

from pdl_sm90_compile import check_ptx  # noqa: E402
from sm90_compile import compile_variant, report, resources  # noqa: E402

from kernels.int4_kchunk import GEMM_MMA, GEMM_WGMMA, pick_kchunk_config  # noqa: E402
from kernels.int4_kchunk_mma import _kchunk_mma_kernel  # noqa: E402
from kernels.int4_kchunk_wgmma import _kchunk_wgmma_kernel, reads_sub_dot_order  # noqa: E402

_DIVISIBLE = ("x_ptr", "w_ptr", "scales_ptr", "zeros_ptr", "bias_ptr", "out_ptr", "partial_ptr", "counter_ptr",
              "N", "K", "group_size", "stride_xm", "stride_wc", "stride_sg", "stride_om")


SHAPES = [(n // tp, k) for n, k in ((6144, 4096), (28672, 4096)) for tp in (1, 2, 4)]
SHAPES += [(n, k // tp) for n, k in ((4096, 4096), (4096, 14336)) for tp in (1, 2, 4)]
GATE_UP = {28672 // tp for tp in (1, 2, 4)}


def wgmma_variants() -> list[tuple]:
    """(block_m, block_n, warps, stages, split) of every GEMM_WGMMA tiling picked at 9-128 rows (the shapes above)."""
    out = []
    for m in range(9, 129):
        for n, k in SHAPES:
            cfg = pick_kchunk_config(m, n, k, 128, 132, mma=True, wgmma=True)
            if cfg.gemm == GEMM_WGMMA:
                out.append((cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages, cfg.split_k > 1))
    return list(dict.fromkeys(out))


def _compiled(fn, const: dict, dtype: str, warps: int) -> tuple:
    """(kernel, registers) of a Gluon int4 kernel for sm_90, x / scales / out in `dtype`; raises on spills."""
    types = {"x_ptr": dtype, "w_ptr": "*i32", "scales_ptr": dtype, "zeros_ptr": dtype, "bias_ptr": dtype,
             "out_ptr": dtype, "partial_ptr": "*fp32", "counter_ptr": "*i32"}
    kernel = compile_variant(fn, const, types, _DIVISIBLE, warps, 1, gluon=True)
    regs, stack = resources(kernel)
    if stack:
        raise RuntimeError(f"{stack} bytes of spills (regs {regs})")
    return kernel, regs


def _one_wgmma(block_m: int, block_n: int, warps: int, stages: int, split: bool, dtype: str) -> str:
    const = dict(HAS_BIAS=True, USE_SPLIT=split, GROUP_TILES=1, BLOCK_N=block_n, BLOCK_M=block_m, WARPS=warps,
                 STAGES=stages, SUB_DOT_ORDER=reads_sub_dot_order(block_m))
    kernel, regs = _compiled(_kchunk_wgmma_kernel, const, dtype, warps)
    return f"regs={regs} shared={kernel.metadata.shared}"


def variants() -> list[tuple]:
    """(block_n, warps, XN, split, gated) of every GEMM_MMA tiling picked at 1-64 rows (8B shapes, TP 1/2/4
    slices; the gate|up ones also as the SwiGLU MLP calls them, gated)."""
    out = []
    for m in range(1, 65):
        for n, k in SHAPES:
            for gated in (False, True) if n in GATE_UP else (False,):
                cfg = pick_kchunk_config(m, n, k, 128, 132, mma=True, gated=gated)
                if cfg.gemm == GEMM_MMA:
                    out.append((cfg.block_n, cfg.num_warps, max(8, 1 << (m - 1).bit_length()), cfg.split_k > 1, gated))
    return list(dict.fromkeys(out))


def _one(block_n: int, warps: int, xn: int, split: bool, gated: bool, dtype: str) -> str:
    const = dict(HAS_BIAS=True, USE_SPLIT=split, GROUP_TILES=1, BLOCK_N=block_n, XN=xn, WARPS=warps, PDL=True,
                 GATED=gated)
    kernel, regs = _compiled(_kchunk_mma_kernel, const, dtype, warps)
    return f"regs={regs} loads_before_wait={check_ptx(kernel.asm['ptx'], True)}"


def main() -> int:
    failed = 0
    for block_n, warps, xn, split, gated in variants():
        for dtype in ("*bf16", "*fp16"):
            label = f"block_n={block_n} warps={warps} XN={xn} split={split} gated={gated} {dtype[1:]}"
            failed += not report(label, lambda: _one(block_n, warps, xn, split, gated, dtype))
    for block_m, block_n, warps, stages, split in wgmma_variants():
        for dtype in ("*bf16", "*fp16"):
            label = f"wgmma block_m={block_m} block_n={block_n} warps={warps} stages={stages} split={split} {dtype[1:]}"
            failed += not report(label, lambda: _one_wgmma(block_m, block_n, warps, stages, split, dtype))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

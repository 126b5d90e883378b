"""Compile every tiling `kernels/fp8_gemm_tma.py`'s picker can return for sm_90, without a GPU.

`tests/kernels/test_fp8_gemm_tma.py` runs this in a subprocess (no TRITON_INTERPRET): each candidate, with and
without bias, bf16 and fp16 out, must compile to TMA copies and `wgmma` without spilling. Prints `ok <tiling>
regs=<n> smem=<bytes>` or `FAIL <tiling> <error>` per variant; exit status 1 if any failed.
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.dirname(os.path.abspath(__file__))]

from sm90_compile import compile_variant, report, resources  # noqa: E402

from kernels.fp8_gemm_tma import _TILINGS, _fp8_gemm_tma_kernel  # noqa: E402

_DIVISIBLE = ("a_scale_ptr", "b_scale_ptr", "bias_ptr", "out_ptr", "N", "K", "stride_om")


def _one(config, has_bias: bool, dtype: str) -> str:
    c = config
    types = {"a_desc": f"tensordesc<fp8e4nv[{c.block_m}, {c.block_k}]>",
             "b_desc": f"tensordesc<fp8e4nv[{c.block_n}, {c.block_k}]>", "a_scale_ptr": "*fp32",
             "b_scale_ptr": "*fp32", "bias_ptr": dtype, "out_ptr": dtype}
    const = dict(HAS_BIAS=has_bias, BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, FLATTEN=c.flatten)
    kernel = compile_variant(_fp8_gemm_tma_kernel, const, types, _DIVISIBLE, c.num_warps, c.num_stages)
    regs, stack = resources(kernel)
    ptx = kernel.asm["ptx"]
    if stack:
        raise RuntimeError(f"{stack} bytes of spills (regs {regs})")
    if "cp.async.bulk.tensor" not in ptx or "wgmma" not in ptx:
        raise RuntimeError("no TMA copy or no wgmma in the PTX")
    return f"regs={regs} smem={kernel.metadata.shared}"


def main() -> int:
    ok = True
    for tiling in _TILINGS:
        for has_bias in (False, True):
            for dtype in ("*bf16", "*fp16"):
                label = f"{tuple(tiling.config)} bias={has_bias} out={dtype[1:]}"
                ok &= report(label, lambda t=tiling, b=has_bias, d=dtype: _one(t.config, b, d))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

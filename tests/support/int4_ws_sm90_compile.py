"""Compile `kernels/int4_kchunk_ws.py`'s variants for sm_90, without a GPU (Gluon has no interpreter).

`tests/kernels/test_int4_kchunk_ws.py` runs this in a subprocess: 64-, 128- and 256-row programs, bf16 and fp16, with and
without bias, must compile to a warp-specialised kernel (register budgets moved with `setmaxnreg`) whose loader
copies x by TMA, whose MMA partition runs `wgmma`, and whose dequantising warps store the weight tile in 16-byte
pieces (no scalar `st.shared.b16`), without spilling. Prints `ok <variant> regs=<n> smem=<bytes>` or `FAIL <variant>
<error>` per variant; exit status 1 if any failed.
"""

from __future__ import annotations

import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.dirname(os.path.abspath(__file__))]

from sm90_compile import compile_variant, report, resources  # noqa: E402

from kernels.int4_kchunk_ws import ROW_SMEM, SMEM, WORDS_SMEM, _kchunk_ws_kernel, buffers, mma_warps, registers  # noqa: E402

_DIVISIBLE = ("bias_ptr", "out_ptr", "partial_ptr", "counter_ptr", "N", "K", "stride_om")


def _one(block_m: int, dtype: str, has_bias: bool, dq_warps: int, split: bool, parts: int) -> str:
    maxnreg, dq_regs = registers(dq_warps, parts, block_m)
    row = f"tensordesc<{dtype}[1, 128],{ROW_SMEM!r}>"
    types = {"x_desc": f"tensordesc<{dtype}[{block_m}, 64],{SMEM!r}>", "w_desc": f"tensordesc<i32[2, 128, 4],{WORDS_SMEM!r}>",
             "s_desc": row, "z_desc": row, "bias_ptr": f"*{dtype}", "out_ptr": f"*{dtype}", "partial_ptr": "*fp32",
             "counter_ptr": "*i32"}
    wbuf, raw = buffers(parts)  # the picker's
    const = dict(GROUP_TILES=2, HAS_BIAS=has_bias, BLOCK_M=block_m, STAGES=4, RAW=raw, WBUF=wbuf,
                 DQ_WARPS=dq_warps, DQ_PARTS=parts, USE_SPLIT=split, DQ_REGS=dq_regs, num_warps=mma_warps(block_m))
    kernel = compile_variant(_kchunk_ws_kernel, const, types, _DIVISIBLE, mma_warps(block_m), 1, gluon=True,
                             maxnreg=maxnreg)
    regs, stack = resources(kernel)
    ptx = kernel.asm["ptx"]
    if stack:
        raise RuntimeError(f"{stack} bytes of spills (regs {regs})")
    for needed in ("setmaxnreg", "cp.async.bulk.tensor", "wgmma.mma_async", "st.shared.v4"):
        if needed not in ptx:
            raise RuntimeError(f"no {needed} in the PTX")
    if re.search(r"st\.shared\.b16", ptx):
        raise RuntimeError("the weight tile is not stored in 16-byte pieces")
    return f"regs={regs} smem={kernel.metadata.shared}"


def main() -> int:
    ok = True
    for block_m in (64, 128, 256):
        for dtype in ("bf16", "fp16"):
            # 256-row programs (two MMA warp groups) leave registers for one dequantising partition
            variants = (((False, 4, False, 1), (True, 4, True, 1), (False, 8, True, 1)) if block_m == 256 else
                        ((False, 4, False, 2), (True, 4, True, 3), (False, 8, True, 1)))
            for has_bias, dq_warps, split, parts in variants:
                label = f"block_m={block_m} {dtype} bias={has_bias} dq_warps={dq_warps} split={split} parts={parts}"
                ok &= report(label, lambda b=block_m, d=dtype, h=has_bias, q=dq_warps, s=split, p=parts:
                             _one(b, d, h, q, s, p))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

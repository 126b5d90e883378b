"""Compile the k-chunk int4 tensor-core kernels for sm_90 without a GPU (Triton's bundled ptxas).

The CPU interpreter accepts programs the compiler rejects, so `tests/kernels/test_int4_kchunk_gemm.py`
runs this in a subprocess (no TRITON_INTERPRET) over every tensor-core tiling `pick_kchunk_config`
can return above 16 rows and every `bench/int4_sweep.py --large` candidate. Prints one line per
variant: `ok <config> regs=<n> stack=<spill bytes> smem=<bytes> wgmma=<bool>` or `FAIL <config> <error>`
(a compile error, or more shared memory than an sm_90 block has); exit status 1 if any failed.
NOTE: it compiles with the Triton installed here; the H100 box runs Triton 3.6, which rejected
tilings that 3.7 compiles (x @ W with the weights as the B operand), so run it there too
(`PYTHONPATH=<triton 3.6 install>:. python tests/support/kchunk_sm90_compile.py`).
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from sm90_compile import compile_variant, report, resources  # noqa: E402

from kernels.int4_kchunk import GEMM_NIBBLES, KChunkConfig, _kchunk_dot_kernel, pick_kchunk_config  # noqa: E402
from kernels.int4_kchunk_gemm import _kchunk_gemm_kernel  # noqa: E402

H100_SMEM = 232448  # bytes of shared memory a block may use on sm_90
_SIG = {"x_ptr": "*bf16", "w_ptr": "*i32", "scales_ptr": "*bf16", "zeros_ptr": "*bf16", "bias_ptr": "*bf16",
        "out_ptr": "*bf16", "partial_ptr": "*fp32", "counter_ptr": "*i32"}
_DIVISIBLE = ("x_ptr", "w_ptr", "scales_ptr", "zeros_ptr", "bias_ptr", "out_ptr", "partial_ptr", "counter_ptr",
              "N", "K", "group_size", "stride_xm", "stride_wc", "stride_sg", "stride_om")


def compile_sm90(cfg: KChunkConfig, split: bool) -> tuple[int, int, int, bool]:
    """Compile one tensor-core variant as the launcher specialises it at the 8B shapes (bf16 x, bias);
    returns (registers a thread, spill stack bytes, shared memory bytes, whether it uses wgmma)."""
    const = dict(HAS_BIAS=True, USE_SPLIT=split, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                 GROUP_M=cfg.group_m, DOT_PRECISION="tf32", ASM=True)
    if cfg.gemm:
        const["NIBBLES"] = cfg.gemm == GEMM_NIBBLES
    kernel = compile_variant(_kchunk_gemm_kernel if cfg.gemm else _kchunk_dot_kernel, const, _SIG, _DIVISIBLE,
                             cfg.num_warps, cfg.num_stages)
    regs, stack = resources(kernel)
    return regs, stack, kernel.metadata.shared, "wgmma" in kernel.asm["ptx"]


def _checked(cfg: KChunkConfig, split: bool) -> str:
    regs, stack, smem, wgmma = compile_sm90(cfg, split)
    if smem > H100_SMEM:  # Triton raises OutOfResources only at launch
        raise RuntimeError(f"shared memory {smem} > the H100's {H100_SMEM} bytes a block")
    return f"regs={regs} stack={stack} smem={smem} wgmma={wgmma}"


def variants() -> list[KChunkConfig]:
    """Every tensor-core tiling the picker returns above 16 rows at the 8B shapes, and the sweep's candidates."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from int4_sweep import large_configs

    out = []
    for m in (17, 64, 65, 128, 256, 257, 512, 2048, 4096):
        for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)):
            cfg = pick_kchunk_config(m, n, k, 128, 132)
            if cfg.block_m >= 16:
                out.append(cfg)
    for m in (64, 128, 256, 512, 2048):
        out.extend(large_configs(m))
    return list(dict.fromkeys(c._replace(split_k=1) for c in out))


def main() -> int:
    failed = 0
    only = sys.argv[1:]  # optional: indices of variants() to compile
    for i, cfg in enumerate(variants()):
        if only and str(i) not in only:
            continue
        for split in (False, True):
            failed += not report(f"{i} {tuple(cfg)} split={split}", lambda: _checked(cfg, split))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

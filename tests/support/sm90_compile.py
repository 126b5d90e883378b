"""Compile the skinny kernels (`kernels/skinny_linear.py`, `kernels/fp8_gemv.py`) for sm_90 without a GPU.

The CPU interpreter accepts programs the compiler rejects (G1 on the H100: a helper with two
returns of different shapes), so `tests/kernels/test_skinny_linear.py` runs this in a subprocess
(no TRITON_INTERPRET) over every tiling the picker can return. Prints one line per variant:
`ok <config> regs=<n>` or `FAIL <config> <error>`; exit status 1 if any failed.
"""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kernels.fp8_gemv import GemvConfig, _fp8_gemv_kernel, block_m_for  # noqa: E402
from kernels.skinny_linear import CARDS, MAX_M, MODE_DOT, _skinny_kernel, m_bucket, pick_skinny_config  # noqa: E402

_SIG = {"x_ptr": "*bf16", "scale_ptr": "*fp32", "bias_ptr": "*bf16", "out_ptr": "*bf16", "partial_ptr": "*fp32",
        "counter_ptr": "*i32"}
_DIVISIBLE = ("x_ptr", "w_ptr", "scale_ptr", "bias_ptr", "out_ptr", "partial_ptr", "counter_ptr", "N", "K",
              "stride_xm", "stride_wn", "stride_om")


def compile_variant(fn, const: dict, types: dict, divisible: tuple, num_warps: int, num_stages: int,
                    gluon: bool = False, maxnreg: int | None = None):
    """Compile the Triton kernel `fn` (a Gluon one with `gluon`) for sm_90 with these constexprs, argument
    types (default i32) and arguments assumed divisible by 16, as a launch at real shapes would specialise it
    (`maxnreg`: the launch's registers a thread, as a warp-specialised kernel's launcher passes them)."""
    names = fn.arg_names
    sig = {n: "constexpr" if n in const else types.get(n, "i32") for n in names}
    source = ASTSource
    if gluon:
        from triton.experimental.gluon._runtime import GluonASTSource as source
    src = source(fn, sig, constexprs={(names.index(k),): v for k, v in const.items()},
                 attrs={(names.index(n),): [["tt.divisibility", 16]] for n in divisible if n in names})
    options = dict(num_warps=num_warps, num_stages=num_stages)
    if maxnreg is not None:
        options["maxnreg"] = maxnreg
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def resources(kernel) -> tuple[int, int]:
    """(registers a thread, spill stack bytes) of a compiled kernel, from cuobjdump."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    regs, stack = re.search(r"REG:(\d+)", usage), re.search(r"STACK:(\d+)", usage)
    return int(regs.group(1)) if regs else -1, int(stack.group(1)) if stack else -1


def run_script(script: str) -> str:
    """Run a compile script of tests/support in a process without TRITON_INTERPRET (tests call this);
    fails with its output unless it exits 0; returns its stdout."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "support", script)],
                          capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def report(label: str, compile_one) -> bool:
    """Run `compile_one()` (which returns the details to print) and print `ok <label> <details>` or
    `FAIL <label> <error>`; True when it compiled. The compile scripts' one line per variant."""
    try:
        details = compile_one()
    except Exception as e:  # noqa: BLE001 - every failure is listed
        print(f"FAIL {label} {type(e).__name__}: {str(e)[-300:]}", flush=True)
        return False
    print(f"ok {label} {details}", flush=True)
    return True


def compile_sm90(m: int, fp8: bool, cfg, split: bool, even_k: bool = True) -> int:
    """Compile one variant as the launcher would specialise it at real shapes; returns its registers."""
    if isinstance(cfg, GemvConfig):
        return _compile_gemv(m, cfg, split, even_k, 4 if fp8 else 2)
    const = dict(HAS_SCALE=fp8, HAS_BIAS=True, USE_SPLIT=split, EVEN_K=even_k, MODE=cfg.mode, STAGES=cfg.num_stages,
                 SUB=cfg.sub,
                 BLOCK_M=max(16, m_bucket(m)) if cfg.mode == MODE_DOT else m_bucket(m), BLOCK_N=cfg.block_n,
                 BLOCK_K=cfg.block_k, DOT_PRECISION="tf32", PDL=True)
    types = dict(_SIG, w_ptr="*fp8e4nv" if fp8 else "*bf16")
    kernel = compile_variant(_skinny_kernel, const, types, _DIVISIBLE, cfg.num_warps, cfg.num_stages)
    return resources(kernel)[0]


def _compile_gemv(m: int, cfg: GemvConfig, split: bool, even_k: bool, epw: int, push_w: int = 0) -> int:
    # kernels/fp8_gemv.py's kernel, with the inline-asm conversions the GPU runs (epw 4: FP8, 2: bf16 weights;
    # push_w > 0: the rows pushed to that many ranks' all-reduce buffers)
    const = dict(HAS_BIAS=True, USE_SPLIT=split, EVEN_K=even_k, MODE=cfg.mode, STAGES=cfg.stages, UNROLL=cfg.unroll,
                 BLOCK_M=block_m_for(m, cfg.mode), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, ASM_CVT=bool(cfg.cvt),
                 EPW=epw, GATED=False, PUSH_W=push_w, PDL=True)
    kernel = compile_variant(_fp8_gemv_kernel, const, dict(_SIG, w_ptr="*i32", push_ptr="*i64", push_state="*i32"),
                             _DIVISIBLE, cfg.num_warps, cfg.stages)
    assert kernel.metadata.shared <= 227 * 1024, f"{cfg.short()}: {kernel.metadata.shared} bytes of shared memory"
    return resources(kernel)[0]


def main() -> int:
    import torch

    failed = 0
    seen = set()
    for wdtype, card, m, (n, k) in itertools.product((torch.bfloat16, torch.float8_e4m3fn), ("", *CARDS),
                                                     range(1, MAX_M + 1), ((1536, 4096), (57344, 8192))):  # split, not
        cfg = pick_skinny_config(m, n, k, wdtype, 132, card)
        bucket = block_m_for(m, cfg.mode) if isinstance(cfg, GemvConfig) else m_bucket(m)
        key = (bucket, wdtype, cfg._replace(split_k=min(cfg.split_k, 2)))
        if key in seen:
            continue
        seen.add(key)
        for even_k in (True, False):  # K a multiple of block_k or not (masked tail)
            fp8 = wdtype == torch.float8_e4m3fn
            failed += not report(f"{key} even_k={even_k}", lambda: "regs=%d" % compile_sm90(
                m, fp8, cfg, cfg.split_k > 1, even_k))
            if isinstance(cfg, GemvConfig):  # as a row-parallel partial pushed to 2 and 4 ranks
                for push_w in (2, 4):
                    failed += not report(f"{key} even_k={even_k} push={push_w}", lambda: "regs=%d" % _compile_gemv(
                        m, cfg, cfg.split_k > 1, even_k, 4 if fp8 else 2, push_w))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

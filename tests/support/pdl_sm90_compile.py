"""Compile every kernel launched with programmatic dependent launch (`kernels/pdl.py`) for sm_90, no GPU needed.

For each kernel, as the decode step launches it on an H100 (`PDL=True`, bf16 activations, 8B shapes),
it reads the PTX in program order and checks the contract `kernels/pdl.py` states:
- `griddepcontrol.launch_dependents` and `griddepcontrol.wait` are both there, the release first;
- nothing is stored (`st.global`, atomics) before the wait;
- kernels with a weight prologue still issue their weight loads before the wait (the overlap is kept);
- a GEMV that pushes its rows to the fused all-reduce stores nothing to its peers before the wait;
- the kernel that carries an L2 hint (`kernels/l2_prefetch.py`), compiled with it, issues its
  `prefetch.global.L2` instructions only after a wait (never competing with the kernel before).
Prints `ok <kernel> loads_before_wait=<n>` or `FAIL <kernel> <error>` per kernel; exit status 1 if any failed.
`tests/kernels/test_pdl.py` runs it in a subprocess without TRITON_INTERPRET.
"""

from __future__ import annotations

import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.dirname(os.path.abspath(__file__))]

from sm90_compile import compile_variant, report  # noqa: E402

import triton.language as tl  # noqa: E402

from kernels.activation import _silu_and_mul_kernel, _silu_and_mul_rows_kernel  # noqa: E402
from kernels.all_reduce_norm import _all_reduce_rms_norm_kernel  # noqa: E402
from kernels.fp8_gemv import MODE_ACC, _fp8_gemv_kernel  # noqa: E402
from kernels.int4_kchunk import _kchunk_gemv_kernel  # noqa: E402
from kernels.paged_decode_attention import _paged_decode_kernel  # noqa: E402
from kernels.rms_norm import _rms_norm_kernel  # noqa: E402
from kernels.rotary import _rotary_and_write_kv_kernel  # noqa: E402
from kernels.skinny_linear import MODE_DOT, MODE_FMA, _skinny_kernel  # noqa: E402

_BF16 = "*bf16"
_STORE = re.compile(r"^\s*(@%p\d+\s+)?(st\.global|atom\.|red\.)")
_LOAD = re.compile(r"^\s*(@%p\d+\s+)?ld\.global")

# (label, kernel, constexprs, pointer types, warps, stages, weight prologue before the wait)
_GEMM_PTRS = {"x_ptr": _BF16, "scale_ptr": "*fp32", "bias_ptr": _BF16, "out_ptr": _BF16, "partial_ptr": "*fp32",
              "counter_ptr": "*i32"}
_DECODE_PTRS = {"q_ptr": _BF16, "k_cache_ptr": _BF16, "v_cache_ptr": _BF16, "block_tables_ptr": "*i32",
                "seq_lens_ptr": "*i32", "mid_o_ptr": "*fp32", "mid_lse_ptr": "*fp32", "out_ptr": _BF16,
                "counter_ptr": "*i32", "qk_scale": "fp32", "softcap": "fp32", "positions_ptr": "*i64",
                "k_new_ptr": _BF16, "v_new_ptr": _BF16, "cos_sin_ptr": "*fp32", "slot_ptr": "*i64"}
CASES = [
    ("rms_norm", _rms_norm_kernel, dict(N=4096, BLOCK=4096, HAS_RESIDUAL=True, UNIT_OFFSET=False, FP8_ROWS=False),
     {"x_ptr": _BF16, "residual_ptr": _BF16, "weight_ptr": _BF16, "out_ptr": _BF16, "residual_out_ptr": _BF16,
      "q_ptr": _BF16, "scale_ptr": _BF16, "eps": "fp32"}, 16, 1, True),
    # before an FP8 linear: the normed rows' FP8 copy too (kernels/fp8_rows.py)
    ("rms_norm+fp8_rows", _rms_norm_kernel, dict(N=4096, BLOCK=4096, HAS_RESIDUAL=True, UNIT_OFFSET=False,
                                                 FP8_ROWS=True),
     {"x_ptr": _BF16, "residual_ptr": _BF16, "weight_ptr": _BF16, "out_ptr": _BF16, "residual_out_ptr": _BF16,
      "q_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "eps": "fp32"}, 16, 1, True),
    ("all_reduce_rms_norm", _all_reduce_rms_norm_kernel,
     dict(N=4096, BLOCK=4096, CHUNK=1024, W=2, INT=tl.int16, SENTINEL=-(1 << 15), POLL_2D=True, HAS_RESIDUAL=True,
          UNIT_OFFSET=False, PUSHED=False, HINT=False, HINT_ASM=False),
     {"x_ptr": _BF16, "residual_ptr": _BF16, "weight_ptr": _BF16, "out_ptr": _BF16, "residual_out_ptr": _BF16,
      "peers_ptr": "*i64", "state_ptr": "*i32", "eps": "fp32"}, 16, 1, True),
    # after a GEMV that pushed its rows (kernels/fp8_gemv.py `push`): no push of its own
    ("all_reduce_rms_norm+pushed", _all_reduce_rms_norm_kernel,
     dict(N=4096, BLOCK=4096, CHUNK=1024, W=4, INT=tl.int16, SENTINEL=-(1 << 15), POLL_2D=True, HAS_RESIDUAL=True,
          UNIT_OFFSET=False, PUSHED=True, HINT=False, HINT_ASM=False),
     {"x_ptr": _BF16, "residual_ptr": _BF16, "weight_ptr": _BF16, "out_ptr": _BF16, "residual_out_ptr": _BF16,
      "peers_ptr": "*i64", "state_ptr": "*i32", "eps": "fp32"}, 16, 1, True),
    ("silu_and_mul", _silu_and_mul_kernel, dict(D=14336, BLOCK=1024), {"x_ptr": _BF16, "out_ptr": _BF16}, 4, 1,
     False),
    ("silu_and_mul+fp8_rows", _silu_and_mul_rows_kernel, dict(D=14336, BLOCK=16384),
     {"x_ptr": _BF16, "out_ptr": _BF16, "q_ptr": "*fp8e4nv", "scale_ptr": "*fp32"}, 16, 1, False),
    ("rotary_and_write_kv", _rotary_and_write_kv_kernel,
     dict(NUM_Q_HEADS=32, NUM_K_HEADS=8, HEAD_DIM=128, HALF=64, BLOCK_Q_HEADS=32, BLOCK_K_HEADS=8, BLOCK_HALF=64,
          ROW=1024, BLOCK_ROW=1024),
     {"positions_ptr": "*i64", "q_ptr": _BF16, "k_ptr": _BF16, "v_ptr": _BF16, "cache_ptr": "*fp32",
      "k_cache_ptr": _BF16, "v_cache_ptr": _BF16, "slot_ptr": "*i64"}, 4, 1, False),
    ("paged_decode", _paged_decode_kernel,
     dict(GROUP=4, HEAD_DIM=128, PAGE_SIZE=16, BLOCK_H=16, BLOCK_D=128, BLOCK_N=64, DOT_PRECISION="tf32",
          SLIDING=False, SOFTCAP=False, ROPE=False, HALF=1),
     _DECODE_PTRS, 4, 2, False),
    # with this step's RoPE and K/V write (kernels/decode_rope.py): the stores come after the wait too
    ("paged_decode+rope", _paged_decode_kernel,
     dict(GROUP=4, HEAD_DIM=128, PAGE_SIZE=16, BLOCK_H=16, BLOCK_D=128, BLOCK_N=64, DOT_PRECISION="tf32",
          SLIDING=False, SOFTCAP=False, ROPE=True, HALF=64),
     _DECODE_PTRS, 4, 2, False),
    ("kchunk_gemv", _kchunk_gemv_kernel,
     dict(ROWS=1, HAS_BIAS=False, USE_SPLIT=True, BLOCK_N=256, BLOCK_K=128, EVEN_K=True, PAIRS=True,
          REDUCE_EACH=False, ASM=True),
     {"x_ptr": _BF16, "w_ptr": "*i32", "scales_ptr": _BF16, "zeros_ptr": _BF16, "bias_ptr": _BF16, "out_ptr": _BF16,
      "partial_ptr": "*fp32", "counter_ptr": "*i32"}, 4, 1, True),
    ("fp8_gemv", _fp8_gemv_kernel,
     dict(HAS_BIAS=False, USE_SPLIT=True, EVEN_K=True, MODE=MODE_ACC, STAGES=1, UNROLL=2, BLOCK_M=1, BLOCK_N=16,
          BLOCK_K=512, ASM_CVT=True, EPW=4, GATED=False, PUSH_W=0),
     dict(_GEMM_PTRS, w_ptr="*i32", push_ptr="*i64", push_state="*i32"), 4, 1, True),
    # a bf16 row-parallel partial pushed to 4 ranks from the epilogue (the phase read after the wait)
    ("fp8_gemv+push", _fp8_gemv_kernel,
     dict(HAS_BIAS=False, USE_SPLIT=False, EVEN_K=True, MODE=MODE_ACC, STAGES=1, UNROLL=1, BLOCK_M=1, BLOCK_N=8,
          BLOCK_K=512, ASM_CVT=True, EPW=2, GATED=False, PUSH_W=4),
     dict(_GEMM_PTRS, w_ptr="*i32", push_ptr="*i64", push_state="*i32"), 4, 1, True),
    ("skinny_fma", _skinny_kernel,
     dict(HAS_SCALE=False, HAS_BIAS=False, USE_SPLIT=True, EVEN_K=True, MODE=MODE_FMA, STAGES=1, SUB=1, BLOCK_M=1,
          BLOCK_N=16, BLOCK_K=256, DOT_PRECISION="tf32"),
     dict(_GEMM_PTRS, w_ptr=_BF16), 4, 1, True),
    ("skinny_dot", _skinny_kernel,
     dict(HAS_SCALE=False, HAS_BIAS=False, USE_SPLIT=True, EVEN_K=True, MODE=MODE_DOT, STAGES=3, SUB=1, BLOCK_M=16,
          BLOCK_N=64, BLOCK_K=128, DOT_PRECISION="tf32"),
     dict(_GEMM_PTRS, w_ptr=_BF16), 4, 3, False),
]


HINTED = ("all_reduce_rms_norm",)  # also compiled with HINT on


def check_hint(ptx: str) -> int:
    """A hinted kernel's prefetches: present, and each after a `griddepcontrol.wait`; returns how many."""
    lines = [ln for ln in ptx.splitlines() if ln.strip() and not ln.strip().startswith((".loc", "//"))]
    waits = [i for i, ln in enumerate(lines) if "griddepcontrol.wait" in ln]
    prefetches = [i for i, ln in enumerate(lines) if "prefetch.global.L2::evict_last" in ln]
    assert prefetches, "no prefetch instruction"
    assert waits and min(prefetches) > min(waits), "a prefetch before any wait"
    return len(prefetches)


def check_ptx(ptx: str, prologue: bool) -> int:
    """The contract's checks on one kernel's PTX; returns the global loads issued before the wait."""
    lines = [ln for ln in ptx.splitlines() if ln.strip() and not ln.strip().startswith((".loc", "//"))]
    waits = [i for i, ln in enumerate(lines) if "griddepcontrol.wait" in ln]
    releases = [i for i, ln in enumerate(lines) if "griddepcontrol.launch_dependents" in ln]
    assert waits and releases, f"waits {len(waits)}, releases {len(releases)}"
    first_wait = waits[0]
    assert releases[0] < first_wait, "the release comes after the wait"
    stores = [ln.strip() for ln in lines[:first_wait] if _STORE.match(ln)]
    assert not stores, f"stores before the wait: {stores[:3]}"
    loads = sum(1 for ln in lines[:first_wait] if _LOAD.match(ln))
    assert (loads > 0) == prologue, f"{loads} global loads before the wait, weight prologue expected: {prologue}"
    return loads


def main() -> int:
    failed = 0
    for label, fn, const, types, warps, stages, prologue in CASES:
        def one(fn=fn, const=const, types=types, warps=warps, stages=stages, prologue=prologue) -> str:
            pointers = tuple(name for name, kind in types.items() if kind.startswith("*"))
            kernel = compile_variant(fn, dict(const, PDL=True), types, pointers, warps, stages)
            return f"loads_before_wait={check_ptx(kernel.asm['ptx'], prologue)}"
        failed += not report(label, one)
        if label in HINTED:
            def hinted(fn=fn, const=const, types=types, warps=warps, stages=stages, prologue=prologue) -> str:
                types = dict(types, hint_ptr="*u8")
                pointers = tuple(name for name, kind in types.items() if kind.startswith("*"))
                kernel = compile_variant(fn, dict(const, PDL=True, HINT=True, HINT_ASM=True), types, pointers, warps,
                                         stages)
                ptx = kernel.asm["ptx"]
                return f"loads_before_wait={check_ptx(ptx, prologue)} prefetches={check_hint(ptx)}"
            failed += not report(label + "+hint", hinted)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

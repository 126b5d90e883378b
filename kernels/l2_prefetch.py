"""Warm the GPU's L2 cache with the first bytes of a weight the stream will read next.

Why: a decode step at small batch alternates bandwidth-bound GEMMs with latency-bound kernels
(rotary + KV write, attention, the all-reduce that waits on other ranks, SiLU-mul). While the
latency-bound kernels run, HBM is idle. Issuing L2 prefetches for the next GEMM's weight just
before them lets those bytes arrive during the idle time, and the GEMM then finds them in L2
(50 MB on an H100). The prefetch instructions are fire-and-forget: the kernel issues them and
exits; nothing waits for the data, and nothing changes in memory, so no result can differ.

Two instruction forms (`MODE`): `cp.async.bulk.prefetch.L2` (sm_90: one instruction moves a whole
chunk, issued by the TMA unit) and `prefetch.global.L2::evict_last` (sm_80+: one 128-byte line an
instruction). The torch reference (`kernels/reference.py: l2_prefetch`) does nothing: a cache hint
has no observable effect, which is also what the CPU path must do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MODE_BULK = 0  # cp.async.bulk.prefetch.L2.global [addr], CHUNK (sm_90)
MODE_LINE = 1  # prefetch.global.L2::evict_last [addr], one 128-byte line an instruction (sm_80+)
_LINE = 128
_BULK_CHUNK = 4096  # bytes one bulk prefetch asks for
_BLOCK = 256  # threads' addresses a program issues at once (num_warps 8 x 32)


@triton.jit
def _prefetch_kernel(base_ptr, n_units, UNIT: tl.constexpr, MODE: tl.constexpr, BLOCK: tl.constexpr):
    # one address per lane; lanes past the end repeat the last unit (a harmless duplicate hint)
    unit = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    unit = tl.minimum(unit, n_units - 1)
    addr = base_ptr + unit.to(tl.int64) * UNIT
    if MODE == 0:
        tl.static_assert(UNIT == 4096, "the bulk prefetch's size is written into its instruction")
        tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], 4096; mov.u32 $0, 0;", "=r,l", [addr],
                                  dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;", "=r,l", [addr],
                                  dtype=tl.int32, is_pure=False, pack=1)


def l2_prefetch(t: torch.Tensor, max_bytes: int, mode: int | None = None) -> None:
    """Ask L2 to fetch the first min(max_bytes, t's bytes) of contiguous `t`; returns at once."""
    assert t.is_contiguous(), "prefetch reads the tensor's bytes in storage order"
    nbytes = min(max_bytes, t.numel() * t.element_size())
    if mode is None:  # per line measured ahead of bulk on an H100 (bench/l2_prefetch.py, bench/RESULTS.md run 44)
        mode = MODE_LINE
    assert mode == MODE_LINE or torch.cuda.get_device_capability(t.device)[0] >= 9, "bulk prefetch needs sm_90"
    unit = _BULK_CHUNK if mode == MODE_BULK else _LINE
    # bulk: the chunk must lie inside the tensor (the address and size are 16-byte aligned)
    n_units = nbytes // unit
    if n_units <= 0:
        return
    base = t.view(-1).view(torch.uint8)
    grid = (triton.cdiv(n_units, _BLOCK),)
    _prefetch_kernel[grid](base, n_units, UNIT=unit, MODE=mode, BLOCK=_BLOCK, num_warps=_BLOCK // 32)

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

`l2_prefetch` is its own launch (on a side stream it measured ~1 % at best in the engine, and it
breaks the PDL chain of the compute stream: run 44, run 49). An `L2Hint` instead rides along with
a latency-bound kernel the step launches anyway: the launcher adds `hint.programs` programs to its
grid, which wait for the previous kernel like every program of it (so they never compete with
the GEMV before), issue their share of the lines (`prefetch_share`) and exit. The carrier's grid
behaves as if it completed only once its lines landed (the next kernel waits on them), so a hint
pays only where the carrier waits anyway: the tensor-parallel all-reduce + norm polling for its
peers (bench/RESULTS.md run 53: 70B TP=4 -1.3 %, 8B TP=2 -1.2 % at 8 MiB but +1.5 % at 16). On one
GPU, RMSNorm and rotary as carriers cost up to 22 % (8B batch 1): their short grids waited on the lines.
The batch-1 decode attention as the carrier of o_proj's weight (run 55) was no better: one H100 4 MiB
+0.4 % (8B bf16), 8B TP=4 +0.9 % (4 MiB) / +2.1 % (8), 70B TP=4 +0.5 % (8) / +1.6 % (16); and 4 KiB
bulk prefetches (`cp.async.bulk.prefetch.L2`) in place of lines +5 to +12 % on one H100.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MODE_BULK = 0  # cp.async.bulk.prefetch.L2.global [addr], CHUNK (sm_90)
MODE_LINE = 1  # prefetch.global.L2::evict_last [addr], one 128-byte line an instruction (sm_80+)
_LINE = 128
_BULK_CHUNK = 4096  # bytes one bulk prefetch asks for
_BLOCK = 256  # threads' addresses a program issues at once (num_warps 8 x 32)
HINT_MAX_ROWS = 16  # hints ride along with calls of at most this many rows: above it the GEMMs are not weight-bound
HINT_PROGRAMS = 32  # programs a hinted launch adds: each issues 1 / 32 of the lines
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # the CPU interpreter runs no inline PTX


def _first_bytes(t: torch.Tensor, max_bytes: int) -> tuple[torch.Tensor, int]:
    """Contiguous `t`'s storage as flat uint8, and how many of its first bytes to prefetch."""
    assert t.is_contiguous(), "prefetch reads the tensor's bytes in storage order"
    return t.reshape(-1).view(torch.uint8), min(max_bytes, t.numel() * t.element_size())


@dataclass(frozen=True)
class L2Hint:
    """The first bytes of the weight that the next bandwidth-bound kernel reads, as lines to prefetch.

    Exists so that a model links each latency-bound launch to its successor's weight once (after
    load, from the order one forward ran its layers) and the kernels' launchers get one checked
    object: the bytes as a flat uint8 tensor, how many 128-byte lines, and how many programs issue them.
    """

    base: torch.Tensor  # uint8 [>= lines * 128]: the weight's storage
    lines: int
    programs: int = HINT_PROGRAMS

    def __post_init__(self) -> None:
        assert self.base.dtype == torch.uint8 and self.base.dim() == 1 and self.base.is_contiguous()
        assert 0 < self.lines * _LINE <= self.base.numel() and self.programs > 0


def l2_hint(t: torch.Tensor, max_bytes: int) -> L2Hint | None:
    """An `L2Hint` for the first min(max_bytes, t's bytes) of contiguous `t`; None below one line."""
    base, nbytes = _first_bytes(t, max_bytes)
    return L2Hint(base, nbytes // _LINE) if nbytes >= _LINE else None


def hint_launch(hint: L2Hint | None, rows: int, fallback: torch.Tensor) -> tuple[torch.Tensor, int, int, dict]:
    """A hinted launcher's extra arguments for a call over `rows` rows: (lines' base pointer, lines,
    programs to add, the constexprs `HINT` and `HINT_ASM`). No hint, or too many rows: 0 programs
    (`fallback` stands in for the pointer)."""
    if hint is None or rows > HINT_MAX_ROWS:
        return fallback, 0, 0, dict(HINT=False, HINT_ASM=False)
    assert hint.base.device == fallback.device, (hint.base.device, fallback.device)
    return hint.base, hint.lines, hint.programs, dict(HINT=True, HINT_ASM=not _INTERPRET)


@triton.jit
def prefetch_share(base_ptr, lines, share, shares, ASM: tl.constexpr):
    """Program `share` of `shares`: ask L2 for its lines of the `lines` 128-byte lines at `base_ptr`
    (uint8), BLOCK at a time, interleaved with the other programs'. Fire and forget: nothing waits
    for the data. Without ASM (the CPU interpreter) each line's first byte is loaded instead."""
    BLOCK: tl.constexpr = 1024
    for start in range(share * BLOCK, lines, shares * BLOCK):
        line = tl.minimum(start + tl.arange(0, BLOCK), lines - 1)  # lanes past the end repeat the last line
        addr = base_ptr + line.to(tl.int64) * 128
        if ASM:
            _prefetch_line(addr)
        else:
            tl.load(addr)


@triton.jit
def _prefetch_line(addr):
    # prefetch.global.L2::evict_last of the 128-byte line at each address (no result, nothing waits)
    tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;", "=r,l", [addr],
                              dtype=tl.int32, is_pure=False, pack=1)


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
        _prefetch_line(addr)


def l2_prefetch(t: torch.Tensor, max_bytes: int, mode: int | None = None) -> None:
    """Ask L2 to fetch the first min(max_bytes, t's bytes) of contiguous `t`; returns at once."""
    base, nbytes = _first_bytes(t, max_bytes)
    if mode is None:  # per line measured ahead of bulk on an H100 (bench/l2_prefetch.py, bench/RESULTS.md run 44)
        mode = MODE_LINE
    assert mode == MODE_LINE or torch.cuda.get_device_capability(t.device)[0] >= 9, "bulk prefetch needs sm_90"
    unit = _BULK_CHUNK if mode == MODE_BULK else _LINE
    # bulk: the chunk must lie inside the tensor (the address and size are 16-byte aligned)
    n_units = nbytes // unit
    if n_units <= 0:
        return
    grid = (triton.cdiv(n_units, _BLOCK),)
    _prefetch_kernel[grid](base, n_units, UNIT=unit, MODE=mode, BLOCK=_BLOCK, num_warps=_BLOCK // 32)

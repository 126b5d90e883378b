"""Programmatic dependent launch (PDL, sm_90+): a decode step's next kernel starts while this one drains.

Why: a batch-1 decode step is 300-500 short kernels in one CUDA graph (8B: 451 for GPTQ int4, run 45),
each a few to a few tens of microseconds. Between two of them the GPU drains the first grid, flushes
its writes, then launches the next one, whose first weight loads only then leave for HBM: an idle
gap at every boundary. Launched with PDL (`launch_pdl=True`, Triton's `cudaLaunchAttribute
ProgrammaticStreamSerialization`), the next kernel's programs become resident as soon as every
program of the current one has signalled (`release_dependents`) and run up to their `wait_upstream`,
which returns once the previous grid has completed and its memory is visible. Loads of read-only
data (weights) placed before the wait overlap the previous kernel's tail.

The contract of a kernel launched with PDL (`**launch_options(x)` in its launch: the `PDL` constexpr on):
- it calls `release_dependents(PDL)` early, in every program (else its dependents wait for its exit);
- before `wait_upstream(PDL)` it reads only data no kernel of the step writes (weights, norm weights)
  and writes nothing: a buffer another kernel still reads may be the one it is about to write;
- every program reaches `wait_upstream(PDL)`: a grid completes only after its own wait returned, so
  completions stay ordered along the whole chain even where a kernel has no input from the previous.
A kernel launched without PDL waits for the previous one as usual, and both instructions are
no-ops then, so PDL kernels mix freely with cuBLAS, torch's and NCCL's launches.

`OPEN_LMI_PDL=0` (read once) launches every kernel without PDL; off CUDA, and below sm_90, it is
off by itself (the CPU interpreter runs the same kernels with `PDL=False`).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

ENV = "OPEN_LMI_PDL"


@functools.cache
def _enabled_on(device_index: int) -> bool:
    raw = os.environ.get(ENV, "1").strip().lower()
    if raw not in ("0", "1", "true", "false", "on", "off", ""):
        raise ValueError(f"{ENV}={raw!r}: expected 1 (on, the default) or 0 (off)")
    if raw in ("0", "false", "off"):
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def enabled_for(t: torch.Tensor) -> bool:
    """True when kernels over `t` launch with PDL: a CUDA tensor on sm_90+ and `OPEN_LMI_PDL` not 0."""
    return t.is_cuda and _enabled_on(t.device.index if t.device.index is not None else torch.cuda.current_device())


def launch_kwargs(pdl: bool) -> dict:
    """Triton launch options for a kernel launched with (or without) PDL."""
    return {"launch_pdl": True} if pdl else {}


def launch_options(t: torch.Tensor, enabled: bool = True) -> dict:
    """What a launcher passes (`**launch_options(x)`) to a kernel over `t` with a `PDL` constexpr: the
    constexpr and Triton's launch option, both from `enabled_for(t)`; `enabled=False` launches this one
    without PDL (where it measured slower with it)."""
    pdl = enabled and enabled_for(t)
    return {"PDL": pdl, **launch_kwargs(pdl)}


@triton.jit
def release_dependents(PDL: tl.constexpr):
    """Let the next kernel in the stream launch once every program here has called this (no-op without PDL)."""
    if PDL:
        tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def wait_upstream(PDL: tl.constexpr):
    """Block until the previous kernel in the stream has completed and its writes are visible."""
    if PDL:
        tl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1)

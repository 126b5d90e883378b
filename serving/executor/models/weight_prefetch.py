"""Warm L2 with the next linear layer's weight while tensor parallelism's all-reduce waits on its peers.

Why: at decode sizes every linear layer is a read of its weight from HBM, and the fused
all-reduce + residual add + RMSNorm between two of them (`kernels/all_reduce_norm.py`) barely
touches HBM: it pushes one row to the peers and polls until theirs arrive (~6 us a launch on 4x
H100, 160 of them a 70B step). Its launcher takes an `L2Hint` (`kernels.l2_hint`): programs added
to its grid wait for the previous kernel like the rest, issue `prefetch.global.L2` for the first
bytes of the weight that the next GEMV reads, and exit while the exchange goes on (a hint changes
no result). Measured (bench/RESULTS.md run 53, H100s, batch-1 decode): 70B TP=4 14.10 -> 13.91 ms
(16 MiB), 8B TP=4 2.19 -> 2.18 (16 MiB), 8B TP=2 3.27 -> 3.23 (8 MiB; 16 MiB: 3.28 -> 3.33). Other
carriers lost: a prefetch launched as its own kernel (side stream: runs 44, 46, 49) and the one-GPU
RMSNorm / rotary launches (their grids then wait for the lines; 8B batch 1, 16 MiB: bf16 +6.5 %,
GPTQ int4 +22 %, FP8 +9.6 %).

How: the first eager forward of a tensor-parallel model on CUDA runs under `tracing()`: every
linear layer and every norm that all-reduces notes itself (`note`) as it runs, so the trace is
the order the model really runs its layers, whatever the architecture. `link_l2_hints` then gives
each norm the hint of the first linear layer after it (the post-attention norm: gate_up; the next
layer's input norm: qkv), kept as the norm's `l2_hint`. The launcher applies it only to calls of
at most `kernels.l2_prefetch.HINT_MAX_ROWS` rows (decode steps: above that the GEMMs are not
weight-bound).

`OPEN_LMI_L2_PREFETCH_MB` (read once, when the hints are linked) sets the bytes per hint in MiB;
0 turns it off. Unset: 4 MiB at 2 ranks, 16 MiB at 4 and more (measured best of 4 / 8 / 16 there).
With row-parallel GEMVs pushing their rows (`kernels/all_reduce_norm.py`) the exchange is shorter and
a hint larger than it can hide delays the next GEMV: run 55, 8B TP=2 4 MiB 3.197 ms, none 3.221, 8 MiB
3.335; 8B TP=4 4 / 8 / 16 MiB 2.106 / 2.107 / 2.128 (16 kept at 4 ranks: the 70B's 13.72 ms was
measured there, its 4 and 8 MiB were not).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
from torch import nn

import kernels

ENV = "OPEN_LMI_L2_PREFETCH_MB"
# MiB per hint when the knob is unset, by degree (bench/RESULTS.md runs 53 and 55, H100s, batch-1 decode): at
# 2 ranks 4 MiB (with pushed partials, 8B TP=2: 4 MiB -0.7 % against none, 8 MiB +3.5 %: more lines than the
# shorter exchange hides), at 4 and more 16 MiB (run 53: 70B TP=4 -1.3 %, 8 MiB -1.0 %; 8B TP=4 -0.6 %; run
# 55 with pushed partials: 70B 13.72 ms at 16, 8B 2.128 at 16 against 2.106 at 4)
DEFAULT_MB_TP2 = 4.0
DEFAULT_MB = 16.0
# the tensor a linear layer's kernel reads, by the names the float and quantized paths store it under
_WEIGHT_NAMES = ("kchunk", "packed", "qweight", "weight")

_trace: list[nn.Module] | None = None  # the modules run so far in a `tracing()` forward


def weight_tensor(module: nn.Module) -> torch.Tensor | None:
    """The weight tensor `module`'s kernel reads at decode (contiguous), or None."""
    for name in _WEIGHT_NAMES:
        t = getattr(module, name, None)
        if isinstance(t, torch.Tensor) and t.is_contiguous() and t.numel() > 0:
            return t
    return None


def prefetch_bytes(tp_degree: int) -> int:
    """`OPEN_LMI_L2_PREFETCH_MB` in bytes; unset: DEFAULT_MB_TP2 at 2 ranks, DEFAULT_MB at more (one
    rank has no all-reduce to carry a hint). A clear error on a bad value."""
    raw = os.environ.get(ENV, "").strip()
    try:
        mb = float(raw) if raw else (DEFAULT_MB_TP2 if tp_degree <= 2 else DEFAULT_MB)
    except ValueError:
        raise ValueError(f"{ENV}={raw!r}: expected a number of MiB (0 turns the prefetch off)") from None
    if mb < 0:
        raise ValueError(f"{ENV}={raw!r}: must be >= 0")
    return int(mb * (1 << 20))


def note(module: nn.Module) -> None:
    """`module` runs now: recorded when a `tracing()` forward is under way (else nothing)."""
    if _trace is not None:
        _trace.append(module)


@contextlib.contextmanager
def tracing() -> Iterator[list[nn.Module]]:
    """Record the modules that `note` themselves during the block, in run order."""
    global _trace
    assert _trace is None, "one trace at a time"
    _trace = trace = []
    try:
        yield trace
    finally:
        _trace = None


def link_l2_hints(trace: list[nn.Module], linear_type: type, max_bytes: int) -> int:
    """Give every other module of `trace` (the norms) the L2 hint of the first `linear_type` module
    after it (`l2_hint`; None where no linear follows or the weight is not on a CUDA device).
    Returns how many modules got one."""
    linked = 0
    nxt: torch.Tensor | None = None
    hints: dict[int, object] = {}
    for module in reversed(trace):
        if isinstance(module, linear_type):
            nxt = weight_tensor(module)
            continue
        hint = None
        if nxt is not None and max_bytes > 0:
            if id(nxt) not in hints:
                hints[id(nxt)] = kernels.l2_hint(nxt, max_bytes)
            hint = hints[id(nxt)]
        vars(module)["l2_hint"] = hint
        linked += hint is not None
    return linked

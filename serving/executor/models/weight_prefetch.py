"""Warm L2 with the next linear layer's weight while the latency-bound kernels between them run.

Why: at decode sizes every linear layer is a read of its weight from HBM, and between two of them
run kernels that barely touch HBM (rotary + KV write, attention over a short context, the
all-reduce waiting on the other ranks, SiLU-mul). `bench/l2_prefetch.py` measured on an H100
(bench/RESULTS.md run 44) that prefetching the next weight's first 8-16 MB into L2 during those
kernels takes 6-8 % off a synthetic decode step at TP=1/2/4 shapes (stand-ins that touch no
memory), when the prefetch is launched on a second stream (on the compute stream its launch costs
more than it saves). In the real 8B engine at TP=1 it takes 1 % off at 8 MB and adds 1-2 % at
12-16 MB: the prefetch's requests queue ahead of the latency-bound kernels' own loads.

How: after the model is loaded, `link_weight_prefetch` chains the model's linear layers in the
order they are registered (the order a decoder layer runs them: qkv, o, gate_up, down, next
layer's qkv) and gives each the chain's `WeightPrefetch`. A linear layer with at most
`MAX_ROWS` input rows then calls `after(self)`: the prefetch of its successor's weight is launched
on the side stream, forked from the compute stream at that point. Before any linear layer computes,
and at the end of the model's forward, `join()` makes the compute stream wait for the side stream,
so a captured CUDA graph always ends joined and a prefetch never outlives the step. A chain whose
order differs from the run order only prefetches the wrong weight: the hint changes no result.

Under tensor parallelism it measured no gain (8B TP=2 +0.5 %, TP=4 +1.2 %, 70B TP=4 -0.4 %, run 44:
the all-reduce's flag polling is as latency-bound as the kernels it would hide); never for quantized
models (GPTQ int4 at batch 1: 3.30 ms/token with 8 MiB, 3.14 without; FP8 unchanged; run 46). Since
decode steps launch their kernels with programmatic dependent launch (`kernels/pdl.py`: the next
linear layer's GEMV starts reading its weight while the previous kernel drains) and bf16 weights
at 1-2 rows go through that GEMV, the prefetch costs time on one GPU too (8B batch 1: 5.68 ms/token
with 8 MiB, 5.52 without; run 49): it is off by default. `OPEN_LMI_L2_PREFETCH_MB` (read once, when
the chain is linked) sets the bytes per prefetch in MiB for unquantized models at any degree; 0
(the default) turns it off. Only on CUDA devices of compute capability 8.0 and above with Triton.
"""

from __future__ import annotations

import os

import torch
from torch import nn

import kernels

ENV = "OPEN_LMI_L2_PREFETCH_MB"
DEFAULT_MB = 0.0  # run 44 (cuBLAS, no PDL): 8 MB -1.0 % at 8B TP=1; run 49 (PDL + bf16 GEMV): 8 MB +2.9 %
MAX_ROWS = 16  # decode-sized calls only: above this the GEMMs are not bandwidth-bound on the weight
# the tensor a linear layer's kernel reads, by the names the float and quantized paths store it under
_WEIGHT_NAMES = ("kchunk", "packed", "qweight", "weight")


def weight_tensor(module: nn.Module) -> torch.Tensor | None:
    """The weight tensor `module`'s kernel reads at decode (contiguous), or None."""
    for name in _WEIGHT_NAMES:
        t = getattr(module, name, None)
        if isinstance(t, torch.Tensor) and t.is_contiguous() and t.numel() > 0:
            return t
    return None


def prefetch_bytes(tp_degree: int = 1) -> int:
    """`OPEN_LMI_L2_PREFETCH_MB` in bytes (default DEFAULT_MB: off, at any degree); a clear error
    on a bad value. (`tp_degree`: kept for callers; no degree turns it on by itself.)"""
    raw = os.environ.get(ENV, "").strip()
    try:
        mb = float(raw) if raw else DEFAULT_MB
    except ValueError:
        raise ValueError(f"{ENV}={raw!r}: expected a number of MiB (0 turns the prefetch off)") from None
    if mb < 0:
        raise ValueError(f"{ENV}={raw!r}: must be >= 0")
    return int(mb * (1 << 20))


class WeightPrefetch:
    """One model's prefetch chain: the side stream and whether a prefetch is in flight on it."""

    def __init__(self, device: torch.device, max_bytes: int) -> None:
        assert device.type == "cuda" and max_bytes > 0
        self.max_bytes = max_bytes
        self.side = torch.cuda.Stream(device)
        self.pending = False

    def after(self, module: nn.Module, x: torch.Tensor) -> None:
        """`module` has just been launched on `x`: prefetch its successor's weight, off the compute stream."""
        nxt = module.prefetch_next
        if nxt is None or x.numel() > MAX_ROWS * x.shape[-1]:
            return
        main = torch.cuda.current_stream(x.device)
        self.side.wait_stream(main)
        with torch.cuda.stream(self.side):
            kernels.l2_prefetch(nxt, self.max_bytes)
        self.pending = True

    def join(self) -> None:
        """The compute stream waits for the side stream (no-op when nothing is in flight)."""
        if self.pending:
            torch.cuda.current_stream(self.side.device).wait_stream(self.side)
            self.pending = False


def prefetch_chain(model: nn.Module, linear_type: type) -> list[nn.Module]:
    """`model`'s `linear_type` layers that hold a weight tensor, in registration order (the chain's order)."""
    return [m for m in model.modules() if isinstance(m, linear_type) and weight_tensor(m) is not None]


def link_weight_prefetch(model: nn.Module, linear_type: type, device: torch.device,
                         tp_degree: int = 1) -> WeightPrefetch | None:
    """Chain `model`'s `linear_type` layers for prefetch; None (nothing set) where it cannot run or is off."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 8:
        return None
    if not kernels.use_triton(torch.empty(0, device=device)):
        return None
    max_bytes = prefetch_bytes(tp_degree)
    if max_bytes == 0:
        return None
    chain = prefetch_chain(model, linear_type)
    if any(getattr(m, "quant_method", None) is not None for m in chain):
        return None  # quantized weights: 8 MiB cost GPTQ int4 5 % at batch 1, 4 MiB nothing (run 46)
    if len(chain) < 2:
        return None
    prefetch = WeightPrefetch(device, max_bytes)
    link_chain(chain, prefetch)
    return prefetch


def link_chain(chain: list[nn.Module], prefetch: object) -> None:
    """Give each layer of `chain` the `prefetch` object and its successor's weight (a detached
    alias: a parameter assigned to a module would register as one of its parameters)."""
    for here, nxt in zip(chain, chain[1:] + [None]):
        vars(here)["prefetch_next"] = None if nxt is None else weight_tensor(nxt).detach()
        vars(here)["weight_prefetch"] = prefetch

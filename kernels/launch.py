"""Launch helpers shared by the Triton launchers: keep compiled specialisations few and fixed.

Triton compiles one kernel per specialisation key, and the key includes whether each pointer
argument is 16-byte aligned. The per-step metadata our launchers receive (positions, slot
mappings, sequence lengths, block tables) are often views into one packed device array, or row
slices of it, at offsets that change with the batch: left alone, the same kernel would compile
again mid-serving for the unaligned case (measured: `bench/cold_start.py`, bench/RESULTS.md).
`aligned` hands such a view over as a small aligned copy instead, so every step reuses the
kernels compiled at start-up.
"""

from __future__ import annotations

import torch

_ALIGN = 16


def aligned(t: torch.Tensor) -> torch.Tensor:
    """`t` itself when its data pointer is 16-byte aligned, else a contiguous copy (which is)."""
    if t.data_ptr() % _ALIGN == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)

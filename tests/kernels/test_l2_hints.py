"""L2 hints (`kernels/l2_prefetch.py`: `L2Hint`): what a hint covers and when a launch takes it.

The carrier, the fused all-reduce + norm, is checked with hints in tests/kernels/
test_all_reduce_norm.py (the same answers; the CPU interpreter runs the added programs' loads);
on sm_90 its added programs compile to `prefetch.global.L2` instructions after the PDL wait
(`tests/support/pdl_sm90_compile.py`).
"""

from __future__ import annotations

import pytest
import torch

from kernels.l2_prefetch import HINT_MAX_ROWS, L2Hint, hint_launch, l2_hint


def test_hint_covers_the_first_bytes_in_whole_lines():
    w = torch.zeros(300, 77, dtype=torch.float16)  # 46,200 bytes
    h = l2_hint(w, 10_000)
    assert h.lines == 10_000 // 128 and h.base.data_ptr() == w.data_ptr() and h.base.numel() == w.numel() * 2
    assert l2_hint(w, 1 << 30).lines == 46_200 // 128  # capped at the tensor's bytes
    assert l2_hint(w, 100) is None  # less than a line
    with pytest.raises(AssertionError):
        l2_hint(w.t(), 1 << 20)  # storage order only
    with pytest.raises(AssertionError):
        L2Hint(torch.zeros(10, dtype=torch.uint8), 1)  # more lines than bytes


def test_hint_applies_to_decode_sized_calls_only():
    x = torch.zeros(4, 8)
    h = l2_hint(torch.zeros(4096), 8192)
    ptr, lines, programs, flags = hint_launch(h, HINT_MAX_ROWS, x)
    assert ptr is h.base and lines == h.lines and programs == h.programs and flags["HINT"]
    ptr, lines, programs, flags = hint_launch(h, HINT_MAX_ROWS + 1, x)
    assert ptr is x and lines == 0 and programs == 0 and not flags["HINT"]
    assert hint_launch(None, 1, x)[2] == 0

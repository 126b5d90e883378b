"""Bit packing of integer weights into int32 words, in GPTQ's and AWQ's orders.

GPTQ (the kernels' canonical order): word i of a packed dim holds the `32 // bits` consecutive
values 0..pf-1 of that dim at bits [bits*j, bits*j + bits). AWQ's GEMM layout packs 8 columns
per word in the interleaved order `AWQ_PACK_ORDER`: nibble j holds column `AWQ_PACK_ORDER[j]`
of its 8. Load-time helpers (plain torch, on the weights' device); the hot path never unpacks.
"""

from __future__ import annotations

import torch

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble j of a word holds column AWQ_PACK_ORDER[j]


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> their unsigned `bits`-bit values (int32), `32 // bits` per word along `dim`."""
    pf = 32 // bits
    shifts = torch.arange(0, 32, bits, device=packed.device, dtype=torch.int32)  # [pf]
    moved = packed.movedim(dim, -1).unsqueeze(-1)  # [..., W, 1]
    values = (moved >> shifts) & ((1 << bits) - 1)  # [..., W, pf]; & drops the sign bits of >>
    return values.reshape(*moved.shape[:-2], moved.shape[-2] * pf).movedim(-1, dim)


def pack_int32(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unsigned `bits`-bit values (any int dtype) -> int32 words along `dim` (its size / (32 // bits))."""
    pf = 32 // bits
    moved = values.movedim(dim, -1).to(torch.int64)
    assert moved.shape[-1] % pf == 0, f"dimension {moved.shape[-1]} is not a multiple of {pf}"
    moved = moved.reshape(*moved.shape[:-1], -1, pf)
    shifts = torch.arange(0, 32, bits, device=values.device, dtype=torch.int64)
    words = (moved << shifts).sum(-1)  # < 2**32
    words = torch.where(words >= 2**31, words - 2**32, words)  # the int32 with those bits
    # contiguous: the kernels read the words by row (a moved view along dim 0 is column-major)
    return words.to(torch.int32).movedim(-1, dim).contiguous()


def awq_to_natural_columns(values: torch.Tensor) -> torch.Tensor:
    """Columns unpacked from AWQ words ([..., 8w]) -> natural column order."""
    n = values.shape[-1]
    # position of natural column c inside its group of 8 = index of c in AWQ_PACK_ORDER
    where = torch.tensor([AWQ_PACK_ORDER.index(c) for c in range(8)], device=values.device)
    index = (torch.arange(0, n, 8, device=values.device).unsqueeze(1) + where).reshape(-1)
    return values.index_select(-1, index)

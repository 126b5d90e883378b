"""This step's RoPE and K/V write, left to the decode attention (`kernels.paged_decode_attention(..., rope=)`).

Why: at decode every layer ran `rotary_and_write_kv` as a launch of its own between the qkv projection
and the attention: ~3 us a layer at batch 1 on an H200 (2.3 bf16 / 3.0 FP8, `OPEN_LMI_PDL=0 python3
bench/decode_profile.py --tp 1 --quantize fp8,bf16`), ~2 us on a rank at TP=4. The attention's programs
load the query heads anyway, and the last split of each (sequence, KV head) covers the new token's
position: they rotate q as they load it, and that split rotates the new key and stores it and the
value at the token's slot before it reads its part of the cache. The rotation is the separate kernel's
(`kernels/rotary.rotate_pair`: the same fp32 operations, each multiply-add an explicit FMA, rounded to
the same dtype). Measured (bench/RESULTS.md run 59, H200): 8B batch-1 bf16 4.17 -> 4.12 ms/token,
8B TP=2 2.665 -> 2.625.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class DecodeRope(NamedTuple):
    """What the decode attention needs to apply RoPE and store this step's K/V itself (see above)."""

    positions: torch.Tensor  # [S] int64: each row's position (its sequence length - 1 at decode)
    key: torch.Tensor  # [S, KVH, D]: this step's keys, not rotated (rows contiguous over D)
    value: torch.Tensor  # [S, KVH, D]
    cos_sin_cache: torch.Tensor  # [max_position, rot_dim]: cos in the first half, sin in the second
    slot_mapping: torch.Tensor  # [S] int32 / int64: each row's K/V slot in the cache (-1: none)

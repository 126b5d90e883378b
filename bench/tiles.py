"""Decode-tile variants for benches: the engine's own decode graph with other `kernels/skinny_linear.py` buckets.

Why: the tables there come from sweeps of one kernel at a time on one card; whether another tiling wins is
best seen inside the engine's decode graph (PDL between neighbours, L2, the split-K finish), per card: on an
H200 two buckets measured faster there than the H100's picks (bench/RESULTS.md run 72).
`bench/decode_profile.py --tiles "A; B; ..."` profiles each variant, applying it in every rank process
before the model is built.

A variant is one of:
- `card`: the tables as serving picks them on this device (its `card_of` buckets included);
- `default`: the H100-measured tables, no per-card buckets;
- settings separated by spaces, each replacing one bucket of `default`:
  `gemvM=mode,block_n,block_k,unroll,warps,stages,per_sm` (FP8 weights through `kernels/fp8_gemv.py`, M in 1, 2, 4),
  `bf16gemvM=...` (bf16 weights through the same GEMV, M in 1, 2),
  `skinnyM=mode,block_n,block_k,warps,stages,per_sm` (FP8 weights through the tiled kernel, M in 1, 2, 4, 8, 16).
"""

from __future__ import annotations

import re
import sys

_SETTING = re.compile(r"^(gemv|bf16gemv|skinny)(\d+)=([\d.,]+)$")
_WIDTH = {"gemv": 7, "bf16gemv": 7, "skinny": 6}


def parse(variant: str) -> dict[tuple[str, int], tuple]:
    """{(table, M bucket): entry} of a variant's settings ({} for `card` / `default`); ValueError on anything else."""
    variant = variant.strip()
    if variant in ("card", "default"):
        return {}
    out: dict[tuple[str, int], tuple] = {}
    for word in variant.split():
        m = _SETTING.match(word)
        if not m:
            raise ValueError(f"tile variant {variant!r}: {word!r} is not card, default or table<M>=v,v,...")
        table, bucket, values = m.group(1), int(m.group(2)), m.group(3).split(",")
        if len(values) != _WIDTH[table] or bucket not in (1, 2, 4, 8, 16) or (table != "skinny" and bucket > 4):
            raise ValueError(f"tile variant {variant!r}: {word!r} needs {_WIDTH[table]} values and a bucket "
                             f"{'1, 2, 4, 8 or 16' if table == 'skinny' else '1, 2 or 4'}")
        out[(table, bucket)] = tuple(float(v) if "." in v else int(v) for v in values)
    return out


def apply(variant: str) -> None:
    """Set this process's skinny-linear tables to `variant` (call before any decode graph is captured)."""
    settings = parse(variant)
    if variant.strip() == "card":
        return
    import kernels.skinny_linear  # noqa: F401 - the submodule (the package exports a function of that name)

    tables = sys.modules["kernels.skinny_linear"]
    tables._CARD_GEMV_TABLE.clear()
    tables._CARD_TABLE.clear()
    target = {"gemv": tables._GEMV_TABLE, "bf16gemv": tables._BF16_GEMV_TABLE}
    for (table, bucket), entry in settings.items():
        if table == "skinny":
            tables._TABLE[(bucket, 1)] = entry
        else:
            target[table][bucket] = entry

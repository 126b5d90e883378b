"""Builders shared by the kernel tests: random paged KV caches and block tables."""

from __future__ import annotations

import torch


def make_paged_cache(
    seq_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str,
    seed: int = 0,
    spare_blocks: int = 3,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random K/V caches plus a shuffled block table per sequence -> (k, v, block_tables, seq_lens)."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [(n + block_size - 1) // block_size for n in seq_lens]
    max_blocks = max(blocks_per_seq) + 1  # one unused column: tables are padded in practice
    num_blocks = sum(blocks_per_seq) + spare_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k = torch.randn(shape, generator=g).to(dtype)
    v = torch.randn(shape, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.zeros((len(seq_lens), max_blocks), dtype=torch.int32)
    i = 0
    for s, nb in enumerate(blocks_per_seq):
        tables[s, :nb] = torch.tensor(perm[i : i + nb], dtype=torch.int32)
        i += nb
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return k.to(device), v.to(device), tables.to(device), lens.to(device)


def tol(dtype: torch.dtype) -> dict[str, float]:
    return {torch.float32: dict(atol=2e-4, rtol=2e-4), torch.float16: dict(atol=4e-3, rtol=4e-3)}.get(
        dtype, dict(atol=3e-2, rtol=3e-2)
    )

"""Triton KV-cache write vs the torch reference: strided K/V views, slot -1 skipped."""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.cache_ops import write_kv_cache


@pytest.mark.parametrize("dtype, head_dim", [(torch.float32, 64), (torch.float16, 80)])
def test_write_kv_cache_matches_reference(device, dtype, head_dim):
    num_tokens, num_kv_heads, num_heads, block_size, num_blocks = 6, 2, 4, 4, 5
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim).to(dtype).to(device)
    kv_dim = num_kv_heads * head_dim
    key = qkv[:, num_heads * head_dim : num_heads * head_dim + kv_dim].view(num_tokens, num_kv_heads, head_dim)
    value = qkv[:, num_heads * head_dim + kv_dim :].view(num_tokens, num_kv_heads, head_dim)
    slots = torch.tensor([0, 7, -1, 12, 19, -1], dtype=torch.int64, device=device)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim).to(dtype).to(device)
    v_cache = torch.randn_like(k_cache)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    write_kv_cache(key, value, k_cache, v_cache, slots)
    reference.write_kv_cache(key, value, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_write_kv_cache_all_padding_writes_nothing(device):
    k_cache = torch.randn(2, 4, 1, 64, device=device)
    before = k_cache.clone()
    key = torch.randn(3, 1, 64, device=device)
    write_kv_cache(key, key, k_cache, k_cache.clone(), torch.full((3,), -1, dtype=torch.int32, device=device))
    assert torch.equal(k_cache, before)

"""Triton KV-cache write vs the torch reference: strided K/V views, slot -1 skipped."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import tol

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


@pytest.mark.parametrize("dtype, head_dim, rot_dim", [(torch.float32, 64, 64), (torch.float16, 128, 128),
                                                      (torch.float32, 80, 32)])
def test_rotary_and_write_kv_matches_rotary_then_write(device, dtype, head_dim, rot_dim):
    # One launch per layer step: q and k rotated in place (views of a fused qkv output), the rotated
    # k and v stored at their slots, padded rows (slot -1) stored nowhere; partial rotary keeps
    # the unrotated dims of the stored key.
    from kernels.rotary import rotary_and_write_kv

    num_tokens, num_heads, num_kv_heads, block_size, num_blocks = 6, 8, 2, 4, 5
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim).to(dtype).to(device)
    q_end, k_end = num_heads * head_dim, (num_heads + num_kv_heads) * head_dim
    views = lambda t: (t[:, :q_end], t[:, q_end:k_end].view(num_tokens, num_kv_heads, head_dim),  # noqa: E731
                       t[:, k_end:].view(num_tokens, num_kv_heads, head_dim))
    inv = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2).float() / rot_dim))
    freqs = torch.outer(torch.arange(64).float(), inv)
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)
    positions = torch.tensor([0, 5, 63, 9, 17, 2], device=device)
    slots = torch.tensor([3, 8, -1, 19, 0, -1], dtype=torch.int64, device=device)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim).to(dtype).to(device)
    v_cache = torch.randn_like(k_cache)
    ref_qkv, k_ref, v_ref = qkv.clone(), k_cache.clone(), v_cache.clone()
    rotary_and_write_kv(positions, *views(qkv), cos_sin, head_dim, k_cache, v_cache, slots)
    q_ref, key_ref, value_ref = views(ref_qkv)
    reference.rotary_embedding(positions, q_ref, key_ref, cos_sin, head_dim)
    reference.write_kv_cache(key_ref, value_ref, k_ref, v_ref, slots)
    torch.testing.assert_close(qkv, ref_qkv, **tol(dtype))
    torch.testing.assert_close(k_cache, k_ref, **tol(dtype))
    assert torch.equal(v_cache, v_ref)

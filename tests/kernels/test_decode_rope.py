"""RoPE and the K/V write left to the decode attention (`kernels/decode_rope.py`): the same cache bits
and the same output as `rotary_and_write_kv` followed by the attention, the inputs left unrotated, and
close to the torch reference with the same `rope` (interpreter on CPU, compiled on CUDA)."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import make_paged_cache, tol

import kernels
from kernels import reference
from kernels.decode_rope import DecodeRope
from kernels.paged_decode_attention import paged_decode_attention_impl
from kernels.rotary import rotary_and_write_kv


def _cos_sin(max_pos: int, rot_dim: int, device: str) -> torch.Tensor:
    inv = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2).float() / rot_dim))
    freqs = torch.arange(max_pos).float()[:, None] * inv[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)


CASES = [
    # (group, head_dim, rot_dim, dtype, seq_lens, block_size, window)
    (4, 64, 64, torch.float32, [1, 17, 40, 0], 16, 0),  # a graph padding row last (seq_len 0, slot -1)
    (2, 64, 32, torch.float16, [33, 5], 16, 0),  # rotary on part of each head
    (4, 80, 80, torch.float32, [9, 31], 8, 0),  # head_dim not a power of two
    (8, 128, 128, torch.float16, [70, 3], 16, 24),  # a sliding window
    # bf16, as served (CUDA only: the attention's bf16 dots are not right in Triton's CPU interpreter)
    pytest.param(4, 128, 128, torch.bfloat16, [70, 3, 129], 16, 0,
                 marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 dots need CUDA")),
]


@pytest.mark.parametrize("group, head_dim, rot_dim, dtype, seq_lens, block_size, window", CASES)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_rope_equals_the_separate_kernels(device, group, head_dim, rot_dim, dtype, seq_lens, block_size,
                                                 window, num_splits):
    num_kv_heads = 2
    heads = num_kv_heads * group
    k_cache, v_cache, tables, lens = make_paged_cache(seq_lens, num_kv_heads, head_dim, block_size, dtype, device)
    S = len(seq_lens)
    positions = (lens.long() - 1).clamp_min(0)
    tab = tables.long()
    slots = torch.where(lens > 0, tab[torch.arange(S, device=device), positions // block_size] * block_size
                        + positions % block_size, torch.full_like(positions, -1))
    qkv = torch.randn(S, (heads + 2 * num_kv_heads) * head_dim).to(dtype).to(device)
    q = qkv[:, : heads * head_dim].view(S, heads, head_dim)
    k = qkv[:, heads * head_dim: (heads + num_kv_heads) * head_dim].view(S, num_kv_heads, head_dim)
    v = qkv[:, (heads + num_kv_heads) * head_dim:].view(S, num_kv_heads, head_dim)
    cos_sin = _cos_sin(max(seq_lens), rot_dim, device)  # a row per position the rows reach
    opts = dict(block_n=16, num_splits=num_splits, min_split=1, window=window)

    # separate: RoPE + K/V write in place on a copy of qkv, then the attention
    qkv_a = qkv.clone()
    kc_a, vc_a = k_cache.clone(), v_cache.clone()
    q_a = qkv_a[:, : heads * head_dim].view(S, heads, head_dim)
    k_a = qkv_a[:, heads * head_dim: (heads + num_kv_heads) * head_dim].view(S, num_kv_heads, head_dim)
    v_a = qkv_a[:, (heads + num_kv_heads) * head_dim:].view(S, num_kv_heads, head_dim)
    rotary_and_write_kv(positions, q_a, k_a, v_a, cos_sin, head_dim, kc_a, vc_a, slots)
    want = paged_decode_attention_impl(q_a, kc_a, vc_a, tables, lens, head_dim**-0.5, **opts)

    # fused: q and k unrotated, the attention rotates and stores
    qkv_before = qkv.clone()
    kc_b, vc_b = k_cache.clone(), v_cache.clone()
    got = paged_decode_attention_impl(q, kc_b, vc_b, tables, lens, head_dim**-0.5, **opts,
                                      rope=DecodeRope(positions, k, v, cos_sin, slots))
    assert torch.equal(qkv, qkv_before)  # the inputs stay unrotated
    assert torch.equal(vc_b, vc_a) and torch.all(got[lens == 0] == 0)
    if device == "cpu":  # the same operations (the interpreter runs them as written): the same bits
        assert torch.equal(kc_b, kc_a) and torch.equal(got[lens > 0], want[lens > 0])
    else:  # compiled: the FMAs are explicit, the rest may still round in another order (within a rounding)
        torch.testing.assert_close(kc_b, kc_a, **tol(dtype))
        torch.testing.assert_close(got[lens > 0], want[lens > 0], **tol(dtype))

    # the torch reference with the same hand-off
    kc_r, vc_r = k_cache.clone(), v_cache.clone()
    ref = reference.paged_decode_attention(q[lens > 0], kc_r, vc_r, tables[lens > 0], lens[lens > 0], head_dim**-0.5,
                                           window=window, rope=DecodeRope(positions[lens > 0], k[lens > 0],
                                                                          v[lens > 0], cos_sin, slots[lens > 0]))
    torch.testing.assert_close(got[lens > 0], ref, **tol(dtype))
    torch.testing.assert_close(kc_r, kc_b, **tol(dtype))
    assert torch.equal(vc_r, vc_b)


def test_dispatcher_passes_rope_on(device):
    k_cache, v_cache, tables, lens = make_paged_cache([5, 12], 1, 64, 16, torch.float32, device)
    positions = lens.long() - 1
    slots = tables.long()[torch.arange(2, device=device), 0] * 16 + positions
    q = torch.randn(2, 2, 64, device=device)
    k, v = torch.randn(2, 1, 64, device=device), torch.randn(2, 1, 64, device=device)
    rope = DecodeRope(positions, k, v, _cos_sin(64, 64, device), slots)
    kc, vc = k_cache.clone(), v_cache.clone()
    got = kernels.paged_decode_attention(q, kc, vc, tables, lens, 0.125, rope=rope)
    kc_r, vc_r = k_cache.clone(), v_cache.clone()
    ref = reference.paged_decode_attention(q, kc_r, vc_r, tables, lens, 0.125, rope=rope)
    torch.testing.assert_close(got, ref, **tol(torch.float32))
    torch.testing.assert_close(kc, kc_r, **tol(torch.float32))
    assert not torch.equal(kc, k_cache)  # the new keys were stored

"""The torch reference attention (the oracle for the Triton kernels) vs a naive per-head loop.

The references run F.scaled_dot_product_attention on gathered, masked K/V; here each query row
is written out as softmax(q . K^T * scale) . V over exactly the keys it may see.
"""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import make_paged_cache, tol

from kernels import reference


def _naive_rows(q, k_cache, v_cache, table, kv_len, q_pos, scale, window=0, softcap=0.0):
    """q: [n, H, D] at positions q_pos (list) of one sequence -> [n, H, D] in fp32 (`window` > 0: each
    row sees its last `window` positions only; `softcap` > 0: scores capped as c * tanh(s / c))."""
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    slots = [int(table[p // block_size]) * block_size + p % block_size for p in range(kv_len)]
    k = k_cache.flatten(0, 1)[slots].float()  # [L, KVH, D]
    v = v_cache.flatten(0, 1)[slots].float()
    out = torch.empty(q.shape, dtype=torch.float32)
    for i, pos in enumerate(q_pos):
        for h in range(q.shape[1]):
            lo = max(0, pos + 1 - window) if window else 0
            kh, vh = k[lo : pos + 1, h // group], v[lo : pos + 1, h // group]
            s = kh @ q[i, h].float() * scale
            if softcap:
                s = softcap * torch.tanh(s / softcap)
            p = torch.softmax(s, dim=0)
            out[i, h] = p @ vh
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group", [1, 3])
def test_decode_reference_matches_naive(group, dtype):
    num_kv_heads, head_dim, seq_lens = 3, 64, [1, 16, 17, 250, 40]
    k, v, tables, lens = make_paged_cache(seq_lens, num_kv_heads, head_dim, 16, dtype, "cpu")
    # A query viewed out of a fused qkv buffer, as the engine passes it.
    qkv = torch.randn(len(seq_lens), (group + 2) * num_kv_heads * head_dim).to(dtype)
    q = qkv[:, : group * num_kv_heads * head_dim].view(len(seq_lens), group * num_kv_heads, head_dim)
    out = reference.paged_decode_attention(q, k, v, tables, lens, 0.125)
    assert out.dtype == dtype and out.shape == q.shape
    for s, n in enumerate(seq_lens):
        want = _naive_rows(q[s : s + 1], k, v, tables[s], n, [n - 1], 0.125)
        torch.testing.assert_close(out[s : s + 1].float(), want, **tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_reference_matches_naive(dtype):
    num_kv_heads, group, head_dim = 3, 3, 64
    chunks = [(0, 1), (0, 45), (20, 13), (5, 0), (31, 1)]  # (cached context, new queries)
    seq_lens = [c + n for c, n in chunks]
    k, v, tables, lens = make_paged_cache(seq_lens, num_kv_heads, head_dim, 16, dtype, "cpu")
    starts = [0]
    for _, n in chunks:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], num_kv_heads * group, head_dim).to(dtype)
    qsl = torch.tensor(starts, dtype=torch.int32)
    out = reference.prefill_attention(q, k, v, tables, qsl, lens, 45, 0.125)
    assert out.dtype == dtype and out.shape == q.shape
    for s, (ctx, n) in enumerate(chunks):
        want = _naive_rows(q[starts[s] : starts[s + 1]], k, v, tables[s], ctx + n, list(range(ctx, ctx + n)), 0.125)
        torch.testing.assert_close(out[starts[s] : starts[s + 1]].float(), want, **tol(dtype))
    # A single-token chunk is a decode step: both references agree.
    dec = reference.paged_decode_attention(q[-1:], k, v, tables[-1:], lens[-1:], 0.125)
    torch.testing.assert_close(out[-1:], dec, **tol(dtype))


@pytest.mark.parametrize("window, softcap", [(1, 0.0), (7, 0.0), (16, 0.0), (300, 0.0), (0, 2.0), (7, 2.0)])
def test_sliding_window_references_match_naive(window, softcap):
    """A sliding window W: each query sees the W positions ending at its own (all of them when W
    exceeds the context), in the decode, prefill and mixed references alike; with a soft cap c
    (Gemma 2), each score s is c * tanh(s / c)."""
    num_kv_heads, group, head_dim, scale = 2, 2, 64, 0.125
    chunks = [(0, 1), (0, 45), (20, 13), (40, 1)]  # (cached context, new queries)
    seq_lens = [c + n for c, n in chunks]
    k, v, tables, lens = make_paged_cache(seq_lens, num_kv_heads, head_dim, 16, torch.float32, "cpu")
    starts = [0]
    for _, n in chunks:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], num_kv_heads * group, head_dim)
    qsl = torch.tensor(starts, dtype=torch.int32)
    pre = reference.prefill_attention(q, k, v, tables, qsl, lens, 45, scale, window=window, softcap=softcap)
    mixed = reference.mixed_attention(q, k, v, tables, qsl, lens, scale, window=window, softcap=softcap)
    for s, (ctx, n) in enumerate(chunks):
        rows = slice(starts[s], starts[s + 1])
        want = _naive_rows(q[rows], k, v, tables[s], ctx + n, list(range(ctx, ctx + n)), scale, window, softcap)
        torch.testing.assert_close(pre[rows], want, **tol(torch.float32))
        torch.testing.assert_close(mixed[rows], want, **tol(torch.float32))
    last = [starts[s + 1] - 1 for s in range(len(chunks))]  # each sequence's last row, as a decode
    dec = reference.paged_decode_attention(q[last], k, v, tables, lens, scale, window=window, softcap=softcap)
    torch.testing.assert_close(dec, pre[last], **tol(torch.float32))
    if 0 < window < 40 or softcap:  # the window or the cap really acts: not the plain answer
        assert not torch.allclose(dec[-1], reference.paged_decode_attention(q[last], k, v, tables, lens, scale)[-1])

"""Triton causal varlen prefill/extend attention vs the torch reference."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import make_paged_cache, tol

from kernels import reference
from kernels.prefill_attention import prefill_attention_impl

CASES = [
    # (group, head_dim, dtype, [(context_len, query_len), ...], block_size)
    (1, 64, torch.float32, [(0, 1), (0, 17), (16, 16)], 16),
    (4, 128, torch.float16, [(5, 11), (0, 32), (31, 1)], 16),
    (8, 64, torch.float16, [(3, 20)], 8),
    (4, 80, torch.float32, [(0, 9), (17, 7)], 16),
    (2, 256, torch.float16, [(3, 20), (0, 5)], 16),  # Gemma 3's heads
]


@pytest.mark.parametrize("group, head_dim, dtype, chunks, block_size", CASES)
def test_prefill_matches_reference(device, group, head_dim, dtype, chunks, block_size):
    num_kv_heads = 1 if group == 8 else 2
    seq_lens = [c + q for c, q in chunks]
    k, v, tables, lens = make_paged_cache(seq_lens, num_kv_heads, head_dim, block_size, dtype, device)
    q_lens = [q for _, q in chunks]
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    qsl = torch.tensor(starts, dtype=torch.int32, device=device)
    q = torch.randn(starts[-1], num_kv_heads * group, head_dim).to(dtype).to(device)
    scale = head_dim**-0.5
    out = prefill_attention_impl(q, k, v, tables, qsl, lens, max(q_lens), scale, block_m=16, block_n=16)
    ref = reference.prefill_attention(q, k, v, tables, qsl, lens, max(q_lens), scale)
    torch.testing.assert_close(out, ref, **tol(dtype))


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_prefill_writes_a_given_out_in_place(device, impl):
    # The prompt rows of a mixed step land after the decode rows of the layer's buffer: written
    # there directly, equal to a fresh result, the rows before them untouched.
    from kernels.prefill_attention import prefill_attention

    num_kv_heads, group, head_dim = 2, 2, 64
    k, v, tables, lens = make_paged_cache([12, 20], num_kv_heads, head_dim, 16, torch.float32, device)
    qsl = torch.tensor([0, 5, 13], dtype=torch.int32, device=device)  # 5 and 8 new tokens
    q = torch.randn(13, num_kv_heads * group, head_dim, device=device)
    fn = prefill_attention if impl == "triton" else reference.prefill_attention
    want = fn(q, k, v, tables, qsl, lens, 8, head_dim**-0.5)
    buf = torch.full((16, num_kv_heads * group * head_dim), float("nan"), device=device)
    got = fn(q, k, v, tables, qsl, lens, 8, head_dim**-0.5, out=buf.view(16, -1, head_dim)[3:])
    assert got.data_ptr() == buf[3:].data_ptr()
    torch.testing.assert_close(buf[3:].view(13, -1, head_dim), want, rtol=0, atol=0)
    assert torch.isnan(buf[:3]).all()


@pytest.mark.parametrize("window, softcap", [(1, 0.0), (5, 0.0), (16, 0.0), (40, 0.0), (0, 3.0), (5, 3.0)])
def test_prefill_sliding_window_matches_reference(device, window, softcap):
    """Rows whose window starts tiles after position 0 (tiles before it are skipped; a row may see
    nothing in a tile its tile-mates need)."""
    chunks, group, head_dim, dtype = [(0, 37), (30, 20), (3, 1), (50, 1)], 2, 64, torch.float32
    seq_lens = [c + q for c, q in chunks]
    k, v, tables, lens = make_paged_cache(seq_lens, 2, head_dim, 8, dtype, device)
    starts = [0]
    for _, n in chunks:
        starts.append(starts[-1] + n)
    qsl = torch.tensor(starts, dtype=torch.int32, device=device)
    q = torch.randn(starts[-1], 2 * group, head_dim).to(dtype).to(device)
    out = prefill_attention_impl(q, k, v, tables, qsl, lens, 37, 0.125, block_m=16, block_n=16, window=window,
                                 softcap=softcap)
    ref = reference.prefill_attention(q, k, v, tables, qsl, lens, 37, 0.125, window=window, softcap=softcap)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out, ref, **tol(dtype))

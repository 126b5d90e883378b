"""Mixed (decode + prompt chunk) paged attention with a fixed grid vs the torch reference.

The steps are laid out as a captured graph sees them: T query rows of which the step uses the
first n, S sequence slots of which the unused ones are zero-length (`query_start_loc` repeats n,
`seq_lens` 0). The reference for the used rows is the prefill reference, itself checked against
SDPA; the rows past n must be left as they were.
"""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import make_paged_cache, tol

from kernels import reference
from kernels.mixed_attention import mixed_attention_impl

CASES = [
    # (group, head_dim, dtype, [(context_len, query_len), ...], spare rows, spare slots, block_m)
    (4, 64, torch.float32, [(7, 1), (20, 1), (0, 13), (16, 9)], 5, 3, 16),  # decodes first, then chunks
    (1, 64, torch.float32, [(0, 1), (0, 17), (16, 16)], 0, 0, 16),
    (4, 128, torch.float16, [(5, 11), (0, 32), (31, 1)], 3, 1, 16),
    (8, 64, torch.float16, [(3, 20), (40, 1)], 7, 2, 16),  # GROUP 8: two query tokens a tile
    (3, 80, torch.float32, [(0, 9), (17, 7), (2, 1)], 1, 4, 16),  # odd group and head_dim: masked rows
    (2, 64, torch.float32, [(30, 1)] * 5 + [(0, 4)], 2, 2, 32),
    (2, 256, torch.float16, [(7, 1), (0, 12)], 2, 1, 16),  # Gemma 3's heads
]


def _layout(chunks, spare_rows, spare_slots, device):
    q_lens = [q for _, q in chunks]
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    n = starts[-1]
    qsl = torch.tensor(starts + [n] * spare_slots, dtype=torch.int32, device=device)
    return qsl, n, n + spare_rows


@pytest.mark.parametrize("group, head_dim, dtype, chunks, spare_rows, spare_slots, block_m", CASES)
def test_mixed_matches_reference(device, group, head_dim, dtype, chunks, spare_rows, spare_slots, block_m):
    num_kv_heads = 1 if group == 8 else 2
    seq_lens = [c + q for c, q in chunks]
    k, v, tables, lens = make_paged_cache(seq_lens + [1] * spare_slots, num_kv_heads, head_dim, 16, dtype, device)
    lens[len(chunks):] = 0  # unused slots attend to nothing
    qsl, n, total = _layout(chunks, spare_rows, spare_slots, device)
    q = torch.randn(total, num_kv_heads * group, head_dim).to(dtype).to(device)
    scale = head_dim**-0.5
    buf = torch.full_like(q, float("nan"))
    got = mixed_attention_impl(q, k, v, tables, qsl, lens, scale, out=buf, block_m=block_m, block_n=16)
    assert got.data_ptr() == buf.data_ptr()
    want = reference.prefill_attention(q[:n], k, v, tables, qsl, lens, max(q for _, q in chunks), scale)
    torch.testing.assert_close(got[:n], want, **tol(dtype))
    assert torch.isnan(buf[n:]).all()  # the padded rows are not written
    ref = reference.mixed_attention(q, k, v, tables, qsl, lens, scale)
    torch.testing.assert_close(ref[:n], want, rtol=0, atol=0)
    assert (ref[n:] == 0).all()


def test_one_grid_serves_every_layout(device):
    # The same buffers (T rows, S slots) with different steps in them: the decode rows and prompt
    # chunks move, the results follow, as when one captured graph replays different steps.
    num_kv_heads, group, head_dim, slots, rows = 2, 4, 64, 6, 40
    k, v, tables, _ = make_paged_cache([60] * slots, num_kv_heads, head_dim, 16, torch.float32, device)
    q = torch.randn(rows, num_kv_heads * group, head_dim, device=device)
    for chunks in ([(10, 1), (20, 1), (0, 30)], [(0, 40)], [(59, 1)] * 6, [(3, 1), (5, 12), (9, 12), (0, 9)]):
        qsl, n, _ = _layout(chunks, 0, slots - len(chunks), device)
        lens = torch.tensor([c + q_ for c, q_ in chunks] + [0] * (slots - len(chunks)), dtype=torch.int32,
                            device=device)
        got = mixed_attention_impl(q, k, v, tables, qsl, lens, head_dim**-0.5, block_m=16, block_n=16)
        want = reference.prefill_attention(q[:n], k, v, tables, qsl, lens, max(q_ for _, q_ in chunks),
                                           head_dim**-0.5)
        torch.testing.assert_close(got[:n], want, **tol(torch.float32))


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_a_query_without_context_gets_zeros(device, impl):
    # A decode graph's padded rows: one query row each, seq_len 0.
    from kernels.mixed_attention import mixed_attention

    k, v, tables, _ = make_paged_cache([20, 20, 20], 2, 64, 16, torch.float32, device)
    lens = torch.tensor([20, 0, 0], dtype=torch.int32, device=device)
    qsl = torch.arange(4, dtype=torch.int32, device=device)
    q = torch.randn(3, 4, 64, device=device)
    fn = mixed_attention if impl == "triton" else reference.mixed_attention
    got = fn(q, k, v, tables, qsl, lens, 0.125, out=torch.full_like(q, float("nan")))
    assert (got[1:] == 0).all()
    want = reference.paged_decode_attention(q, k, v, tables, lens, 0.125)
    torch.testing.assert_close(got, want, **tol(torch.float32))


@pytest.mark.parametrize("window, softcap", [(1, 0.0), (6, 0.0), (33, 0.0), (0, 3.0), (6, 3.0)])
def test_mixed_sliding_window_matches_reference(device, window, softcap):
    chunks, group, head_dim, dtype = [(7, 1), (40, 1), (0, 29), (25, 18)], 4, 64, torch.float32
    seq_lens = [c + q for c, q in chunks]
    k, v, tables, lens = make_paged_cache(seq_lens + [1], 2, head_dim, 8, dtype, device)
    lens[len(chunks):] = 0
    qsl, n, total = _layout(chunks, 3, 1, device)
    q = torch.randn(total, 2 * group, head_dim).to(dtype).to(device)
    got = mixed_attention_impl(q, k, v, tables, qsl, lens, 0.125, block_m=16, block_n=16, window=window,
                               softcap=softcap)
    want = reference.prefill_attention(q[:n], k, v, tables, qsl, lens, 29, 0.125, window=window, softcap=softcap)
    assert not torch.isnan(got[:n]).any()
    torch.testing.assert_close(got[:n], want, **tol(dtype))

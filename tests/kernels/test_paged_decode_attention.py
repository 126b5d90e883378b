"""Triton paged decode attention vs the torch reference (interpreter on CPU, compiled on CUDA)."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import make_paged_cache, tol

from kernels import reference
from kernels.paged_decode_attention import paged_decode_attention, paged_decode_attention_impl

CASES = [
    # (group, head_dim, dtype, seq_lens, block_size)
    (1, 64, torch.float32, [1, 16, 17], 16),
    (4, 128, torch.float16, [33, 1, 32], 16),
    (8, 64, torch.float16, [7, 48], 16),
    (4, 80, torch.float32, [5, 31], 8),
    (2, 96, torch.float16, [64, 9], 32),
    (8, 128, torch.float32, [1, 2, 3], 16),
    (2, 256, torch.float16, [9, 40], 16),  # Gemma 3's heads
]


@pytest.mark.parametrize("group, head_dim, dtype, seq_lens, block_size", CASES)
@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_decode_matches_reference(device, group, head_dim, dtype, seq_lens, block_size, num_splits):
    num_kv_heads = 2
    k, v, tables, lens = make_paged_cache(seq_lens, num_kv_heads, head_dim, block_size, dtype, device)
    q = torch.randn(len(seq_lens), num_kv_heads * group, head_dim).to(dtype).to(device)
    scale = head_dim**-0.5
    out = paged_decode_attention_impl(q, k, v, tables, lens, scale, block_n=16, num_splits=num_splits, min_split=1)
    ref = reference.paged_decode_attention(q, k, v, tables, lens, scale)
    torch.testing.assert_close(out, ref, **tol(dtype))


@pytest.mark.parametrize("num_splits", [None, 1])
def test_decode_public_launcher_strided_query_and_padding_row(device, num_splits):
    # A query viewed out of a fused qkv buffer; a last row with seq_len 0 (graph padding) -> zeros,
    # also with one split, where the only program writes the output (no merge).
    num_kv_heads, group, head_dim = 1, 4, 64
    k, v, tables, lens = make_paged_cache([19, 1, 0], num_kv_heads, head_dim, 16, torch.float32, device)
    qkv = torch.randn(3, (group + 2) * num_kv_heads * head_dim, device=device)
    q = qkv[:, : group * head_dim].view(3, group, head_dim)
    if num_splits is None:
        out = paged_decode_attention(q, k, v, tables, lens, 0.125)
    else:
        torch.full((3 * group * head_dim,), float("nan"), device=device)  # leave garbage in the allocator
        out = paged_decode_attention_impl(q, k, v, tables, lens, 0.125, num_splits=num_splits)
    ref = reference.paged_decode_attention(q[:2], k, v, tables[:2], lens[:2], 0.125)
    torch.testing.assert_close(out[:2], ref, **tol(torch.float32))
    assert torch.all(out[2] == 0)


@pytest.mark.parametrize("num_splits", [2, 5, 32])
def test_split_merge_is_one_launch_that_resets_its_counters_and_repeats_bit_identically(device, num_splits):
    # The last split to arrive merges (a counter per sequence and KV head): every counter is back at
    # zero after the launch (the next launch, or a GEMV's split-K, starts clean), and the merge runs
    # in split order, so a repeated launch gives the same bits whatever order the programs ran in.
    from kernels.int4_matmul import _tile_counters

    seq_lens, num_kv_heads, head_dim = [200, 1, 64, 0, 129], 2, 64
    k, v, tables, lens = make_paged_cache(seq_lens, num_kv_heads, head_dim, 16, torch.float32, device)
    q = torch.randn(len(seq_lens), num_kv_heads * 4, head_dim, device=device)
    first = paged_decode_attention_impl(q, k, v, tables, lens, 0.125, block_n=16, num_splits=num_splits, min_split=1)
    assert not _tile_counters(q.device)[: len(seq_lens) * num_kv_heads].any()
    for _ in range(3):
        again = paged_decode_attention_impl(q, k, v, tables, lens, 0.125, block_n=16, num_splits=num_splits,
                                            min_split=1)
        assert torch.equal(again, first)
    ref = reference.paged_decode_attention(q, k, v, tables, lens, 0.125)
    torch.testing.assert_close(first, ref, **tol(torch.float32))
    assert torch.all(first[3] == 0)


@pytest.mark.parametrize("min_split", [1, 16, 40, 64, 1000])
def test_min_split_only_changes_how_many_programs_share_a_context(device, min_split):
    # A split covers at least min_split positions (whole tiles): contexts shorter than that run in
    # one program that writes the answer itself, longer ones merge fewer, longer splits.
    seq_lens, num_kv_heads, head_dim = [5, 70, 200, 1], 2, 64
    k, v, tables, lens = make_paged_cache(seq_lens, num_kv_heads, head_dim, 16, torch.float32, device)
    q = torch.randn(len(seq_lens), num_kv_heads * 2, head_dim, device=device)
    out = paged_decode_attention_impl(q, k, v, tables, lens, 0.125, block_n=16, num_splits=8, min_split=min_split)
    ref = reference.paged_decode_attention(q, k, v, tables, lens, 0.125)
    torch.testing.assert_close(out, ref, **tol(torch.float32))


def test_dispatch_uses_reference_on_cpu():
    import kernels

    assert not kernels.use_triton(torch.zeros(1))


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_decode_writes_a_given_out_in_place(device, impl):
    # A mixed step's eager attention writes its decode rows straight into the first rows of the
    # layer's [T, H * D] buffer: the same values as a fresh result, nothing outside those rows.
    num_kv_heads, group, head_dim = 2, 2, 64
    k, v, tables, lens = make_paged_cache([9, 30, 1], num_kv_heads, head_dim, 16, torch.float32, device)
    q = torch.randn(3, num_kv_heads * group, head_dim, device=device)
    fn = paged_decode_attention if impl == "triton" else reference.paged_decode_attention
    want = fn(q, k, v, tables, lens, head_dim**-0.5)
    buf = torch.full((5, num_kv_heads * group * head_dim), float("nan"), device=device)
    view = buf.view(5, num_kv_heads * group, head_dim)[:3]
    got = fn(q, k, v, tables, lens, head_dim**-0.5, out=view)
    assert got.data_ptr() == buf.data_ptr()
    torch.testing.assert_close(buf[:3].view(3, -1, head_dim), want, rtol=0, atol=0)
    assert torch.isnan(buf[3:]).all()


@pytest.mark.parametrize("window, softcap", [(1, 0.0), (10, 0.0), (16, 0.0), (100, 0.0), (0, 3.0), (10, 3.0)])
@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_decode_sliding_window_matches_reference(device, window, softcap, num_splits):
    """The splits share each sequence's last `window` positions (the merge counts the same non-empty splits)."""
    seq_lens, head_dim, dtype = [1, 9, 40, 77], 64, torch.float32
    k, v, tables, lens = make_paged_cache(seq_lens, 2, head_dim, 8, dtype, device)
    q = torch.randn(len(seq_lens), 4, head_dim).to(dtype).to(device)
    out = paged_decode_attention_impl(q, k, v, tables, lens, 0.125, block_n=16, num_splits=num_splits, window=window,
                                      softcap=softcap, min_split=1)
    ref = reference.paged_decode_attention(q, k, v, tables, lens, 0.125, window=window, softcap=softcap)
    torch.testing.assert_close(out, ref, **tol(dtype))

"""Triton paged attention for any mix of decode rows and prompt chunks, with a fixed launch grid.

Why: the decode and prefill kernels each size their grid from the step (how many sequences
decode, the longest prompt chunk), so a step that carries prompt tokens cannot be replayed from
one captured CUDA graph, and its attention used to run eagerly between graph pieces: 2-3
launches a layer plus their set-up, ~6 ms of host time per 8B step on a fast host and up to
16 ms on a slow one (RESULTS run 17), which is what set the serving inter-token tail there.

What: one kernel whose grid depends only on the shapes of its buffers, `[T // BLOCK_Q + S,
num_kv_heads]` for T query rows and S sequence slots. Each program owns one tile of BLOCK_Q
query tokens of one sequence and all GROUP query heads that share a KV head (BLOCK_M = BLOCK_Q x
GROUP rows, so each K/V tile is loaded once for the whole group). Sequence s owns the tiles
from `query_start_loc[s] // BLOCK_Q + s`; a program finds its sequence by binary search over
`query_start_loc` and returns at once when its tile holds no query row. So a graph captured
for T rows and S slots serves every step of at most T tokens and S sequences: unused slots are
zero-length sequences (`query_start_loc` repeats the token count, `seq_lens` 0), and rows past
`query_start_loc[S]` are not written. A sequence with query rows but `seq_lens` 0 gets zeros (the
decode kernel's convention for graph padding).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch import aligned
from kernels.prefill_attention import causal_paged_attend, check_varlen_inputs

_LOG2E = 1.4426950408889634


def tile_rows(group: int, num_tokens: int, on_cuda: bool, head_dim: int = 128) -> int:
    """BLOCK_M, the rows of a program's query tile (BLOCK_M // group query tokens).

    16 rows while a step's rows are few (its sequences mostly decode: a 16-row tile wastes least
    on one-token queries), 64 for the large buckets that long prompt chunks fill (more rows share
    each K/V tile). Graph-timed on an H100 (`bench/studies/mixed_attention.py`, 8B heads): 32 decodes +
    a 256 chunk 64.7 us at 16 against 74.2 at 64; one 2048-token chunk 329 against 172. Heads wider
    than 128 (Gemma 3's 256) keep 16 rows: a 64 x 256 float32 accumulator alone is 128 registers a
    thread."""
    rows = 16 if not on_cuda or num_tokens <= 512 or head_dim > 128 else 64
    return max(rows, triton.next_power_of_2(group))


def tile_columns(block_m: int, head_dim: int, on_cuda: bool) -> int:
    """BLOCK_N, the K/V positions a program reads per loop step.

    128 for 16-row tiles of small heads (decode-heavy steps of head_dim <= 64: each loop step then
    moves as many bytes as 64 positions of a 128-wide head), else 64. Graph-timed on an H100
    (`bench/studies/mixed_attention.py --configs`, 1B heads, steps of 256 tokens mostly decoding): 250 decodes
    at 900 + a 6-token chunk 177.0 us against 187.8 with 64; 256 decodes at 1,000 193.3 against 207.4;
    128 at 1,500 + a 128 chunk 154.4 against 168.5. At head_dim 128 the same change lost 0-7 %.
    Heads wider than 128 read 32 positions a step (the K and V tiles stay 16 KB each in bf16)."""
    if not on_cuda:
        return 16
    if head_dim > 128:
        return 32
    return 128 if block_m == 16 and head_dim <= 64 else 64


# NOTE: eager callers size the block table to the step; graphs fix every stride and count. Neither
# is specialised on, so one compiled kernel serves all of them.
@triton.jit(do_not_specialize=["stride_bt_seq", "num_seqs"])
def _mixed_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    out_ptr,
    qk_scale,  # softmax scale * log2(e)
    num_seqs,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_c_block,
    stride_c_tok,
    stride_c_head,
    stride_bt_seq,
    window,
    softcap,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SLIDING: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)

    # The sequence of this tile: the last s whose first tile (qsl[s] // BLOCK_Q + s) is <= tile.
    lo = num_seqs * 0  # a runtime int32, like hi (loop-carried values keep one type)
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        below = first <= tile
        lo = tl.where(below, mid + 1, lo)
        hi = tl.where(below, hi, mid)
    seq = lo - 1

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    m_block = tile - (q_start // BLOCK_Q + seq)
    if m_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len  # K/V positions before this chunk

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_in_seq = m_block * BLOCK_Q + offs_m // GROUP  # each row's query token, counted in its sequence
    head = kv_head * GROUP + offs_m % GROUP
    mask_m = (offs_m < BLOCK_Q * GROUP) & (q_in_seq < q_len)
    mask_d = offs_d < HEAD_DIM
    tok = (q_start + q_in_seq).to(tl.int64)
    o_ptrs = out_ptr + tok[:, None] * stride_o_tok + head[:, None] * stride_o_head + offs_d[None, :]
    if seq_len == 0:  # a query with no context (graph padding, by the decode kernel's convention): zeros
        tl.store(o_ptrs, tl.zeros([BLOCK_M, BLOCK_D], dtype=out_ptr.dtype.element_ty),
                 mask=mask_m[:, None] & mask_d[None, :])
        return
    q = tl.load(
        q_ptr + tok[:, None] * stride_q_tok + head[:, None] * stride_q_head + offs_d[None, :],
        mask=mask_m[:, None] & mask_d[None, :],
        other=0.0,
    )  # [BLOCK_M, BLOCK_D]
    q_pos = context_len + q_in_seq  # absolute position of each row's token

    # The tile's last token sees positions < end_n; nothing past it is needed.
    end_n = tl.minimum(seq_len, context_len + (m_block + 1) * BLOCK_Q)
    out = causal_paged_attend(q, q_pos, k_cache_ptr, v_cache_ptr, block_tables_ptr + seq.to(tl.int64) * stride_bt_seq,
                              kv_head, end_n, qk_scale, stride_c_block, stride_c_tok, stride_c_head,
                              context_len + m_block * BLOCK_Q, window, softcap,
                              HEAD_DIM, PAGE_SIZE, BLOCK_M, BLOCK_N, BLOCK_D, DOT_PRECISION, SLIDING, SOFTCAP)
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def mixed_attention_impl(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """`mixed_attention` with the tile sizes and launch shape exposed (tests and the bench pin them)."""
    assert window >= 0 and softcap >= 0, (window, softcap)
    num_tokens, num_heads, head_dim = query.shape
    page_size, num_kv_heads, num_seqs = check_varlen_inputs(query, k_cache, v_cache, block_tables, query_start_loc,
                                                            seq_lens)
    if out is None:
        out = torch.zeros((num_tokens, num_heads, head_dim), dtype=query.dtype, device=query.device)
    assert out.shape == query.shape and out.dtype == query.dtype and out.stride(2) == 1, (out.shape, out.dtype)
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    block_m = block_m or tile_rows(group, num_tokens, query.is_cuda, head_dim)
    block_q = max(1, block_m // group)
    assert block_m >= group and block_m == triton.next_power_of_2(block_m), (block_m, group)
    if block_n is None:
        block_n = tile_columns(block_m, head_dim, query.is_cuda)
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    block_tables, query_start_loc, seq_lens = aligned(block_tables), aligned(query_start_loc), aligned(seq_lens)
    _mixed_attention_kernel[grid](
        query,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        out,
        scale * _LOG2E,
        num_seqs,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        window,
        softcap * _LOG2E,
        GROUP=group,
        HEAD_DIM=head_dim,
        PAGE_SIZE=page_size,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=triton.next_power_of_2(head_dim),
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        SLIDING=window > 0,
        SOFTCAP=softcap > 0,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


def mixed_attention(
    query: torch.Tensor,  # [T, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    query_start_loc: torch.Tensor,  # [S + 1] int32 (or int64), non-decreasing from 0, last <= T
    seq_lens: torch.Tensor,  # [S] int32 (or int64): K/V length incl. this step's tokens (0: unused slot)
    scale: float,
    out: torch.Tensor | None = None,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Causal attention of each sequence's query rows (one for a decode, a chunk for a prompt)
    over its cached prefix and itself (with `window` W > 0, its last W positions only; `softcap`
    c > 0: scores capped as c * tanh(s / c)); see the module docstring for the fixed grid.

    Query j of sequence s sits at position `seq_lens[s] - q_len_s + j`. All K/V are read from
    the paged cache, so the caller writes this step's K/V first. Rows from `query_start_loc[S]`
    to T are not written (zeros in a new `out`). Returns `out` `[T, H, D]`.
    """
    return mixed_attention_impl(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, out=out,
                                window=window, softcap=softcap)

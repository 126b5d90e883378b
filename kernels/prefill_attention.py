"""Triton causal varlen prefill/extend attention reading all K/V from the paged cache.

In: this step's query tokens of several sequences packed `[num_tokens, H, D]` with
`query_start_loc`, total K/V lengths `seq_lens` (cached prefix + this chunk, so chunked prefill
and prefix-cache hits are the same case) and block tables. Out: `[num_tokens, H, D]`.
One program per (query tile, sequence, query head) runs an online softmax over K/V tiles
gathered token by token through the block table, stopping at the tile's causal frontier. With a
sliding window W (`window` > 0), a query at position p sees positions p - W + 1 .. p only, and the
K/V tiles wholly before the tile's first window are not read. With a soft cap c (`softcap` > 0,
Gemma 2) each score s becomes c * tanh(s / c) before the softmax.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch import aligned

_LOG2E = 1.4426950408889634


@triton.jit
def soft_cap(qk, cap):
    """cap * tanh(qk / cap), elementwise (both in the same units: here log2-scaled scores)."""
    return cap - 2.0 * cap / (tl.exp(2.0 * qk / cap) + 1.0)


@triton.jit
def causal_paged_attend(
    q,  # [BLOCK_M, BLOCK_D] query rows, masked rows zero
    q_pos,  # [BLOCK_M] absolute position of each row's token (>= 0)
    k_cache_ptr,
    v_cache_ptr,
    bt_row,  # this sequence's block-table row
    kv_head,
    end_n,  # K/V positions [0, end_n) are read
    qk_scale,  # softmax scale * log2(e)
    stride_c_block,
    stride_c_tok,
    stride_c_head,
    first_pos,  # the position of the tile's first query row (SLIDING only)
    window,  # the sliding window W (SLIDING only)
    softcap,  # the score cap times log2(e) (SOFTCAP only)
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SLIDING: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """Online softmax of each row over the paged K/V of one KV head at positions <= its own
    (`prefill_attention` and `mixed_attention` share it) -> the attention output, float32.
    With SLIDING, each row sees only the `window` positions ending at its own."""
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    start_n = 0
    if SLIDING:  # from the tile holding the first row's first visible position
        start_n = (tl.maximum(first_pos - window + 1, 0) // BLOCK_N) * BLOCK_N
    for n_start in range(start_n, end_n, BLOCK_N):
        offs_n = n_start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end_n
        page = tl.load(bt_row + offs_n // PAGE_SIZE, mask=mask_n, other=0).to(tl.int64)
        kv_offs = page * stride_c_block + (offs_n % PAGE_SIZE) * stride_c_tok + kv_head * stride_c_head
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_cache_ptr + kv_offs[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        if SOFTCAP:
            qk = soft_cap(qk, softcap)
        # NOTE: without a window, position 0 is visible to every row (q_pos >= 0), so each row's max
        # is finite after tile 0; with one, a row may see nothing in a tile and has no finite max yet.
        allowed = (offs_n[None, :] <= q_pos[:, None]) & mask_n[None, :]
        if SLIDING:
            allowed = allowed & (offs_n[None, :] > q_pos[:, None] - window)
        qk = tl.where(allowed, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        if SLIDING:  # a row with nothing visible so far: p and alpha are 0, not NaN
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(qk - m_use[:, None])
            alpha = tl.exp2(m_i - m_use)
        else:
            p = tl.exp2(qk - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_offs[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    if SLIDING:  # rows past the chunk (masked, never stored) may have seen nothing: no 0 / 0
        l_i = tl.where(l_i > 0, l_i, 1.0)
    return acc / l_i[:, None]


# NOTE: the block-table row stride varies with the step (eager steps size the table to the
# batch): not specialised on, so one compiled kernel serves every step.
@triton.jit(do_not_specialize=["stride_bt_seq"])
def _prefill_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    out_ptr,
    qk_scale,  # softmax scale * log2(e)
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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SLIDING: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    m_block = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // GROUP

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if m_block * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len  # K/V positions before this chunk

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < q_len
    mask_d = offs_d < HEAD_DIM
    tok = (q_start + offs_m).to(tl.int64)
    q = tl.load(
        q_ptr + tok[:, None] * stride_q_tok + head * stride_q_head + offs_d[None, :],
        mask=mask_m[:, None] & mask_d[None, :],
        other=0.0,
    )  # [BLOCK_M, BLOCK_D]
    q_pos = context_len + offs_m  # absolute position of each query row

    # The last query row of this tile sees positions < end_n; nothing past it is needed.
    end_n = tl.minimum(seq_len, context_len + (m_block + 1) * BLOCK_M)
    out = causal_paged_attend(q, q_pos, k_cache_ptr, v_cache_ptr, block_tables_ptr + seq.to(tl.int64) * stride_bt_seq,
                              kv_head, end_n, qk_scale, stride_c_block, stride_c_tok, stride_c_head,
                              context_len + m_block * BLOCK_M, window, softcap,
                              HEAD_DIM, PAGE_SIZE, BLOCK_M, BLOCK_N, BLOCK_D, DOT_PRECISION, SLIDING, SOFTCAP)
    tl.store(
        out_ptr + tok[:, None] * stride_o_tok + head * stride_o_head + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_d[None, :],
    )


def check_varlen_inputs(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                        query_start_loc: torch.Tensor, seq_lens: torch.Tensor) -> tuple[int, int, int]:
    """The layout both varlen launchers (prefill, mixed) rely on -> (page_size, num_kv_heads, num_seqs)."""
    num_heads, head_dim = query.shape[1:]
    _, page_size, num_kv_heads, cache_head_dim = k_cache.shape
    assert cache_head_dim == head_dim and v_cache.shape == k_cache.shape
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    assert query.stride(2) == 1, "query rows must be contiguous over head_dim"
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1
    assert query.dtype == k_cache.dtype == v_cache.dtype, (query.dtype, k_cache.dtype)
    assert block_tables.dim() == 2 and block_tables.stride(1) == 1
    assert query_start_loc.dtype in (torch.int32, torch.int64) and query_start_loc.is_contiguous()
    assert seq_lens.dtype in (torch.int32, torch.int64) and seq_lens.is_contiguous()
    num_seqs = seq_lens.shape[0]
    assert query_start_loc.shape[0] == num_seqs + 1 and block_tables.shape[0] >= num_seqs
    return page_size, num_kv_heads, num_seqs


def prefill_attention_impl(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
    block_m: int | None = None,
    block_n: int | None = None,
    out: torch.Tensor | None = None,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """`prefill_attention` with the tile sizes exposed (tests pin them)."""
    assert window >= 0 and softcap >= 0, (window, softcap)
    num_tokens, num_heads, head_dim = query.shape
    page_size, num_kv_heads, num_seqs = check_varlen_inputs(query, k_cache, v_cache, block_tables, query_start_loc,
                                                            seq_lens)
    if out is None:
        out = torch.empty((num_tokens, num_heads, head_dim), dtype=query.dtype, device=query.device)
    assert out.shape == query.shape and out.dtype == query.dtype and out.stride(2) == 1, (out.shape, out.dtype)
    if num_tokens == 0 or num_seqs == 0 or max_query_len == 0:
        return out
    wide = head_dim > 128  # Gemma 3's 256: smaller tiles keep the accumulator and K/V tiles in bounds
    if block_m is None:
        block_m = (32 if wide else 64) if query.is_cuda else 16
    if block_n is None:
        block_n = (32 if wide else 64) if query.is_cuda else 16
    grid = (triton.cdiv(max_query_len, block_m), num_seqs, num_heads)
    block_tables, query_start_loc, seq_lens = aligned(block_tables), aligned(query_start_loc), aligned(seq_lens)
    _prefill_attention_kernel[grid](
        query,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        out,
        scale * _LOG2E,
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
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        PAGE_SIZE=page_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=triton.next_power_of_2(head_dim),
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        SLIDING=window > 0,
        SOFTCAP=softcap > 0,
        num_warps=4,
        num_stages=2,
    )
    return out


def prefill_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32: total K/V length incl. this chunk
    max_query_len: int,
    scale: float,
    out: torch.Tensor | None = None,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its cached prefix + itself.

    Query j of sequence s sits at position `seq_lens[s] - q_len_s + j` and sees K/V positions up
    to and including it (with `window` W > 0, only the last W of them; with `softcap` c > 0, each
    scaled score s is c * tanh(s / c)). All K/V are read from the
    paged cache, so the caller writes this step's K/V first. Shapes: query [T, H, D] (unit stride
    over D); caches [NB, BS, KVH, D]; query_start_loc [S + 1]; seq_lens [S]. Returns [T, H, D].
    """
    return prefill_attention_impl(
        query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, max_query_len, scale, out=out,
        window=window, softcap=softcap,
    )

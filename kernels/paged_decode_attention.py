"""Triton paged decode attention: split-KV flash-decoding over block tables, GQA-aware, one launch.

In: one query token per sequence `[num_seqs, H, D]`, the paged K/V cache of one layer, block
tables and sequence lengths. Out: `[num_seqs, H, D]`. One program per (sequence, KV head, split)
serves all `H // KVH` query heads of that KV head with one pass over its slice of the context (a
`tl.dot` on a head tile padded to 16 rows), writing a partial output and its log-sum-exp; the last
non-empty split of a (sequence, KV head) to arrive (a self-resetting counter per pair) merges the
partials in split order and writes the output, so the merge needs no second launch (at batch 1 it
was a kernel boundary in every layer) and its result does not depend on arrival order. A split
covers at least `MIN_SPLIT_LEN` positions: where one split holds the whole context, its program
writes the output directly. Every launch parameter is derived from tensor
shapes, never from tensor values, so the op can be captured in a CUDA graph. With a sliding
window W (`window` > 0) the splits cover a sequence's last W positions only; with a soft cap c
(`softcap` > 0, Gemma 2) each score s becomes c * tanh(s / c) before the softmax. With `rope`
(`kernels/decode_rope.py`) the query comes unrotated: each program rotates its heads as it loads them,
and the last split of a (sequence, KV head) rotates the step's key and stores it and the value at the
row's slot before it reads the cache (the layer's RoPE + K/V write launch is gone).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels.decode_rope import DecodeRope
from kernels.int4_matmul import _tile_counters
from kernels.launch import aligned
from kernels.pdl import launch_options, release_dependents, wait_upstream
from kernels.prefill_attention import soft_cap
from kernels.rotary import rotate_pair

_LOG2E = 1.4426950408889634
MAX_SPLITS = 32
# Positions a split covers at the least (each split a whole number of BLOCK_N tiles in any case).
# bench/studies/decode_attention_batch1.py on an H100 (RESULTS run 51; us per chained batch-1 launch,
# BLOCK_N 64, 64 / 128 / 256): 8B at 128 positions 5.20 / 4.43 / 4.44, 256: 6.28 / 6.77 / 7.19,
# 512: 8.05 / 8.01 / 9.81, 1,024: 11.05 / 9.98 / 11.33, 4,096: 18.83 / 18.80 / 17.34; a rank of 8B or
# 70B at TP = 4 alike. Two other merges lost (run 51): every split's output read four at a time as
# [4, 16, head_dim] tiles (2-5x slower at every length), and one query head at a time with all
# splits at once (14.6 against 18.8 us at 4,096 positions, but 9.9 against 6.8 at 256 and, on a 70B
# rank, 12.8 against 8.0 at 1,024; 8B batch 1 in the engine 5.58 against 5.46 ms/token). The merge
# below goes split by split.
MIN_SPLIT_LEN = 128


@triton.jit
def _split_len(seq_len, num_splits, min_split, BLOCK_N: tl.constexpr):
    # Each split covers a whole number of BLOCK_N tiles, and at least min_split positions (a short
    # context then runs in fewer programs, down to one, which needs no merge).
    per_split = tl.maximum(tl.cdiv(seq_len, num_splits), min_split)
    return tl.cdiv(per_split, BLOCK_N) * BLOCK_N


@triton.jit
def _rope_rows(ptrs, x, pos, cs_ptr, stride_cs, offs_d, mask, HALF: tl.constexpr):
    """Rows `x` (loaded from `ptrs`, [R, BLOCK_D], head dims along the last axis) rotated neox style on
    their first 2 * HALF dims at position `pos`, in x's dtype: `kernels/rotary.py`'s arithmetic
    (`rotate_pair` in fp32, the partner element loaded again)."""
    first = offs_d < HALF
    rot = offs_d < 2 * HALF
    shift = tl.where(first, HALF, tl.where(rot, -HALF, 0))  # the partner of each dim
    xp = tl.load(ptrs + shift[None, :], mask=mask, other=0.0).to(tl.float32)
    r = tl.where(first, offs_d, offs_d - HALF)
    cos = tl.load(cs_ptr + pos * stride_cs + r, mask=rot, other=1.0).to(tl.float32)[None, :]
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + r, mask=rot, other=0.0).to(tl.float32)[None, :]
    xf = x.to(tl.float32)
    # x1 / x2: the pair's first-half and second-half elements, rotated as kernels/rotary.py rotates them
    x1 = tl.where(first[None, :], xf, xp)
    x2 = tl.where(first[None, :], xp, xf)
    o1, o2 = rotate_pair(x1, x2, cos, sin)
    o = tl.where(first[None, :], o1, o2)
    return tl.where(rot[None, :], o, xf).to(x.dtype)


# NOTE: the split count and the block-table row stride vary from step to step (eager steps size
# them to the batch); as runtime values that Triton does not specialise on, one compiled kernel
# serves every step, so nothing compiles while serving (bench/cold_start.py lists compiles).
@triton.jit(do_not_specialize=["stride_bt_seq", "num_splits", "min_split"])
def _paged_decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    mid_o_ptr,  # [S, H, num_splits, HEAD_DIM] fp32
    mid_lse_ptr,  # [S, H, num_splits] fp32 (log2 domain)
    out_ptr,  # [S, H, HEAD_DIM]
    counter_ptr,  # [>= S * KVH] int32, zero between launches (read with num_splits > 1)
    qk_scale,  # softmax scale * log2(e)
    stride_q_seq,
    stride_q_head,
    stride_o_seq,
    stride_o_head,
    stride_c_block,
    stride_c_tok,
    stride_c_head,
    stride_bt_seq,
    num_splits,
    min_split,  # positions a split covers at the least (`_split_len`)
    window,
    softcap,  # the score cap times log2(e) (SOFTCAP only)
    positions_ptr,  # ROPE: [S] each row's position
    k_new_ptr,  # ROPE: [S, KVH, D] the step's keys, not rotated
    v_new_ptr,  # ROPE: [S, KVH, D] its values
    cos_sin_ptr,  # ROPE: [max_position, 2 * HALF]
    slot_ptr,  # ROPE: [S] each row's cache slot (-1: none)
    stride_kn_seq,
    stride_vn_seq,
    stride_cs,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SLIDING: tl.constexpr,
    SOFTCAP: tl.constexpr,
    ROPE: tl.constexpr,  # rotate q here, and the last split stores the step's K/V (kernels/decode_rope.py)
    HALF: tl.constexpr,  # ROPE: half the rotated dims
    PDL: tl.constexpr,  # launched with programmatic dependent launch (kernels/pdl.py)
):
    release_dependents(PDL)
    wait_upstream(PDL)  # every program, before its early return too
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq)
    if SLIDING:  # the splits share the visible positions [seq_len - window, seq_len)
        first = tl.maximum(seq_len - window, 0)
    else:
        first = seq_len * 0
    span = seq_len - first
    split_len = _split_len(span, num_splits, min_split, BLOCK_N)
    filled = tl.cdiv(span, split_len)  # the non-empty splits: 0 .. filled - 1
    start = first + split * split_len
    end = tl.minimum(start + split_len, seq_len)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask_h = offs_h < GROUP
    mask_d = offs_d < HEAD_DIM
    mask_hd = mask_h[:, None] & mask_d[None, :]
    heads = kv_head * GROUP + offs_h  # [BLOCK_H] query heads served by this KV head
    o_ptrs = out_ptr + seq.to(tl.int64) * stride_o_seq + heads[:, None] * stride_o_head + offs_d[None, :]
    if start >= end:  # an empty split (the merge counts only the others)
        if split == 0:  # seq_len 0 (graph padding): every split is empty; the output is zeros
            tl.store(o_ptrs, tl.zeros([BLOCK_H, BLOCK_D], dtype=out_ptr.dtype.element_ty), mask=mask_hd)
        return

    q_ptrs = q_ptr + seq.to(tl.int64) * stride_q_seq + heads[:, None] * stride_q_head + offs_d[None, :]
    q = tl.load(q_ptrs, mask=mask_h[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_H, BLOCK_D]
    if ROPE:
        pos = tl.load(positions_ptr + seq).to(tl.int64)
        q = _rope_rows(q_ptrs, q, pos, cos_sin_ptr, stride_cs, offs_d, mask_hd, HALF)
        slot = tl.load(slot_ptr + seq).to(tl.int64)
        if (split == filled - 1) & (slot >= 0):  # the split that holds the new position stores its K/V
            kn_ptrs = k_new_ptr + seq.to(tl.int64) * stride_kn_seq + kv_head * HEAD_DIM + offs_d[None, :]
            kn = _rope_rows(kn_ptrs, tl.load(kn_ptrs, mask=mask_d[None, :], other=0.0), pos, cos_sin_ptr, stride_cs,
                            offs_d, mask_d[None, :], HALF)
            vn = tl.load(v_new_ptr + seq.to(tl.int64) * stride_vn_seq + kv_head * HEAD_DIM + offs_d[None, :],
                         mask=mask_d[None, :], other=0.0)
            # the cache is contiguous: slot s starts at s * stride_c_tok
            c_offs = slot * stride_c_tok + kv_head * stride_c_head + offs_d[None, :]
            tl.store(k_cache_ptr + c_offs, kn.to(k_cache_ptr.dtype.element_ty), mask=mask_d[None, :])
            tl.store(v_cache_ptr + c_offs, vn.to(v_cache_ptr.dtype.element_ty), mask=mask_d[None, :])
            tl.debug_barrier()  # stored by this program's threads, read back by others in the loop below

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq

    for n_start in range(start, end, BLOCK_N):
        offs_n = n_start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        page = tl.load(bt_row + offs_n // PAGE_SIZE, mask=mask_n, other=0).to(tl.int64)
        kv_offs = page * stride_c_block + (offs_n % PAGE_SIZE) * stride_c_tok + kv_head * stride_c_head
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_cache_ptr + kv_offs[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(v_cache_ptr + kv_offs[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)  # in flight with k
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_H, BLOCK_N]
        if SOFTCAP:
            qk = soft_cap(qk, softcap)
        qk = tl.where(mask_n[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]
    if filled == 1:  # the whole context in one program: this is the answer
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_hd)
    else:
        rows = (seq * tl.num_programs(1) * GROUP + heads).to(tl.int64) * num_splits  # [BLOCK_H]: split 0's row
        mid_ptrs = mid_o_ptr + (rows + split)[:, None] * HEAD_DIM + offs_d[None, :]
        tl.store(mid_ptrs, out, mask=mask_hd)
        tl.store(mid_lse_ptr + rows + split, m_i + tl.log2(l_i), mask=mask_h)
        # NOTE: the barrier orders every thread's partial stores before the release below.
        tl.debug_barrier()
        pair = seq * tl.num_programs(1) + kv_head
        arrived = tl.atomic_add(counter_ptr + pair, 1, sem="acq_rel")
        if arrived == filled - 1:  # the last to arrive merges all of them, in split order
            m = tl.full([BLOCK_H], -1e30, dtype=tl.float32)
            for s_i in range(filled):
                m = tl.maximum(m, tl.load(mid_lse_ptr + rows + s_i, mask=mask_h, other=-1e30, cache_modifier=".cg"))
            den = tl.zeros([BLOCK_H], dtype=tl.float32)
            num = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
            for s_i in range(filled):
                w = tl.exp2(tl.load(mid_lse_ptr + rows + s_i, mask=mask_h, other=-1e30, cache_modifier=".cg") - m)
                o_s = tl.load(mid_o_ptr + (rows + s_i)[:, None] * HEAD_DIM + offs_d[None, :], mask=mask_hd,
                              other=0.0, cache_modifier=".cg")
                den += w
                num += w[:, None] * o_s
            merged = num / tl.where(den > 0, den, 1.0)[:, None]
            tl.store(o_ptrs, merged.to(out_ptr.dtype.element_ty), mask=mask_hd)
            tl.store(counter_ptr + pair, 0)  # ready for the next launch


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _default_num_splits(query: torch.Tensor, num_kv_heads: int, max_context: int, block_n: int) -> int:
    # Enough (seq, kv_head, split) programs to cover the SMs about twice; splits that fall past a
    # sequence's length exit at once, so over-splitting short contexts costs little.
    num_sms = _num_sms(query.device.index or 0) if query.is_cuda else 4
    programs = query.shape[0] * num_kv_heads
    want = triton.cdiv(2 * num_sms, max(programs, 1))
    return max(1, min(want, triton.cdiv(max_context, block_n), MAX_SPLITS))


def paged_decode_attention_impl(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    block_n: int | None = None,
    num_splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    out: torch.Tensor | None = None,
    window: int = 0,
    softcap: float = 0.0,
    min_split: int | None = None,
    rope: DecodeRope | None = None,
) -> torch.Tensor:
    """`paged_decode_attention` with the tile, split count and launch shape exposed (tests,
    bench/studies/decode_attention_sweep.py and decode_attention_batch1.py pin them)."""
    assert window >= 0 and softcap >= 0, (window, softcap)
    num_seqs, num_heads, head_dim = query.shape
    num_blocks, page_size, num_kv_heads, cache_head_dim = k_cache.shape
    assert cache_head_dim == head_dim and v_cache.shape == k_cache.shape
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    assert query.stride(2) == 1, "query rows must be contiguous over head_dim"
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1
    assert query.dtype == k_cache.dtype == v_cache.dtype, (query.dtype, k_cache.dtype)
    assert block_tables.dim() == 2 and block_tables.shape[0] >= num_seqs and block_tables.stride(1) == 1
    assert block_tables.dtype in (torch.int32, torch.int64) and seq_lens.dtype in (torch.int32, torch.int64)
    assert seq_lens.shape[0] >= num_seqs and seq_lens.is_contiguous()
    if out is None:
        out = torch.empty((num_seqs, num_heads, head_dim), dtype=query.dtype, device=query.device)
    assert out.shape == query.shape and out.dtype == query.dtype and out.stride(2) == 1, (out.shape, out.dtype)
    if num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    if block_n is None:
        block_n = 64 if query.is_cuda else 16
    if num_splits is None:
        context = block_tables.shape[1] * page_size
        num_splits = _default_num_splits(query, num_kv_heads, min(context, window) if window else context, block_n)
    assert 1 <= num_splits <= MAX_SPLITS, num_splits
    min_split = MIN_SPLIT_LEN if min_split is None else min_split
    assert min_split >= 1, min_split
    block_tables, seq_lens = aligned(block_tables), aligned(seq_lens)
    block_d = triton.next_power_of_2(head_dim)
    mid_o = torch.empty((num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=query.device)
    mid_lse = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=query.device)
    # one self-resetting counter per (sequence, KV head): the GEMVs' split-K counters, free between launches
    counters = _tile_counters(query.device) if num_splits > 1 else mid_lse
    assert num_splits == 1 or num_seqs * num_kv_heads <= counters.numel(), (num_seqs, num_kv_heads)
    precision = "ieee" if query.dtype == torch.float32 else "tf32"
    pdl = launch_options(query)
    half, rope_args = 1, (seq_lens, query, query, query, seq_lens, 0, 0, 0)  # unused without rope
    if rope is not None:
        rot_dim = rope.cos_sin_cache.shape[1]
        assert rot_dim % 2 == 0 and rot_dim <= head_dim and rope.cos_sin_cache.stride(1) == 1, rope.cos_sin_cache.shape
        assert rope.key.shape == rope.value.shape == (num_seqs, num_kv_heads, head_dim), (rope.key.shape, query.shape)
        for t in (rope.key, rope.value):
            assert t.stride(2) == 1 and t.stride(1) == head_dim and t.dtype == query.dtype, "K/V rows: contiguous"
        assert rope.positions.shape[0] >= num_seqs and rope.slot_mapping.shape[0] >= num_seqs
        assert k_cache.is_contiguous() and v_cache.is_contiguous()
        half = rot_dim // 2
        rope_args = (aligned(rope.positions), rope.key, rope.value, rope.cos_sin_cache, aligned(rope.slot_mapping),
                     rope.key.stride(0), rope.value.stride(0), rope.cos_sin_cache.stride(0))
    _paged_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        mid_o,
        mid_lse,
        out,
        counters,
        scale * _LOG2E,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        num_splits,
        min_split,
        window,
        softcap * _LOG2E,
        *rope_args,
        GROUP=group,
        HEAD_DIM=head_dim,
        PAGE_SIZE=page_size,
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        DOT_PRECISION=precision,
        SLIDING=window > 0,
        SOFTCAP=softcap > 0,
        ROPE=rope is not None,
        HALF=half,
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl,
    )
    return out


def paged_decode_attention(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, >= 1
    scale: float,
    out: torch.Tensor | None = None,
    window: int = 0,
    softcap: float = 0.0,
    rope: DecodeRope | None = None,
) -> torch.Tensor:
    """One query token per sequence attending to its whole cached context (with `window` W > 0,
    its last W positions; with `softcap` c > 0, scores capped as c * tanh(s / c)) -> [num_seqs, H, D].
    With `rope` (`kernels/decode_rope.py`) the query is not rotated yet and this step's K/V not stored:
    both happen here.

    Shapes: query [S, H, D] (unit stride over D); caches [NB, BS, KVH, D] with H % KVH == 0;
    block_tables [>=S, max_blocks]; seq_lens [>=S]. A row with seq_len 0 (graph padding)
    yields zeros. Head dims that are not powers of two are padded to BLOCK_D and masked.
    `out` ([S, H, D], query's dtype, unit stride over D; rows may be strided): written in
    place of a fresh tensor (a step's eager attention writes its layer's buffer directly).
    """
    return paged_decode_attention_impl(query, k_cache, v_cache, block_tables, seq_lens, scale, out=out, window=window,
                                       softcap=softcap, rope=rope)

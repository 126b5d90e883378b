"""Pure-torch versions of every kernel op: the CPU path, the test oracle, the fallback.

Each function has exactly the signature of its Triton launcher in this package. Layouts:
KV cache per layer is `[num_blocks, block_size, num_kv_heads, head_dim]`; a slot is
`block_id * block_size + offset`; `block_tables[s, i]` is the i-th block of sequence s.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from kernels.decode_rope import DecodeRope


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
) -> None:
    """Store each token's K/V row at its slot; rows with slot -1 are skipped."""
    num_blocks, block_size = k_cache.shape[:2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_flat = k_cache.view(num_blocks * block_size, *k_cache.shape[2:])
    v_flat = v_cache.view(num_blocks * block_size, *v_cache.shape[2:])
    k_flat.index_copy_(0, slots, key[keep].to(k_cache.dtype))
    v_flat.index_copy_(0, slots, value[keep].to(v_cache.dtype))


def _gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, max_len: int) -> torch.Tensor:
    # [num_blocks, block_size, KVH, D] -> [num_seqs, max_len, KVH, D]: the first max_len positions
    # of each sequence, read block by block through its table. One index_select over all the
    # blocks needed (on CPU several times faster than advanced indexing `cache[tables]`).
    num_seqs = block_tables.shape[0]
    block_size = cache.shape[1]
    num_blocks_needed = (max_len + block_size - 1) // block_size
    block_ids = block_tables[:, :num_blocks_needed].reshape(-1).long()
    g = cache.index_select(0, block_ids)  # [num_seqs * num_blocks_needed, block_size, KVH, D]
    return g.view(num_seqs, num_blocks_needed * block_size, *cache.shape[2:])[:, :max_len]


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float,
               softcap: float) -> torch.Tensor:
    """softmax(q k^T * scale [capped: c * tanh(s / c)], where allowed) v: SDPA without a cap."""
    if not softcap:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def paged_decode_attention(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, >= 1
    scale: float,
    out: torch.Tensor | None = None,  # [num_seqs, H, D] of query's dtype: written and returned
    window: int = 0,  # > 0: each query sees the last `window` positions only
    softcap: float = 0.0,  # > 0: scores capped as c * tanh(s / c) (Gemma 2)
    rope: DecodeRope | None = None,  # first RoPE on query and rope.key, and rope.key / value into the cache
) -> torch.Tensor:
    """One query token per sequence attending to its whole cached context -> [num_seqs, H, D]."""
    num_seqs, num_heads, head_dim = query.shape
    if rope is not None:  # kernels/decode_rope.py: rotate copies (the inputs stay as given), store K/V
        query, key = query.clone(), rope.key.clone()
        rotary_embedding(rope.positions, query, key, rope.cos_sin_cache, head_dim)
        write_kv_cache(key, rope.value, k_cache, v_cache, rope.slot_mapping)
    if num_seqs == 0:
        return query.new_empty(query.shape) if out is None else out
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    max_len = int(seq_lens.max())
    # K/V as [S, KVH, L, D] views of the gathered copy (`.float()` is a no-op for fp32).
    k = _gather_kv(k_cache, block_tables, max_len).float().transpose(1, 2)
    v = _gather_kv(v_cache, block_tables, max_len).float().transpose(1, 2)
    # The `group` query heads that share KV head h are h's `group` query rows: [S, KVH, G, D].
    q = query.float().view(num_seqs, num_kv_heads, group, head_dim)
    pos = torch.arange(max_len, device=query.device)
    lens = seq_lens[:num_seqs, None].to(pos.device)
    valid = pos[None, :] < lens  # [S, L]: key l is in sequence s
    if window:
        valid &= pos[None, :] >= lens - window
    res = _attention(q, k, v, valid[:, None, None, :], scale, softcap)
    res = res.reshape(num_seqs, num_heads, head_dim).to(query.dtype)
    return res if out is None else out.copy_(res)


def prefill_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32: total K/V length incl. this chunk
    max_query_len: int,
    scale: float,
    out: torch.Tensor | None = None,  # [num_tokens, H, D] of query's dtype: written and returned
    window: int = 0,  # > 0: each query sees the last `window` positions up to its own only
    softcap: float = 0.0,  # > 0: scores capped as c * tanh(s / c) (Gemma 2)
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its cached prefix + itself.

    Query j of sequence s sits at position `seq_lens[s] - q_len_s + j` and sees K/V positions
    up to and including it. All K/V (old and new) are read from the paged cache, so the
    caller writes this step's K/V first. Returns [num_tokens, H, D] (`out` when given).
    """
    num_tokens, num_heads, head_dim = query.shape
    out = torch.empty_like(query) if out is None else out
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    # One sequence at a time: padding a batch to the longest prompt costs more attention
    # compute than the per-call overhead it saves.
    for s in range(len(lens)):
        q0, q1, kv_len = starts[s], starts[s + 1], lens[s]
        q_len = q1 - q0
        if q_len == 0:
            continue
        k = _gather_kv(k_cache, block_tables[s : s + 1], kv_len).float().transpose(1, 2)  # [1, KVH, L, D]
        v = _gather_kv(v_cache, block_tables[s : s + 1], kv_len).float().transpose(1, 2)
        k = k.repeat_interleave(group, dim=1)  # [1, H, L, D]
        v = v.repeat_interleave(group, dim=1)
        q = query[q0:q1].float().transpose(0, 1)[None]  # [1, H, q_len, D]
        # Row j (position kv_len - q_len + j) sees keys 0 .. kv_len - q_len + j.
        allowed = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril(kv_len - q_len)
        if window:  # and keys later than its position - window
            allowed &= ~torch.ones_like(allowed).tril(kv_len - q_len - window)
        o = _attention(q, k, v, allowed, scale, softcap)[0]
        out[q0:q1] = o.transpose(0, 1).to(query.dtype)
    return out


def mixed_attention(
    query: torch.Tensor,  # [T, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    query_start_loc: torch.Tensor,  # [S + 1] int32, non-decreasing from 0, last <= T
    seq_lens: torch.Tensor,  # [S] int32: total K/V length incl. this step's tokens (0: unused slot)
    scale: float,
    out: torch.Tensor | None = None,  # [T, H, D]: written and returned
    window: int = 0,  # > 0: each query sees the last `window` positions up to its own only
    softcap: float = 0.0,  # > 0: scores capped as c * tanh(s / c) (Gemma 2)
) -> torch.Tensor:
    """Attention of a step of decodes and prompt chunks laid out for a fixed grid (unused sequence
    slots have no query rows); rows past `query_start_loc[S]` are not written (zeros in a new `out`), and
    a sequence with query rows but no context (a decode graph's padded row) gets zeros."""
    out = torch.zeros_like(query) if out is None else out
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for s, kv_len in enumerate(lens):
        q0, q1 = starts[s], starts[s + 1]
        if q1 == q0:
            continue
        if kv_len == 0:  # a padded decode row of a graph: zeros
            out[q0:q1] = 0
            continue
        qsl = torch.tensor([0, q1 - q0], dtype=query_start_loc.dtype, device=query.device)
        prefill_attention(query[q0:q1], k_cache, v_cache, block_tables[s : s + 1], qsl, seq_lens[s : s + 1],
                          q1 - q0, scale, out=out[q0:q1], window=window, softcap=softcap)
    return out


def rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [num_tokens, hidden]
    unit_offset: bool = False,  # Gemma: scale by 1 + weight in float32, cast once
    fp8_rows: bool = False,  # the Triton path's FP8 rows for the next linear (kernels/fp8_rows.py); none here
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm; with `residual`, first x = x + residual and return (normed, x)."""
    if residual is not None:
        x = x + residual
        residual_out = x
    xf = x.float()
    var = xf.pow(2).mean(dim=-1, keepdim=True)
    if unit_offset:
        out = (xf * torch.rsqrt(var + eps) * (1.0 + weight.float())).to(x.dtype)
    else:
        out = (xf * torch.rsqrt(var + eps)).to(x.dtype) * weight
    if residual is not None:
        return out, residual_out
    return out


def all_reduce_rms_norm(
    partials: list[torch.Tensor],  # every rank's [T, N] partial sums, in rank order
    weight: torch.Tensor,  # [N]
    eps: float,
    residual: torch.Tensor | None,  # [T, N], or None: the sum becomes the residual
    unit_offset: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What `kernels/all_reduce_norm.py` gives every rank: the partials summed in rank order in
    float32 and rounded (the all-reduce), then `rms_norm` with the residual add: (normed, residual)."""
    acc = torch.zeros_like(partials[0], dtype=torch.float32)
    for p in partials:  # rank order, one rounding at the end: as the kernel sums
        acc += p.float()
    total = acc.to(partials[0].dtype)
    if residual is None:
        return rms_norm(total, weight, eps, None, unit_offset), total
    return rms_norm(total, weight, eps, residual, unit_offset)


def rotary_embedding(
    positions: torch.Tensor,  # [num_tokens] int64
    query: torch.Tensor,  # [num_tokens, num_heads * head_dim] (or [T, H, D]), rotated in place
    key: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim] (or [T, KVH, D]), in place
    cos_sin_cache: torch.Tensor,  # [max_position, rot_dim]: cos in the first half, sin second
    head_dim: int,
) -> None:
    """Neox-style (rotate-half) RoPE on the first rot_dim dims of each head, in place."""
    rot_dim = cos_sin_cache.shape[1]
    half = rot_dim // 2
    cs = cos_sin_cache[positions.long()].float()
    cos, sin = cs[:, None, :half], cs[:, None, half:]  # [T, 1, half]
    for t in (query, key):
        v = t.view(t.shape[0], -1, head_dim)
        x1 = v[..., :half].float()
        x2 = v[..., half:rot_dim].float()
        o1 = x1 * cos - x2 * sin
        o2 = x2 * cos + x1 * sin
        v[..., :half] = o1.to(t.dtype)
        v[..., half:rot_dim] = o2.to(t.dtype)


def rotary_and_write_kv(
    positions: torch.Tensor,  # [num_tokens] int64
    query: torch.Tensor,  # [num_tokens, num_heads * head_dim] (or [T, H, D]), rotated in place
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], rotated in place, then stored
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], stored
    cos_sin_cache: torch.Tensor,  # [max_position, rot_dim]
    head_dim: int,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens], -1 = not stored
) -> None:
    """`rotary_embedding` on query and key, then `write_kv_cache` of the rotated key and the value."""
    rotary_embedding(positions, query, key, cos_sin_cache, head_dim)
    write_kv_cache(key, value, k_cache, v_cache, slot_mapping)


def l2_prefetch(t: torch.Tensor, max_bytes: int, mode: int | None = None) -> None:
    """Warm L2 with t's first bytes: a cache hint with no observable effect, so nothing to do here
    (the CPU path, and the reference the Triton launcher in `kernels/l2_prefetch.py` must match)."""
    assert t.is_contiguous(), "prefetch reads the tensor's bytes in storage order"
    assert max_bytes >= 0


def silu_and_mul(x: torch.Tensor, fp8_rows: bool = False) -> torch.Tensor:
    """SwiGLU activation: x = [gate | up] along the last dim -> silu(gate) * up (`fp8_rows`: as `rms_norm`'s)."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def gumbel_sample(
    logits: torch.Tensor,  # [num_rows, vocab] float
    inv_temperature: torch.Tensor,  # [num_rows] float32; 0 = greedy row
    seeds: torch.Tensor,  # [num_rows] int64: this draw's key per row
) -> torch.Tensor:
    """Sample one token per row of softmax(logits * inv_temperature); greedy rows take the argmax.

    argmax(logits / T + Gumbel noise), the noise of each row drawn from a generator seeded with
    the row's seed (the same law as the Triton kernel; a different random stream).
    """
    num_rows, vocab = logits.shape
    x = logits.float()
    out = x.argmax(dim=-1)
    inv_t = inv_temperature.tolist()
    for r, seed in enumerate(seeds.tolist()):
        if inv_t[r] == 0.0:
            continue
        g = torch.Generator(device=logits.device).manual_seed(seed)
        u = torch.rand(vocab, generator=g, device=logits.device)
        noise = -torch.log(-torch.log(u))
        out[r] = (x[r] * inv_t[r] + noise).argmax()
    return out


LORA_BLOCK_M = 16  # rows per block of a slot's segment (the Triton kernels' BLOCK_M)


def lora_num_blocks(num_tokens: int, num_slots: int) -> int:
    """Row blocks that always suffice for T rows over `num_slots` slots: every slot's segment
    rounds up to whole blocks (cdiv(T, 16) + slots), and each block holds >= 1 row (<= T)."""
    return min(num_tokens, -(-num_tokens // LORA_BLOCK_M) + num_slots)


def lora_segments(
    token_slots: torch.Tensor,  # [T] int: each row's adapter slot, -1 = base model
    num_slots: int,
) -> tuple[torch.Tensor, ...]:
    """Group rows by slot, without a host sync (CUDA-graph safe), for lora_shrink / lora_expand.

    Returns `sorted_rows` [T + 1] int32 (rows of slot 0, then slot 1, ...; base rows not listed;
    the last entry is scratch), `seg_starts` [num_slots] and `seg_counts` [num_slots] int32, and
    the row blocks the kernels run: block b covers rows `block_m0[b] ..+ LORA_BLOCK_M` of slot
    `block_slot[b]` (-1: no block), [lora_num_blocks(T, num_slots)] int32 each. Plain torch on
    every device: one compare matrix [num_slots, T], no sort. The engine groups on the host
    instead (`lora_segments_host`, same result); this is its oracle.
    """
    num_tokens = token_slots.shape[0]
    slots = token_slots.long()
    ids = torch.arange(num_slots, device=slots.device)
    member = (slots[None, :] == ids[:, None]).long()  # [S, T]
    counts = member.sum(1)  # [S]
    starts = counts.cumsum(0) - counts
    rank = member.cumsum(1) - 1  # [S, T]: position of each row among its slot's rows
    valid = slots >= 0
    clamped = slots.clamp(min=0)
    dest = starts[clamped] + rank.gather(0, clamped[None, :])[0]
    dest = torch.where(valid, dest, num_tokens)  # base rows all land in the scratch entry
    rows = torch.zeros(num_tokens + 1, dtype=torch.int32, device=slots.device)
    rows.scatter_(0, dest, torch.arange(num_tokens, dtype=torch.int32, device=slots.device))
    blocks = (counts + LORA_BLOCK_M - 1) // LORA_BLOCK_M  # [S]
    block_end = blocks.cumsum(0)
    b = torch.arange(lora_num_blocks(num_tokens, num_slots), device=slots.device)
    block_slot = torch.searchsorted(block_end, b, right=True)  # [NB] in 0..S (S: past the last block)
    owner = block_slot.clamp(max=num_slots - 1)
    block_m0 = (b - (block_end[owner] - blocks[owner])) * LORA_BLOCK_M
    block_slot = torch.where(block_slot < num_slots, block_slot, -1)
    return rows, starts.to(torch.int32), counts.to(torch.int32), block_slot.to(torch.int32), block_m0.to(torch.int32)


def lora_segments_host(
    token_slots: np.ndarray,  # [T] int: each row's adapter slot, -1 = base model
    num_slots: int,
    num_blocks: int | None = None,
) -> tuple[np.ndarray, ...]:
    """`lora_segments` in numpy, for the host that stages the slots (no device op per step).

    Same arrays (int32), except that `sorted_rows` is [T] (no scratch entry; entries past the
    listed rows are 0) and the block arrays are [num_blocks] (default lora_num_blocks(T, S)),
    padded with slot -1 / m0 0: a larger buffer serves every graph bucket >= T.
    """
    num_tokens = token_slots.shape[0]
    nb = lora_num_blocks(num_tokens, num_slots) if num_blocks is None else num_blocks
    slots = token_slots.astype(np.int64, copy=False)
    listed = np.flatnonzero(slots >= 0)
    order = listed[np.argsort(slots[listed], kind="stable")]  # rows by slot, row order kept
    counts = np.bincount(slots[listed], minlength=num_slots)
    starts = np.cumsum(counts) - counts
    rows = np.zeros(num_tokens, dtype=np.int32)
    rows[: order.shape[0]] = order
    blocks = (counts + LORA_BLOCK_M - 1) // LORA_BLOCK_M
    block_end = np.cumsum(blocks)
    used = int(block_end[-1]) if num_slots else 0
    assert used <= nb, (used, nb)
    block_slot = np.full(nb, -1, dtype=np.int32)
    block_m0 = np.zeros(nb, dtype=np.int32)
    b = np.arange(used)
    owner = np.searchsorted(block_end, b, side="right")
    block_slot[:used] = owner
    block_m0[:used] = (b - (block_end[owner] - blocks[owner])) * LORA_BLOCK_M
    return rows, starts.astype(np.int32), counts.astype(np.int32), block_slot, block_m0


def lora_shrink(
    x: torch.Tensor,  # [T, K]
    a_stacked: torch.Tensor,  # [num_slots, R, K]: per slot, the slices' A rows stacked (R = slices * r)
    sorted_rows: torch.Tensor,  # [>= T] int32: rows grouped by slot (lora_segments)
    seg_starts: torch.Tensor,  # [num_slots] int32
    seg_counts: torch.Tensor,  # [num_slots] int32
    block_slot: torch.Tensor,  # [NB] int32 (lora_segments; the kernels' grid, unused here)
    block_m0: torch.Tensor,  # [NB] int32
) -> torch.Tensor:
    """Per row of slot s: x[t] · a_stacked[s]ᵀ, as float32 partial sums [num_splits, T, R] (sum over
    dim 0); rows of no slot are left unwritten (expand never reads them)."""
    out = torch.zeros((1, x.shape[0], a_stacked.shape[1]), dtype=torch.float32, device=x.device)
    for s, (start, count) in enumerate(zip(seg_starts.tolist(), seg_counts.tolist())):
        if count:
            rows = sorted_rows[start : start + count].long()
            out[0].index_copy_(0, rows, x.index_select(0, rows).float() @ a_stacked[s].float().T)
    return out


def lora_expand(
    y: torch.Tensor,  # [T, N], updated in place
    partials: torch.Tensor,  # [P, T, slices * r] float32 (lora_shrink's output)
    b_stacked: torch.Tensor,  # [num_slots, N, r]: the slices' B rows one after another
    slice_sizes: tuple[int, ...],  # output columns of each slice (1 to 3 of them), summing to N
    sorted_rows: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_counts: torch.Tensor,
    block_slot: torch.Tensor,
    block_m0: torch.Tensor,
) -> None:
    """Per row of slot s and slice p: y[t, cols(p)] += (Σ partials)[t, p*r:(p+1)*r] · B[s, cols(p)]ᵀ."""
    r = b_stacked.shape[2]
    buf = partials[0] if partials.shape[0] == 1 else partials.sum(0)  # [T, slices * r]
    for s, (start, count) in enumerate(zip(seg_starts.tolist(), seg_counts.tolist())):
        if not count:
            continue
        rows = sorted_rows[start : start + count].long()
        h = buf.index_select(0, rows)  # [count, slices * r]
        # The slices side by side: [count, N], then one scatter-add into the rows of y.
        delta = torch.cat([h[:, p * r : (p + 1) * r] @ b.float().T
                           for p, b in enumerate(b_stacked[s].split(list(slice_sizes)))], dim=1)
        y.index_add_(0, rows, delta.to(y.dtype))


def stage_decode_inputs(ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, seq_lens: torch.Tensor,
                        rows: torch.Tensor, fix_rows: torch.Tensor, fix_src: torch.Tensor,
                        prev_ids: torch.Tensor | None, block_table: torch.Tensor, width: int,
                        out_ids: torch.Tensor, out_positions: torch.Tensor, out_slots: torch.Tensor,
                        out_seq_lens: torch.Tensor, out_tables: torch.Tensor, bucket: int) -> None:
    """A decode step's inputs into a CUDA graph's static buffers (`kernels/stage_inputs.py`): rows [0, n)
    from the step (placeholder ids from `prev_ids`, block-table rows gathered), rows [n, bucket) padding."""
    n = ids.shape[0]
    assert 0 < n <= bucket <= out_ids.shape[0] and width <= min(block_table.shape[1], out_tables.shape[1])
    out_ids[:n].copy_(ids)
    if fix_rows.shape[0]:
        assert prev_ids is not None, "placeholders without the previous step's ids"
        out_ids.index_copy_(0, fix_rows, prev_ids.index_select(0, fix_src))
    out_positions[:n].copy_(positions)
    out_slots[:n].copy_(slots)
    out_seq_lens[:n].copy_(seq_lens)
    out_tables[:n, :width].copy_(block_table[:, :width].index_select(0, rows))
    out_slots[n:bucket].fill_(-1)
    out_seq_lens[n:bucket].zero_()

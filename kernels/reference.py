"""Pure-torch versions of every kernel op: the CPU path, the test oracle, the fallback.

Each function has exactly the signature of its Triton launcher in this package. Layouts:
KV cache per layer is `[num_blocks, block_size, num_kv_heads, head_dim]`; a slot is
`block_id * block_size + offset`; `block_tables[s, i]` is the i-th block of sequence s.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
    # [num_seqs, max_blocks, block_size, KVH, D] -> [num_seqs, max_len, KVH, D]
    block_size = cache.shape[1]
    num_blocks_needed = (max_len + block_size - 1) // block_size
    g = cache[block_tables[:, :num_blocks_needed].long()]
    s = g.shape[0]
    return g.reshape(s, num_blocks_needed * block_size, *cache.shape[2:])[:, :max_len]


def paged_decode_attention(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, >= 1
    scale: float,
) -> torch.Tensor:
    """One query token per sequence attending to its whole cached context -> [num_seqs, H, D]."""
    num_seqs, num_heads, head_dim = query.shape
    if num_seqs == 0:
        return query.new_empty(query.shape)
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    max_len = int(seq_lens.max())
    k = _gather_kv(k_cache, block_tables, max_len).float()  # [S, L, KVH, D]
    v = _gather_kv(v_cache, block_tables, max_len).float()
    q = query.float().view(num_seqs, num_kv_heads, group, head_dim)
    scores = torch.einsum("skgd,slkd->skgl", q, k) * scale  # [S, KVH, G, L]
    pos = torch.arange(max_len, device=query.device)
    mask = pos[None, :] >= seq_lens[:, None].to(pos.device)  # [S, L]
    scores = scores.masked_fill(mask[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("skgl,slkd->skgd", probs, v)
    return out.reshape(num_seqs, num_heads, head_dim).to(query.dtype)


def prefill_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32: total K/V length incl. this chunk
    max_query_len: int,
    scale: float,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its cached prefix + itself.

    Query j of sequence s sits at position `seq_lens[s] - q_len_s + j` and sees K/V positions
    up to and including it. All K/V (old and new) are read from the paged cache, so the
    caller writes this step's K/V first. Returns [num_tokens, H, D].
    """
    num_tokens, num_heads, head_dim = query.shape
    out = torch.empty_like(query)
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for s in range(len(lens)):
        q0, q1, kv_len = starts[s], starts[s + 1], lens[s]
        q_len = q1 - q0
        if q_len == 0:
            continue
        k = _gather_kv(k_cache, block_tables[s : s + 1], kv_len)[0]  # [L, KVH, D]
        v = _gather_kv(v_cache, block_tables[s : s + 1], kv_len)[0]
        q = query[q0:q1].transpose(0, 1)  # [H, q_len, D]
        k = k.transpose(0, 1).repeat_interleave(group, dim=0)  # [H, L, D]
        v = v.transpose(0, 1).repeat_interleave(group, dim=0)
        q_pos = torch.arange(kv_len - q_len, kv_len, device=query.device)
        k_pos = torch.arange(kv_len, device=query.device)
        allowed = k_pos[None, :] <= q_pos[:, None]  # [q_len, L]
        o = F.scaled_dot_product_attention(
            q.float()[None], k.float()[None], v.float()[None], attn_mask=allowed[None, None], scale=scale
        )[0]
        out[q0:q1] = o.transpose(0, 1).to(query.dtype)
    return out


def rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [num_tokens, hidden]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm; with `residual`, first x = x + residual and return (normed, x)."""
    if residual is not None:
        x = x + residual
        residual_out = x
    xf = x.float()
    var = xf.pow(2).mean(dim=-1, keepdim=True)
    out = (xf * torch.rsqrt(var + eps)).to(x.dtype) * weight
    if residual is not None:
        return out, residual_out
    return out


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


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU activation: x = [gate | up] along the last dim -> silu(gate) * up."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]

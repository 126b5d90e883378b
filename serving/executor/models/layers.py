"""Building blocks of Llama-family decoders, on top of `kernels` ops.

Linear layers carry a `weight_loader` on each parameter so `serving/executor/weights.py` can fill packed
parameters (q|k|v -> qkv_proj, gate|up -> gate_up_proj) from separate HF tensors, or copy a
checkpoint that is already fused (Phi-3). `PagedAttention` writes this step's K/V into the
paged cache, then runs decode attention for the leading one-token sequences and prefill
attention for the rest, as described by the ambient `AttentionMetadata`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from serving.executor.attention_metadata import get_attention_metadata


def _param(*shape: int) -> nn.Parameter:
    # Device and dtype come from the construction context (see models.build_model).
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
    """Copy a whole checkpoint tensor into `param` (shapes must match exactly)."""
    assert shard_id is None, f"unexpected shard {shard_id!r} for an unpacked parameter"
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor shape {tuple(loaded.shape)} != parameter shape {tuple(param.shape)}")
    param.data.copy_(loaded)


class Linear(nn.Module):
    """y = x W^T (+ b), W stored [out_features, in_features] as in HF."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = _param(out_features, in_features)
        self.weight.weight_loader = self.weight_loader
        self.bias = _param(out_features) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
        default_weight_loader(param, loaded, shard_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class PackedLinear(Linear):
    """Several HF projections stacked along the output dim (shards named by `shard_names`).

    A checkpoint may hold the shards separately (q_proj/k_proj/v_proj) or already fused
    (Phi-3's qkv_proj): the loader takes `shard_id=None` for the latter.
    """

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool = False) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias)
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, size in shard_sizes.items():
            self.shard_offsets[name] = (offset, size)
            offset += size

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
        if shard_id is None:
            default_weight_loader(param, loaded)
            return
        offset, size = self.shard_offsets[str(shard_id)]
        target = param.data.narrow(0, offset, size)
        if target.shape != loaded.shape:
            raise ValueError(f"shard {shard_id!r}: checkpoint shape {tuple(loaded.shape)} != {tuple(target.shape)}")
        target.copy_(loaded)


class RMSNorm(nn.Module):
    """RMSNorm with optional fused residual add (kernels.rms_norm)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = _param(hidden_size)
        self.weight.weight_loader = default_weight_loader
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return kernels.rms_norm(x, self.weight, self.eps, residual)


class PagedAttention(nn.Module):
    """Self-attention over the paged KV cache: qkv -> RoPE -> write cache -> attend -> o_proj.

    `k_cache` / `v_cache` are views into the runner's single KV allocation, set with
    `bind_kv_cache`; shape [num_blocks, block_size, num_kv_heads, head_dim].
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        qkv_bias: bool,
        o_bias: bool,
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.scale = head_dim**-0.5
        self.qkv_proj = PackedLinear(hidden_size, {"q": self.q_size, "k": self.kv_size, "v": self.kv_size}, qkv_bias)
        self.o_proj = Linear(self.q_size, hidden_size, o_bias)
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self.cos_sin_cache = torch.empty(0)  # shared, set by the model

    def bind_kv_cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        self.k_cache, self.v_cache = k_cache, v_cache

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        meta = get_attention_metadata()
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)  # [T, q_size + 2 * kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        kernels.rotary_embedding(positions, q, k, self.cos_sin_cache, self.head_dim)  # in place (views)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        kernels.write_kv_cache(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        nd = meta.num_decode_tokens
        if meta.num_prefills == 0:
            out = kernels.paged_decode_attention(
                q, self.k_cache, self.v_cache, meta.block_tables, meta.seq_lens, self.scale
            )
        elif nd == 0:
            out = kernels.prefill_attention(
                q, self.k_cache, self.v_cache, meta.block_tables, meta.query_start_loc,
                meta.seq_lens, meta.max_query_len, self.scale,
            )
        else:
            out = torch.empty_like(q)  # [T, H, D]
            out[:nd] = kernels.paged_decode_attention(
                q[:nd], self.k_cache, self.v_cache, meta.block_tables[:nd], meta.seq_lens[:nd], self.scale
            )
            out[nd:] = kernels.prefill_attention(
                q[nd:], self.k_cache, self.v_cache, meta.block_tables[nd:],
                meta.query_start_loc[nd:] - nd,  # prefill tokens start right after the decodes
                meta.seq_lens[nd:], meta.max_query_len, self.scale,
            )
        return self.o_proj(out.view(num_tokens, self.q_size))


class GatedMLP(nn.Module):
    """SwiGLU MLP: down(silu(gate(x)) * up(x)), gate|up packed as gate_up_proj."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool) -> None:
        super().__init__()
        self.gate_up_proj = PackedLinear(hidden_size, {"0": intermediate_size, "1": intermediate_size}, bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(kernels.silu_and_mul(self.gate_up_proj(x)))

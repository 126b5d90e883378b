"""What every decoder model shares: the RoPE caches its attention layers read, and (for the models
whose layers return the residual stream itself) the embedding -> layers -> final norm skeleton.

`bind_rope_caches` registers `cos_sin_cache` on the model (and `cos_sin_cache_local` where the
sliding layers have a RoPE of their own: Gemma 3, OLMo 3) and points each layer's attention at its
cache. `ResidualStack` is `model.*` of the models whose norms are not fused with the residual add
(Cohere, OLMo, the LayerNorm decoders); Llama's and Gemma's carry the residual beside the hidden
state for the fused kernel and keep their own loop.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from serving.executor.models.embedding import VocabParallelEmbedding
from serving.executor.models.rotary import build_cos_sin_cache
from serving.executor.parallel import TPShard
from serving.checkpoint.model_config import ModelArgs


def bind_rope_caches(model: nn.Module, args: ModelArgs, max_position: int, context_len: int | None) -> None:
    """Register `model`'s RoPE caches ([P, rot_dim] float32, on its norm's device) and bind each of
    `model.layers`' attention to the one it reads: the sliding layers' own where `args.rope_local`."""
    device = model.norm.weight.device
    full = build_cos_sin_cache(args.rope, args.head_dim, max_position, device=device, context_len=context_len)
    model.register_buffer("cos_sin_cache", full, persistent=False)
    local = full
    if args.rope_local is not None:
        local = build_cos_sin_cache(args.rope_local, args.head_dim, max_position, device=device,
                                    context_len=context_len)
        model.register_buffer("cos_sin_cache_local", local, persistent=False)
    for layer in model.layers:
        layer.self_attn.cos_sin_cache = local if layer.self_attn.window else full


class ResidualStack(nn.Module):
    """Embedding, decoder layers (`layer(positions, hidden) -> hidden`), final norm (HF `model.*`)."""

    def __init__(self, args: ModelArgs, max_position: int, shard: TPShard, context_len: int | None,
                 make_layer: Callable[[int, int | None], nn.Module], norm: nn.Module) -> None:
        """`make_layer(i, window)`: layer i, with its sliding window (None: the whole context)."""
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(args.vocab_size, args.hidden_size, shard)
        self.layers = nn.ModuleList(make_layer(i, args.layer_window(i)) for i in range(args.num_hidden_layers))
        self.norm = norm
        bind_rope_caches(self, args, max_position, context_len)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(input_ids, positions)
        for layer in self.layers:
            hidden = layer(positions, hidden)
        return self.norm(hidden)

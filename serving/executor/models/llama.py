"""Llama-family causal LM (Llama 2/3, Mistral, Qwen2, Phi-3) with HF parameter names.

The four architectures differ only in options read from `ModelArgs` (q/k/v bias for Qwen2,
head_dim, rope scaling) and in how the checkpoint names packed projections, which
`packed_modules_mapping` covers (Phi-3 checkpoints are already fused). Forward takes flat
token rows `[num_tokens]` plus the ambient `AttentionMetadata`; `compute_logits` is applied by
the runner only to the rows it samples.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from serving.executor.models.layers import GatedMLP, Linear, PagedAttention, RMSNorm, _param, default_weight_loader
from serving.model_config import ModelArgs
from serving.executor.models.rotary import build_cos_sin_cache


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: x -> norm -> attention -> (+res) norm -> MLP, residual carried fused."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.self_attn = PagedAttention(
            args.hidden_size, args.num_attention_heads, args.num_key_value_heads, args.head_dim,
            qkv_bias=args.qkv_bias, o_bias=args.o_bias,
        )
        self.mlp = GatedMLP(args.hidden_size, args.intermediate_size, args.mlp_bias)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class Embedding(nn.Module):
    """Token embedding [vocab, hidden] (HF `embed_tokens`)."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = _param(vocab_size, hidden_size)
        self.weight.weight_loader = default_weight_loader

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm (HF `model.*`)."""

    def __init__(self, args: ModelArgs, max_position: int) -> None:
        super().__init__()
        self.embed_tokens = Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(args) for _ in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        cache = build_cos_sin_cache(args.rope, args.head_dim, max_position, device=self.norm.weight.device)
        self.register_buffer("cos_sin_cache", cache, persistent=False)  # [P, rot_dim] float32
        for layer in self.layers:
            layer.self_attn.cos_sin_cache = self.cos_sin_cache

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # [T, hidden]
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """The causal LM: `forward(input_ids, positions) -> hidden`, `compute_logits(hidden) -> fp32`."""

    # HF checkpoint name piece -> (our packed param piece, shard id)
    packed_modules_mapping: dict[str, tuple[str, str]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "0"),
        "up_proj": ("gate_up_proj", "1"),
    }

    def __init__(self, args: ModelArgs, max_position: int | None = None) -> None:
        super().__init__()
        self.args = args
        self.model = LlamaModel(args, max_position or args.max_position_embeddings)
        if args.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(args.hidden_size, args.vocab_size, bias=False)

    @property
    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn for layer in self.model.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32 (tied embeddings reuse embed_tokens)."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()

"""Llama-family causal LM (Llama 2/3, Mistral, Qwen2, Qwen3, Phi-3, SmolLM3, Granite, and the
mixture-of-experts Mixtral, Qwen2-MoE, Qwen3-MoE) with HF parameter names.

The architectures differ only in options read from `ModelArgs` (q/k/v bias for Qwen2, per-head
q/k RMSNorm for Qwen3, layers without RoPE for SmolLM3, Granite's multipliers, head_dim, rope
scaling, an MoE block in place of the MLP) and in how the checkpoint names packed projections, which
`packed_modules_mapping` covers (Phi-3 checkpoints are already fused). Forward takes flat
token rows `[num_tokens]` plus the ambient `AttentionMetadata`; `compute_logits` is applied by
the runner only to the rows it samples.

Tensor parallel: the model is built for one `TPShard` (default: this process's,
`parallel.tp_shard()`) and holds only that rank's slices; `compute_logits` still returns the
full vocab on every rank. `num_kv_heads_per_rank` is what the runner's KV cache must hold.
Quantized checkpoints: `quant` (a `QuantConfig`) reaches each linear layer with its HF module name,
so the layer's linear method (and the checkpoint's skip list) decide what it holds.
"""

from __future__ import annotations

import torch
from torch import nn

from serving.executor.models.attention import PagedAttention
from serving.executor import parallel
from serving.executor.models.embedding import ParallelLMHead, VocabParallelEmbedding
from serving.executor.models.linear import sums_later
from serving.executor.models.mlp import GatedMLP
from serving.executor.models.moe import SparseMoeBlock, mixtral_checkpoint_name
from serving.executor.models.norm import RMSNorm
from serving.executor.models.stack import bind_rope_caches
from serving.executor.parallel import (
    TPShard,
    kv_heads_per_rank,
    tp_shard,
    validate_tensor_parallel,
)
from serving.checkpoint.architectures import llama as llama_types, moe as moe_types
from serving.checkpoint.model_args import ModelArgs
from serving.checkpoint.quantization import QuantConfig


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: x -> norm -> attention -> (+res) norm -> MLP, residual carried fused."""

    def __init__(self, args: ModelArgs, shard: TPShard, quant: QuantConfig | None = None, prefix: str = "",
                 use_rope: bool = True, sliding_window: int | None = None, moe: bool = False) -> None:
        super().__init__()
        self.residual_multiplier = args.residual_multiplier
        self.self_attn = PagedAttention.of_model(
            args, shard, quant, prefix,
            qk_norm_eps=args.rms_norm_eps if args.qk_norm else None, use_rope=use_rope,
            scale=args.attention_multiplier, sliding_window=sliding_window,
        )
        self.mlp = (SparseMoeBlock(args, shard, quant, f"{prefix}.mlp") if moe else
                    GatedMLP(args.hidden_size, args.intermediate_size, args.mlp_bias, shard, quant, f"{prefix}.mlp",
                             activation=args.hidden_act))
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual, partial = self.forward_partial(positions, hidden, residual, fused_out=False)
        return (parallel.all_reduce(hidden) if partial else hidden), residual

    def forward_partial(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None, partial: bool = False,
        fused_out: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """The layer, leaving its MLP's all-reduce to the next norm: (hidden, residual, whether
        hidden is still this rank's partial sum). `partial`: the incoming hidden is one (the
        embedding's or the previous layer's), summed in this layer's input norm. Under tensor
        parallelism each row-parallel sum then runs fused with the residual add and RMSNorm after it.
        `fused_out`: the caller sums a partial hidden with `RMSNorm.add_and_norm` (its GEMV may push
        the rows: `RowParallelLinear.partial`), not with a plain all-reduce."""
        m = self.residual_multiplier  # Granite scales each block's output before the residual add
        hidden, residual = self.input_layernorm.add_and_norm(hidden, residual, reduce=partial)
        attn = self.self_attn.attend(*self.self_attn.project(positions, hidden))
        o_proj = self.self_attn.o_proj
        later = sums_later(o_proj)
        # push: the partial goes unchanged into the fused all-reduce + norm (not scaled first)
        attn = o_proj.partial(attn, push=m == 1.0) if later else o_proj(attn)
        hidden, residual = self.post_attention_layernorm.add_and_norm(attn if m == 1.0 else attn * m, residual,
                                                                      reduce=later)
        later = isinstance(self.mlp, GatedMLP) and sums_later(self.mlp.down_proj)
        hidden = self.mlp.partial(hidden, push=fused_out and m == 1.0) if later else self.mlp(hidden)
        return (hidden if m == 1.0 else hidden * m), residual, later


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm (HF `model.*`)."""

    def __init__(self, args: ModelArgs, max_position: int, shard: TPShard, quant: QuantConfig | None = None,
                 context_len: int | None = None) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(args.vocab_size, args.hidden_size, shard)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(args, shard, quant, f"model.layers.{i}", use_rope=i not in args.no_rope_layers,
                              sliding_window=args.layer_window(i), moe=i in args.moe_layers)
            for i in range(args.num_hidden_layers))
        self.embedding_multiplier = args.embedding_multiplier
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        bind_rope_caches(self, args, max_position, context_len)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # Each all-reduce (the embedding's, o_proj's, down_proj's) is left to the norm after it.
        partial = type(self.embed_tokens) is VocabParallelEmbedding and self.embed_tokens.tp > 1
        hidden = self.embed_tokens.partial(input_ids) if partial else self.embed_tokens(input_ids)  # [T, hidden]
        if self.embedding_multiplier != 1.0:  # Granite
            hidden = hidden * self.embedding_multiplier
        residual = None
        for layer in self.layers:
            hidden, residual, partial = layer.forward_partial(positions, hidden, residual, partial)
        hidden, _ = self.norm.add_and_norm(hidden, residual, reduce=partial)
        return hidden


class LlamaForCausalLM(nn.Module):
    """The causal LM: `forward(input_ids, positions) -> hidden`, `compute_logits(hidden) -> fp32`."""

    # the model types (their declarations: serving/checkpoint/architectures/) this class runs; each
    # subclass names its own, and the registry (models/__init__.py) maps their architectures to it
    serves = (llama_types.LLAMA, llama_types.MISTRAL, llama_types.QWEN2, llama_types.QWEN3, llama_types.PHI3,
              llama_types.SMOLLM3, llama_types.GRANITE, moe_types.QWEN2_MOE, moe_types.QWEN3_MOE)

    model_class: type[nn.Module] = LlamaModel  # the decoder inside (`model.*`); Gemma swaps in its own

    # HF checkpoint name piece -> (our packed param piece, shard id)
    packed_modules_mapping: dict[str, tuple[str, str]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "0"),
        "up_proj": ("gate_up_proj", "1"),
    }

    def __init__(self, args: ModelArgs, max_position: int | None = None, shard: TPShard | None = None,
                 quant: QuantConfig | None = None, context_len: int | None = None) -> None:
        super().__init__()
        self.args = args
        self.tp_shard = shard = shard or tp_shard()
        self.quant = quant
        validate_tensor_parallel(args, shard.world_size)
        self.model = self.model_class(args, max_position or args.max_position_embeddings, shard, quant, context_len)
        if args.tie_word_embeddings:
            assert not args.lm_head_bias, "a tied LM head with a bias of its own"
            self.lm_head = None
        else:
            self.lm_head = ParallelLMHead(args.vocab_size, args.hidden_size, shard, bias=args.lm_head_bias)
        # What each rank's KV cache holds per layer: [num_blocks, block_size, this, head_dim].
        self.num_kv_heads_per_rank = kv_heads_per_rank(args, shard.world_size, shard.rank)

    @property
    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn for layer in self.model.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32 (into `out` when given), full vocab on every rank
        (tied embeddings reuse embed_tokens)."""
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        logits = head.compute_logits(hidden, out)
        if self.args.logits_scaling != 1.0:  # Granite divides the logits
            logits.div_(self.args.logits_scaling)
        return logits


class MixtralForCausalLM(LlamaForCausalLM):
    """Mixtral: Mistral's attention and an MoE block in every layer, under its own checkpoint names
    (`block_sparse_moe`, experts' w1 / w3 / w2)."""

    serves = (moe_types.MIXTRAL,)

    checkpoint_name = staticmethod(mixtral_checkpoint_name)

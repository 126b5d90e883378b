"""AllenAI's OLMo 2 and OLMo 3 decoders (`Olmo2ForCausalLM`, `Olmo3ForCausalLM`) with HF parameter names.

Where they differ from the Llama family:
- norms after each block, not before: x + norm(attn(x)), then + norm(mlp(.)) (`post_attention_layernorm`,
  `post_feedforward_layernorm`), RMSNorm scaling in float32 before the cast;
- q and k RMS-normalised over the whole projection (all heads at once, `q_norm` / `k_norm` of
  num_heads * head_dim), before RoPE. Under tensor parallelism each rank holds its heads' slice of
  the norm weight and the mean square is summed over the ranks (`FullWidthRMSNorm`);
- OLMo 3: sliding-window layers (`layer_types`) with their own RoPE where the config gives one.
The rest (paged attention, SwiGLU MLP, tensor parallelism, the weight loaders) is the shared layers'.
"""

from __future__ import annotations

import torch
from torch import nn

from serving.executor import parallel
from serving.executor.models.attention import PagedAttention
from serving.executor.models.llama import LlamaForCausalLM
from serving.executor.models.mlp import GatedMLP
from serving.executor.models.params import Loaded, check_shape, default_weight_loader, new_param, read_checkpoint
from serving.executor.models.stack import ResidualStack
from serving.executor.parallel import TPShard, attention_shard
from serving.checkpoint.architectures import olmo as olmo_types
from serving.checkpoint.model_config import ModelArgs
from serving.checkpoint.quantization import QuantConfig


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float, full: int, reduce: bool) -> torch.Tensor:
    """weight * x / rms(x) in float32, cast back; rms over `full` elements (summed over ranks when `reduce`)."""
    xf = x.float()
    sq = xf.pow(2).sum(-1, keepdim=True)
    if reduce:
        sq = parallel.all_reduce(sq)
    return (weight.float() * (xf * torch.rsqrt(sq / full + eps))).to(x.dtype)


class OlmoRMSNorm(nn.Module):
    """RMSNorm with the weight applied in float32 before the cast (OLMo's order); replicated."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = new_param(hidden_size)
        self.weight.weight_loader = default_weight_loader
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _rms(x, self.weight, self.eps, x.shape[-1], reduce=False)


class FullWidthRMSNorm(nn.Module):
    """OLMo's q / k norm over all heads of the projection: this rank holds the weight of its heads
    (`start`, `size` of the `full` width) and sums the squares with the other ranks."""

    def __init__(self, full: int, start: int, size: int, eps: float, reduce: bool) -> None:
        super().__init__()
        self.full, self.start, self.eps, self.reduce = full, start, eps, reduce
        self.weight = new_param(size)
        self.weight.weight_loader = self.weight_loader
        self.weight.tp_sharded = size != full

    def weight_loader(self, param: torch.Tensor, loaded: Loaded, shard_id: object = None) -> None:
        assert shard_id is None, shard_id
        check_shape(loaded, (self.full,))
        param.data.copy_(read_checkpoint(loaded, 0, self.start, param.shape[0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _rms(x, self.weight, self.eps, self.full, self.reduce)


class OlmoDecoderLayer(nn.Module):
    """x + norm(attn(x)), then + norm(mlp(.)): the norms after the blocks."""

    def __init__(self, args: ModelArgs, shard: TPShard, quant: QuantConfig | None, prefix: str,
                 sliding_window: int | None) -> None:
        super().__init__()
        self.self_attn = PagedAttention.of_model(args, shard, quant, prefix, sliding_window=sliding_window)
        attn, eps, tp = self.self_attn, args.rms_norm_eps, shard.world_size > 1
        heads = attention_shard(args.num_attention_heads, args.num_key_value_heads, shard)
        if tp and args.num_key_value_heads % shard.world_size:
            raise ValueError(f"OLMo's k norm spans all KV heads: tensor parallel degree {shard.world_size} must divide "
                             f"num_key_value_heads ({args.num_key_value_heads})")
        attn.q_norm = FullWidthRMSNorm(args.q_size, heads.q_head_start * args.head_dim, attn.q_size, eps, tp)
        attn.k_norm = FullWidthRMSNorm(args.kv_size, heads.kv_head_start * args.head_dim, attn.kv_size, eps, tp)
        attn.qk_norm_per_head = False
        self.mlp = GatedMLP(args.hidden_size, args.intermediate_size, args.mlp_bias, shard, quant, f"{prefix}.mlp",
                            activation=args.hidden_act)
        self.post_attention_layernorm = OlmoRMSNorm(args.hidden_size, eps)
        self.post_feedforward_layernorm = OlmoRMSNorm(args.hidden_size, eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.post_attention_layernorm(self.self_attn(positions, hidden))
        return hidden + self.post_feedforward_layernorm(self.mlp(hidden))


class OlmoModel(ResidualStack):
    """Embedding, decoder layers (OLMo 3: the sliding layers' own RoPE), final norm (`model.*`)."""

    def __init__(self, args: ModelArgs, max_position: int, shard: TPShard, quant: QuantConfig | None = None,
                 context_len: int | None = None) -> None:
        super().__init__(args, max_position, shard, context_len,
                         lambda i, window: OlmoDecoderLayer(args, shard, quant, f"model.layers.{i}", window),
                         OlmoRMSNorm(args.hidden_size, args.rms_norm_eps))


class OlmoForCausalLM(LlamaForCausalLM):
    """`Olmo2ForCausalLM`, `Olmo3ForCausalLM`: `LlamaForCausalLM`'s head and loading around `OlmoModel`."""

    serves = (olmo_types.OLMO2, olmo_types.OLMO3)

    model_class = OlmoModel

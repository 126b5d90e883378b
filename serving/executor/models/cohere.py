"""Cohere's Command-R decoder (`CohereForCausalLM`) with HF parameter names.

Where it differs from the Llama family:
- LayerNorm without a bias (mean removed, then scaled; in float32 as transformers computes it);
- one norm a layer, feeding attention and the SwiGLU MLP in parallel: x + attn(ln(x)) + mlp(ln(x));
- logits multiplied by `logit_scale`;
- RoPE on interleaved pairs (dims 2i, 2i + 1) rather than halves (i, i + head_dim / 2). The q and k
  rows of each head are permuted as they load (even dims first, then odd ones), which turns the
  one into the other; q.k is unchanged because both are permuted alike, so the shared kernels run
  it as they are.
`use_qk_norm` (Command R+) is refused when the config is read.
"""

from __future__ import annotations

import torch
from torch import nn

from serving.executor.models.attention import PagedAttention
from serving.executor.models.llama import LlamaForCausalLM
from serving.executor.models.mlp import GatedMLP
from serving.executor.models.norm import LayerNorm
from serving.executor.models.params import Loaded, read_checkpoint
from serving.executor.models.stack import ResidualStack
from serving.executor.parallel import TPShard
from serving.checkpoint.architectures import cohere as cohere_types
from serving.checkpoint.model_config import ModelArgs
from serving.checkpoint.quantization import QuantConfig


class CohereDecoderLayer(nn.Module):
    """x + attn(ln(x)) + mlp(ln(x))."""

    def __init__(self, args: ModelArgs, shard: TPShard, quant: QuantConfig | None, prefix: str,
                 sliding_window: int | None) -> None:
        super().__init__()
        self.self_attn = PagedAttention.of_model(args, shard, quant, prefix, sliding_window=sliding_window)
        self.mlp = GatedMLP(args.hidden_size, args.intermediate_size, args.mlp_bias, shard, quant, f"{prefix}.mlp",
                            activation=args.hidden_act)
        self.input_layernorm = LayerNorm(args.hidden_size, args.rms_norm_eps, bias=False)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        normed = self.input_layernorm(hidden)
        return hidden + self.self_attn(positions, normed) + self.mlp(normed)


class CohereModel(ResidualStack):
    """Embedding, decoder layers and the final bias-free LayerNorm (`model.*`)."""

    def __init__(self, args: ModelArgs, max_position: int, shard: TPShard, quant: QuantConfig | None = None,
                 context_len: int | None = None) -> None:
        super().__init__(args, max_position, shard, context_len,
                         lambda i, window: CohereDecoderLayer(args, shard, quant, f"model.layers.{i}", window),
                         LayerNorm(args.hidden_size, args.rms_norm_eps, bias=False))


class CohereForCausalLM(LlamaForCausalLM):
    """`CohereForCausalLM` (Command-R, Aya 23 / Expanse): logits times `logit_scale`; q / k rows
    permuted for the half-split RoPE as they load."""

    serves = (cohere_types.COHERE,)

    model_class = CohereModel

    def checkpoint_tensor(self, name: str, loaded: Loaded) -> Loaded:
        if not name.endswith((".self_attn.q_proj.weight", ".self_attn.k_proj.weight",
                              ".self_attn.q_proj.bias", ".self_attn.k_proj.bias")):
            return loaded
        return interleaved_to_halves(read_checkpoint(loaded), self.args.head_dim)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return super().compute_logits(hidden, out).mul_(self.args.logit_scale)


def interleaved_to_halves(t: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rows of q or k projections ([heads * head_dim, ...]), each head's reordered to its even dims
    then its odd ones: RoPE on interleaved pairs becomes RoPE on halves."""
    heads = t.shape[0] // head_dim
    return t.view(heads, head_dim // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)

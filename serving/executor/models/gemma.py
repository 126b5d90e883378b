"""Gemma 1, 2 and 3 text decoders (`GemmaForCausalLM`, `Gemma2ForCausalLM`, `Gemma3ForCausalLM`) with HF
parameter names.

They differ from the Llama family in ways `ModelArgs` carries and this module applies:
- RMSNorm scales by `1 + weight`, in float32 before the cast (`GemmaRMSNorm`);
- Gemma 2 and 3: four norms a layer, after attention and after the MLP as well as before each
  (Gemma 1: Llama's two);
- Gemma 2 and 3: the softmax scale `query_pre_attn_scalar ** -0.5`; GeGLU MLP (`gelu_pytorch_tanh`); embeddings
  scaled by sqrt(hidden_size) rounded to the model dtype;
- sliding-window layers (Gemma 2: every other one; Gemma 3: 5 of 6, with their own RoPE base);
- Gemma 2: attention scores capped as c * tanh(s / c) (`attn_logit_softcapping`, in the kernels);
- Gemma 3: per-head q/k norms before RoPE (Gemma norms);
- an optional tanh cap on the logits (`final_logit_softcapping`).
The rest (paged attention, tensor parallelism, quantized linears, the weight loaders) is
`LlamaForCausalLM`'s, which this subclasses.
"""

from __future__ import annotations

import torch
from torch import nn

from serving.executor.models.attention import PagedAttention
from serving.executor.models.embedding import VocabParallelEmbedding
from serving.executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from serving.executor.models.mlp import GatedMLP
from serving.executor.models.multimodal_text import text_checkpoint_name
from serving.executor.models.norm import RMSNorm
from serving.executor.models.stack import bind_rope_caches
from serving.executor.parallel import TPShard
from serving.checkpoint.architectures import gemma as gemma_types
from serving.checkpoint.model_config import ModelArgs
from serving.checkpoint.quantization import QuantConfig


class GemmaRMSNorm(RMSNorm):
    """x / rms(x) * (1 + weight), computed in float32 and cast back (Gemma's order, not Llama's)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__(hidden_size, eps, unit_offset=True)


class GemmaDecoderLayer(nn.Module):
    """norm -> attention -> norm (+res) norm -> GeGLU MLP -> norm; the residual is carried fused."""

    def __init__(self, args: ModelArgs, shard: TPShard, quant: QuantConfig | None, prefix: str,
                 sliding_window: int | None) -> None:
        super().__init__()
        eps = args.rms_norm_eps
        self.self_attn = PagedAttention.of_model(
            args, shard, quant, prefix,
            scale=args.attention_multiplier, sliding_window=sliding_window, softcap=args.attn_logit_softcapping,
            qk_norm_eps=eps if args.qk_norm else None, qk_norm_class=GemmaRMSNorm,
        )
        self.mlp = GatedMLP(args.hidden_size, args.intermediate_size, args.mlp_bias, shard, quant, f"{prefix}.mlp",
                            activation=args.hidden_act)
        self.input_layernorm = GemmaRMSNorm(args.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(args.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(args.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(args.hidden_size, eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.input_layernorm.add_and_norm(hidden, residual)
        attn = self.self_attn(positions, hidden)
        hidden, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(attn), residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class Gemma1DecoderLayer(LlamaDecoderLayer):
    """Gemma 1: Llama's pre-norm block (GeGLU MLP) with Gemma's norms."""

    def __init__(self, args: ModelArgs, shard: TPShard, quant: QuantConfig | None, prefix: str,
                 sliding_window: int | None) -> None:
        super().__init__(args, shard, quant, prefix, sliding_window=sliding_window)
        self.input_layernorm = GemmaRMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(args.hidden_size, args.rms_norm_eps)


class GemmaModel(nn.Module):
    """Scaled embedding, decoder layers (Gemma 3: two RoPE caches, sliding and full layers), final norm."""

    decoder_layer: type[nn.Module] = GemmaDecoderLayer

    def __init__(self, args: ModelArgs, max_position: int, shard: TPShard, quant: QuantConfig | None = None,
                 context_len: int | None = None) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(args.vocab_size, args.hidden_size, shard)
        self.layers = nn.ModuleList(self.decoder_layer(args, shard, quant, f"model.layers.{i}", args.layer_window(i))
                                    for i in range(args.num_hidden_layers))
        self.norm = GemmaRMSNorm(args.hidden_size, args.rms_norm_eps)
        # sqrt(hidden_size), rounded to the model dtype as transformers rounds it
        self.register_buffer("embed_scale", torch.tensor(args.hidden_size**0.5, device=self.norm.weight.device),
                             persistent=False)
        bind_rope_caches(self, args, max_position, context_len)  # Gemma 3: the sliding layers' own RoPE

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        hidden = hidden * self.embed_scale.to(hidden.dtype)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class GemmaForCausalLM(LlamaForCausalLM):
    """`LlamaForCausalLM` with `GemmaModel` inside and the logits' optional tanh cap (Gemma 2 and 3)."""

    serves = (gemma_types.GEMMA2, gemma_types.GEMMA3_TEXT)

    model_class = GemmaModel

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        logits = super().compute_logits(hidden, out)
        cap = self.args.final_logit_softcapping
        if cap is not None:
            logits.div_(cap).tanh_().mul_(cap)
        return logits


class Gemma1Model(GemmaModel):
    decoder_layer = Gemma1DecoderLayer


class Gemma1ForCausalLM(GemmaForCausalLM):
    """`GemmaForCausalLM` (gemma-2b / 7b, CodeGemma): Gemma's scaled embedding and norms, Llama's block."""

    serves = (gemma_types.GEMMA,)

    model_class = Gemma1Model


class Gemma3TextOfMultimodal(GemmaForCausalLM):
    """`Gemma3ForConditionalGeneration` (gemma-3-4b/12b/27b) served as text: its language model's
    weights, the vision tower's skipped (requests with images are refused where they are read).
    Its logits are uncapped: transformers applies `final_logit_softcapping` in Gemma3ForCausalLM
    only, not here (Gemma 3's released configs set none)."""

    serves = (gemma_types.GEMMA3_MULTIMODAL,)

    compute_logits = LlamaForCausalLM.compute_logits
    checkpoint_name = staticmethod(text_checkpoint_name)

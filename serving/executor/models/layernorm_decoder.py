"""Decoders with LayerNorm (StarCoder2, Phi-1/1.5/2, GPT-2, GPT-BigCode, GPT-NeoX, Falcon, OPT, Nemotron, and
StableLM with Llama's gated MLP) with HF-like parameter names.

Where they differ from the Llama family:
- LayerNorm with a bias (not RMSNorm), computed by `F.layer_norm` as transformers computes it;
- a plain MLP, fc_out(act(fc_in(x))) with biases, in place of the gated one (but StableLM's);
- Nemotron: LayerNorm scaled by 1 + weight (LayerNorm1P), a squared-ReLU MLP, half of each head rotary;
- Phi: attention and MLP read the same normed input and are added to the residual together
  (`parallel_residual`), rotary embedding on part of each head, an LM head with a bias;
- GPT-2, GPT-BigCode (StarCoder 1, SantaCoder: GPT-2 with one KV head and Linear weights) and OPT
  (its position p at row p + 2, a ReLU MLP): learned absolute position embeddings added to the
  token embeddings, no RoPE;
- GPT-NeoX (Pythia): a parallel block whose MLP reads its own LayerNorm, a quarter of each head
  rotary, q/k/v fused per head in its checkpoint;
- Falcon: a parallel block with one LayerNorm (7B) or two (40B / 180B, `new_decoder_architecture`),
  or a sequential one; one KV head (multi_query) or grouped ones, q/k/v fused by KV group.
Attention (paged KV, RoPE, sliding windows), tensor parallelism (fc_in column-parallel, fc_out
row-parallel, LayerNorm replicated) and quantized linears are the shared layers'.

Checkpoint names map onto ours (`layernorm_checkpoint_name`): StarCoder2's `mlp.c_fc` / `mlp.c_proj`
and Phi's `mlp.fc1` / `mlp.fc2` are `mlp.fc_in` / `mlp.fc_out`; Phi's `self_attn.dense` is `o_proj`
and its `model.final_layernorm` is `model.norm`. GPT-2's (`gpt2_checkpoint_name`, with or without
the `transformer.` prefix) are renamed whole, and its Conv1D weights, stored [in, out], are
transposed as they load (`checkpoint_tensor`); GPT-BigCode uses GPT-2's names; GPT-NeoX has its
own, as has Falcon. Where fused q/k/v rows are stored head by head ([heads, 3, head_dim]: GPT-NeoX,
GPT-BigCode and Falcon without multi_query) or by KV group ([kv_heads, q_per_kv + 2, head_dim]: Falcon's
new_decoder_architecture) they are reordered to q | k | v as they load.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from serving.executor.models.attention import PagedAttention
from serving.executor.models.embedding import VocabParallelEmbedding
from serving.executor.models.llama import LlamaForCausalLM
from serving.executor.models.mlp import GatedMLP, PlainMLP
from serving.executor.models.norm import LayerNorm
from serving.executor.models.params import Loaded, read_checkpoint
from serving.executor.models.stack import ResidualStack
from serving.executor.parallel import TPShard
from serving.checkpoint.architectures import layernorm_decoder as ln_types
from serving.checkpoint.model_config import ModelArgs
from serving.checkpoint.quantization import QuantConfig

_RENAMES = ((".mlp.c_fc.", ".mlp.fc_in."), (".mlp.c_proj.", ".mlp.fc_out."), (".mlp.fc1.", ".mlp.fc_in."),
            (".mlp.fc2.", ".mlp.fc_out."), (".self_attn.dense.", ".self_attn.o_proj."),
            ("model.final_layernorm.", "model.norm."))


def layernorm_checkpoint_name(name: str) -> str:
    for theirs, ours in _RENAMES:
        if theirs in name:
            return name.replace(theirs, ours)
    return name


@dataclass(frozen=True)
class CheckpointNames:
    """One architecture's checkpoint names in ours, by table: the prefix its model sits under, its
    top-level modules, the key of its layer list, each layer module, and the saved buffers
    (`module.leaf` inside a layer: causal masks) to skip. Unknown names come back unchanged, for the
    loader to name as unexpected; rotary frequency buffers are skipped by the loader itself."""

    prefix: str
    top: dict[str, str]
    layers: str
    layer: dict[str, str]
    buffers: frozenset[str] = frozenset()

    def __call__(self, name: str) -> str | None:
        module, _, leaf = name.removeprefix(self.prefix).rpartition(".")
        if module in self.top:
            return f"{self.top[module]}.{leaf}"
        parts = module.split(".", 2)  # the layer list, N, the layer's module
        if len(parts) == 3 and parts[0] == self.layers:
            if f"{parts[2]}.{leaf}" in self.buffers:
                return None
            if parts[2] in self.layer:
                return f"model.layers.{parts[1]}.{self.layer[parts[2]]}.{leaf}"
        return name


# GPT-2 (and GPT-BigCode): `transformer.h.3.attn.c_attn.weight`, or without `transformer.` as the original
# checkpoints have them; `attn.bias` / `attn.masked_bias` are the causal mask
gpt2_checkpoint_name = CheckpointNames(
    "transformer.", {"wte": "model.embed_tokens", "wpe": "model.embed_positions", "ln_f": "model.norm"}, "h",
    {"ln_1": "input_layernorm", "ln_2": "post_attention_layernorm", "attn.c_attn": "self_attn.qkv_proj",
     "attn.c_proj": "self_attn.o_proj", "mlp.c_fc": "mlp.fc_in", "mlp.c_proj": "mlp.fc_out"},
    frozenset({"attn.bias", "attn.masked_bias"}))
_FUSED_QKV = (".self_attn.qkv_proj.weight", ".self_attn.qkv_proj.bias")
_GPT2_CONV1D = (".self_attn.qkv_proj.weight", ".self_attn.o_proj.weight", ".mlp.fc_in.weight", ".mlp.fc_out.weight")


class LayerNormDecoderLayer(nn.Module):
    """x + attn(ln1(x)), then + mlp(ln2(.)); with `parallel_residual`: x + attn(ln1(x)) + mlp(ln1(x))
    (Phi), or + mlp(ln2(x)) where the MLP has a norm of its own (GPT-NeoX)."""

    def __init__(self, args: ModelArgs, shard: TPShard, quant: QuantConfig | None, prefix: str,
                 sliding_window: int | None) -> None:
        super().__init__()
        self.self_attn = PagedAttention.of_model(args, shard, quant, prefix, sliding_window=sliding_window,
                                                 use_rope=not args.learned_positions)
        mlp = PlainMLP if args.plain_mlp else GatedMLP
        self.mlp = mlp(args.hidden_size, args.intermediate_size, args.mlp_bias, shard, quant, f"{prefix}.mlp",
                       activation=args.hidden_act)
        eps, offset = args.rms_norm_eps, args.layer_norm_unit_offset
        self.input_layernorm = LayerNorm(args.hidden_size, eps, unit_offset=offset)
        self.parallel = args.parallel_residual
        self.post_attention_layernorm = (LayerNorm(args.hidden_size, eps, unit_offset=offset)
                                         if not self.parallel or args.parallel_mlp_norm else None)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        normed = self.input_layernorm(hidden)
        attn = self.self_attn(positions, normed)
        if self.parallel:  # each in transformers' order of the two additions
            if self.post_attention_layernorm is None:
                return attn + self.mlp(normed) + hidden
            return self.mlp(self.post_attention_layernorm(hidden)) + attn + hidden
        hidden = hidden + attn
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LayerNormModel(ResidualStack):
    """Embedding (+ learned positions: GPT-2, GPT-BigCode, OPT), decoder layers, the final LayerNorm (`model.*`)."""

    def __init__(self, args: ModelArgs, max_position: int, shard: TPShard, quant: QuantConfig | None = None,
                 context_len: int | None = None) -> None:
        super().__init__(args, max_position, shard, context_len,
                         lambda i, window: LayerNormDecoderLayer(args, shard, quant, f"model.layers.{i}", window),
                         LayerNorm(args.hidden_size, args.rms_norm_eps, unit_offset=args.layer_norm_unit_offset))
        self.embed_positions = None
        self.position_offset = args.position_offset
        if args.learned_positions:  # replicated: [max_position_embeddings (+ OPT's offset), hidden]
            self.embed_positions = VocabParallelEmbedding(args.max_position_embeddings + args.position_offset,
                                                          args.hidden_size)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        if self.embed_positions is None:
            return hidden
        return hidden + self.embed_positions(positions + self.position_offset if self.position_offset else positions)


class LayerNormForCausalLM(LlamaForCausalLM):
    """`Starcoder2ForCausalLM`, `PhiForCausalLM`: `LlamaForCausalLM`'s head and loading around `LayerNormModel`."""

    serves = (ln_types.STARCODER2, ln_types.PHI, ln_types.STABLELM)

    model_class = LayerNormModel
    checkpoint_name = staticmethod(layernorm_checkpoint_name)


class GPT2ForCausalLM(LayerNormForCausalLM):
    """`GPT2LMHeadModel`: learned positions, GPT-2's names, Conv1D weights transposed as they load."""

    serves = (ln_types.GPT2,)

    checkpoint_name = gpt2_checkpoint_name

    @staticmethod
    def checkpoint_tensor(name: str, loaded: Loaded) -> Loaded:
        """Our parameter `name`'s tensor as our layer holds it: Conv1D weights are stored [in, out]."""
        return read_checkpoint(loaded).t() if name.endswith(_GPT2_CONV1D) else loaded


# GPT-NeoX: `gpt_neox.layers.3.attention.query_key_value.weight`, `embed_out.weight`; `attention.bias` /
# `attention.masked_bias`: the causal mask
gpt_neox_checkpoint_name = CheckpointNames(
    "gpt_neox.", {"embed_in": "model.embed_tokens", "final_layer_norm": "model.norm", "embed_out": "lm_head"}, "layers",
    {"attention.query_key_value": "self_attn.qkv_proj", "attention.dense": "self_attn.o_proj",
     "mlp.dense_h_to_4h": "mlp.fc_in", "mlp.dense_4h_to_h": "mlp.fc_out", "input_layernorm": "input_layernorm",
     "post_attention_layernorm": "post_attention_layernorm"},
    frozenset({"attention.bias", "attention.masked_bias"}))


class FusedQKVForCausalLM(LayerNormForCausalLM):
    """A LayerNorm decoder whose checkpoint fuses q/k/v by KV group, [kv_heads, q_per_kv + 2, head_dim]
    (with as many KV heads as heads: head by head, [heads, 3, head_dim]; with one: q | k | v already),
    reordered to our q | k | v as they load (GPT-NeoX, GPT-BigCode, Falcon)."""

    serves = ()  # a base: its subclasses serve

    def checkpoint_tensor(self, name: str, loaded: Loaded) -> Loaded:
        a = self.args
        if a.num_key_value_heads == 1 or not name.endswith(_FUSED_QKV):
            return loaded
        return qkv_by_group(read_checkpoint(loaded), a.num_attention_heads, a.num_key_value_heads, a.head_dim)


def qkv_by_group(t: torch.Tensor, heads: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    """Fused q/k/v rows (weight or bias) stored by KV group, [kv_heads, heads / kv_heads + 2, head_dim], as q | k | v."""
    rest = t.shape[1:]
    groups = t.view(kv_heads, heads // kv_heads + 2, head_dim, *rest)
    return torch.cat([groups[:, :-2].reshape(-1, *rest), groups[:, -2].reshape(-1, *rest),
                      groups[:, -1].reshape(-1, *rest)])


class GPTNeoXForCausalLM(FusedQKVForCausalLM):
    """`GPTNeoXForCausalLM` (Pythia, GPT-NeoX-20B): its names; q/k/v fused head by head."""

    serves = (ln_types.GPT_NEOX,)

    checkpoint_name = gpt_neox_checkpoint_name


class GPTBigCodeForCausalLM(FusedQKVForCausalLM):
    """`GPTBigCodeForCausalLM` (StarCoder 1, SantaCoder, WizardCoder): GPT-2's names with Linear weights;
    one KV head (multi_query) or q/k/v fused head by head."""

    serves = (ln_types.GPT_BIGCODE,)

    checkpoint_name = gpt2_checkpoint_name


# Falcon: `transformer.h.3.self_attention.query_key_value.weight`, `ln_attn` / `ln_mlp` in the 40B layout
falcon_checkpoint_name = CheckpointNames(
    "transformer.", {"word_embeddings": "model.embed_tokens", "ln_f": "model.norm"}, "h",
    {"self_attention.query_key_value": "self_attn.qkv_proj", "self_attention.dense": "self_attn.o_proj",
     "mlp.dense_h_to_4h": "mlp.fc_in", "mlp.dense_4h_to_h": "mlp.fc_out", "input_layernorm": "input_layernorm",
     "ln_attn": "input_layernorm", "ln_mlp": "post_attention_layernorm",
     "post_attention_layernorm": "post_attention_layernorm"})


class FalconForCausalLM(FusedQKVForCausalLM):
    """`FalconForCausalLM` (Falcon 7B / 40B / 180B, Falcon 2): its names; q/k/v fused by KV group."""

    serves = (ln_types.FALCON,)

    checkpoint_name = falcon_checkpoint_name


def opt_checkpoint_name(name: str) -> str:
    """OPT's names (`model.decoder.layers.3.self_attn.out_proj.weight`, `fc1`, per-layer
    `final_layer_norm`) in ours."""
    if not name.startswith("model.decoder."):
        return name
    base = name.removeprefix("model.decoder.")
    if base.startswith("final_layer_norm."):
        return "model.norm." + base.removeprefix("final_layer_norm.")
    for theirs, ours in ((".self_attn.out_proj.", ".self_attn.o_proj."), (".self_attn_layer_norm.", ".input_layernorm."),
                         (".final_layer_norm.", ".post_attention_layernorm."), (".fc1.", ".mlp.fc_in."),
                         (".fc2.", ".mlp.fc_out.")):
        if theirs in base:
            base = base.replace(theirs, ours)
            break
    return "model." + base


class OPTForCausalLM(LayerNormForCausalLM):
    """`OPTForCausalLM` (OPT 125M, 1.3B and up; not 350M's post-norm layout)."""

    serves = (ln_types.OPT,)

    checkpoint_name = staticmethod(opt_checkpoint_name)


def nemotron_checkpoint_name(name: str) -> str:
    """Nemotron's plain MLP is named like a gated one's halves (`mlp.up_proj`, `mlp.down_proj`): ours is fc_in / fc_out."""
    return name.replace(".mlp.up_proj.", ".mlp.fc_in.").replace(".mlp.down_proj.", ".mlp.fc_out.")


class NemotronForCausalLM(LayerNormForCausalLM):
    """`NemotronForCausalLM` (Nemotron-4, Minitron): LayerNorm1P, squared-ReLU MLP, partial rotary."""

    serves = (ln_types.NEMOTRON,)

    checkpoint_name = staticmethod(nemotron_checkpoint_name)

"""The mixture-of-experts model types (serving/executor/models/moe.py's block in a Llama decoder):
Mixtral, Qwen2-MoE, Qwen3-MoE, and how their configs place the experts."""

from __future__ import annotations

from serving.checkpoint.architectures.llama import qwen_sliding_layers
from serving.checkpoint.architectures.model_type import ArchitectureFamily, Config, ModelType


def _num_experts(d: Config, default: int) -> int:
    # transformers 5 writes either spelling of the expert count (an attribute map), hub configs their own
    return int(d.get("num_experts") or d.get("num_local_experts") or default)


def _top_k(d: Config, num_experts: int, default: int) -> int:
    top_k = int(d.get("num_experts_per_tok") or default)
    if not 0 < top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok={top_k} must be in 1..{num_experts} (the number of experts)")
    return top_k


def _mixtral_args(d: Config, num_layers: int) -> dict:
    """Mixtral: every layer, experts as wide as `intermediate_size`, top-k always renormalised,
    expert outputs weighed in float32."""
    num_experts = _num_experts(d, 8)
    if not num_experts:
        return {}
    return dict(num_experts=num_experts, num_experts_per_tok=_top_k(d, num_experts, 2),
                moe_intermediate_size=int(d["intermediate_size"]), moe_layers=tuple(range(num_layers)),
                norm_topk_prob=True, moe_combine_fp32=True)


def _qwen_moe_args(d: Config, num_layers: int, shared_expert: bool) -> dict:
    """Qwen2/3-MoE: the layers (i + 1) % decoder_sparse_step == 0 not in `mlp_only_layers`, experts of
    `moe_intermediate_size`, `norm_topk_prob` as configured (transformers' default: false); Qwen2-MoE
    adds a gated shared expert. Without experts, a dense model."""
    num_experts = _num_experts(d, 0)
    if not num_experts:
        return {}
    step = int(d.get("decoder_sparse_step") or 1)
    dense = set(d.get("mlp_only_layers") or ())
    return dict(num_experts=num_experts, num_experts_per_tok=_top_k(d, num_experts, 0),
                moe_intermediate_size=int(d["moe_intermediate_size"]),
                moe_layers=tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0),
                norm_topk_prob=bool(d.get("norm_topk_prob", False)),
                shared_expert_intermediate_size=int(d.get("shared_expert_intermediate_size") or 0)
                if shared_expert else 0)


MIXTRAL = ModelType("mixtral", "MixtralForCausalLM", norm_eps=1e-5, read_args=_mixtral_args)
QWEN2_MOE = ModelType("qwen2_moe", "Qwen2MoeForCausalLM", qkv_bias=True, sliding_opt_in=True,
                      sliding_layers=qwen_sliding_layers, read_args=lambda d, n: _qwen_moe_args(d, n, True))
QWEN3_MOE = ModelType("qwen3_moe", "Qwen3MoeForCausalLM", qk_norm=True, sliding_opt_in=True,
                      sliding_layers=qwen_sliding_layers, read_args=lambda d, n: _qwen_moe_args(d, n, False))

FAMILY = ArchitectureFamily("moe", (MIXTRAL, QWEN2_MOE, QWEN3_MOE))

"""The mixture-of-experts block on its own: its two ways of running the experts (grouped rows in
eager steps; every expert on every row, weighted 0 where not chosen, in CUDA graphs) against a
per-token sum written from the definition, and what an MoE config turns into.

The whole models (Mixtral, Qwen2-MoE, Qwen3-MoE) are checked against transformers' logits in
test_models.py, through the engine in test_engine_tiny_archs.py and at TP=2 in
test_tensor_parallel.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from serving.executor.models.moe import SparseMoeBlock, mixtral_checkpoint_name
from serving.executor.parallel import TPShard, validate_tensor_parallel
from serving.model_config import ModelArgs

BASE = dict(architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", vocab_size=100, hidden_size=32,
            intermediate_size=48, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
            num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16)


def _block(**over: object) -> SparseMoeBlock:
    torch.manual_seed(0)
    block = SparseMoeBlock(ModelArgs.from_dict({**BASE, **over}), shard=TPShard())
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.3)
    return block


def _per_token(block: SparseMoeBlock, x: torch.Tensor, norm: bool) -> torch.Tensor:
    """sum over the chosen experts e of p_e * expert_e(x_t), token by token (+ the gated shared expert)."""
    out = []
    for t in range(x.shape[0]):
        probs = F.softmax(x[t] @ block.gate.weight.t(), dim=-1)
        top = torch.topk(probs, block.top_k)
        weights = top.values / top.values.sum() if norm else top.values
        row = sum(w * block.experts[int(e)](x[t:t + 1])[0] for w, e in zip(weights, top.indices, strict=True))
        if block.shared_expert is not None:
            row = row + torch.sigmoid(block.shared_expert_gate(x[t:t + 1])[0]) * block.shared_expert(x[t:t + 1])[0]
        out.append(row)
    return torch.stack(out)


@pytest.mark.parametrize("over", [dict(), dict(norm_topk_prob=True, shared_expert_intermediate_size=24),
                                  dict(num_experts_per_tok=6)], ids=["topk", "normalised_shared", "all_experts"])
def test_grouped_and_dense_equal_the_per_token_sum(over):
    block = _block(**over)
    x = torch.randn(37, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = _per_token(block, x, block.norm_topk_prob)
        grouped = block(x)
        block.force_dense = True
        dense = block(x)
    torch.testing.assert_close(grouped, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dense, want, atol=1e-5, rtol=1e-5)
    # every expert was chosen for some token, so every expert's rows were compared
    _, ids = block.route(x)
    assert len(set(ids.flatten().tolist())) == 6


def test_bf16_grouped_equals_dense_exactly():
    """The graph path must not change a served token: in bf16 too, unchosen experts add exact zeros."""
    block = _block().to(torch.bfloat16)
    x = torch.randn(20, 32, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    with torch.no_grad():
        grouped = block(x)
        block.force_dense = True
        assert torch.equal(block(x), grouped)


def test_moe_layers_and_defaults_from_configs():
    qwen = ModelArgs.from_dict({**BASE, "decoder_sparse_step": 1, "mlp_only_layers": [1]})
    assert (qwen.moe_layers, qwen.norm_topk_prob, qwen.qkv_bias) == ((0, 2), False, True)
    stepped = ModelArgs.from_dict({**BASE, "decoder_sparse_step": 2})
    assert stepped.moe_layers == (1,)
    q3 = ModelArgs.from_dict({**BASE, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                              "num_experts": None, "num_local_experts": 6, "norm_topk_prob": True})
    assert (q3.num_experts, q3.norm_topk_prob, q3.qk_norm, q3.qkv_bias) == (6, True, True, False)
    mixtral = ModelArgs.from_dict({**BASE, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                                   "num_experts": None, "num_local_experts": 8})
    assert (mixtral.num_experts, mixtral.moe_intermediate_size, mixtral.moe_layers, mixtral.norm_topk_prob,
            mixtral.moe_combine_fp32) == (8, 48, (0, 1, 2), True, True)
    with pytest.raises(ValueError, match=r"num_experts_per_tok=7 must be in 1\.\.6"):
        ModelArgs.from_dict({**BASE, "num_experts_per_tok": 7})


def test_tensor_parallel_degree_must_divide_the_expert_width():
    args = ModelArgs.from_dict({**BASE, "moe_intermediate_size": 18, "intermediate_size": 64,
                                "num_attention_heads": 4, "num_key_value_heads": 4})
    validate_tensor_parallel(args, 2)
    with pytest.raises(ValueError, match=r"does not divide moe_intermediate_size \(18\)"):
        validate_tensor_parallel(args, 4)


def test_mixtral_checkpoint_names():
    assert mixtral_checkpoint_name("model.layers.3.block_sparse_moe.experts.7.w1.weight") == \
        "model.layers.3.mlp.experts.7.gate_proj.weight"
    assert mixtral_checkpoint_name("model.layers.3.block_sparse_moe.experts.7.w2.qweight") == \
        "model.layers.3.mlp.experts.7.down_proj.qweight"
    assert mixtral_checkpoint_name("model.layers.3.block_sparse_moe.gate.weight") == "model.layers.3.mlp.gate.weight"
    assert mixtral_checkpoint_name("model.layers.3.self_attn.q_proj.weight") == "model.layers.3.self_attn.q_proj.weight"


def test_lora_on_an_moe_model_is_a_clear_error(tiny_models):
    from serving.llm import LLM

    with pytest.raises(ValueError, match="LoRA adapters on a mixture-of-experts model"):
        LLM(str(tiny_models("mixtral")), enable_lora=True, device="cpu", kv_cache_memory_gb=0.01)

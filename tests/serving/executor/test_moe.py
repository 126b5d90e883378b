"""The mixture-of-experts block on its own: its three ways of running the experts (each pick with
its own expert's gathered weights; rows grouped by expert; every expert on every row, weighted 0
where not chosen) against a per-token sum written from the definition, and what an MoE config
turns into.

The whole models (Mixtral, Qwen2-MoE, Qwen3-MoE) are checked against transformers' logits in
test_models.py, through the engine in test_engine_tiny_archs.py and at TP=2 in
test_tensor_parallel.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from serving.executor.models import _default_dtype
from serving.executor.models.moe import SparseMoeBlock, mixtral_checkpoint_name
from serving.executor.parallel import TPShard, validate_tensor_parallel
from serving.checkpoint.model_config import ModelArgs

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


PATHS = ("picked", "grouped", "dense")


@pytest.mark.parametrize("over", [dict(), dict(norm_topk_prob=True, shared_expert_intermediate_size=24),
                                  dict(num_experts_per_tok=6)], ids=["topk", "normalised_shared", "all_experts"])
@pytest.mark.parametrize("tokens", [2, 37])
def test_every_path_equals_the_per_token_sum(over, tokens):
    block = _block(**over)
    x = torch.randn(tokens, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = _per_token(block, x, block.norm_topk_prob)
        for path in PATHS:
            block.force_path = path
            torch.testing.assert_close(block(x), want, atol=1e-5, rtol=1e-5, msg=path)
    if tokens == 37:  # every expert was chosen for some token, so every expert's rows were compared
        _, ids = block.route(x)
        assert len(set(ids.flatten().tolist())) == 6


def test_the_path_follows_the_picks_and_reads_the_loaded_weights():
    block = _block()
    assert block.path(torch.zeros(2, 32)) == "picked"  # 4 picks < 6 experts: only chosen experts are read
    assert block.path(torch.zeros(3, 32)) == "grouped"  # 6 picks: eager steps group rows by expert
    # the stacked tensors are the experts' own weights (views), so loading and dummy fills reach them
    assert torch.equal(block.w13[4], block.experts[4].gate_up_proj.weight)
    assert block.w2[1].data_ptr() == block.experts[1].down_proj.weight.data_ptr()


@pytest.mark.parametrize("mixtral", [False, True], ids=["qwen_model_dtype_weights", "mixtral_fp32_weights"])
def test_bf16_paths_equal_exactly(mixtral):
    """The graph paths must not change a served token: in bf16 too, the picks are added in the same order
    (here on the CPU; a GPU's GEMM kernels may round differently by shape)."""
    over = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": 6} if mixtral else {}
    with _default_dtype(torch.bfloat16):
        block = _block(**over)
    x = torch.randn(20, 32, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    with torch.no_grad():
        results = {}
        for path in PATHS:
            block.force_path = path
            results[path] = block(x)
    assert torch.equal(results["picked"], results["grouped"]) and torch.equal(results["dense"], results["grouped"])


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


@pytest.mark.parametrize("arch, kind", [("mixtral", "a mixture-of-experts model"),
                                        ("starcoder2", "a model with a plain \\(ungated\\) MLP")])
def test_lora_where_the_mlp_is_not_gated_is_a_clear_error(tiny_models, arch, kind):
    from serving.llm import LLM

    with pytest.raises(ValueError, match=f"LoRA adapters on {kind}"):
        LLM(str(tiny_models(arch)), enable_lora=True, device="cpu", kv_cache_memory_gb=0.01)

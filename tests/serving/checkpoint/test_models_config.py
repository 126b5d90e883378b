"""Model config parsing (transformers 4.x and 5.x spellings), RoPE caches vs HF, the registry."""

from __future__ import annotations

import json
import math

import pytest
import torch

from serving.executor.models import build_model
from serving.checkpoint.model_config import UnsupportedModelError, check_supported
from serving.checkpoint.model_config import ModelArgs
from serving.executor.models.rotary import build_cos_sin_cache

BASE = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128, "hidden_size": 256,
    "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
}
LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def test_rope_keys_4x_and_5x_give_the_same_args():
    v4 = ModelArgs.from_dict({**BASE, "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", **LLAMA3}})
    v4_type = ModelArgs.from_dict({**BASE, "rope_theta": 500000.0, "rope_scaling": {"type": "llama3", **LLAMA3}})
    v5 = ModelArgs.from_dict({**BASE, "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3}})
    assert v4.rope == v4_type.rope == v5.rope
    assert v5.rope.scaling_type == "llama3" and v5.rope.theta == 500000.0
    plain = ModelArgs.from_dict(BASE)
    assert plain.rope.scaling_type == "default" and plain.rope.theta == 10000.0
    assert plain.head_dim == 64 and plain.q_size == 256 and plain.kv_size == 128


def test_arch_defaults():
    qwen = ModelArgs.from_dict({**BASE, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
                                "sliding_window": 4096, "use_sliding_window": False})
    assert qwen.qkv_bias and not qwen.o_bias and qwen.sliding_window is None
    mistral = ModelArgs.from_dict({**BASE, "architectures": ["MistralForCausalLM"], "model_type": "mistral",
                                   "sliding_window": 4096, "head_dim": 80})
    assert mistral.sliding_window == 4096 and mistral.head_dim == 80 and not mistral.qkv_bias
    assert not qwen.qk_norm and not mistral.qk_norm
    assert mistral.sliding_layers is None  # the window holds in every layer
    # Qwen2 with its window on: the layers from max_window_layers; layer_types, where given, decide.
    qwen_sw = {**BASE, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "num_hidden_layers": 4,
               "sliding_window": 64, "use_sliding_window": True, "max_window_layers": 3}
    assert ModelArgs.from_dict(qwen_sw).sliding_layers == (3,)
    types = ["sliding_attention", "full_attention"] * 2
    assert ModelArgs.from_dict({**qwen_sw, "layer_types": types}).sliding_layers == (0, 2)
    with pytest.raises(ValueError, match="layer_types has 2 entries for 4 layers"):
        ModelArgs.from_dict({**qwen_sw, "layer_types": types[:2]})
    # Qwen3 (Qwen3-0.6B's numbers): heads wider than hidden / heads, q/k norms, no bias, the window off;
    # a config naming only its model_type is the same architecture.
    qwen3_cfg = {**BASE, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024,
                 "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "sliding_window": None,
                 "use_sliding_window": False, "attention_bias": False}
    qwen3 = ModelArgs.from_dict(qwen3_cfg)
    assert qwen3.qk_norm and not qwen3.qkv_bias and qwen3.sliding_window is None
    assert (qwen3.head_dim, qwen3.q_size, qwen3.kv_size) == (128, 2048, 1024)
    assert ModelArgs.from_dict({**qwen3_cfg, "architectures": None}) == qwen3
    check_supported({"model_type": "qwen3"})
    # SmolLM3: every 4th layer without RoPE unless the config lists them; Granite: its four multipliers.
    smol = {**BASE, "architectures": ["SmolLM3ForCausalLM"], "model_type": "smollm3", "num_hidden_layers": 8}
    assert ModelArgs.from_dict(smol).no_rope_layers == (3, 7)
    assert ModelArgs.from_dict({**smol, "no_rope_layers": [0, 1, 1, 1, 0, 1, 1, 1]}).no_rope_layers == (0, 4)
    with pytest.raises(ValueError, match="no_rope_layers has 2 entries for 8 layers"):
        ModelArgs.from_dict({**smol, "no_rope_layers": [1, 0]})
    granite = ModelArgs.from_dict({**BASE, "architectures": ["GraniteForCausalLM"], "model_type": "granite",
                                   "embedding_multiplier": 12.0, "residual_multiplier": 0.22,
                                   "attention_multiplier": 0.0078125, "logits_scaling": 16.0})
    assert (granite.embedding_multiplier, granite.residual_multiplier, granite.attention_multiplier,
            granite.logits_scaling) == (12.0, 0.22, 0.0078125, 16.0)
    assert qwen3.attention_multiplier is None and qwen3.no_rope_layers == () and qwen3.logits_scaling == 1.0
    # Gemma 1 (gemma-7b's config.json): "gelu" means the tanh approximation, tied without saying so,
    # the plain head_dim ** -0.5 scale (no query_pre_attn_scalar)
    gemma = ModelArgs.from_dict({**BASE, "architectures": ["GemmaForCausalLM"], "model_type": "gemma",
                                 "hidden_size": 3072, "num_attention_heads": 16, "num_key_value_heads": 16,
                                 "head_dim": 256, "hidden_act": "gelu"})
    assert (gemma.hidden_act, gemma.tie_word_embeddings, gemma.attention_multiplier, gemma.q_size) == (
        "gelu_pytorch_tanh", True, None, 4096)
    # StarCoder2: `use_bias` switches every bias, `norm_epsilon`; Phi: biases, parallel block, LM head bias
    no_eps = {k: v for k, v in BASE.items() if k != "rms_norm_eps"}
    sc2 = {**no_eps, "architectures": ["Starcoder2ForCausalLM"], "model_type": "starcoder2", "norm_epsilon": 2e-5,
           "hidden_act": "gelu_pytorch_tanh", "sliding_window": 4096}
    a = ModelArgs.from_dict(sc2)
    assert (a.layer_norm, a.qkv_bias, a.o_bias, a.mlp_bias, a.rms_norm_eps, a.tie_word_embeddings, a.sliding_window) == (
        True, True, True, True, 2e-5, True, 4096)
    a = ModelArgs.from_dict({**sc2, "use_bias": False})
    assert not (a.qkv_bias or a.o_bias or a.mlp_bias)
    phi = {**no_eps, "architectures": ["PhiForCausalLM"], "model_type": "phi", "hidden_act": "gelu_new",
           "partial_rotary_factor": 0.4, "layer_norm_eps": 3e-5}
    a = ModelArgs.from_dict(phi)
    assert (a.parallel_residual, a.lm_head_bias, a.qkv_bias, a.mlp_bias, a.rope.partial_rotary_factor, a.rms_norm_eps,
            a.tie_word_embeddings) == (True, True, True, True, 0.4, 3e-5, False)
    with pytest.raises(ValueError, match="qk_layernorm"):
        ModelArgs.from_dict({**phi, "qk_layernorm": True})
    with pytest.raises(ValueError, match="hidden_act 'silu' is not supported for phi"):
        ModelArgs.from_dict({**phi, "hidden_act": "silu"})
    # OPT: ffn_dim, ReLU, positions at an offset of 2; opt-350m's layout and Falcon's ALiBi refused by name
    opt = {**no_eps, "architectures": ["OPTForCausalLM"], "model_type": "opt", "ffn_dim": 1024}
    a = ModelArgs.from_dict(opt)
    assert (a.intermediate_size, a.hidden_act, a.position_offset, a.learned_positions, a.tie_word_embeddings) == (
        1024, "relu", 2, True, True)
    with pytest.raises(ValueError, match="do_layer_norm_before=false"):
        ModelArgs.from_dict({**opt, "do_layer_norm_before": False})
    with pytest.raises(ValueError, match=r"word_embed_proj_dim \(512\) != hidden_size \(256\)"):
        ModelArgs.from_dict({**opt, "word_embed_proj_dim": 512})
    cohere = {**no_eps, "architectures": ["CohereForCausalLM"], "model_type": "cohere", "logit_scale": 0.0625}
    a = ModelArgs.from_dict(cohere)
    assert (a.logit_scale, a.tie_word_embeddings, a.rms_norm_eps) == (0.0625, True, 1e-5)
    with pytest.raises(ValueError, match="use_qk_norm"):
        ModelArgs.from_dict({**cohere, "use_qk_norm": True})
    with pytest.raises(ValueError, match="names architecture FalconForCausalLM but model_type 'llama'"):
        ModelArgs.from_dict({**BASE, "architectures": ["FalconForCausalLM"]})
    assert ModelArgs.from_dict({**BASE, "model_type": "mistral"}).architecture == "LlamaForCausalLM"  # alike: fine
    with pytest.raises(ValueError, match="alibi"):
        ModelArgs.from_dict({**no_eps, "architectures": ["FalconForCausalLM"], "model_type": "falcon", "alibi": True})


def test_gemma3_configs_of_both_transformers_versions():
    """Gemma 3 (google/gemma-3-1b-it's numbers): 4.x keys (rope_local_base_freq, sliding_window_pattern,
    rope_scaling for the full layers) and 5.x ones (rope_parameters by layer type, layer_types) agree."""
    v4 = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 262144,
          "hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 8, "num_attention_heads": 4,
          "num_key_value_heads": 1, "head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 512,
          "sliding_window_pattern": 6, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
          "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "hidden_activation": "gelu_pytorch_tanh",
          "final_logit_softcapping": None, "attn_logit_softcapping": None, "max_position_embeddings": 32768}
    a4 = ModelArgs.from_dict(v4)
    assert a4.sliding_layers == (0, 1, 2, 3, 4, 6, 7) and a4.sliding_window == 512
    assert (a4.rope.theta, a4.rope.scaling_type, a4.rope.factor) == (1000000.0, "linear", 8.0)
    assert (a4.rope_local.theta, a4.rope_local.scaling_type) == (10000.0, "default")
    assert a4.attention_multiplier == 256**-0.5 and a4.hidden_act == "gelu_pytorch_tanh"
    assert a4.final_logit_softcapping is None and a4.q_size == 1024
    v5 = {k: v for k, v in v4.items() if k not in ("sliding_window_pattern", "rope_theta", "rope_local_base_freq",
                                                    "rope_scaling")}
    v5["layer_types"] = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(8)]
    v5["rope_parameters"] = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    assert ModelArgs.from_dict(v5) == a4
    # Gemma 2 (gemma-2-9b's numbers, a 4.x config): the even layers slide, both caps, one RoPE.
    g2 = ModelArgs.from_dict({"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "hidden_size": 3584,
                              "intermediate_size": 14336, "num_hidden_layers": 4, "num_attention_heads": 16,
                              "num_key_value_heads": 8, "head_dim": 256, "query_pre_attn_scalar": 256,
                              "sliding_window": 4096, "final_logit_softcapping": 30.0,
                              "attn_logit_softcapping": 50.0, "vocab_size": 256000})
    assert g2.sliding_layers == (0, 2) and (g2.attn_logit_softcapping, g2.final_logit_softcapping) == (50.0, 30.0)
    assert g2.rope_local is None and g2.rope.theta == 10000.0 and not g2.qk_norm and g2.hidden_act == "gelu_pytorch_tanh"
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        ModelArgs.from_dict({**v4, "use_bidirectional_attention": True})


@pytest.mark.parametrize(
    "rope_parameters",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        {"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3},
        {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},  # within the window: plain
        # YaRN (Qwen's long-context recipe): blended frequencies and cos/sin scaled by its attention factor
        {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0, "original_max_position_embeddings": 64},
        {"rope_type": "yarn", "factor": 8.0, "rope_theta": 50000.0, "original_max_position_embeddings": 128,
         "beta_fast": 16, "beta_slow": 2, "mscale": 0.707, "mscale_all_dim": 1.0, "truncate": False},
        {"rope_type": "yarn", "factor": 2.0, "rope_theta": 10000.0, "original_max_position_embeddings": 256,
         "attention_factor": 1.25},
    ],
)
def test_cos_sin_cache_matches_transformers_exactly(rope_parameters):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = LlamaConfig(**{k: v for k, v in BASE.items() if k not in ("architectures", "model_type")},
                      rope_parameters=dict(rope_parameters))
    hf = LlamaRotaryEmbedding(cfg)
    positions = torch.arange(300)
    cos, sin = hf(torch.zeros(1, 1, 64), positions[None])  # [1, P, 64] (halves repeated)
    args = ModelArgs.from_dict({**BASE, "rope_parameters": dict(rope_parameters)})
    cache = build_cos_sin_cache(args.rope, args.head_dim, 512)
    assert torch.equal(cache[:300, :32], cos[0, :, :32]) and torch.equal(cache[:300, 32:], sin[0, :, :32])


def test_yarn_needs_its_original_context_and_scales_cos_sin():
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        ModelArgs.from_dict({**BASE, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    # No factor (DeepSeek-style): max_position_embeddings / original; cos and sin carry 0.1 ln(4) + 1.
    args = ModelArgs.from_dict({**BASE, "rope_scaling": {"rope_type": "yarn", "original_max_position_embeddings": 128}})
    assert args.rope.factor == 4.0
    cache = build_cos_sin_cache(args.rope, args.head_dim, 8)
    assert torch.allclose(cache[0, :32], torch.full((32,), 0.1 * math.log(4.0) + 1.0))


@pytest.mark.parametrize("partial", [1.0, 0.75])
def test_longrope_short_within_the_original_context_long_beyond_as_transformers(partial):
    """Phi-3.5 / Phi-4-mini: LongRoPE's short factors for a served context within the original 64
    positions, the long ones beyond it, each equal to transformers' cache for such a sequence; cos
    and sin carry sqrt(1 + ln(2048 / 64) / ln 64)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    half = int(64 * partial) // 2
    gen = torch.Generator().manual_seed(0)
    short = (1.0 + torch.rand(half, generator=gen)).tolist()
    long = (1.0 + 20 * torch.rand(half, generator=gen)).tolist()
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": short, "long_factor": long,
            "original_max_position_embeddings": 64, "partial_rotary_factor": partial}
    base = {**BASE, "max_position_embeddings": 2048, "partial_rotary_factor": partial}
    cfg = LlamaConfig(**{k: v for k, v in base.items() if k not in ("architectures", "model_type")},
                      rope_parameters=dict(rope))
    hf = LlamaRotaryEmbedding(cfg)
    args = ModelArgs.from_dict({**base, "rope_parameters": dict(rope)})
    assert args.rope.factor == 32.0 and args.rope.scaling_type == "longrope"
    rot = int(64 * partial) // 2
    for context_len, positions in ((64, torch.arange(64)), (2048, torch.arange(300))):
        cos, sin = hf(torch.zeros(1, 1, 64), positions[None])  # the factors of this longest position
        cache = build_cos_sin_cache(args.rope, args.head_dim, 2048, context_len=context_len)
        n = len(positions)
        assert torch.equal(cache[:n, :rot], cos[0, :, :rot]) and torch.equal(cache[:n, rot:], sin[0, :, :rot])
    assert math.isclose(build_cos_sin_cache(args.rope, args.head_dim, 8)[0, 0].item(),
                        math.sqrt(1 + math.log(32) / math.log(64)), rel_tol=1e-6)
    # The early name "su", and factors that do not fit the rotary dims
    su = {**{k: v for k, v in rope.items() if k != "rope_type"}, "type": "su"}
    assert ModelArgs.from_dict({**base, "rope_scaling": su}).rope == args.rope
    with pytest.raises(ValueError, match=f"long_factor: a list of {half} numbers"):
        ModelArgs.from_dict({**base, "rope_parameters": {**rope, "long_factor": long[:-1]}})


def test_partial_rotary_dim():
    args = ModelArgs.from_dict({**BASE, "partial_rotary_factor": 0.5})
    assert build_cos_sin_cache(args.rope, args.head_dim, 16).shape == (16, 32)


def test_unsupported_rope_and_activation_are_clear():
    with pytest.raises(ValueError, match="'ntk-by-parts' is not supported"):
        ModelArgs.from_dict({**BASE, "rope_scaling": {"type": "ntk-by-parts", "factor": 2.0}})
    with pytest.raises(ValueError, match="gelu"):
        ModelArgs.from_dict({**BASE, "hidden_act": "gelu"})


def test_registry_errors():
    check_supported(BASE)
    with pytest.raises(UnsupportedModelError, match="BloomForCausalLM.*supported"):
        check_supported({**BASE, "architectures": ["BloomForCausalLM"], "model_type": "bloom"})
    with pytest.raises(UnsupportedModelError, match="remote code"):
        check_supported({**BASE, "architectures": ["MyLM"], "auto_map": {"AutoModelForCausalLM": "x.MyLM"}})


def test_runner_rejects_unsupported_dir(tmp_path):
    from serving.engine_config import EngineConfig
    from serving.executor.model_runner import ModelRunner

    (tmp_path / "config.json").write_text(json.dumps({**BASE, "architectures": ["MptForCausalLM"]}))
    with pytest.raises(UnsupportedModelError, match="MptForCausalLM"):
        ModelRunner(EngineConfig(model=str(tmp_path)))


def test_build_model_uses_dtype_and_names():
    args = ModelArgs.from_dict({**BASE, "tie_word_embeddings": True})
    model = build_model(args, torch.bfloat16, torch.device("cpu"))
    names = {n for n, _ in model.named_parameters()}
    assert "model.layers.0.self_attn.qkv_proj.weight" in names and "model.layers.0.mlp.gate_up_proj.weight" in names
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.model.cos_sin_cache.dtype == torch.float32
    assert torch.get_default_dtype() == torch.float32  # restored

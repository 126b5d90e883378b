"""The Gemma model types (serving/executor/models/gemma.py): Gemma 1, 2, 3 (text), and Gemma 3's
multimodal checkpoints served as their text decoder.

Gemma's configs leave out what transformers' config classes default (Gemma 3's multimodal text
configs name little more than their sizes): those defaults are declared here."""

from __future__ import annotations

from types import MappingProxyType

from serving.checkpoint.architectures.model_type import ArchitectureFamily, Config, ModelType, MultimodalText


def _gemma1_fields(d: Config) -> Config:
    """Gemma 1's released configs say `gelu` meaning the tanh approximation."""
    if (d.get("hidden_activation") or d.get("hidden_act") or "silu") == "gelu":
        return {**d, "hidden_activation": "gelu_pytorch_tanh"}
    return d


def _softmax_scale(d: Config, num_layers: int) -> dict:
    """Gemma 2/3 scale attention scores by query_pre_attn_scalar ** -0.5, not head_dim ** -0.5."""
    return {"attention_multiplier": float(d["query_pre_attn_scalar"]) ** -0.5}


def _gemma3_sliding_layers(d: Config, num_layers: int) -> tuple[int, ...]:
    """4.x configs: every `sliding_window_pattern`-th layer is global, the others slide."""
    pattern = int(d.get("sliding_window_pattern", 6))
    return tuple(i for i in range(num_layers) if (i + 1) % pattern)


GEMMA = ModelType("gemma", "GemmaForCausalLM", tied_embeddings=True, dialect=_gemma1_fields)
GEMMA2 = ModelType(
    "gemma2", "Gemma2ForCausalLM", read_args=_softmax_scale,
    sliding_layers=lambda d, n: tuple(range(0, n, 2)),  # 4.x configs: the even layers slide
    defaults=MappingProxyType({
        "vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256, "sliding_window": 4096,
        "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True, "rope_theta": 10000.0,
        "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0, "bos_token_id": 2, "eos_token_id": 1,
    }))
GEMMA3_TEXT = ModelType(
    "gemma3_text", "Gemma3ForCausalLM", qk_norm=True, read_args=_softmax_scale, sliding_layers=_gemma3_sliding_layers,
    local_rope_base_key="rope_local_base_freq",
    defaults=MappingProxyType({
        "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256, "sliding_window": 4096, "sliding_window_pattern": 6,
        "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True, "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10000.0, "bos_token_id": 2, "eos_token_id": 1,
    }))
GEMMA3_MULTIMODAL = MultimodalText("Gemma3ForConditionalGeneration", GEMMA3_TEXT.name)  # Gemma 3 4B and larger

FAMILY = ArchitectureFamily("gemma", (GEMMA, GEMMA2, GEMMA3_TEXT), (GEMMA3_MULTIMODAL,))

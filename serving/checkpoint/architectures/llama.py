"""The Llama-family model types (serving/executor/models/llama.py): Llama, Mistral, Qwen2/3, Phi-3,
SmolLM3, Granite. A fine-tune may name one's architecture with another's model_type."""

from __future__ import annotations

from serving.checkpoint.architectures.model_type import ArchitectureFamily, Config, ModelType


def qwen_sliding_layers(d: Config, num_layers: int) -> tuple[int, ...] | None:
    """Qwen2/3 (dense and MoE): the layers from `max_window_layers` on slide (all of them without it)."""
    if d.get("max_window_layers") is None:
        return None
    return tuple(range(int(d["max_window_layers"]), num_layers))


def _smollm3_args(d: Config, num_layers: int) -> dict:
    """SmolLM3's NoPE layers: `no_rope_layers[i]` is 1 where layer i applies RoPE, 0 where it does
    not; without the list, every `no_rope_layer_interval`-th layer (default 4) has none."""
    flags = d.get("no_rope_layers")
    if flags is None:
        interval = int(d.get("no_rope_layer_interval", 4))
        flags = [int((i + 1) % interval != 0) for i in range(num_layers)]
    if len(flags) != num_layers:
        raise ValueError(f"no_rope_layers has {len(flags)} entries for {num_layers} layers")
    return {"no_rope_layers": tuple(i for i, use_rope in enumerate(flags) if not use_rope)}


LLAMA = ModelType("llama", "LlamaForCausalLM", llama_alike=True)
MISTRAL = ModelType("mistral", "MistralForCausalLM", llama_alike=True)
QWEN2 = ModelType("qwen2", "Qwen2ForCausalLM", qkv_bias=True, llama_alike=True, sliding_opt_in=True,
                  sliding_layers=qwen_sliding_layers)
QWEN3 = ModelType("qwen3", "Qwen3ForCausalLM", qk_norm=True, llama_alike=True, sliding_opt_in=True,
                  sliding_layers=qwen_sliding_layers)
PHI3 = ModelType("phi3", "Phi3ForCausalLM", norm_eps=1e-5, llama_alike=True)
SMOLLM3 = ModelType("smollm3", "SmolLM3ForCausalLM", llama_alike=True, read_args=_smollm3_args)
# Granite: embeddings and each block's output scaled, softmax scale set, logits divided
GRANITE = ModelType("granite", "GraniteForCausalLM", llama_alike=True,
                    read_args=lambda d, n: {"attention_multiplier": float(d.get("attention_multiplier", 1.0))})

FAMILY = ArchitectureFamily("llama", (LLAMA, MISTRAL, QWEN2, QWEN3, PHI3, SMOLLM3, GRANITE))

"""The OLMo model types (serving/executor/models/olmo.py): OLMo 2 and 3 (OLMo 3's sliding layers
read their own RoPE from `rope_parameters`, keyed by layer type)."""

from __future__ import annotations

from serving.checkpoint.architectures.model_type import ArchitectureFamily, ModelType

OLMO2 = ModelType("olmo2", "Olmo2ForCausalLM", norm_eps=1e-5)
OLMO3 = ModelType("olmo3", "Olmo3ForCausalLM", norm_eps=1e-5)

FAMILY = ArchitectureFamily("olmo", (OLMO2, OLMO3))

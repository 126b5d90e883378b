"""Multimodal checkpoints served as a Llama-family text decoder (serving/executor/models/multimodal_text.py).

Qwen-VL's multimodal RoPE gives a text token the same position on its 3 axes: plain RoPE."""

from __future__ import annotations

from serving.checkpoint.architectures.llama import MISTRAL, QWEN2, QWEN3
from serving.checkpoint.architectures.model_type import ArchitectureFamily, MultimodalText

MISTRAL3 = MultimodalText("Mistral3ForConditionalGeneration", MISTRAL.name)  # Mistral Small 3.1 / 3.2
QWEN2_VL = MultimodalText("Qwen2VLForConditionalGeneration", QWEN2.name)
QWEN2_5_VL = MultimodalText("Qwen2_5_VLForConditionalGeneration", QWEN2.name)
QWEN3_VL = MultimodalText("Qwen3VLForConditionalGeneration", QWEN3.name)

FAMILY = ArchitectureFamily("multimodal_text", (), (MISTRAL3, QWEN2_VL, QWEN2_5_VL, QWEN3_VL))

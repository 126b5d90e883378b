"""Multimodal checkpoints served as their text decoder: where their language model's tensors sit.

A vision-language checkpoint (Gemma 3 4B and larger, Mistral Small 3.x, Qwen2/2.5/3-VL) nests its language model:
transformers 4.5x saved it as `language_model.model.*` (+ `language_model.lm_head.*`), 5.x as
`model.language_model.*`; the vision tower and the projector sit beside it. `text_checkpoint_name`
maps the language model's tensors onto a text-only model's parameter names and drops the rest
(`serving/executor/weights.py` calls a model's `checkpoint_name`). Requests carrying images are
refused where requests are read (only text content parts are accepted).
"""

from __future__ import annotations

from serving.executor.models.llama import LlamaForCausalLM
from serving.checkpoint.architectures import multimodal_text as multimodal_types

_TEXT_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                  ("language_model.lm_head.", "lm_head."))
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.",
                    "visual.", "model.visual.")  # the last two: Qwen-VL's


def text_checkpoint_name(name: str) -> str | None:
    """The text decoder's parameter a checkpoint tensor fills, or None for the vision side's."""
    if name.startswith(_VISION_PREFIXES):
        return None
    for theirs, ours in _TEXT_PREFIXES:
        if name.startswith(theirs):
            return ours + name[len(theirs):]
    return name


class LlamaTextOfMultimodal(LlamaForCausalLM):
    """`Mistral3ForConditionalGeneration` (Mistral Small 3.1 / 3.2) served as its Mistral text decoder,
    `Qwen2VLForConditionalGeneration` / `Qwen2_5_VLForConditionalGeneration` as Qwen2 and
    `Qwen3VLForConditionalGeneration` as Qwen3 (text only: no image reaches DeepStack's layers)."""

    serves = (multimodal_types.MISTRAL3, multimodal_types.QWEN2_VL, multimodal_types.QWEN2_5_VL,
              multimodal_types.QWEN3_VL)

    checkpoint_name = staticmethod(text_checkpoint_name)

"""open-lmi serving: `from serving import LLM, SamplingParams` (vLLM's offline API).

Exports resolve lazily, so `import serving.server.settings.config` (the container's start path) does not pull
torch or transformers before it needs them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from serving.engine.llm_engine import LLMEngine
    from serving.engine_config import EngineConfig
    from serving.llm import LLM
    from serving.lora_request import LoRARequest
    from serving.outputs import CompletionOutput, RequestOutput
    from serving.sampling_params import SamplingParams

_EXPORTS = {
    "LLM": "serving.llm",
    "LLMEngine": "serving.engine.llm_engine",
    "EngineConfig": "serving.engine_config",
    "SamplingParams": "serving.sampling_params",
    "LoRARequest": "serving.lora_request",
    "RequestOutput": "serving.outputs",
    "CompletionOutput": "serving.outputs",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'serving' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value

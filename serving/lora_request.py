"""`LoRARequest` (which adapter a request runs on, vLLM's shape) and `UnknownAdapterError`.

Shared by every layer: the HTTP edge and the offline `LLM` build a `LoRARequest` (or just a
name), the engine registers adapters by it (`add_lora` / `remove_lora` / `list_loras`) and
routes requests by `lora_name`; the executor reads the PEFT files at `lora_path`. vLLM users
write `from vllm.lora.request import LoRARequest; llm.generate(prompts, sp,
lora_request=LoRARequest("sql", 1, "/path/to/adapter"))`; the same call works here.

Interface (kept stable for the HTTP half):
- `EngineClient.add_lora(LoRARequest) -> None` (ValueError with a clear message when LoRA is
  off, the rank exceeds `max_lora_rank`, a target module cannot be applied, the shapes do not
  match the base model, the files are not PEFT safetensors, or the name is taken),
- `remove_lora(name) -> bool`, `list_loras() -> list[str]`,
- `add_request(..., lora_name=None)` raising `UnknownAdapterError` for a name not registered.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter: a unique `lora_name`, a positive `lora_int_id`, and the PEFT directory
    (`adapter_config.json` + `adapter_model.safetensors`) at `lora_path`."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        object.__setattr__(self, "lora_path", str(self.lora_path))

    # vLLM's aliases
    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path


class UnknownAdapterError(ValueError):
    """A request named an adapter that is not registered. `known` holds the registered names for the
    caller; the message never lists them (it reaches HTTP clients, one tenant must not see another's)."""

    def __init__(self, name: str, known: Iterable[str], hint: str = "") -> None:
        self.name = name
        self.known = sorted(known)
        self.hint = hint
        super().__init__(f"unknown adapter {name!r}: no adapter of that name is registered" +
                         (f" ({hint})" if hint else ""))

    def __reduce__(self):  # noqa: ANN204 - rebuilt from its fields (it crosses the engine process's pipe)
        return (UnknownAdapterError, (self.name, self.known, self.hint))

"""`EngineClient`: what the HTTP edge may use of an engine, whichever runs behind it.

It exists so the edge is typed against one interface instead of probing attributes: an
`EngineLoop` (one model copy) and a `ReplicaSet` (several copies behind one endpoint) both
provide it. Every method is safe to call from any thread.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from serving.lora_request import LoRARequest
from serving.sampling_params import SamplingParams

if TYPE_CHECKING:
    from serving.engine.engine_loop import EngineState, RequestStream


class EngineClient(Protocol):
    """The engine as the HTTP edge sees it."""

    @property
    def state(self) -> EngineState: ...  # LOADING | READY | DEAD

    @property
    def error(self) -> BaseException | None: ...  # why it is DEAD

    @property
    def was_ready(self) -> bool: ...  # it served at some point (a later death is a crash)

    @property
    def closing(self) -> bool: ...  # close() was called: DEAD is a shutdown, not a crash

    @property
    def tokenizer(self) -> Any: ...  # the HF tokenizer, None while loading

    @property
    def max_model_len(self) -> int | None: ...  # None while loading

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    lora_name: str | None = None) -> RequestStream: ...  # UnknownAdapterError for a bad name

    def add_lora(self, request: LoRARequest) -> None: ...  # ValueError saying why it cannot be served

    def remove_lora(self, name: str) -> bool: ...  # running requests on it finish on it

    def list_loras(self) -> list[str]: ...

    def stats(self) -> dict: ...

    def start(self) -> Any: ...

    def wait_ready(self, timeout: float | None = None) -> bool: ...

    def close(self, timeout: float | None = 30.0) -> None: ...

"""`EngineClient`: what the HTTP edge may use of an engine, whichever runs behind it.

It exists so the edge is typed against one interface instead of probing attributes. Four shells
implement it: an `EngineLoop` (one model copy on a thread here) and an `EngineProcess` (one copy in
an engine core process) route deltas into their own streams (their common part is
`engine_loop.StreamRouter`); a `ReplicaSet` spreads requests over several of those; wsgi's
`ServedEngine` wraps one client and changes only its health (`DelegatingClient` forwards the rest).
Every method is safe to call from any thread.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any

from serving.lora_request import LoRARequest
from serving.sampling_params import SamplingParams

if TYPE_CHECKING:
    from serving.engine.request_stream import EngineState, RequestStream


class EngineClient(abc.ABC):
    """The engine as the HTTP edge sees it: these fields (attributes or properties) and methods."""

    state: EngineState  # LOADING | READY | DEAD
    error: BaseException | None  # why it is DEAD
    was_ready: bool  # it served at some point (a later death is a crash)
    closing: bool  # close() was called: DEAD is a shutdown, not a crash
    tokenizer: Any  # the HF tokenizer, None while loading
    max_model_len: int | None  # None while loading

    @abc.abstractmethod
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    lora_name: str | None = None) -> RequestStream:
        """Submit a request; its stream. UnknownAdapterError for a bad adapter name."""

    @abc.abstractmethod
    def add_lora(self, request: LoRARequest) -> LoRARequest | None:
        """Register an adapter (ValueError saying why it cannot be served); what the engine holds under
        that name where engine cores are shared by several frontends, else None."""

    @abc.abstractmethod
    def remove_lora(self, name: str) -> bool:
        """Unregister an adapter; running requests on it finish on it."""

    @abc.abstractmethod
    def list_loras(self) -> list[str]: ...

    def held_loras(self) -> list[LoRARequest] | None:
        """The adapters the engine cores hold (registered through any frontend); None: the engine is
        this process's own, on which no one else registers."""
        return None

    @abc.abstractmethod
    def stats(self) -> dict: ...

    @abc.abstractmethod
    def start(self) -> EngineClient:
        """Start loading (returns at once, state LOADING)."""

    @abc.abstractmethod
    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until READY (True) or timeout (False); EngineDeadError if it died."""

    @abc.abstractmethod
    def close(self, timeout: float | None = 30.0) -> None: ...


class DelegatingClient(EngineClient):
    """A shell around another client: everything is the wrapped client's, unless a subclass
    overrides it, so a shell writes only what it changes."""

    def __init__(self, inner: EngineClient) -> None:
        self.inner = inner

    @property
    def state(self) -> EngineState:  # type: ignore[override]
        return self.inner.state

    @property
    def error(self) -> BaseException | None:  # type: ignore[override]
        return self.inner.error

    @property
    def was_ready(self) -> bool:  # type: ignore[override]
        return self.inner.was_ready

    @property
    def closing(self) -> bool:  # type: ignore[override]
        return self.inner.closing

    @property
    def tokenizer(self) -> Any:  # type: ignore[override]
        return self.inner.tokenizer

    @property
    def max_model_len(self) -> int | None:  # type: ignore[override]
        return self.inner.max_model_len

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    lora_name: str | None = None) -> RequestStream:
        return self.inner.add_request(request_id, prompt, params, lora_name)

    def add_lora(self, request: LoRARequest) -> LoRARequest | None:
        return self.inner.add_lora(request)

    def remove_lora(self, name: str) -> bool:
        return self.inner.remove_lora(name)

    def list_loras(self) -> list[str]:
        return self.inner.list_loras()

    def held_loras(self) -> list[LoRARequest] | None:
        return self.inner.held_loras()

    def stats(self) -> dict:
        return self.inner.stats()

    def start(self) -> EngineClient:
        return self.inner.start()

    def wait_ready(self, timeout: float | None = None) -> bool:
        return self.inner.wait_ready(timeout)

    def close(self, timeout: float | None = 30.0) -> None:
        self.inner.close(timeout)

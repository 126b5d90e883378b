"""LoRA adapters at the HTTP edge: the registry behind the management API, and which adapter a request names.

`AdapterRegistry` keeps what the server registered on the engine (name -> source) and is the
one writer of adapters: at start (`<model dir>/adapters/<name>/`, before /ping turns 200) and
through DJL's management API (`POST|GET /models/{model}/adapters`, `GET|DELETE
/models/{model}/adapters/{name}`; `management_*` below build its answers), which is off unless the
operator allows sources (`serving/server/settings/adapter_allowlist.py`); API registrations are journaled so a
replaced worker registers them again (`serving/server/adapter_journal.py`). `select_adapters`
merges the three ways a request names an adapter: the `adapter` custom attribute (SageMaker's
way), LMI's body field `adapters`, and on `/v1/*` the `model` field (vLLM's way).
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from serving.server.settings.adapter_allowlist import SourceNotAllowed, check_allowed
from serving.server.settings.adapter_source import check_adapter_name, fetch_adapter, find_adapters
from serving.server.settings.config import ServingConfig
from serving.engine.client import EngineClient
from serving.lora_request import LoRARequest
from serving.server.adapter_journal import AdapterJournal
from serving.server.protocol import GenerateRequest

logger = logging.getLogger("serving.server.adapters")
ADAPTER_ATTRIBUTE = "adapter"  # X-Amzn-SageMaker-Custom-Attributes: adapter=<name>
LIST_LIMIT = 100  # DJL's default page size for GET /models/{model}/adapters


class AdapterNotFound(LookupError):
    """A request or a management call named an adapter that is not registered (HTTP 404)."""


class AdapterConflict(ValueError):
    """An adapter of that name is already registered (HTTP 409)."""


class StartupAdapterError(RuntimeError):
    """An adapter under `<model dir>/adapters/` could not be registered: the start fails."""


@dataclass(frozen=True)
class Adapter:
    """A registered adapter: its name, the `src` it was registered from, and the local copy."""

    name: str
    src: str
    path: str
    lora_int_id: int


class AdapterRegistry:
    """The adapters registered on the engine. Registrations and removals are serialized; readers
    never wait (they read the current mapping)."""

    def __init__(self, engine: EngineClient, config: ServingConfig, journal: AdapterJournal | None = None) -> None:
        self.engine = engine
        self.config = config
        self.journal = journal  # API registrations, for a worker that replaces this one
        self._adapters: dict[str, Adapter] = {}
        self._write = threading.RLock()
        self._next_id = 1
        self._shared_ids: Callable[[], int] | None = None  # several frontends: ids from the arbiter

    def share(self, next_id: Callable[[], int]) -> None:
        """This is one of several frontends over shared engine cores (serving/server/cores.py): take
        adapter ids from the server-wide `next_id`, and agree with the cores on what is registered
        (an adapter registered or removed through another frontend; see `_sync`)."""
        self._shared_ids = next_id

    def _sync(self) -> None:
        """Several frontends: the cores hold the adapters. Adopt those another frontend registered
        (its `src` from the shared journal), forget those another removed. One round trip to a core;
        done when a name is not found here and before a listing, a registration or a removal."""
        if self._shared_ids is None:
            return
        try:
            held = self.engine.held_loras()  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001 - the cores are loading or gone: what this frontend knows stands
            return
        if held is None:
            return
        sources = dict(self.journal.entries()) if self.journal is not None else {}
        with self._write:
            current = {r.lora_name: r for r in held}
            adapters = {name: a for name, a in self._adapters.items() if name in current}
            for name, r in current.items():
                if name not in adapters:
                    adapters[name] = Adapter(name, sources.get(name, r.lora_path), r.lora_path, r.lora_int_id)
            self._adapters = adapters

    @property
    def enabled(self) -> bool:
        return self.config.engine.enable_lora

    def names(self) -> list[str]:
        self._sync()
        return sorted(self._adapters)

    def get(self, name: str) -> Adapter | None:
        adapter = self._adapters.get(name)
        if adapter is None and self._shared_ids is not None:
            self._sync()
            adapter = self._adapters.get(name)
        return adapter

    def adapters(self) -> list[Adapter]:
        return [self._adapters[n] for n in self.names() if n in self._adapters]

    def base_names(self) -> set[str]:
        """The names that mean the base model: the served name, the model id and its DJL form."""
        names = {self.config.served_model_name}
        model_id = self.config.model_id
        if model_id:
            names |= {model_id, model_id.rstrip("/").rsplit("/", 1)[-1], re.sub(r"\W", "_", model_id)}
        return names

    def unknown(self, name: str) -> AdapterNotFound:
        """The 404 of a request naming `name`, which is not registered, and why none are when LoRA is
        off. Never the base model in its place, and never the names that are registered: a client
        of one adapter (one tenant) does not learn the others'."""
        if not self.enabled:
            return AdapterNotFound(f"unknown adapter {name!r}: LoRA adapters are not enabled on this server "
                                   "(set OPTION_ENABLE_LORA=true / option.enable_lora=true)")
        return AdapterNotFound(f"unknown adapter {name!r}: no adapter of that name is registered (the base model, "
                               f"{self.config.served_model_name!r}, is used when no adapter is named)")

    def register(self, name: str, src: str) -> Adapter:
        """Fetch `src` (local dir or s3:// prefix) and register it on the engine as `name`.

        Raises AdapterConflict (the name is taken), ValueError (bad name, source or weights; the
        engine's own message for weights that do not fit the base model)."""
        self._check_new_name(name)
        with self._write:
            self._sync()
            if name in self._adapters:
                raise AdapterConflict(f"adapter {name!r} is already registered (from {self._adapters[name].src}); "
                                      "DELETE it first to replace it")
            path = fetch_adapter(name, src, self.config.download_dir, self.config.s3_endpoint_url)
            adapter = Adapter(name, src, str(path), self._shared_ids() if self._shared_ids else self._next_id)
            try:
                held = self.engine.add_lora(LoRARequest(name, adapter.lora_int_id, adapter.path))
            except ValueError as exc:
                raise ValueError(f"adapter {name!r} from {src}: {exc}") from None
            if isinstance(held, LoRARequest):  # shared cores: the one they hold (registered by another frontend)
                adapter = replace(adapter, path=held.lora_path, lora_int_id=held.lora_int_id)
            self._next_id += 1
            self._adapters = {**self._adapters, name: adapter}
        logger.info("adapter %s registered from %s", name, src)
        return adapter

    def _check_new_name(self, name: str) -> None:
        """ValueError unless LoRA is on and `name` may name an adapter."""
        if not self.enabled:
            raise ValueError("LoRA is not enabled: start the server with OPTION_ENABLE_LORA=true "
                             "(option.enable_lora=true) to register adapters")
        check_adapter_name(name)
        if name in self.base_names():
            raise ValueError(f"adapter name {name!r} is the base model's name: choose another")

    def register_from_client(self, name: str, src: str) -> Adapter:
        """`register` for the management API: `src` must lie under the operator's allow-list
        (SourceNotAllowed, HTTP 403, otherwise), and the registration is recorded so that a worker
        replacing this one registers it again (`serving/server/adapter_journal.py`)."""
        self._check_new_name(name)  # 400 for a bad name before 403 for a source
        check_allowed(src, self.config.runtime_adapter_sources)
        adapter = self.register(name, src)
        if self.journal is not None:
            self.journal.record(name, src)
        return adapter

    def unregister(self, name: str) -> Adapter:
        """Remove `name`: new requests on it get 404; requests already running on it finish on it."""
        with self._write:
            self._sync()
            adapter = self._adapters.get(name)
            if adapter is None:
                raise AdapterNotFound(f"The adapter {name} was not found")
            self._adapters = {k: v for k, v in self._adapters.items() if k != name}
            self.engine.remove_lora(name)
            if self.journal is not None:
                self.journal.forget(name)
        logger.info("adapter %s unregistered", name)
        return adapter

    def register_startup(self, model_dir: object) -> list[str]:
        """Register every adapter under `<model_dir>/adapters/` (LMI's start-up layout), then those
        this server run registered through the API before this worker replaced a dead one (its
        journal). The first that fails raises with its name (the start fails, as LMI's does).
        Without option.enable_lora they are listed in a warning and left alone."""
        found = find_adapters(Path(model_dir)) if model_dir is not None else {}
        if found and not self.enabled:
            logger.warning("%d adapter(s) under %s/adapters are ignored because LoRA is off (%s): set "
                           "OPTION_ENABLE_LORA=true to serve them", len(found), model_dir, ", ".join(found))
            return []
        self._sync()
        for name, path in found.items():
            if self._shared_ids is not None and name in self._adapters:
                continue  # another frontend registered it on the shared cores
            try:
                self.register(name, str(path))
            except AdapterConflict:
                if self._shared_ids is None:
                    raise
                continue  # another frontend registered it meanwhile
            except ValueError as exc:  # AdapterSourceError, AdapterConflict, the engine's refusal
                raise StartupAdapterError(f"cannot register adapter {name!r} found at start in {path}: {exc}") from None
        if found:
            logger.info("%d adapter(s) registered at start from %s/adapters: %s", len(found), model_dir,
                        ", ".join(found))
        restored = [name for name, src in (self.journal.entries() if self.journal and self.enabled else [])
                    if self._restore(name, src)]
        if restored:
            logger.info("%d adapter(s) registered again after a worker restart (registered through the API "
                        "earlier in this server run): %s", len(restored), ", ".join(restored))
        return list(found) + restored

    def _restore(self, name: str, src: str) -> bool:
        """Register again an adapter the journal lists (False: already registered, as a start-up one)."""
        if name in self._adapters:
            if self._shared_ids is not None and self._adapters[name].src == src:
                return False  # the shared cores hold it still (this frontend adopted it)
            logger.warning("adapter %s from %s, registered through the API earlier, is now a start-up adapter: "
                           "kept as that", name, src)
            return False
        try:
            check_allowed(src, self.config.runtime_adapter_sources)
            self.register(name, src)
        except (ValueError, SourceNotAllowed) as exc:
            raise StartupAdapterError(f"cannot register again adapter {name!r} (registered through the API from "
                                      f"{src} before this worker restarted): {exc}") from None
        return True


# ---- which adapter a request runs on -----------------------------------------------------------

def header_adapter(header: str | None) -> str | None:
    """The `adapter` of `X-Amzn-SageMaker-Custom-Attributes` (`k=v;k2=v2`, DJL's rules: split on ';',
    then on the first '=', both sides trimmed; other keys ignored). A value in double quotes is
    unquoted; an empty value is no adapter. The key given twice with two values is a ValueError."""
    found: set[str] = set()
    for item in (header or "").split(";"):
        key, sep, value = item.partition("=")
        if key.strip().lower() != ADAPTER_ATTRIBUTE or not sep:
            continue
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] == '"':
            value = value[1:-1].strip()
        if value:
            found.add(value)
    if len(found) > 1:
        names = ", ".join(sorted(found))
        raise ValueError(f"X-Amzn-SageMaker-Custom-Attributes names more than one adapter ({names}): send one")
    return found.pop() if found else None


def select_adapters(req: GenerateRequest, header: str | None, registry: AdapterRegistry,
                    model_field: bool) -> GenerateRequest:
    """`req` with the adapter of each prompt resolved from the header, the body's `adapters` and
    (`model_field`: on /v1) the `model` field.

    Raises ValueError (400) when two of them name different adapters, AdapterNotFound (404) for a
    name not registered. On /v1 with LoRA on, a `model` that is neither the base model's name nor
    an adapter is a 404 too (vLLM); with LoRA off any `model` is accepted, as before.
    """
    from_header = header_adapter(header)
    chosen = req.adapters
    if model_field and req.model is not None and req.model not in registry.base_names():
        if req.model in registry.names() or registry.enabled:
            chosen = _agree(chosen, (req.model,), "the model field", "the body's adapters")
    if from_header is not None:
        chosen = _agree(chosen, (from_header,), "the body" if not model_field else "the model field",
                        "the adapter custom attribute")
    for name in dict.fromkeys(chosen):
        if name and registry.get(name) is None:
            raise registry.unknown(name)
    return replace(req, adapters=chosen) if chosen != req.adapters else req


def _agree(first: tuple[str, ...], second: tuple[str, ...], what_first: str, what_second: str) -> tuple[str, ...]:
    """Merge two selections; each may be () (no opinion). Any prompt on which they name different
    adapters is a ValueError naming both."""
    if not first:
        return second
    if not second:
        return first
    name = second[0]
    clash = sorted({a for a in first if a != name}, key=str)
    if clash:
        shown = ", ".join(repr(a) if a else "'' (base)" for a in clash)
        raise ValueError(f"{what_second} names adapter {name!r} but {what_first} names {shown}: send one, "
                         "or the same in both")
    return first


# ---- DJL's management API answers --------------------------------------------------------------

def describe(adapter: Adapter) -> dict:
    """DJL's DescribeAdapterResponse."""
    return {"name": adapter.name, "src": adapter.src}


def list_page(registry: AdapterRegistry, limit: str | None, token: str | None) -> dict:
    """DJL's ListAdaptersResponse: `adapters` from `next_page_token` (an offset), at most `limit`
    (default 100); `nextPageToken` when more remain."""
    try:
        start = int(token) if token not in (None, "") else 0
        size = int(limit) if limit not in (None, "") else LIST_LIMIT
    except ValueError:
        raise ValueError(f"limit and next_page_token must be integers, got limit={limit!r} "
                         f"next_page_token={token!r}") from None
    if start < 0 or size < 1:
        raise ValueError(f"limit must be >= 1 and next_page_token >= 0, got limit={size} next_page_token={start}")
    adapters = registry.adapters()
    end = min(start + size, len(adapters))
    body: dict = {"adapters": [describe(a) for a in adapters[start:end]]}
    if end < len(adapters):
        body["nextPageToken"] = str(end)
    return body

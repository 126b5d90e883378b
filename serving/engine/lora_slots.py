"""The engine's LoRA adapters: the registry (add / remove / list, thread-safe) and the device slots.

`LoRARegistry` checks an adapter when it is registered (PEFT config and tensor shapes against
the base model, `serving/checkpoint/lora_adapter.py`; nothing is loaded here), resolves the adapter name
of each new request (`UnknownAdapterError` otherwise), and per step assigns each adapter of the
scheduled rows a device slot, least recently used first (`assign`): the plan carries the slot
of every chunk and the slot loads the workers must do first. The scheduler never schedules
more distinct adapters in a step than there are slots, so an adapter of this step is never
evicted by another of the same step. A removed adapter takes no new requests; sequences
already running on it keep their `LoRARequest` and finish on it.
"""

from __future__ import annotations

import threading

from serving.engine.scheduler_output import SchedulerOutput
from serving.checkpoint.lora_adapter import read_adapter
from serving.lora_request import LoRARequest, UnknownAdapterError
from serving.checkpoint.model_config import ModelArgs

SlotLoad = tuple[str, int, str] | None  # (name, int id, path) to load into a slot, or None: free it


def _key(req: LoRARequest) -> tuple[str, int, str]:
    return req.lora_name, req.lora_int_id, req.lora_path


class LoRARegistry:
    """Registered adapters (any thread) and the slot table (engine thread only)."""

    def __init__(self, model_dir: str, max_loras: int, max_lora_rank: int) -> None:
        self.args = ModelArgs.from_dir(model_dir)
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self._lock = threading.Lock()
        self._adapters: dict[str, LoRARequest] = {}
        self._slots: list[tuple[str, int, str] | None] = [None] * max_loras
        self._last_used = [0] * max_loras
        self._clock = 0
        self._removed = False  # an adapter was removed: free its slot once no step needs it
        self.num_loads = 0

    # ---- the registry (any thread) ------------------------------------------------------

    def add(self, request: LoRARequest) -> None:
        """Check the adapter's files against the base model, then register it (ValueError if not)."""
        if not isinstance(request, LoRARequest):
            raise ValueError(f"add_lora needs a LoRARequest, got {type(request).__name__}")
        with self._lock:
            if request.lora_name in self._adapters:
                raise ValueError(f"an adapter named {request.lora_name!r} is already registered")
        read_adapter(request.lora_path, self.args, self.max_lora_rank, load=False)
        with self._lock:
            if request.lora_name in self._adapters:  # registered meanwhile by another thread
                raise ValueError(f"an adapter named {request.lora_name!r} is already registered")
            self._adapters[request.lora_name] = request

    def remove(self, name: str) -> bool:
        """Unregister `name` (new requests on it are refused); False when it was not registered."""
        with self._lock:
            removed = self._adapters.pop(name, None) is not None
            self._removed = self._removed or removed
            return removed

    def names(self) -> list[str]:
        with self._lock:
            return list(self._adapters)

    def get(self, name: str) -> LoRARequest | None:
        with self._lock:
            return self._adapters.get(name)

    def resolve(self, name: str) -> LoRARequest:
        """The registered adapter called `name`; UnknownAdapterError (listing the known) if none."""
        with self._lock:
            req = self._adapters.get(name)
            if req is None:
                raise UnknownAdapterError(name, self._adapters)
            return req

    # ---- slots (engine thread) ----------------------------------------------------------

    def assign(self, sched_out: SchedulerOutput) -> tuple[list[int] | None, dict[int, SlotLoad]]:
        """Slot of each scheduled chunk (-1: base; None when no chunk uses an adapter) and the
        loads the workers do before the step."""
        reqs = [item.seq.lora_request for item in sched_out.scheduled]
        active = {_key(r) for r in reqs if r is not None}
        loads: dict[int, SlotLoad] = self._free_removed(active) if self._removed else {}
        if not active:
            return None, loads
        assert len(active) <= self.max_loras, f"{len(active)} adapters scheduled for {self.max_loras} slots"
        self._clock += 1
        slot_of = {key: s for s, key in enumerate(self._slots) if key is not None}
        for key in active:
            slot = slot_of.get(key)
            if slot is None:
                # A free slot, else the least recently used one that this step does not need.
                slot = min((s for s, k in enumerate(self._slots) if k is None or k not in active),
                           key=lambda s: (self._slots[s] is not None, self._last_used[s]))
                self._slots[slot] = key
                slot_of[key] = slot
                loads[slot] = key
                self.num_loads += 1
            self._last_used[slot] = self._clock
        return [slot_of[_key(r)] if r is not None else -1 for r in reqs], loads

    def _free_removed(self, active: set[tuple[str, int, str]]) -> dict[int, SlotLoad]:
        """Free the slots of removed adapters this step does not use (a sequence still running on
        one reloads it when it is scheduled again: it keeps its `LoRARequest`)."""
        with self._lock:
            registered = {_key(r) for r in self._adapters.values()}
            self._removed = False
        loads: dict[int, SlotLoad] = {}
        for slot, key in enumerate(self._slots):
            if key is not None and key not in registered:
                if key in active:
                    self._removed = True  # still in use: look again next step
                    continue
                self._slots[slot] = None
                loads[slot] = None
        return loads

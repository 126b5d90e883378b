"""`ReplicaSet`: several model copies (one `EngineLoop` each) behind one endpoint.

As LMI does when the GPUs outnumber the tensor-parallel degree, the container runs
GPUs ÷ degree engine copies; this object routes each request to the copy with the fewest
open requests. Prefix affinity: a prompt long enough to share cached blocks goes to its prefix's
home copy, a function of its first `affinity_tokens` tokens alone (so every HTTP frontend of the
server, serving/server/cores.py, sends a shared prefix to the same copy, whose prefix cache holds
it), unless that copy is busier than the least loaded one by more than `affinity_slack` requests.
With engine cores the loads are the cores' own counts, every frontend's requests included. The set is healthy only while every copy
is: one dead copy marks the whole set dead (the worker then restarts, as for one copy).
"""

from __future__ import annotations

import hashlib
import itertools
import threading
from collections import OrderedDict

from serving.engine.client import EngineClient
from serving.engine.engine_loop import EngineLoop
from serving.engine.request_stream import EngineState, RequestStream
from serving.engine.engine_process import EngineProcess
from serving.engine.token_intervals import merge_snapshots
from serving.lora_request import LoRARequest
from serving.sampling_params import SamplingParams

_AFFINITY_ENTRIES = 16384  # remembered prompt prefixes (LRU)


class ReplicaSet(EngineClient):
    """An `EngineClient` over `loops` (EngineLoops or EngineProcesses, one per model copy); see the
    module docstring for the routing rule."""

    AFFINITY_TOKENS = 64  # the prompt head that keys prefix affinity (0 turns it off)

    def __init__(self, loops: list[EngineLoop | EngineProcess], affinity_tokens: int = AFFINITY_TOKENS, affinity_slack: int = 4) -> None:
        assert loops, "a replica set needs at least one engine loop"
        self.loops = loops
        self.affinity_tokens = affinity_tokens  # 0 disables prefix affinity
        self.affinity_slack = affinity_slack
        self._affinity: OrderedDict[int, int] = OrderedDict()
        self._lock = threading.Lock()
        self._next = itertools.count()
        self.num_routed = [0] * len(loops)
        self.num_affinity_hits = 0

    # ---- health --------------------------------------------------------------------------

    @property
    def state(self) -> EngineState:
        states = [loop.state for loop in self.loops]
        if EngineState.DEAD in states:
            return EngineState.DEAD
        if EngineState.LOADING in states:
            return EngineState.LOADING
        return EngineState.READY

    @property
    def error(self) -> BaseException | None:
        return next((loop.error for loop in self.loops if loop.error is not None), None)

    @property
    def was_ready(self) -> bool:
        return any(loop.was_ready for loop in self.loops)

    @property
    def closing(self) -> bool:
        return any(loop.closing for loop in self.loops)

    @property
    def started(self) -> bool:
        return any(loop.started for loop in self.loops)

    @property
    def tokenizer(self):  # noqa: ANN201 - HF tokenizer or None while loading
        return next((loop.tokenizer for loop in self.loops if loop.tokenizer is not None), None)

    @property
    def max_model_len(self) -> int | None:
        return next((loop.max_model_len for loop in self.loops if loop.max_model_len is not None), None)

    def start(self) -> ReplicaSet:
        for loop in self.loops:
            loop.start()
        return self

    def wait_ready(self, timeout: float | None = None) -> bool:
        return all(loop.wait_ready(timeout) for loop in self.loops)

    def close(self, timeout: float | None = 30.0) -> None:
        closers = [threading.Thread(target=loop.close, args=(timeout,), daemon=True) for loop in self.loops]
        for t in closers:
            t.start()
        for t in closers:
            t.join()

    def stats(self) -> dict:
        """Counters and gauges summed over the copies (the cache usage is the mean)."""
        per_copy = [loop.stats() for loop in self.loops]
        out: dict = {"state": self.state.value, "num_copies": len(self.loops)}
        for stats in per_copy:
            for key, value in stats.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    out[key] = out.get(key, 0) + value
        if "kv_cache_usage" in out:
            out["kv_cache_usage"] /= len(per_copy)
        intervals = [stats["token_intervals"] for stats in per_copy if "token_intervals" in stats]
        if intervals:
            out["token_intervals"] = merge_snapshots(intervals)
        received = [stats.get("num_received_requests") for stats in per_copy]
        # Engine cores count what every frontend sent them; EngineLoops, what this set routed.
        out["routed_per_copy"] = received if None not in received else list(self.num_routed)
        out.pop("num_received_requests", None)
        out["prefix_affinity_hits"] = self.num_affinity_hits
        return out

    # ---- routing -------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    lora_name: str | None = None) -> RequestStream:
        index = self.route(prompt, lora_name)
        stream = self.loops[index].add_request(request_id, prompt, params, lora_name)
        self.num_routed[index] += 1
        return stream

    # ---- LoRA adapters: every copy holds the same ones -----------------------------------

    def add_lora(self, request: LoRARequest) -> LoRARequest | None:
        """Register on every copy; if one refuses, the others forget it again (and the error is raised).
        Returns what the first copy holds under that name (engine cores shared by several frontends
        may hold it already: serving/engine/engine_process.py), or None (an EngineLoop)."""
        done: list[EngineLoop] = []
        held = None
        try:
            for loop in self.loops:
                out = loop.add_lora(request)
                held = held if done else out
                done.append(loop)
        except BaseException:
            for loop in done:
                loop.remove_lora(request.lora_name)
            raise
        return held

    def held_loras(self) -> list[LoRARequest] | None:
        """The adapters the engine cores hold (registered through any frontend); None for EngineLoops."""
        return self.loops[0].held_loras()

    def remove_lora(self, name: str) -> bool:
        return any([loop.remove_lora(name) for loop in self.loops])  # (a list: every copy removes it)

    def list_loras(self) -> list[str]:
        return self.loops[0].list_loras()

    def route(self, prompt: str | list[int], lora_name: str | None = None) -> int:
        """The copy for a prompt: the least loaded, or the one that saw its prefix (see module doc)."""
        loads = [loop.num_open_requests if loop.state is EngineState.READY else 1 << 30 for loop in self.loops]
        least = min(loads)
        candidates = [i for i, load in enumerate(loads) if load == least]
        choice = candidates[next(self._next) % len(candidates)]
        key = self._prefix_key(prompt, lora_name)
        if key is None:
            return choice
        home = key % len(self.loops)
        with self._lock:
            seen = key in self._affinity
            if loads[home] <= least + self.affinity_slack:
                choice = home
                self.num_affinity_hits += seen  # a prefix seen before, sent where its blocks are cached
            self._affinity[key] = choice
            self._affinity.move_to_end(key)
            if len(self._affinity) > _AFFINITY_ENTRIES:
                self._affinity.popitem(last=False)
        return choice

    def _prefix_key(self, prompt: str | list[int], lora_name: str | None) -> int | None:
        """A hash of the prompt's head (and adapter: its cached prefix is its own), the same in every
        process (not Python's `hash`, which is salted per process for strings)."""
        n = self.affinity_tokens
        if n <= 0 or len(prompt) < n:
            return None  # too short to share a cached block worth steering for
        head = prompt[:n]
        text = head if isinstance(head, str) else ",".join(map(str, head))
        digest = hashlib.blake2b(f"{lora_name or ''}\0{text}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little")

"""EngineLoop: the one background thread that owns the LLMEngine (HTTP threads never touch it).

`StreamRouter` is what it shares with `EngineProcess` (the same client of a copy in another
process): the health fields, the open streams, and the routing of deltas into them.

In: `add_request(...)` / `abort(...)` from any thread, through a thread-safe submit queue.
Out: a `RequestStream` per request whose queue receives that request's `StreamDelta`s. The
loop also owns the health state: LOADING while the model loads (on this thread, after any
fork), READY, or DEAD with the exception; on death every open stream gets a final
`finish_reason='error'` delta so no caller hangs.
"""

from __future__ import annotations

import abc
import logging
import queue
import threading
import traceback
from dataclasses import dataclass
from collections.abc import Callable
from typing import TYPE_CHECKING

from serving.engine.client import EngineClient
from serving.engine.request_stream import EngineDeadError, EngineState, QueueFullError, RequestStream
from serving.engine_config import EngineConfig
from serving.lora_request import LoRARequest
from serving.outputs import StreamDelta
from serving.sampling_params import SamplingParams

if TYPE_CHECKING:
    from serving.engine.llm_engine import LLMEngine

logger = logging.getLogger("serving.engine.engine_loop")


class StreamRouter(EngineClient):
    """An engine client that owns its request streams (an `EngineLoop`, an `EngineProcess`): the
    health fields, the streams by request id, and the delivery of each delta into its stream (the
    stream leaves `_streams` with its last delta)."""

    def __init__(self) -> None:
        self.state = EngineState.LOADING
        self.was_ready = False  # it served at some point (a later death is a crash, not a load failure)
        self.closing = False  # close() was called: a DEAD state is a shutdown, not a crash
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._streams: dict[str, RequestStream] = {}
        self._ready = threading.Event()

    @abc.abstractmethod
    def abort(self, request_id: str) -> None:
        """End a request now (no-op if unknown or finished): what `RequestStream.close` calls."""

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until READY (True) or timeout (False); raises EngineDeadError if it died."""
        self._ready.wait(timeout)
        if self.state is EngineState.DEAD:
            raise EngineDeadError(f"the engine is dead: {self.error!r}") from self.error
        return self.state is EngineState.READY

    def _deliver(self, delta: StreamDelta) -> None:
        stream = self._streams.get(delta.request_id)
        if stream is None:
            return
        if delta.finish_reason is None:  # once per token per stream: straight onto the queue
            stream._queue.put(delta)
        elif stream._put(delta):
            with self._lock:
                self._streams.pop(delta.request_id, None)

    def _fail_stream(self, stream: RequestStream, message: str, reason: str = "error") -> None:
        for index in stream._unfinished_indexes():
            stream._put(StreamDelta(stream.request_id, index, (), "", finish_reason=reason, error=message))
        with self._lock:
            self._streams.pop(stream.request_id, None)


_STOP = object()


@dataclass(frozen=True, slots=True)
class _Add:
    """Submit queue: a request for the engine thread (ids already validated, or a prompt while loading)."""

    request_id: str
    payload: str | list[int]
    params: SamplingParams
    text: str | None
    lora: LoRARequest | str | None = None  # resolved, or a name to resolve (submitted while loading)
    validated: bool = False  # admitted on the caller's thread (the engine was loaded): not checked again


@dataclass(frozen=True, slots=True)
class _Abort:
    """Submit queue: end a request now."""

    request_id: str


class EngineLoop(StreamRouter):
    """Runs `LLMEngine.step()` on a background thread and routes deltas to request streams.

    Args:
        config: engine options; the engine is built on the loop thread by `engine_factory`.
        engine_factory: builds the engine (default `LLMEngine(config)`); tests inject fakes.
        max_queue_size: most unfinished requests before `add_request` raises QueueFullError.
    """

    stream_class: type[RequestStream] = RequestStream  # the engine process forwards instead of queueing

    def __init__(
        self,
        config: EngineConfig,
        engine_factory: Callable[[EngineConfig], LLMEngine] | None = None,
        max_queue_size: int = 1000,
    ) -> None:
        super().__init__()
        self.config = config
        self._factory = engine_factory
        self.max_queue_size = max_queue_size
        self.engine: LLMEngine | None = None
        self._submit: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._pending_loras: dict[str, LoRARequest] = {}  # added while loading: registered once loaded

    # ---- lifecycle -----------------------------------------------------------------------

    def start(self) -> EngineLoop:
        """Start the thread (it loads the model); returns at once, state LOADING."""
        assert self._thread is None, "EngineLoop already started"
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()
        return self

    def close(self, timeout: float | None = 30.0) -> None:
        """Abort every request (final 'abort' deltas), stop the thread; on its way out the thread
        shuts the engine down (worker processes, GPU memory). A model still loading is shut
        down as soon as it is built, even when that is after `timeout`."""
        self.closing = True
        self._submit.put(_STOP)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("the engine thread did not stop within %s s (%s): it shuts the engine down when it "
                               "does", timeout, self.state.value)
        with self._lock:
            if self.state is not EngineState.DEAD:
                self.state = EngineState.DEAD
                self.error = self.error or EngineDeadError("the engine loop was closed")
            self._ready.set()

    # ---- what the HTTP layer reads -------------------------------------------------------

    @property
    def tokenizer(self):  # noqa: ANN201 - HF tokenizer or None while loading
        return self.engine.tokenizer if self.engine is not None else None

    @property
    def max_model_len(self) -> int | None:
        return self.engine.max_model_len if self.engine is not None else None

    @property
    def num_open_requests(self) -> int:
        """Requests submitted and not finished (the router's measure of load)."""
        return len(self._streams)

    @property
    def started(self) -> bool:
        return self._thread is not None

    def stats(self) -> dict:
        """Engine gauges/counters plus the state; safe from any thread (reads counters)."""
        out: dict = {"state": self.state.value, "num_streams": len(self._streams)}
        if self.engine is not None:
            try:
                out.update(self.engine.stats())
                out["token_intervals"] = self.engine.token_intervals.snapshot()
            except Exception:  # noqa: BLE001 - a racing read must never fail a scrape
                pass
        return out

    # ---- submitting ----------------------------------------------------------------------

    def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
        lora_name: str | None = None,
    ) -> RequestStream:
        """Submit a request (text or token ids), on the adapter `lora_name` if given; returns its stream at once.

        Raises:
            UnknownAdapterError: `lora_name` is not a registered adapter (a ValueError).
            ValueError: the request can never run (too long, bad ids) -> HTTP 400.
            QueueFullError: too many unfinished requests -> HTTP 503.
            EngineDeadError: the engine died or is closed -> HTTP 503/500.
        """
        params = params or SamplingParams()
        engine = self.engine
        if self.state is EngineState.DEAD:
            raise EngineDeadError(f"the engine is dead: {self.error!r}")
        if engine is not None:
            # Tokenize and validate on the caller's thread: errors come back synchronously,
            # and the engine thread does no per-request CPU work beyond the step.
            lora: LoRARequest | str | None = engine.resolve_lora(lora_name)
            ids = engine.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
            engine.validate(ids, params)
            payload: str | list[int] = ids
        else:
            lora = lora_name
            payload = prompt if isinstance(prompt, str) else [int(t) for t in prompt]
        stream = self.stream_class(self, request_id, params.n)
        with self._lock:
            if self.state is EngineState.DEAD:
                raise EngineDeadError(f"the engine is dead: {self.error!r}")
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            if len(self._streams) >= self.max_queue_size:
                raise QueueFullError(f"too many unfinished requests (max_queue_size={self.max_queue_size})")
            self._streams[request_id] = stream
        self._submit.put(_Add(request_id, payload, params, prompt if isinstance(prompt, str) else None, lora,
                              validated=engine is not None))
        return stream

    # ---- LoRA adapters (any thread) ------------------------------------------------------

    def add_lora(self, request: LoRARequest) -> None:
        """Register an adapter (ValueError saying why it cannot be served). While the engine loads,
        it is kept and registered once the engine is up (a failure then is logged)."""
        with self._lock:
            engine = self.engine
            if engine is None:
                if not self.config.enable_lora:
                    raise ValueError("LoRA adapters are not enabled: set option.enable_lora=true")
                if request.lora_name in self._pending_loras:
                    raise ValueError(f"an adapter named {request.lora_name!r} is already registered")
                self._pending_loras[request.lora_name] = request
                return
        engine.add_lora(request)

    def remove_lora(self, name: str) -> bool:
        """Unregister an adapter: new requests on it are refused; running ones finish on it."""
        with self._lock:
            engine = self.engine
            if engine is None:
                return self._pending_loras.pop(name, None) is not None
        return engine.remove_lora(name)

    def list_loras(self) -> list[str]:
        with self._lock:
            engine = self.engine
            if engine is None:
                return list(self._pending_loras)
        return engine.list_loras()

    def abort(self, request_id: str) -> None:
        """Ask the loop to abort a request (no-op if unknown or finished)."""
        self._submit.put(_Abort(request_id))

    # ---- the thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            engine = self._factory(self.config) if self._factory else self._default_engine()
        except BaseException as exc:  # noqa: BLE001 - any load failure is the health state
            logger.exception("engine failed to load")
            # The error is kept (it is the health state) but not the half-built engine its
            # traceback's frames hold: the worker processes and the GPU memory go now.
            traceback.clear_frames(exc.__traceback__)
            self._die(exc)
            return
        with self._lock:  # (add_lora reads `engine` under the lock: none is left pending)
            pending, self._pending_loras = list(self._pending_loras.values()), {}
            self.engine = engine
        for lora in pending:
            try:
                engine.add_lora(lora)
            except ValueError as exc:
                logger.error("adapter %r not registered: %s", lora.lora_name, exc)
        engine.executor.set_failure_callback(self._die)  # a dead or hung worker, seen by its watchdog
        with self._lock:
            if self.state is EngineState.LOADING:
                self.state = EngineState.READY
                self.was_ready = True
        self._ready.set()
        try:
            self._serve(engine)
        finally:
            engine.shutdown()

    def _serve(self, engine: LLMEngine) -> None:
        try:
            while True:
                if self._drain(block=not engine.has_unfinished_requests()):
                    self._abort_all()
                    return
                if engine.has_unfinished_requests():
                    try:
                        deltas = engine.step()
                    except Exception as exc:  # noqa: BLE001 - one request's failure is not the engine's
                        logger.exception("engine step failed; recovering")
                        deltas = engine.recover(exc)  # re-raises when the engine cannot go on
                    for delta in deltas:
                        self._deliver(delta)
        except BaseException as exc:  # noqa: BLE001 - an unrecoverable failure kills the engine, loudly
            logger.exception("engine step failed; the engine is now dead")
            self._die(exc)

    def _default_engine(self) -> LLMEngine:
        from serving.engine.llm_engine import LLMEngine

        return LLMEngine(self.config)

    def _drain(self, block: bool) -> bool:
        """Apply queued commands (waiting for one if `block`); True when asked to stop."""
        item = self._submit.get() if block else self._next_nowait()
        while item is not None:
            if item is _STOP:
                return True
            if isinstance(item, _Add):
                self._handle_add(item)
            else:
                for delta in self.engine.abort_request(item.request_id):  # type: ignore[union-attr]
                    self._deliver(delta)
            item = self._next_nowait()
        return False

    def _next_nowait(self):  # noqa: ANN202
        try:
            return self._submit.get_nowait()
        except queue.Empty:
            return None

    def _handle_add(self, add: _Add) -> None:
        request_id, payload, params, text = add.request_id, add.payload, add.params, add.text
        stream = self._streams.get(request_id)
        if stream is None or stream.closed:  # closed before the engine saw it
            self._streams.pop(request_id, None)
            return
        try:
            lora = add.lora
            if isinstance(lora, str):  # submitted while loading
                lora = self.engine.resolve_lora(lora)  # type: ignore[union-attr]
            if isinstance(payload, str):
                self.engine.add_request(request_id, payload, params, lora_request=lora)  # type: ignore[union-attr]
            else:
                self.engine.add_request(request_id, text, params, prompt_token_ids=payload,  # type: ignore[union-attr]
                                        lora_request=lora, validated=add.validated)
        except ValueError as exc:
            self._fail_stream(stream, str(exc))

    def _abort_all(self) -> None:
        for request_id in list(self._streams):
            for delta in self.engine.abort_request(request_id):  # type: ignore[union-attr]
                self._deliver(delta)
        for stream in list(self._streams.values()):  # submitted but never added
            self._fail_stream(stream, "the engine loop was closed", reason="abort")
        with self._lock:
            self.state = EngineState.DEAD
            self.error = EngineDeadError("the engine loop was closed")

    def _die(self, exc: BaseException) -> None:
        with self._lock:
            if self.state is EngineState.DEAD and self.error is not None and not self._streams:
                return  # already dead (the watchdog and the engine thread may both report it)
            self.state = EngineState.DEAD
            self.error = exc
            streams = list(self._streams.values())
            self._streams.clear()
        self._ready.set()
        message = f"engine error: {type(exc).__name__}: {exc}"
        for stream in streams:
            for index in stream._unfinished_indexes():
                stream._put(StreamDelta(stream.request_id, index, (), "", finish_reason="error", error=message))

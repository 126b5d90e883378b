"""`EngineProcess`: the engine loop in a process of its own, driven from the HTTP process over a pipe.

Why: in one process, the engine thread (schedule, launch, read tokens, detokenize) shares the GIL
with every HTTP thread, and each streamed token wakes one of those. A py-spy of a freshly started
8B server at 16 req/s (bench/RESULTS.md run 16) found the engine thread waiting for the GIL after
every pipe read and write of its step. Here the engine's cadence depends on its own process only;
the HTTP process just routes finished deltas to the streams (vLLM v1 splits its API server and
engine core the same way). Opt-in (`option.engine_process=true`): at 8 and 16 req/s on an 8B server
it measured the same as the default, where only the model's work leaves the HTTP process
(`distributed_executor_backend="mp"`); it is there for loads where the HTTP side is heavier.

Parent side (`EngineProcess`, an `EngineClient`): `start()` resolves the model on a thread (S3,
hub, local, the default model), spawns the child, loads the edge's tokenizer meanwhile, then reads
the child's messages on that same thread: it routes each batch of deltas into the callers'
`RequestStream`s and answers calls (requests, adapters, stats). Child side (`_child_main`): an
ordinary `EngineLoop` whose streams forward every delta to one queue, drained in batches onto the
pipe; commands are applied on the child's main thread. A child that exits (or is killed) makes the
parent DEAD at once, with a final error delta on every open stream, as a dead engine thread does.
The child dies with its parent.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import multiprocessing as mp
import os
import pickle
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from serving.engine.engine_loop import EngineDeadError, EngineLoop, EngineState, RequestStream
from serving.engine_config import EngineConfig
from serving.lora_request import LoRARequest
from serving.outputs import StreamDelta
from serving.sampling_params import SamplingParams

logger = logging.getLogger("serving.engine.engine_process")

_CALL_TIMEOUT_S = 60.0  # a call the child never answers (it is alive but stuck): the caller gets an error


@dataclasses.dataclass(frozen=True, slots=True)
class _Ready:
    """Child -> parent once the engine is built: what the HTTP edge reads without a round trip."""

    max_model_len: int


class EngineProcess:
    """One model copy's engine in a child process (see the module docstring).

    Args:
        config: the engine options (`model` is filled in from `resolve()`).
        resolve: run on the parent's start-up thread; returns the model dir (or None: the default).
        devices: the devices of this copy (the child's executor uses them).
        max_queue_size: most unfinished requests (the child's EngineLoop enforces it).
    """

    def __init__(self, config: EngineConfig, resolve: Callable[[], Any] | None = None,
                 devices: tuple[str, ...] | None = None, max_queue_size: int = 1000) -> None:
        self.config = config
        self._resolve = resolve or (lambda: config.model)
        self.devices = devices
        self.max_queue_size = max_queue_size
        self.state = EngineState.LOADING
        self.error: BaseException | None = None
        self.was_ready = False
        self.closing = False
        self.tokenizer: Any = None
        self._tokenizer_ready = False
        self.max_model_len: int | None = None
        self._streams: dict[str, RequestStream] = {}
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._ready = threading.Event()
        self._calls: dict[int, list] = {}  # call id -> [Event, ok, value]
        self._call_ids = itertools.count()
        self._conn = None
        self._proc: mp.process.BaseProcess | None = None
        self._starter: threading.Thread | None = None  # spawns the child, then reads its messages

    # ---- lifecycle -----------------------------------------------------------------------

    @property
    def started(self) -> bool:
        return self._starter is not None

    @property
    def num_open_requests(self) -> int:
        return len(self._streams)

    def start(self) -> EngineProcess:
        """Resolve the model and spawn the engine process, on a thread that then reads its messages;
        returns at once (LOADING)."""
        assert self._starter is None, "EngineProcess already started"
        self._starter = threading.Thread(target=self._start, name="engine-process", daemon=True)
        self._starter.start()
        return self

    def _start(self) -> None:
        try:
            model = self._resolve()
            config = dataclasses.replace(self.config, model=str(model) if model else None)
            ctx = mp.get_context("spawn")
            parent_conn, child_conn = ctx.Pipe(duplex=True)
            with self._lock:
                if self.closing:
                    return
                self._conn = parent_conn
                # Not a multiprocessing daemon: the engine core may start the model's rank processes
                # (tensor parallelism, the mp executor), which daemons may not. It still dies with this
                # process (PR_SET_PDEATHSIG in the child) and is stopped by close().
                self._proc = ctx.Process(target=_child_main, name="engine-core", daemon=False,
                                         args=(config, self.devices, self.max_queue_size, child_conn, os.getpid()))
                self._proc.start()
            child_conn.close()
            # The edge's tokenizer, loaded here while the child builds the engine (same files).
            if not config.skip_tokenizer_init:
                from serving.checkpoint.model_files import resolve_model_dir
                from serving.engine.tokenizer import load_tokenizer

                path = config.tokenizer or str(resolve_model_dir(config.model, config.revision))
                self.tokenizer = load_tokenizer(path, config.revision, config.trust_remote_code)
        except BaseException as exc:  # noqa: BLE001 - a failed start is the health state
            logger.exception("the engine process could not start")
            self._die(exc)
            return
        self._tokenizer_ready = True
        self._maybe_ready()
        # This thread spawned the child, so it lives as long as the child does: the child's
        # parent-death signal (PR_SET_PDEATHSIG) follows the thread that forked it, not the process.
        self._read()

    # Block until READY (True) or timeout (False); EngineDeadError if it died: the same fields as a loop.
    wait_ready = EngineLoop.wait_ready

    def close(self, timeout: float | None = 30.0) -> None:
        """Abort every request (their streams get final 'abort' deltas), stop the child and wait for it."""
        self.closing = True
        proc = self._proc
        if proc is not None and proc.is_alive():
            try:
                self._post(("stop", timeout))
            except (OSError, EOFError):
                pass
            proc.join(None if timeout is None else timeout + 5.0)
            if proc.is_alive():
                logger.warning("the engine process did not stop within %s s: killing it", timeout)
                proc.kill()
                proc.join(5.0)
        if self._starter is not None and self._starter is not threading.current_thread():
            self._starter.join(5.0)
        self._die(EngineDeadError("the engine loop was closed"), reason="abort")

    # ---- the EngineClient calls ----------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    lora_name: str | None = None) -> RequestStream:
        """Submit a request; returns its stream once the child took it (its errors are raised here)."""
        params = params or SamplingParams()
        if self.state is not EngineState.READY:
            raise EngineDeadError(f"the engine is {self.state.value}" + (f": {self.error!r}" if self.error else ""))
        stream = RequestStream(self, request_id, params.n)
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = stream  # before the child can answer with its first delta
        try:
            self._call("add_request", request_id, prompt, params, lora_name)
        except BaseException:
            with self._lock:
                self._streams.pop(request_id, None)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        if self._conn is not None and self.state is not EngineState.DEAD:
            try:
                self._post(("abort", request_id))
            except (OSError, EOFError):
                pass

    def add_lora(self, request: LoRARequest) -> None:
        self._call("add_lora", request)

    def remove_lora(self, name: str) -> bool:
        return bool(self._call("remove_lora", name))

    def list_loras(self) -> list[str]:
        return list(self._call("list_loras"))

    def stats(self) -> dict:
        out: dict = {"state": self.state.value, "num_streams": len(self._streams)}
        if self.state is EngineState.READY:
            try:
                out.update(self._call("stats", timeout=5.0))
            except Exception:  # noqa: BLE001 - a racing read must never fail a scrape
                pass
        return out

    # ---- messages ------------------------------------------------------------------------

    def _post(self, message: tuple) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            self._conn.send_bytes(data)  # type: ignore[union-attr]

    def _call(self, method: str, *args: object, timeout: float = _CALL_TIMEOUT_S) -> Any:
        """Run `method` on the child's EngineLoop; its return value, or its exception raised here."""
        if self._conn is None or self.state is EngineState.DEAD:
            raise EngineDeadError(f"the engine is {self.state.value}" + (f": {self.error!r}" if self.error else ""))
        call_id = next(self._call_ids)
        slot = [threading.Event(), False, None]
        self._calls[call_id] = slot
        try:
            try:
                self._post(("call", call_id, method, args))
            except (OSError, EOFError) as exc:
                raise EngineDeadError(f"the engine process went away: {exc}") from None
            if not slot[0].wait(timeout):
                raise EngineDeadError(f"the engine process did not answer {method} within {timeout:g} s")
        finally:
            self._calls.pop(call_id, None)
        ok, value = slot[1], slot[2]
        if not ok:
            raise value
        return value

    def _read(self) -> None:
        """Reader thread: route deltas to streams, answer calls; EOF means the child is gone."""
        conn = self._conn
        try:
            while True:
                message = pickle.loads(conn.recv_bytes())  # type: ignore[union-attr]
                kind = message[0]
                if kind == "deltas":
                    self._route(message[1])
                elif kind == "reply":
                    slot = self._calls.get(message[1])
                    if slot is not None:
                        slot[1], slot[2] = message[2], message[3]
                        slot[0].set()
                elif kind == "ready":
                    self._on_ready(message[1])
                elif kind == "dead":
                    self._die(EngineDeadError(message[1]))
                else:
                    raise ValueError(f"unknown message {kind!r} from the engine process")
        except (EOFError, OSError):
            pass
        except BaseException as exc:  # noqa: BLE001 - a broken reader is a dead engine
            logger.exception("the engine process reader failed")
            self._die(exc)
            return
        proc = self._proc
        if proc is not None:
            proc.join(5.0)
        if not self.closing:
            code = proc.exitcode if proc is not None else None
            logger.error("the engine process exited (code %s)", code)
            self._die(EngineDeadError(f"the engine process exited (code {code})"))

    def _on_ready(self, ready: _Ready) -> None:
        self.max_model_len = ready.max_model_len
        self._maybe_ready()

    def _maybe_ready(self) -> None:
        """READY once the child's engine is built and this side's tokenizer is loaded (either order)."""
        with self._lock:
            if self.state is EngineState.LOADING and self.max_model_len is not None and self._tokenizer_ready:
                self.state = EngineState.READY
                self.was_ready = True
                self._ready.set()

    # A delta into its stream (the stream leaves `_streams` with its last): the loop's own routing,
    # on the same fields.
    _deliver = EngineLoop._deliver
    _fail_stream = EngineLoop._fail_stream

    def _route(self, deltas: list[StreamDelta]) -> None:
        for delta in deltas:
            self._deliver(delta)

    def _die(self, exc: BaseException, reason: str = "error") -> None:
        with self._lock:
            if self.state is EngineState.DEAD and not self._streams:
                self._ready.set()
                return
            if self.state is not EngineState.DEAD:
                self.state = EngineState.DEAD
                self.error = self.error or exc
            streams = list(self._streams.values())
            self._streams.clear()
            calls = list(self._calls.values())
        self._ready.set()
        message = f"engine error: {type(exc).__name__}: {exc}" if reason == "error" else str(exc)
        for stream in streams:
            self._fail_stream(stream, message, reason)
        for slot in calls:  # callers waiting on a dead child: fail them now
            slot[1], slot[2] = False, EngineDeadError(f"the engine is dead: {exc}")
            slot[0].set()


# ---- the child -------------------------------------------------------------------------------


class _ForwardingStream(RequestStream):
    """A child-side stream whose deltas go to the process's outbox (one queue for every request)."""

    outbox: queue.SimpleQueue  # set on the class by _child_main

    def __init__(self, loop: EngineLoop, request_id: str, n: int) -> None:
        super().__init__(loop, request_id, n)
        self._queue = self.outbox  # type: ignore[assignment]


class _ForwardingLoop(EngineLoop):
    stream_class = _ForwardingStream


def _picklable_error(exc: BaseException) -> BaseException:
    """`exc` if it survives pickling as itself, else a RuntimeError with its text."""
    try:
        return pickle.loads(pickle.dumps(exc))
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def _child_main(config: EngineConfig, devices: tuple[str, ...] | None, max_queue_size: int, conn,  # noqa: ANN001
                parent_pid: int) -> None:
    """The engine process: an EngineLoop, its deltas forwarded in batches, commands from the pipe."""
    import gc

    from serving.engine.llm_engine import LLMEngine
    from serving.executor.worker_proc import die_with_parent

    die_with_parent(parent_pid)
    logging.basicConfig(level=os.environ.get("LOG_LEVEL", "INFO").upper(),
                        format="%(asctime)s %(levelname)s engine-core %(name)s: %(message)s")
    send_lock = threading.Lock()

    def send(message: tuple) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with send_lock:
            conn.send_bytes(data)

    outbox: queue.SimpleQueue = queue.SimpleQueue()
    _ForwardingStream.outbox = outbox
    loop = _ForwardingLoop(config, engine_factory=lambda cfg: LLMEngine(cfg, devices=devices),
                           max_queue_size=max_queue_size)

    def forward() -> None:
        """Every delta, in batches: one wait for the first, then whatever else is already there."""
        while True:
            batch = [outbox.get()]
            while not outbox.empty():
                batch.append(outbox.get_nowait())
            if batch[-1] is None:  # the stop marker
                batch.pop()
                if batch:
                    send(("deltas", batch))
                return
            send(("deltas", batch))

    def report() -> None:
        """Ready (with what the edge needs) once built; later, a death the parent must hear of."""
        try:
            loop.wait_ready(None)
        except EngineDeadError:
            send(("dead", f"{type(loop.error).__name__}: {loop.error}"))
            return
        gc.collect()
        gc.freeze()  # what loading built lives as long as this process (see serving/server/wsgi.py)
        send(("ready", _Ready(max_model_len=int(loop.max_model_len))))
        while loop.state is not EngineState.DEAD:
            time.sleep(0.2)
        if not loop.closing:
            send(("dead", f"{type(loop.error).__name__}: {loop.error}"))

    forwarder = threading.Thread(target=forward, name="engine-core-forward", daemon=True)
    forwarder.start()
    loop.start()
    threading.Thread(target=report, name="engine-core-report", daemon=True).start()
    try:
        while True:
            message = pickle.loads(conn.recv_bytes())
            kind = message[0]
            if kind == "call":
                _, call_id, method, args = message
                try:
                    value = getattr(loop, method)(*args)
                    if method == "add_request":
                        value = None  # the parent has its own stream
                    reply = ("reply", call_id, True, value)
                except Exception as exc:  # noqa: BLE001 - raised again in the caller
                    reply = ("reply", call_id, False, _picklable_error(exc))
                send(reply)
            elif kind == "abort":
                loop.abort(message[1])
            elif kind == "stop":
                loop.close(message[1])
                break
            else:
                raise ValueError(f"unknown message {kind!r}")
    except (EOFError, OSError):
        loop.close(5.0)  # the parent went away
    outbox.put(None)
    forwarder.join(10.0)
    logging.shutdown()
    os._exit(0)

"""Engine cores: each model copy's engine loop in a process of its own, serving several HTTP frontends.

Why: in one process, the engine thread (schedule, launch, read tokens, detokenize) shares the GIL
with every HTTP thread, and each streamed token wakes one of those (bench/RESULTS.md). And
one HTTP process in front of several copies is itself the ceiling: at 2 copies it sat at ~130 % CPU,
~100 us of Python per streamed token, and delivered 1.66x one copy (bench/RESULTS.md). So, as vLLM runs several
API-server processes over its engine cores, each copy's engine runs in a core process that listens on
a private AF_UNIX socket and serves any number of frontends (gunicorn workers), each of which is a
client of every core.

Owner side (`EngineCore`, in gunicorn's arbiter via serving/server/cores.py): spawns the core, can
spawn it again, stops it. Core side (`_core_main`): an ordinary `EngineLoop` whose streams forward
every delta to one queue, drained in batches and sent to the connection that owns each request;
request ids are namespaced per connection (`<client>/<id>`); calls (requests, adapters, stats) are
answered to the caller; every message carries the core's open-request count (its load, for the
frontends' least-loaded routing). A client that disconnects has its requests aborted; the core goes
on serving the others. A core whose model fails to load stays up telling each client why (the
frontends then stop the server); a core whose engine dies while serving tells its clients, then exits
(the owner starts a fresh one).

Frontend side (`EngineProcess`, an `EngineClient`): connects (retrying while the core starts), loads
the tokenizer once per process from the model dir the core reports, then reads the core's messages
on that thread: it routes each batch of deltas into the callers' `RequestStream`s and answers calls.
A core that goes away makes it DEAD at once, with a final error delta on every open stream.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import multiprocessing as mp
import os
import pickle
import queue
import signal
import socket
import threading
import time
from multiprocessing.connection import Client, Listener
from multiprocessing.connection import wait as mp_wait
from typing import Any

from serving.engine.engine_loop import EngineLoop, StreamRouter
from serving.engine.request_stream import EngineDeadError, EngineState, RequestStream
from serving.engine_config import EngineConfig
from serving.lora_request import LoRARequest
from serving.outputs import StreamDelta
from serving.sampling_params import SamplingParams

logger = logging.getLogger("serving.engine.engine_process")

_CALL_TIMEOUT_S = 60.0  # a call the core never answers (it is alive but stuck): the caller gets an error
_CONNECT_RETRY_S = 0.1  # while the core is not listening yet
_DEAD_LINGER_S = 1.0  # a core whose engine died keeps its connections this long (the news gets out)


@dataclasses.dataclass(frozen=True, slots=True)
class CoreAddress:
    """Where a core listens (an AF_UNIX path in a private directory) and the key its clients prove
    themselves with: what a frontend needs to reach one model copy."""

    path: str
    authkey: bytes


@dataclasses.dataclass(frozen=True, slots=True)
class _Ready:
    """Core -> client once the engine is built: what the HTTP edge reads without a round trip."""

    max_model_len: int
    model_dir: str | None  # the resolved model (the frontends' tokenizer comes from it); None: the default


# ---- the owner (gunicorn's arbiter) ---------------------------------------------------------


class EngineCore:
    """One model copy's core process, as its owner sees it: start it, start it again, stop it.

    Args:
        config: the engine options, `model` resolved already (or None: the embedded default).
        address: where it listens.
        devices: the devices of this copy.
        max_queue_size: most unfinished requests (the core's EngineLoop enforces it).
    """

    def __init__(self, config: EngineConfig, address: CoreAddress, devices: tuple[str, ...] | None = None,
                 max_queue_size: int = 1000) -> None:
        self.config = config
        self.address = address
        self.devices = devices
        self.max_queue_size = max_queue_size
        self.proc: mp.process.BaseProcess | None = None

    def start(self, load_error: str | None = None) -> EngineCore:
        """Spawn the core (again). The spawning thread must outlive it: the core's parent-death
        signal follows the thread that forked it. `load_error`: the model could not even be
        fetched; the core then only tells its clients that."""
        assert self.proc is None or self.exited, "the core is running"
        try:
            os.unlink(self.address.path)  # a core that was killed leaves its socket file
        except FileNotFoundError:
            pass
        ctx = mp.get_context("spawn")
        # Not a multiprocessing daemon: the core may start the model's rank processes (tensor
        # parallelism, the mp executor), which daemons may not. It dies with its owner all the same.
        self.proc = ctx.Process(target=_core_main, name="engine-core", daemon=False,
                                args=(self.config, self.devices, self.max_queue_size, self.address, os.getpid(),
                                      load_error))
        self.proc.start()
        return self

    @property
    def exited(self) -> bool:
        """Whether the core process ended. Read from its sentinel, not its exit status: gunicorn's
        arbiter reaps every child it is signalled about (`waitpid(-1)`), the cores included."""
        return self.proc is not None and bool(mp_wait([self.proc.sentinel], 0))

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (the core aborts what is left and exits), then SIGKILL after `timeout`."""
        proc = self.proc
        if proc is not None and not self.exited:
            proc.terminate()
            mp_wait([proc.sentinel], timeout)
            if not self.exited:
                logger.warning("engine core %s did not stop within %s s: killing it", proc.pid, timeout)
                proc.kill()
                mp_wait([proc.sentinel], 5.0)
            proc.join(0)  # (its status, unless the arbiter reaped it already)
        try:
            os.unlink(self.address.path)
        except FileNotFoundError:
            pass


# ---- the core ---------------------------------------------------------------------------------


class _ForwardingStream(RequestStream):
    """A core-side stream whose deltas go to the process's outbox (one queue for every request)."""

    outbox: queue.SimpleQueue  # set on the class by _core_main

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


class _Connection:
    """One frontend's connection to the core (messages are sent whole, one writer at a time)."""

    def __init__(self, cid: str, conn) -> None:  # noqa: ANN001 - multiprocessing Connection
        self.cid = cid
        self.conn = conn
        self._lock = threading.Lock()

    def send(self, message: tuple) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            with self._lock:
                self.conn.send_bytes(data)
        except (OSError, ValueError):  # gone: its reader sees EOF and aborts its requests
            pass


class _Core:
    """The core process's state: the loop, its connections, and who owns which request."""

    def __init__(self, config: EngineConfig, devices: tuple[str, ...] | None, max_queue_size: int,
                 load_error: str | None) -> None:
        from serving.engine.llm_engine import LLMEngine

        self.config = config
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        _ForwardingStream.outbox = self.outbox
        self.loop = None if load_error else _ForwardingLoop(
            config, engine_factory=lambda cfg: LLMEngine(cfg, devices=devices), max_queue_size=max_queue_size)
        self.load_error = load_error
        self.clients: dict[str, _Connection] = {}
        self.open: dict[str, int] = {}  # namespaced request id -> samples not finished (the core's load)
        self.loras: dict[str, LoRARequest] = {}  # adapters registered through the clients, by name
        self.hello: tuple | None = None  # what a client hears on connecting: ("ready", ...) or ("dead", why)
        self.received = 0  # requests taken in, from every client
        self.stop = threading.Event()
        self.exit_code = 0
        self._lock = threading.Lock()
        self._lora_lock = threading.Lock()

    def load(self) -> int:
        return len(self.open)

    def announce(self, message: tuple) -> None:
        """Tell every client (and every later one) the engine's state."""
        with self._lock:
            self.hello = message
            clients = list(self.clients.values())
        for client in clients:
            client.send(message)

    # -- threads ----------------------------------------------------------------------------------

    def accept(self, listener: Listener) -> None:
        for n in itertools.count(1):
            try:
                conn = listener.accept()
            except Exception:  # noqa: BLE001 - a client that failed the handshake, or the listener closed
                if self.stop.is_set():
                    return
                logger.warning("a connection to the engine core was refused", exc_info=True)
                continue
            client = _Connection(str(n), conn)
            with self._lock:
                self.clients[client.cid] = client
                hello = self.hello
            if hello is not None:  # (announced meanwhile: heard twice, which clients take)
                client.send(hello)
            threading.Thread(target=self.serve_client, args=(client,), name=f"core-client-{n}", daemon=True).start()

    def serve_client(self, client: _Connection) -> None:
        """Apply a client's commands until it goes away; then abort what it left running."""
        prefix = client.cid + "/"
        try:
            while True:
                message = pickle.loads(client.conn.recv_bytes())
                if message[0] == "call":
                    self.call(client, *message[1:])
                elif message[0] == "abort":
                    if self.loop is not None:
                        self.loop.abort(prefix + message[1])
                else:
                    raise ValueError(f"unknown message {message[0]!r}")
        except (EOFError, OSError):
            pass
        except Exception:  # noqa: BLE001 - a broken client is dropped, the core serves on
            logger.exception("engine core: client %s sent a bad message; dropping it", client.cid)
        with self._lock:
            self.clients.pop(client.cid, None)
            left = [rid for rid in self.open if rid.startswith(prefix)]
        if left:
            logger.warning("a frontend went away: aborting its %d open request(s)", len(left))
        for rid in left:
            if self.loop is not None:
                self.loop.abort(rid)
        client.conn.close()

    def call(self, client: _Connection, call_id: int, method: str, args: tuple) -> None:
        try:
            if self.loop is None:
                raise EngineDeadError(f"the model failed to load: {self.load_error}")
            if method == "add_request":
                request_id, prompt, params, lora_name = args
                rid = f"{client.cid}/{request_id}"
                with self._lock:
                    self.open[rid] = params.n  # before the engine can answer with its last delta
                try:
                    self.loop.add_request(rid, prompt, params, lora_name)
                except BaseException:
                    with self._lock:
                        self.open.pop(rid, None)
                    raise
                self.received += 1
                value: Any = None  # the client has its own stream
            elif method == "add_lora":
                value = self.add_lora(*args)
            elif method == "remove_lora":
                with self._lora_lock:
                    self.loras.pop(args[0], None)
                    value = self.loop.remove_lora(args[0])
            elif method == "held_loras":
                value = list(self.loras.values())
            elif method == "stats":
                value = {**self.loop.stats(), "num_received_requests": self.received, "num_clients": len(self.clients)}
            elif method == "list_loras":
                value = self.loop.list_loras()
            else:
                raise ValueError(f"unknown engine core call {method!r}")
            reply = ("reply", call_id, True, value, self.load())
        except Exception as exc:  # noqa: BLE001 - raised again in the caller
            reply = ("reply", call_id, False, _picklable_error(exc), self.load())
        client.send(reply)

    def add_lora(self, request: LoRARequest) -> LoRARequest:
        """Register an adapter; one of that name from the same directory is already there: that one
        (every frontend registers the start-up adapters, and a replaced one registers its journal)."""
        with self._lora_lock:
            held = self.loras.get(request.lora_name)
            if held is not None and held.lora_path == request.lora_path:
                return held
            self.loop.add_lora(request)  # type: ignore[union-attr]
            self.loras[request.lora_name] = request
            return request

    def forward(self) -> None:
        """Every delta, in batches (one wait for the first, then whatever else is already there),
        each to the client that owns its request, under the client's own request id."""
        outbox = self.outbox
        while True:
            batch = [outbox.get()]
            while not outbox.empty():
                batch.append(outbox.get_nowait())
            stop = batch[-1] is None
            if stop:
                batch.pop()
            per_client: dict[str, list[StreamDelta]] = {}
            with self._lock:
                for delta in batch:
                    rid = delta.request_id
                    if delta.finish_reason is not None:
                        left = self.open.get(rid, 1) - 1
                        if left > 0:
                            self.open[rid] = left
                        else:
                            self.open.pop(rid, None)
                    cid, _, delta.request_id = rid.partition("/")
                    per_client.setdefault(cid, []).append(delta)
                load = len(self.open)
                clients = {cid: self.clients.get(cid) for cid in per_client}
            for cid, deltas in per_client.items():
                client = clients[cid]
                if client is not None:
                    client.send(("deltas", deltas, load))
            if stop:
                return

    def report(self) -> None:
        """Ready (with what the edge needs) once built; later, a death the clients must hear of."""
        import gc

        loop = self.loop
        assert loop is not None
        try:
            loop.wait_ready(None)
        except EngineDeadError:
            pass
        if loop.state is not EngineState.READY:
            logger.error("engine core: the engine could not be built: %s: %s", type(loop.error).__name__, loop.error)
            self.announce(("dead", f"{type(loop.error).__name__}: {loop.error}"))
            return  # stays up telling each client why, until its owner stops it
        gc.collect()
        gc.freeze()  # what loading built lives as long as this process (see serving/server/wsgi.py)
        self.announce(("ready", _Ready(max_model_len=int(loop.max_model_len), model_dir=self.config.model)))
        while loop.state is not EngineState.DEAD:
            time.sleep(0.2)
        if not loop.closing and not self.stop.is_set():
            logger.error("the engine died while serving: %s: %s", type(loop.error).__name__, loop.error)
            self.announce(("dead", f"{type(loop.error).__name__}: {loop.error}"))
            time.sleep(_DEAD_LINGER_S)
            self.exit_code = 1
            self.stop.set()


def _core_main(config: EngineConfig, devices: tuple[str, ...] | None, max_queue_size: int, address: CoreAddress,
               parent_pid: int, load_error: str | None) -> None:
    """The core process: listen, build the engine, serve every client until SIGTERM (see module doc)."""
    from serving.executor.rank_process import die_with_parent

    die_with_parent(parent_pid)
    logging.basicConfig(level=os.environ.get("LOG_LEVEL", "INFO").upper(),
                        format="%(asctime)s %(levelname)s engine-core %(name)s: %(message)s")
    core = _Core(config, devices, max_queue_size, load_error)
    signal.signal(signal.SIGTERM, lambda *_: core.stop.set())
    listener = Listener(address.path, family="AF_UNIX", authkey=address.authkey, backlog=128)
    threading.Thread(target=core.accept, args=(listener,), name="core-accept", daemon=True).start()
    forwarder = threading.Thread(target=core.forward, name="core-forward", daemon=True)
    forwarder.start()
    if core.loop is not None:
        core.loop.start()
        threading.Thread(target=core.report, name="core-report", daemon=True).start()
    else:
        logger.error("engine core: the model could not be fetched: %s", load_error)
        core.announce(("dead", load_error))
    while not core.stop.wait(0.5):
        pass
    if core.loop is not None:
        core.loop.close(5.0)  # open requests end with final 'abort' deltas, sent to their clients
    core.outbox.put(None)
    forwarder.join(10.0)
    listener.close()  # removes the socket file
    logging.shutdown()
    os._exit(core.exit_code)


# ---- the frontend's end ------------------------------------------------------------------------

_tokenizers: dict[tuple, Any] = {}
_tokenizer_lock = threading.Lock()


def _shared_tokenizer(path: str, revision: str | None, trust_remote_code: bool) -> Any:
    """One tokenizer per process for every core's client (the same files; transformers' lazy module
    is not safe to import from several threads at once: bench/RESULTS.md)."""
    key = (path, revision, trust_remote_code)
    with _tokenizer_lock:
        if key not in _tokenizers:
            from serving.engine.tokenizer import load_tokenizer

            _tokenizers[key] = load_tokenizer(path, revision, trust_remote_code)
        return _tokenizers[key]


class EngineProcess(StreamRouter):
    """A frontend's connection to one engine core: an `EngineClient` (see the module docstring).

    Args:
        config: the engine options (the tokenizer settings are read here).
        address: the core's socket and key.
    """

    def __init__(self, config: EngineConfig, address: CoreAddress) -> None:
        super().__init__()
        self.config = config
        self.address = address
        self.tokenizer: Any = None
        self.max_model_len: int | None = None
        self.model_dir: str | None = None  # the model the core loaded (None: the embedded default)
        self.core_load = 0  # the core's open requests (every frontend's), as of its last message
        self._sent_since_load = 0  # requests this frontend sent since that message
        self._send_lock = threading.Lock()
        self._calls: dict[int, list] = {}  # call id -> [Event, ok, value]
        self._call_ids = itertools.count()
        self._conn = None
        self._reader: threading.Thread | None = None

    # ---- lifecycle -----------------------------------------------------------------------

    @property
    def started(self) -> bool:
        return self._reader is not None

    @property
    def num_open_requests(self) -> int:
        """The core's load as every frontend adds to it (for least-loaded routing)."""
        return self.core_load + self._sent_since_load

    def start(self) -> EngineProcess:
        """Connect (on a thread that then reads the core's messages); returns at once (LOADING)."""
        assert self._reader is None, "EngineProcess already started"
        self._reader = threading.Thread(target=self._run, name="engine-core-client", daemon=True)
        self._reader.start()
        return self

    def _run(self) -> None:
        while not self.closing:
            try:
                conn = Client(self.address.path, family="AF_UNIX", authkey=self.address.authkey)
                break
            except (FileNotFoundError, ConnectionRefusedError):  # the core is starting
                time.sleep(_CONNECT_RETRY_S)
            except BaseException as exc:  # noqa: BLE001 - a bad key, a broken socket: the engine is unreachable
                logger.exception("cannot connect to the engine core at %s", self.address.path)
                self._die(exc)
                return
        else:
            return
        with self._lock:
            if self.closing:
                conn.close()
                return
            self._conn = conn
        self._read()

    def close(self, timeout: float | None = 30.0) -> None:
        """Disconnect: the core aborts this frontend's requests (their streams get final 'abort'
        deltas here) and serves on for the others."""
        with self._lock:
            self.closing = True
            conn = self._conn
        if conn is not None:
            try:  # wake the reader blocked in recv (closing the descriptor alone does not)
                socket.socket(fileno=os.dup(conn.fileno())).shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        reader = self._reader
        if reader is not None and reader is not threading.current_thread():
            reader.join(5.0)
        self._die(EngineDeadError("the engine loop was closed"), reason="abort")

    # ---- the EngineClient calls ----------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    lora_name: str | None = None) -> RequestStream:
        """Submit a request; returns its stream once the core took it (its errors are raised here)."""
        params = params or SamplingParams()
        if self.state is not EngineState.READY:
            raise EngineDeadError(f"the engine is {self.state.value}" + (f": {self.error!r}" if self.error else ""))
        stream = RequestStream(self, request_id, params.n)
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = stream  # before the core can answer with its first delta
        self._sent_since_load += 1
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

    def add_lora(self, request: LoRARequest) -> LoRARequest:
        """Register on the core; returns the adapter the core holds under that name (this one, or
        the same directory registered before by another frontend)."""
        return self._call("add_lora", request)

    def remove_lora(self, name: str) -> bool:
        return bool(self._call("remove_lora", name))

    def list_loras(self) -> list[str]:
        return list(self._call("list_loras"))

    def held_loras(self) -> list[LoRARequest]:
        """The adapters the core holds (registered through any frontend)."""
        return list(self._call("held_loras"))

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
        """Run `method` on the core; its return value, or its exception raised here."""
        if self._conn is None or self.state is EngineState.DEAD:
            raise EngineDeadError(f"the engine is {self.state.value}" + (f": {self.error!r}" if self.error else ""))
        call_id = next(self._call_ids)
        slot = [threading.Event(), False, None]
        self._calls[call_id] = slot
        try:
            try:
                self._post(("call", call_id, method, args))
            except (OSError, EOFError) as exc:
                raise EngineDeadError(f"the engine core went away: {exc}") from None
            if not slot[0].wait(timeout):
                raise EngineDeadError(f"the engine core did not answer {method} within {timeout:g} s")
        finally:
            self._calls.pop(call_id, None)
        ok, value = slot[1], slot[2]
        if not ok:
            raise value
        return value

    def _read(self) -> None:
        """Reader thread: route deltas to streams, answer calls; EOF means the core is gone."""
        conn = self._conn
        try:
            while True:
                message = pickle.loads(conn.recv_bytes())  # type: ignore[union-attr]
                kind = message[0]
                if kind == "deltas":
                    self.core_load, self._sent_since_load = message[2], 0
                    for delta in message[1]:
                        self._deliver(delta)
                elif kind == "reply":
                    self.core_load, self._sent_since_load = message[4], 0
                    slot = self._calls.get(message[1])
                    if slot is not None:
                        slot[1], slot[2] = message[2], message[3]
                        slot[0].set()
                elif kind == "ready":
                    self._on_ready(message[1])
                elif kind == "dead":
                    self._die(EngineDeadError(message[1]))
                else:
                    raise ValueError(f"unknown message {kind!r} from the engine core")
        except (EOFError, OSError):
            pass
        except BaseException as exc:  # noqa: BLE001 - a broken reader is a dead engine
            if self.closing:
                return
            logger.exception("the engine core client failed")
            self._die(exc)
            return
        try:
            conn.close()  # type: ignore[union-attr]
        except OSError:
            pass
        if not self.closing:
            logger.error("the engine core at %s went away", self.address.path)
            self._die(EngineDeadError("the engine core exited"))

    def _on_ready(self, ready: _Ready) -> None:
        if self.state is not EngineState.LOADING:
            return  # heard twice (it connected as the core announced)
        try:
            if not self.config.skip_tokenizer_init:
                from serving.checkpoint.model_files import resolve_model_dir

                path = self.config.tokenizer or str(resolve_model_dir(ready.model_dir, self.config.revision))
                self.tokenizer = _shared_tokenizer(path, self.config.revision, self.config.trust_remote_code)
        except BaseException as exc:  # noqa: BLE001 - a tokenizer that does not load fails the start
            logger.exception("the tokenizer could not be loaded")
            self._die(exc)
            return
        with self._lock:
            self.max_model_len = ready.max_model_len
            self.model_dir = ready.model_dir
            if self.state is EngineState.LOADING:
                self.state = EngineState.READY
                self.was_ready = True
        self._ready.set()

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
        for slot in calls:  # callers waiting on a dead core: fail them now
            slot[1], slot[2] = False, EngineDeadError(f"the engine is dead: {exc}")
            slot[0].set()

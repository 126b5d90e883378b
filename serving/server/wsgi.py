"""gunicorn's entry point (`serving.server.wsgi:app`): config -> EngineLoop -> Flask app, in the worker.

Importing this module builds the app but starts nothing: `start()` (called from gunicorn's
`post_worker_init`, i.e. after fork) starts the engine thread, which fetches the model (S3 /
hub / local / default) and loads it while `/ping` answers 503; then the LoRA adapters under the
model's `adapters/` are registered, still behind the 503 (one that fails is a failed start).
`stop()` closes the engine on worker exit. The configuration comes resolved from
`container/serve` (`config_from_env`). With `option.engine_process` this worker is one of
`option.frontends` HTTP frontends: `start()` connects it to the engine cores the arbiter started
(serving/server/cores.py) and shares the queue bound, adapter ids and metrics with the others.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import signal
import threading
import time

from serving.server.app import create_app
from serving.server.settings.serving_config import ServingConfig, config_from_env
from serving.engine_config import EngineConfig
from serving.engine.client import DelegatingClient, EngineClient
from serving.engine.engine_loop import EngineLoop
from serving.engine.request_stream import EngineState
from serving.engine.engine_process import EngineProcess
from serving.engine.replicas import ReplicaSet

logger = logging.getLogger("serving.server.wsgi")


class ServedEngine(DelegatingClient):
    """The engine client as the app sees it, plus the model-loading deadline of the container and
    the start-up adapters: only the health (`state`, `error`) differs from the wrapped client's."""

    def __init__(self, inner: EngineClient, config: ServingConfig) -> None:
        super().__init__(inner)
        self.config = config
        self.started_at: float | None = None
        self.load_error: BaseException | None = None
        self.startup_done = threading.Event()  # start-up adapters registered: READY may show
        self.startup_error: BaseException | None = None  # a start-up adapter failed: the start failed

    @property
    def state(self) -> EngineState:  # type: ignore[override]
        st = self.inner.state
        if st is EngineState.READY:
            if self.startup_error is not None:  # a start-up adapter could not be registered
                return EngineState.DEAD
            if not self.startup_done.is_set():
                st = EngineState.LOADING
        if st is EngineState.LOADING and self.started_at is not None and \
                time.monotonic() - self.started_at > self.config.model_loading_timeout:
            self.load_error = self.load_error or TimeoutError(
                f"the model did not load within option.model_loading_timeout={self.config.model_loading_timeout:g} s")
            return EngineState.DEAD
        return st

    @property
    def error(self) -> BaseException | None:  # type: ignore[override]
        return self.inner.error or self.load_error or self.startup_error


def _engine_factory(config: ServingConfig, devices: tuple[str, ...], copy: int):  # noqa: ANN202
    """Builds copy `copy` of the engine on `devices` (on its engine thread; the model is fetched once)."""
    def build(engine_config: EngineConfig):  # noqa: ANN202 - runs on the engine thread
        from serving.engine.llm_engine import LLMEngine

        t0 = time.monotonic()
        path = _resolved_model()
        engine = LLMEngine(dataclasses.replace(engine_config, model=str(path) if path else None),
                           devices=devices, multiprocess=True if config.model_copies > 1 else None)
        logger.info("model %s ready in %.1f s (copy %d of %d on %s)",
                    path or "(embedded default SmolLM2-135M-Instruct)", time.monotonic() - t0,
                    copy, config.model_copies, ",".join(devices))
        return engine
    return build


_resolve_lock = threading.Lock()
_resolved: list = []


def _resolved_model():  # noqa: ANN202 - Path | None
    """Fetch the model (S3 / hub / local / default) once for every copy."""
    from serving.server.settings.model_fetch import resolve_model

    with _resolve_lock:
        if not _resolved:
            _resolved.append(resolve_model(config))
        return _resolved[0]


def _engine_client(config: ServingConfig) -> EngineClient:
    """One engine per model copy (max_workers, else GPUs / tensor-parallel degree): each in an engine
    core process that gunicorn's arbiter started and this frontend connects to (`option.engine_process`,
    the default for several copies: serving/server/cores.py), or an EngineLoop thread in this process;
    several copies behind a ReplicaSet."""
    if config.engine_process:
        from serving.server import cores

        assert cores.CURRENT is not None, \
            "option.engine_process: the engine cores are started by gunicorn's arbiter (container/gunicorn.conf.py)"
        loops = [EngineProcess(config.engine, address) for address in cores.CURRENT.addresses]
    else:
        loops = [EngineLoop(config.engine, engine_factory=_engine_factory(config, devices, c),
                            max_queue_size=config.job_queue_size)
                 for c, devices in enumerate(config.copy_devices())]
    if len(loops) == 1:
        return loops[0]
    return ReplicaSet(loops, affinity_tokens=ReplicaSet.AFFINITY_TOKENS if config.prefix_affinity else 0)


# gunicorn's arbiter halts the whole server, with this exit status, when a worker exits with it.
WORKER_BOOT_ERROR = 3


def _watch(served: ServedEngine) -> None:
    """Once the engine is dead. A start that failed (any copy, any cause: the model, an adapter, the
    loading deadline) stops the container: the error on one line, then this worker exits with
    gunicorn's boot-error status, on which the arbiter halts and `serve` exits non-zero, as vLLM and
    TGI do (SageMaker reports the failed deployment at once, Kubernetes restarts the pod, `docker run`
    ends). An engine that dies while serving ends this worker so gunicorn starts a fresh one, or,
    with SERVING_FAIL_FAST, takes the whole server down."""
    while served.state is not EngineState.DEAD:
        time.sleep(0.2)
    if served.inner.closing:
        return
    if not served.inner.was_ready or served.startup_error is not None:
        if config.engine_process and not _first_to_report_failed_start():
            return  # another frontend reported it: the arbiter halts and stops this one
        logger.critical("the model failed to load: %s", _one_line(served.error))
        _exit_worker(WORKER_BOOT_ERROR, linger=0.0)
    if config.fail_fast:
        logger.error("engine is dead (%s); fail_fast is on: stopping the server", _one_line(served.error))
        os.kill(os.getppid(), signal.SIGTERM)
        return
    logger.error("engine died while serving (%s); this worker exits so gunicorn starts a new one",
                 _one_line(served.error))
    _exit_worker(1, linger=1.0)  # let open streams write their final error records


def _first_to_report_failed_start() -> bool:
    from serving.server import cores

    return cores.CURRENT is None or cores.CURRENT.claim_failed_start()


def _one_line(error: BaseException | None) -> str:
    text = f"{type(error).__name__}: {error}" if error is not None else "unknown error"
    return " ".join(text.split())


def _exit_worker(status: int, linger: float) -> None:
    time.sleep(linger)
    closer = threading.Thread(target=stop, name="engine-close", daemon=True)
    closer.start()
    closer.join(5.0)
    logging.shutdown()
    os._exit(status)


def _setup_logging() -> None:
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(level=os.environ.get("LOG_LEVEL", "INFO").upper(),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")


_setup_logging()
config = config_from_env(os.environ)  # resolved by container/serve; parsed in the arbiter before fork (else here)
served = ServedEngine(_engine_client(config), config)
app = create_app(served, config)
_started = threading.Lock()


def start(frontend_slot: int | None = None) -> None:
    """Start the engine thread, or connect to the engine cores (idempotent); call after fork.
    `frontend_slot`: this worker's share of the server's admission count (several frontends)."""
    if not _started.acquire(blocking=False):
        return
    served.started_at = time.monotonic()
    if config.engine_process:
        _share_with_other_frontends(frontend_slot)
    if config.model_copies > 1 and not config.engine_process:
        import transformers  # noqa: F401 - its lazy module is not safe to import from the copies' threads at once
        from transformers import AutoConfig, AutoTokenizer  # noqa: F401
    served.inner.start()
    threading.Thread(target=_register_startup_adapters, args=(served,), name="adapters-at-start",
                     daemon=True).start()
    threading.Thread(target=_watch, args=(served,), name="engine-watch", daemon=True).start()


def _share_with_other_frontends(slot: int | None) -> None:
    """This worker is one of the frontends over the arbiter's engine cores: the queue bound, the
    adapter ids and the request counters are the server's (serving/server/cores.py)."""
    from serving.server import cores

    shared = cores.CURRENT
    assert shared is not None and slot is not None, "a frontend needs the arbiter's cores and its slot"
    app.extensions["admission"].share(shared.queue.attach(slot))
    app.extensions["adapters"].share(shared.next_adapter_id)
    app.extensions["metrics"].share(shared.queue.total, adapters=app.extensions["adapters"].names)


def _model_dir():  # noqa: ANN202 - Path | str | None
    """The resolved model dir (its `adapters/` are registered at start)."""
    if config.engine_process:
        loops = getattr(served.inner, "loops", [served.inner])
        return loops[0].model_dir
    return _resolved[0] if _resolved else None


def _register_startup_adapters(served: ServedEngine) -> None:
    """Once the model is loaded: register `<model dir>/adapters/<name>/` (LMI's start-up adapters),
    then let /ping answer 200. A failure is the start's failure (/ping 500 naming the adapter)."""
    try:
        if not served.inner.wait_ready(None):
            return
        app.extensions["adapters"].register_startup(_model_dir())
        _freeze_startup_objects()
        app.extensions["admission"].mark_ready()
    except BaseException as exc:  # noqa: BLE001 - the engine died while loading, or an adapter is bad
        if served.inner.state is not EngineState.DEAD:
            logger.error("%s", exc)
            served.startup_error = exc
    finally:
        served.startup_done.set()


def _freeze_startup_objects() -> None:
    """Put what the start built (imports, model, engine, kernels: a few hundred thousand objects
    that live as long as the process) out of the cyclic collector's reach, before /ping says 200.

    A full collection walks every tracked object while holding the GIL, so every stream stalls
    for it: on a 16 req/s 8B server they took 28-275 ms each (bench/RESULTS.md), the
    TTFT and inter-token p99. Frozen objects are still freed by reference counting; only cycles
    among them would stay, and this process never builds a second engine (it exits on SIGTERM).
    """
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    logger.info("start-up objects frozen out of the garbage collector's walks: %d (%.2f s)",
                gc.get_freeze_count(), time.perf_counter() - t0)


def stop() -> None:
    """Close the engine (aborts what is left); called when the worker exits."""
    if served.inner.started:
        served.inner.close(timeout=5.0)

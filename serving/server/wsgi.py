"""gunicorn's entry point (`serving.server.wsgi:app`): config -> EngineLoop -> Flask app, in the worker.

Importing this module builds the app but starts nothing: `start()` (called from gunicorn's
`post_worker_init`, i.e. after fork) starts the engine thread, which fetches the model (S3 /
hub / local / default) and loads it while `/ping` answers 503. `stop()` closes the engine on
worker exit. The configuration comes resolved from `container/serve` (`config_from_env`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
import time

from serving.server.app import create_app
from serving.config import ServingConfig, config_from_env
from serving.engine_config import EngineConfig
from serving.sampling_params import SamplingParams
from serving.engine.client import EngineClient
from serving.engine.engine_loop import EngineLoop, EngineState, RequestStream
from serving.engine.replicas import ReplicaSet

logger = logging.getLogger("serving.server.wsgi")


class ServedEngine:
    """The EngineLoop as the app sees it, plus the model-loading deadline of the container."""

    def __init__(self, loop: EngineClient, config: ServingConfig) -> None:
        self.loop = loop
        self.config = config
        self.started_at: float | None = None
        self.load_error: BaseException | None = None

    @property
    def state(self) -> EngineState:
        st = self.loop.state
        if st is EngineState.LOADING and self.started_at is not None and \
                time.monotonic() - self.started_at > self.config.model_loading_timeout:
            self.load_error = self.load_error or TimeoutError(
                f"the model did not load within option.model_loading_timeout={self.config.model_loading_timeout:g} s")
            return EngineState.DEAD
        return st

    @property
    def error(self) -> BaseException | None:
        return self.loop.error or self.load_error

    # The rest of the EngineClient interface, as the wrapped client has it.
    @property
    def was_ready(self) -> bool:
        return self.loop.was_ready

    @property
    def closing(self) -> bool:
        return self.loop.closing

    @property
    def tokenizer(self):  # noqa: ANN201 - HF tokenizer or None while loading
        return self.loop.tokenizer

    @property
    def max_model_len(self) -> int | None:
        return self.loop.max_model_len

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None
                    ) -> RequestStream:
        return self.loop.add_request(request_id, prompt, params)

    def stats(self) -> dict:
        return self.loop.stats()

    def start(self) -> EngineClient:
        return self.loop.start()

    def wait_ready(self, timeout: float | None = None) -> bool:
        return self.loop.wait_ready(timeout)

    def close(self, timeout: float | None = 30.0) -> None:
        self.loop.close(timeout)


def _engine_factory(config: ServingConfig, devices: tuple[str, ...], copy: int):  # noqa: ANN202
    """Builds copy `copy` of the engine on `devices` (on its engine thread; the model is fetched once)."""
    def build(engine_config: EngineConfig):  # noqa: ANN202 - runs on the engine thread
        from serving.engine.llm_engine import LLMEngine

        t0 = time.monotonic()
        path = _resolved_model()
        engine = LLMEngine(dataclasses.replace(engine_config, model=str(path) if path else None),
                           devices=devices, multiprocess=config.model_copies > 1)
        logger.info("model %s ready in %.1f s (copy %d of %d on %s)",
                    path or "(embedded default SmolLM2-135M-Instruct)", time.monotonic() - t0,
                    copy, config.model_copies, ",".join(devices))
        return engine
    return build


_resolve_lock = threading.Lock()
_resolved: list = []


def _resolved_model():  # noqa: ANN202 - Path | None
    """Fetch the model (S3 / hub / local / default) once for every copy."""
    from serving.model_source import resolve_model

    with _resolve_lock:
        if not _resolved:
            _resolved.append(resolve_model(config))
        return _resolved[0]


def _engine_client(config: ServingConfig) -> EngineClient:
    """One EngineLoop, or a ReplicaSet of one loop per model copy (GPUs / tensor-parallel degree)."""
    loops = [EngineLoop(config.engine, engine_factory=_engine_factory(config, devices, c),
                        max_queue_size=config.job_queue_size)
             for c, devices in enumerate(config.copy_devices())]
    return loops[0] if len(loops) == 1 else ReplicaSet(loops)


def _watch(served: ServedEngine) -> None:
    """Once the engine is dead: with SERVING_FAIL_FAST, take the whole server down (SageMaker
    restarts it); otherwise, if it had been serving, end this worker so gunicorn starts a fresh
    one (a model that never loaded stays dead: /ping answers 500 rather than reload forever)."""
    while served.state is not EngineState.DEAD:
        time.sleep(0.2)
    if config.fail_fast:
        logger.error("engine is dead (%s); fail_fast is on: stopping the server", served.error)
        os.kill(os.getppid(), signal.SIGTERM)
        return
    if not served.loop.was_ready or served.loop.closing:
        return
    logger.error("engine died while serving (%s); this worker exits so gunicorn starts a new one", served.error)
    time.sleep(1.0)  # let open streams write their final error records
    closer = threading.Thread(target=stop, name="engine-close", daemon=True)
    closer.start()
    closer.join(5.0)
    logging.shutdown()
    os._exit(1)


def _setup_logging() -> None:
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(level=os.environ.get("LOG_LEVEL", "INFO").upper(),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")


_setup_logging()
config = config_from_env(os.environ)  # resolved once, by container/serve (else here)
engine_loop = ServedEngine(_engine_client(config), config)
app = create_app(engine_loop, config)
_started = threading.Lock()


def start() -> None:
    """Start the engine thread (idempotent); call after fork."""
    if not _started.acquire(blocking=False):
        return
    engine_loop.started_at = time.monotonic()
    engine_loop.loop.start()
    threading.Thread(target=_watch, args=(engine_loop,), name="engine-watch", daemon=True).start()


def stop() -> None:
    """Close the engine (aborts what is left); called when the worker exits."""
    if engine_loop.loop.started:
        engine_loop.loop.close(timeout=5.0)

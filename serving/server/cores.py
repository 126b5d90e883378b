"""`ServerCores`: the model copies' engine cores and what every HTTP frontend shares, owned by gunicorn's arbiter.

Why the arbiter: the cores must be started once, before and independently of the HTTP workers
(frontends), and outlive a worker's restart; every frontend is a client of every core
(serving/engine/engine_process.py). container/gunicorn.conf.py calls `start` in `on_starting`
(before any worker is forked), `assign_slot` in `pre_fork`, `frontend_exited` in `child_exit` and
`stop` in `on_exit`. What is created here before the fork is inherited by every worker: the cores'
addresses (AF_UNIX sockets in a private 0700 temp dir, one random key), the shared admission counter
(`SharedQueue`, so `job_queue_size` bounds the whole server), the adapter id counter (ids are unique
whichever frontend registers), and prometheus_client's multiprocess directory (a scrape of any
frontend sums every frontend's request counters).

The arbiter imports no torch or CUDA: the cores are spawned (not forked) from a thread of the
arbiter's that lives as long as it does (their parent-death signal follows that thread), which
first fetches the model once (S3 / hub / local / GGUF) for every copy, in a spawned process. A model that cannot be fetched is
handed to the cores as their load error: the frontends hear it and stop the server ("the model
failed to load: ...", exit 3). A core that exits while the server runs (its engine died while
serving, or it was killed) is started again at once; the frontends that used it exit on its death
and gunicorn's new ones connect to the new core (serving/server/wsgi.py `_watch`: the same policy
as one engine). `stop` leaves no process and no socket file behind.
"""

from __future__ import annotations

import atexit
import dataclasses
import importlib
import logging
import multiprocessing as mp
import os
import shutil
import tempfile
import threading
from concurrent.futures import ProcessPoolExecutor

from serving.server.settings.serving_config import ServingConfig, resolved_to_env
from serving.engine.engine_process import CoreAddress, EngineCore
from serving.server.shared_queue import SharedQueue

logger = logging.getLogger("serving.server.cores")

METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's multiprocess mode reads it at import
_WATCH_S = 0.25  # how often the arbiter's core thread looks for a core that exited

_THREAD_IMPORTS = ("concurrent.futures.process", "multiprocessing.connection", "multiprocessing.popen_spawn_posix",
                   "multiprocessing.queues", "multiprocessing.reduction", "multiprocessing.resource_tracker",
                   "multiprocessing.spawn", "multiprocessing.synchronize", "multiprocessing.util")

CURRENT: ServerCores | None = None  # set in the arbiter by `start`; the workers inherit it by fork


class ServerCores:
    """The cores of one server run and the state its frontends share (see the module docstring)."""

    def __init__(self, config: ServingConfig) -> None:
        self.config = config
        self.dir = tempfile.mkdtemp(prefix="open-lmi-cores-")  # 0700: only this user reaches the sockets
        authkey = os.urandom(32)
        self.addresses = [CoreAddress(os.path.join(self.dir, f"core{i}.sock"), authkey)
                          for i in range(config.model_copies)]
        self.cores = [EngineCore(config.engine, address, devices, config.job_queue_size)
                      for address, devices in zip(self.addresses, config.copy_devices())]
        self.queue = SharedQueue(2 * config.frontends, config.frontends)  # a replaced worker's slot may linger
        self._adapter_ids = mp.get_context("fork").Value("q", 0)
        self._boot_error = mp.get_context("fork").Value("b", 0)  # a frontend reported the failed start
        self.metrics_dir = os.path.join(self.dir, "metrics")
        os.mkdir(self.metrics_dir)
        self.restarts = 0
        self._owner = os.getpid()
        self._lock = threading.Lock()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="engine-cores", daemon=True)

    def next_adapter_id(self) -> int:
        """A LoRA int id no frontend has used in this server run."""
        with self._adapter_ids.get_lock():
            self._adapter_ids.value += 1
            return int(self._adapter_ids.value)

    def claim_failed_start(self) -> bool:
        """True for the first frontend that reports a failed start (it logs the reason and exits
        with gunicorn's boot-error status): one line, and one exit gunicorn's arbiter halts on (a
        second such exit while it halts would escape its handler)."""
        with self._boot_error.get_lock():
            first = not self._boot_error.value
            self._boot_error.value = 1
            return first

    def _run(self) -> None:
        """Fetch the model once, spawn every core, then start again any core that exits."""
        load_error = None
        model = None
        try:
            with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
                model = pool.submit(_fetch_model, resolved_to_env(self.config)).result()
        except BaseException as exc:  # noqa: BLE001 - a failed fetch is the cores' load error
            logger.exception("the model could not be fetched")
            load_error = " ".join(f"{type(exc).__name__}: {exc}".split())
        engine = dataclasses.replace(self.config.engine, model=str(model) if model else None)
        with self._lock:
            for core in self.cores:
                if self._stopping:
                    return
                core.config = engine
                core.start(load_error)
            logger.info("%d engine core(s) started (pids %s), model %s", len(self.cores),
                        ",".join(str(core.proc.pid) for core in self.cores), model or "(embedded default)")
        while True:
            threading.Event().wait(_WATCH_S)
            with self._lock:
                if self._stopping:
                    return
                for index, core in enumerate(self.cores):
                    if core.exited:
                        logger.error("engine core %d (pid %s) exited: starting a fresh one", index, core.proc.pid)
                        self.restarts += 1
                        core.start(load_error)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop every core (SIGTERM, then SIGKILL), then remove the sockets and the shared files."""
        if os.getpid() != self._owner:
            return  # a forked worker's copy
        with self._lock:
            self._stopping = True
        stoppers = [threading.Thread(target=core.stop, args=(timeout,), daemon=True) for core in self.cores]
        for t in stoppers:
            t.start()
        for t in stoppers:
            t.join(timeout + 10.0)
        shutil.rmtree(self.dir, ignore_errors=True)


def _fetch_model(resolved: str) -> str | None:
    """In a spawned process: fetch the model once for every copy (S3 / hub / local / GGUF, whose
    conversion imports torch, which the arbiter must not)."""
    from serving.server.settings.serving_config import RESOLVED_ENV, config_from_env
    from serving.server.settings.model_fetch import resolve_model

    path = resolve_model(config_from_env({RESOLVED_ENV: resolved}))
    return str(path) if path else None


def start(config: ServingConfig) -> ServerCores:
    """In the arbiter, before any worker: create the shared state and start the cores (see module doc)."""
    global CURRENT
    assert CURRENT is None, "the engine cores are started once"
    # What the core thread imports, imported here first: gunicorn forks the workers while that thread
    # runs, and a worker forked in the middle of an import keeps a half-initialized module (seen:
    # `multiprocessing.resource_tracker`, which torch then failed to import in the worker).
    for module in _THREAD_IMPORTS:
        importlib.import_module(module)
    cores = ServerCores(config)
    os.environ[METRICS_DIR_ENV] = cores.metrics_dir
    # The worker class brought prometheus_client into the arbiter already: choose its value class
    # again, now that the directory is set (metrics built later in the workers read this name).
    from prometheus_client import values

    values.ValueClass = values.get_value_class()
    cores._thread.start()
    CURRENT = cores
    atexit.register(cores.stop)  # an arbiter that ends without `on_exit` (an error) still stops them
    return cores


def assign_slot(server: object, worker: object) -> None:
    """In the arbiter's `pre_fork`: give the new worker the lowest admission slot no live worker holds."""
    if CURRENT is None:
        return
    taken = {getattr(w, "frontend_slot", None) for w in list(server.WORKERS.values())}  # type: ignore[attr-defined]
    worker.frontend_slot = CURRENT.queue.free_slot(taken)  # type: ignore[attr-defined]


def frontend_exited(worker: object) -> None:
    """In the arbiter's `child_exit`: the worker's admitted requests died with it."""
    slot = getattr(worker, "frontend_slot", None)
    if CURRENT is not None and slot is not None:
        CURRENT.queue.reset(slot)


def forget_cores_in_worker() -> None:
    """In a new worker (gunicorn's `post_fork`): the core processes are the arbiter's children, not
    this fork's (multiprocessing would try to join them when the worker exits)."""
    import multiprocessing.process

    multiprocessing.process._children.clear()  # type: ignore[attr-defined]


def stop() -> None:
    """In the arbiter's `on_exit`: stop the cores, remove what they left."""
    if CURRENT is not None:
        CURRENT.stop()

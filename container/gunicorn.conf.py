"""gunicorn settings for the LMI container (read by `container/serve`).

`gthread` workers (`serving/server/worker.py`: requests are read whole before they take a thread,
gunicorn's own errors are JSON, SIGTERM ends open requests with a final record before
`graceful_timeout`); every open stream holds a thread. Two ways to hold the engine:

- one copy, `option.engine_process=false` (the default for one copy): one worker, the engine on its
  own OS thread started *after* fork (`post_worker_init`), because CUDA does not survive fork;
- `option.engine_process=true` (the default for several copies): the arbiter starts one engine core
  process per model copy before any worker (`on_starting`, serving/server/cores.py; spawned, so the
  arbiter itself never imports torch) and `option.frontends` workers each connect to every core; a
  worker that exits is replaced and reconnects, the cores stay; they stop in `on_exit`.

Never `preload_app`, never gevent (its hub starves /ping under load).
"""

import os

from serving.server.settings.serving_config import config_from_env

_config = config_from_env(os.environ)  # resolved by container/serve; parsed here, once: the worker forks from us

bind = f"0.0.0.0:{_config.port}"
workers = _config.frontends  # 1 unless the engine runs in cores of its own (serving/server/settings/serving_config.py auto_frontends)
worker_class = "serving.server.worker.LMIWorker"
threads = _config.gunicorn_threads
worker_connections = threads + 4096  # a connection whose request is still arriving holds no thread
preload_app = False
# Worker heartbeat: the worker beats from a thread of its own (serving/server/worker.py) while its
# main loop runs, so only a stopped, frozen or GIL-stuck process (or a main loop stuck for 120 s)
# goes this long without one; the arbiter then replaces it, and meanwhile answers 503 itself
# (serving/server/health_guard.py, started in `when_ready`).
timeout = 15
graceful_timeout = int(_config.graceful_timeout)  # SageMaker sends SIGKILL 30 s after SIGTERM
keepalive = 75
backlog = 2048
accesslog = "-" if os.environ.get("SERVING_ACCESS_LOG", "").lower() == "true" else None
errorlog = "-"
loglevel = os.environ.get("LOG_LEVEL", "info").lower()
limit_request_line = 8190
control_socket_disable = True  # several servers may run on one host (tests); nothing uses it


def post_worker_init(worker):  # noqa: ANN001, ANN201 - gunicorn hook
    """Wire the worker to the app (body limit, SIGTERM drain), then start model download/loading on
    the engine thread, now that we are in the worker."""
    from serving.server import wsgi

    worker.configure(max_body_size=wsgi.config.max_request_size,
                     on_drain=wsgi.app.extensions["runner"].begin_drain,
                     admission=wsgi.app.extensions["admission"], write_timeout=wsgi.config.write_timeout)
    wsgi.start(getattr(worker, "frontend_slot", None))


def on_starting(server):  # noqa: ANN001, ANN201 - gunicorn hook, in the arbiter before any worker
    """Start the engine cores and the state the frontends share (option.engine_process)."""
    if _config.engine_process:
        from serving.server import cores

        cores.start(_config)


def pre_fork(server, worker):  # noqa: ANN001, ANN201 - in the arbiter
    if _config.engine_process:
        from serving.server import cores

        cores.assign_slot(server, worker)


def post_fork(server, worker):  # noqa: ANN001, ANN201 - in the new worker
    if _config.engine_process:
        from serving.server import cores

        cores.forget_cores_in_worker()


def child_exit(server, worker):  # noqa: ANN001, ANN201 - in the arbiter, a worker exited
    if _config.engine_process:
        from serving.server import cores

        cores.frontend_exited(worker)


def on_exit(server):  # noqa: ANN001, ANN201 - in the arbiter, the workers are gone
    if _config.engine_process:
        from serving.server import cores

        cores.stop()


def when_ready(server):  # noqa: ANN001, ANN201 - gunicorn hook, runs in the arbiter
    """Answer 503 for the worker whenever it stops beating (stopped, frozen, being replaced)."""
    from serving.server.health_guard import HealthGuard

    server.health_guard = HealthGuard(server).start()


def worker_int(worker):  # noqa: ANN001, ANN201
    from serving.server import wsgi

    wsgi.stop()


def worker_exit(server, worker):  # noqa: ANN001, ANN201
    from serving.server import wsgi

    wsgi.stop()

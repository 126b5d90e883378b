"""gunicorn settings for the LMI container (read by `container/serve`).

One `gthread` worker (`serving/server/worker.py`: requests are read whole before they take a
thread, gunicorn's own errors are JSON, SIGTERM ends open requests with a final record before
`graceful_timeout`): a single process owns the accelerator, every open stream holds a thread, and
the engine runs on its own OS thread started *after* fork (`post_worker_init`), because CUDA does
not survive fork. Never `preload_app`, never gevent (its hub starves /ping under load).
"""

import os

from serving.server.settings.config import config_from_env

_config = config_from_env(os.environ)  # resolved by container/serve; parsed here, once: the worker forks from us

bind = f"0.0.0.0:{_config.port}"
workers = 1
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
    wsgi.start()


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

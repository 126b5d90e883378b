"""The HTTP worker takes every connection waiting in the listen backlog per poller wake-up.

gunicorn's gthread worker accepts one connection per wake-up of its poller; under load (many streaming
threads holding the GIL) an overloaded server then accepted about as fast as it served, and the excess
waited unread in the kernel's backlog where the queue bound never saw it (bench/RESULTS.md run 27).
"""

from __future__ import annotations

import socket
import types

from serving.server.worker import LMIWorker


def _worker(limit: int) -> types.SimpleNamespace:
    taken: list = []
    return types.SimpleNamespace(nr_conns=0, worker_connections=limit, cfg=None, taken=taken,
                                 enqueue_req=taken.append)


def _listener_with(n: int) -> tuple[socket.socket, list[socket.socket]]:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    listener.setblocking(False)
    clients = [socket.create_connection(listener.getsockname()) for _ in range(n)]
    return listener, clients


def test_one_wake_up_takes_the_whole_backlog_then_stops_at_eagain() -> None:
    listener, clients = _listener_with(7)
    worker = _worker(limit=100)
    try:
        LMIWorker.accept(worker, listener)
        assert worker.nr_conns == 7 and len(worker.taken) == 7
        LMIWorker.accept(worker, listener)  # nothing waiting: returns at once
        assert worker.nr_conns == 7
    finally:
        for c in clients + [t.sock for t in worker.taken] + [listener]:
            c.close()


def test_the_connection_limit_still_holds() -> None:
    listener, clients = _listener_with(5)
    worker = _worker(limit=3)
    try:
        LMIWorker.accept(worker, listener)
        assert worker.nr_conns == 3 and len(worker.taken) == 3  # the other two wait in the backlog
    finally:
        for c in clients + [t.sock for t in worker.taken] + [listener]:
            c.close()

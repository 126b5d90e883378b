"""Answer for a worker that cannot: gunicorn's arbiter says 503 while its worker is stopped or hung.

The one gunicorn worker (serving/server/worker.py) touches its heartbeat file every
HEARTBEAT_S from a thread of its own. A worker that is stopped (SIGSTOP), frozen or stuck holding
the GIL accepts nothing, so without this a health check would wait in the listen backlog until the
arbiter replaced the worker. `HealthGuard` is a thread in the arbiter (started by
container/gunicorn.conf.py's `when_ready`) that, whenever no worker touched its heartbeat within
STALE_S (or none is left), accepts the connections waiting on the
listening sockets itself and answers each `503 {"error", "code"}` with `Connection: close`:
/ping says "unhealthy" within STALE_S + POLL_S (about 1.6 s) instead of hanging, and other requests
get a retryable 503 instead of a timeout. The arbiter's own `timeout` (gunicorn.conf.py) then
replaces the worker. While a worker beats, this never touches a socket (with several frontends,
while any of them beats: the others accept the connections a stopped one would have taken).

It imports nothing of the app: the arbiter must stay free of torch and the engine.
"""

from __future__ import annotations

import json
import select
import socket
import threading
import time

HEARTBEAT_S = 0.25  # how often a live worker touches its heartbeat file
STALE_S = 1.5  # a heartbeat older than this: the worker is not answering
POLL_S = 0.1  # how often the guard looks
_READ_S = 0.5  # how long it waits for a request head before answering anyway


def _answer(message: str) -> bytes:
    body = json.dumps({"error": message, "code": 503}).encode()
    return (b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nContent-Type: application/json\r\n"
            b"Retry-After: 5\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


class HealthGuard:
    """The arbiter-side responder (see the module doc). `arbiter`: gunicorn's Arbiter."""

    def __init__(self, arbiter: object) -> None:
        self.arbiter = arbiter
        self.answered = 0
        self._thread = threading.Thread(target=self._run, name="health-guard", daemon=True)

    def start(self) -> HealthGuard:
        self._thread.start()
        return self

    def why_unhealthy(self, now: float) -> str | None:
        """Why no worker can answer now, or None while one beats."""
        try:
            workers = list(self.arbiter.WORKERS.values())  # type: ignore[attr-defined]
        except RuntimeError:  # changed while copied: look again next time
            return None
        if not workers:
            return "no worker process is running; one is being started"
        ages = []
        for worker in workers:
            try:
                ages.append(now - worker.tmp.last_update())  # gunicorn writes time.monotonic() as mtime
            except (OSError, ValueError):
                continue
        if not ages or min(ages) <= STALE_S:  # (a worker that never beat has a wall-clock mtime: < 0)
            return None
        return (f"the worker process has not answered for {min(ages):.1f} s (stopped or hung); "
                "it is being replaced")

    def _run(self) -> None:
        while True:
            time.sleep(POLL_S)
            why = self.why_unhealthy(time.monotonic())
            if why is None:
                continue
            listeners = [lnr for lnr in list(self.arbiter.LISTENERS) if lnr.fileno() >= 0]  # type: ignore[attr-defined]
            try:
                ready, _, _ = select.select(listeners, [], [], POLL_S)
            except (OSError, ValueError):  # closed meanwhile (shutdown)
                continue
            for lnr in ready:
                self._serve_one(lnr, why)

    def _serve_one(self, listener: object, why: str) -> None:
        try:
            conn, _ = listener.accept()  # type: ignore[attr-defined]
        except (BlockingIOError, InterruptedError, OSError):  # the worker (or nobody) took it
            return
        with conn:
            try:
                conn.settimeout(_READ_S)
                deadline = time.monotonic() + _READ_S
                head = b""
                while b"\r\n\r\n" not in head and len(head) < 65536 and time.monotonic() < deadline:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    head += chunk
                conn.sendall(_answer(why))
                conn.shutdown(socket.SHUT_WR)
                self.answered += 1
            except OSError:
                pass

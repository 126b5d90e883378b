"""What the poller thread answers before a request takes a thread: `/ping` and `/health`, and the full queue's 503.

Why here and not in a Flask route: every open stream holds one of gunicorn's threads, and a
request that finds them all busy waits in the thread pool's queue, which nothing counts and
nothing bounds. On one 8B copy offered 256 req/s, all 2,560 requests were taken in (none got
LMI's 503) and `/ping` waited behind them for up to 31 s: past SageMaker's 2 s health-check
timeout, at peak load. `serving/server/worker.py` reads each request whole on its poller thread
and asks `Admission.decide` what to do with it before it is handed to the pool:

- `GET /ping` and `GET /health` (and `HEAD`) are answered there and then from the engine's state,
  never queued;
- a `POST` (every inference and management call) counts against `job_queue_size` from the
  moment it is read until its response is finished (`release`); one past the bound is answered
  503 at once (LMI's `Worker queue capacity exceeded`, with `Retry-After`), before it holds a
  thread, a socket read or an engine slot. Nothing admitted is dropped: it runs to its final record.

`Retry-After` is the expected wait for one admitted request to finish: the recent mean request
duration divided by the requests in flight (a full queue frees a slot that often), rounded up
to whole seconds (the header's unit), so 1 s on a busy server and more only when few long
requests fill a small queue.

With several frontends (gunicorn workers over shared engine cores, serving/server/cores.py) the bound
is the server's: `share(queue)` makes every decision count the requests all frontends admitted
(`serving/server/shared_queue.py`, shared memory created by the arbiter before it forks them).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus

from serving.server.shared_queue import SharedQueue

_PING_PATHS = (b"/ping",)
_HEALTH_PATHS = (b"/health",)  # vLLM's and TGI's: 200 and an empty body when healthy
_EWMA = 0.05  # weight of one finished request in the mean duration
_MAX_RETRY_AFTER_S = 60


@dataclass(frozen=True, slots=True)
class Health:
    """The engine's health as `/ping` answers it (status code and JSON body)."""

    status: int
    body: dict


@dataclass(frozen=True, slots=True)
class Decision:
    """What the poller does with one request: `answer` now (bytes of a whole response) or dispatch
    it to a thread; `admitted` says it counts against the queue until `Admission.release`."""

    answer: bytes | None = None
    admitted: bool = False
    close: bool = False  # after `answer`, close the connection (else read the next request)


def health_answer(health: Health) -> tuple[int, bytes]:
    """`/health` as vLLM and TGI answer it: 200 with an empty body when healthy; otherwise the
    status `/ping` has (503 loading, 500 dead) and its JSON body saying why."""
    if health.status == 200:
        return 200, b""
    return health.status, json.dumps(health.body).encode()


class Admission:
    """The queue bound and the `/ping` fast path (see the module docstring).

    Args:
        limit: requests admitted at once (`job_queue_size`).
        health: the engine's health now (called on the poller thread: must not block).
        reject_body: the 503's body for a request path (LMI's or OpenAI's error object).
        on_reject: called with (method, path) for each 503 (metrics).
    """

    def __init__(self, limit: int, health: Callable[[], Health], reject_body: Callable[[str, str], dict],
                 on_reject: Callable[[str, str], None] | None = None) -> None:
        assert limit >= 1, limit
        self.limit = limit
        self._health = health
        self._reject_body = reject_body
        self._on_reject = on_reject
        self.in_flight = 0  # admitted by this process and not finished (touched on the poller thread only)
        self._mean_s = 1.0  # recent mean duration of an admitted request
        self._shared: SharedQueue | None = None  # every frontend's admitted requests (several frontends)

    def share(self, shared: SharedQueue) -> None:
        """Count the bound over every frontend from now on (`shared` has this process's slot)."""
        assert self.in_flight == 0, "share the queue before admitting requests"
        self._shared = shared

    @property
    def total_in_flight(self) -> int:
        """Requests admitted and not finished: by every frontend when the queue is shared."""
        return self._shared.total() if self._shared is not None else self.in_flight

    def decide(self, head: bytes) -> Decision:
        """The decision for a request whose head (request line and headers) is `head`."""
        method, path, version = _request_line(head)
        if method in (b"GET", b"HEAD") and (path in _PING_PATHS or path in _HEALTH_PATHS):
            keep = version == b"HTTP/1.1" and not _asks_close(head)
            health = self._health()
            if health.status == 200 and self._shared is not None and not self._shared.started:
                health = Health(503, {"status": "Loading"})  # another frontend is still starting
            status, body = (health.status, json.dumps(health.body).encode()) if path in _PING_PATHS \
                else health_answer(health)
            return Decision(answer=_response(status, body, keep, send_body=method == b"GET", version=version),
                            close=not keep)
        if method != b"POST":
            return Decision()
        if not self._admit():
            text_path = path.decode("latin-1")
            if self._on_reject is not None:
                self._on_reject(method.decode("latin-1"), text_path)
            body = json.dumps(self._reject_body(text_path, f"Worker queue capacity exceeded ({self.limit} requests); "
                                                           "send it again later")).encode()
            return Decision(answer=_response(503, body, False, retry_after=self.retry_after()), close=True)
        self.in_flight += 1
        return Decision(admitted=True)

    def _admit(self) -> bool:
        if self._shared is not None:
            return self._shared.try_acquire(self.limit)
        return self.in_flight < self.limit

    def mark_ready(self) -> None:
        """This frontend's engine clients are ready (several frontends: `/ping` waits for all of them)."""
        if self._shared is not None:
            self._shared.mark_ready()

    def release(self, duration_s: float) -> None:
        """An admitted request's response is finished (or failed) after `duration_s`."""
        assert self.in_flight > 0, "released more requests than were admitted"
        self.in_flight -= 1
        if self._shared is not None:
            self._shared.release()
        self._mean_s += _EWMA * (max(duration_s, 0.0) - self._mean_s)

    def retry_after(self) -> int:
        """Whole seconds until one admitted request is expected to finish (at least 1)."""
        return max(1, min(_MAX_RETRY_AFTER_S, math.ceil(self._mean_s / max(self.total_in_flight, 1))))


def _request_line(head: bytes) -> tuple[bytes, bytes, bytes]:
    line = head.split(b"\r\n", 1)[0].split(b"\n", 1)[0]
    parts = line.split(b" ")
    if len(parts) != 3:
        return b"", b"", b""
    method, target, version = parts
    return method, target.split(b"?", 1)[0], version


def _asks_close(head: bytes) -> bool:
    for line in head.split(b"\n")[1:]:
        name, sep, value = line.partition(b":")
        if sep and name.strip().lower() == b"connection" and b"close" in value.lower():
            return True
    return False


def _response(status: int, body: bytes, keep_alive: bool, retry_after: int | None = None,
              send_body: bool = True, version: bytes = b"HTTP/1.1") -> bytes:
    """A whole response with a JSON body (a HEAD's answer: its headers only), in the request's
    HTTP version (1.0 or 1.1)."""
    try:
        reason = HTTPStatus(status).phrase
    except ValueError:
        reason = "Error"
    head = [f"{'HTTP/1.0' if version == b'HTTP/1.0' else 'HTTP/1.1'} {status} {reason}", "Content-Type: application/json",
            f"Content-Length: {len(body)}",
            "Cache-Control: no-cache, no-store, must-revalidate, private",
            "Connection: keep-alive" if keep_alive else "Connection: close"]
    if retry_after is not None:
        head.append(f"Retry-After: {retry_after}")
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + (body if send_body else b"")

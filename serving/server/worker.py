"""The container's gunicorn worker: gthread, hardened so that no single client can hurt the others.

- Requests are read on the poller thread (serving/server/request_reader.py) and handed to a thread
  only once the head and the whole body are there, so connections that trickle bytes or stall
  mid-body hold no thread and `/ping` (SageMaker's health signal) keeps answering; past their
  deadlines they are answered 408 and closed.
- Before a request takes a thread, `serving/server/admission.py` decides on it: `/ping` is answered
  on the poller thread from the engine's state (never queued behind streams), and a request past
  `job_queue_size` admitted ones gets LMI's 503 at once.
- A thread never waits on its client for long: a response write (a stream's next record) or a
  read that makes no progress for `write_timeout` s fails (SO_SNDTIMEO / SO_RCVTIMEO; a client
  that stopped reading while the send buffer still absorbs the writes is noticed by
  serving/server/write_stall.py), the response is cut and closed, and closing its body iterator
  aborts the request in the engine (its KV blocks are freed): a client that stops reading holds
  no thread, queue slot or KV.
- Its heartbeat (gunicorn's tmp file) is touched every HEARTBEAT_S by a thread of its own while
  the main loop has run within _LOOP_STALL_S: the arbiter's short `timeout` then catches a stopped
  or frozen process in seconds, and serving/server/health_guard.py (in the arbiter) answers 503
  meanwhile.
- gunicorn's own error answers (400 bad request, 414, 431, 501, ...) are the container's JSON
  `{"error", "code"}`, not HTML.
- SIGTERM: `on_drain(deadline)` is called so every open request ends with a final record before
  gunicorn's graceful_timeout runs out, and once the worker stops accepting, its listening sockets
  are closed (the arbiter closed its copies already): new connections are refused at once instead
  of waiting in the backlog until the process exits; idle kept-alive connections are closed after
  gunicorn's short linger, so they do not hold the exit until graceful_timeout.
"""

from __future__ import annotations

import errno
import resource
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable
from functools import partial
from http import HTTPStatus

from gunicorn import util
from gunicorn.workers.gthread import ThreadWorker

from serving.server.admission import Admission, Decision
from serving.server.health_guard import HEARTBEAT_S
from serving.server.request_reader import RequestReader
from serving.server.request_runner import HTTPError

_SWEEP_S = 0.25  # how often the read deadlines are checked
_LOOP_STALL_S = 120.0  # the heartbeat stops once the main loop has not run for this long (stuck)
_DRAIN_MARGIN_S = 3.0  # time left after the drain deadline for final records and the exit
_MAX_MESSAGE = 300  # characters of an error message (gunicorn's quote the request line)
# Sent when a head asks for it and its body is still to come (gunicorn sends its own once the body
# is read: clients take any number of 1xx answers, RFC 9110 15.2).
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


def drain_seconds(graceful_timeout: float) -> float:
    """How long open requests may run after SIGTERM: gunicorn's graceful_timeout less a margin
    (3 s, or a third of a shorter timeout) to write their final records and exit in time."""
    return graceful_timeout - min(_DRAIN_MARGIN_S, graceful_timeout / 3)


def error_response(status: int, message: str) -> bytes:
    """A whole `Connection: close` answer with the container's JSON error body."""
    if len(message) > _MAX_MESSAGE:
        message = message[:_MAX_MESSAGE] + "..."
    body = HTTPError(status, message).body()
    try:
        reason = HTTPStatus(status).phrase
    except ValueError:
        reason = "Error"
    head = (f"HTTP/1.1 {status} {reason}\r\nConnection: close\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n")
    return head.encode("latin-1") + body


def _write_json_error(sock, status_int: int, reason: str, mesg: str) -> None:  # noqa: ANN001
    """gunicorn's `util.write_error` (same signature), answering in JSON instead of HTML."""
    util.write_nonblock(sock, error_response(status_int, mesg or reason))


def _close_now(sock: socket.socket) -> None:
    """Close after a last response without blocking the poller thread, where gunicorn waits up to
    2 s for the client's EOF: FIN after the response, drop what the client sent meanwhile, close."""
    try:
        sock.shutdown(socket.SHUT_WR)
        sock.setblocking(False)
        for _ in range(16):  # at most 1 MB: a client that keeps sending is reset
            if not sock.recv(65536):
                break
    except OSError:  # nothing pending (BlockingIOError), or already gone
        pass
    finally:
        sock.close()


def _raise_fd_limit(want: int) -> None:
    """Every open connection is a descriptor: lift the soft limit towards `want` (up to the hard one)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want if hard == resource.RLIM_INFINITY else min(want, hard), hard))


class LMIWorker(ThreadWorker):
    """gunicorn's gthread worker that reads whole requests before taking a thread (see module doc)."""

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003 - gunicorn's signature
        super().__init__(*args, **kwargs)
        self.max_body_size = 6 * 1024 * 1024
        self.on_drain: Callable[[float], None] | None = None
        self.admission: Admission | None = None
        self.write_timeout = 30.0
        self._loop_ran = time.monotonic()
        self._readers: dict[object, RequestReader] = {}  # connection -> its request so far
        self._buffered = 0  # bytes held by all readers
        self._next_sweep = 0.0
        self._listeners_closed = False
        cfg = self.cfg
        # Past this a head is rejected by gunicorn's parser whatever follows (its own arithmetic).
        self._max_head = (cfg.limit_request_line or 8190) + \
            (cfg.limit_request_fields or 100) * ((cfg.limit_request_field_size or 8190) + 2) + 8
        # TLS and HTTP/2 prior knowledge read the socket themselves: those keep gunicorn's path.
        self._preread = not cfg.is_ssl and cfg.http2_cleartext == "off"

    def configure(self, *, max_body_size: int, on_drain: Callable[[float], None] | None,
                  admission: Admission | None = None, write_timeout: float = 30.0) -> None:
        """Set the body size limit (bodies are buffered up to it), the SIGTERM drain callback
        (called from the signal handler with the deadline, in time.monotonic()), the admission
        rules (`/ping` and the queue bound, decided here before a request takes a thread) and the
        longest a thread waits on its client (`write_timeout`, seconds)."""
        self.max_body_size = max_body_size
        self.on_drain = on_drain
        self.admission = admission
        self.write_timeout = write_timeout

    def init_process(self) -> None:
        util.write_error = _write_json_error  # the one writer of gunicorn's own error answers
        _raise_fd_limit(self.cfg.worker_connections + 256)
        self._loop_ran = time.monotonic()
        threading.Thread(target=self._beat, name="heartbeat", daemon=True).start()
        super().init_process()

    # ---- heartbeat ------------------------------------------------------------------------------
    def notify(self) -> None:
        """gunicorn's main loop calls this every turn: note that it ran."""
        self._loop_ran = time.monotonic()
        super().notify()

    def _beat(self) -> None:
        """Touch the heartbeat while the main loop runs (loading the app included): what stops it
        is the process stopping, freezing or holding the GIL, or the loop stuck for _LOOP_STALL_S."""
        while True:
            time.sleep(HEARTBEAT_S)
            if time.monotonic() - self._loop_ran < _LOOP_STALL_S:
                try:
                    self.tmp.notify()
                except (OSError, ValueError):  # closed: the worker is exiting
                    return

    # ---- SIGTERM --------------------------------------------------------------------------------
    def handle_exit(self, sig, frame) -> None:  # noqa: ANN001
        if self.alive and self.on_drain is not None:
            self.on_drain(time.monotonic() + drain_seconds(self.cfg.graceful_timeout))
        super().handle_exit(sig, frame)

    def set_accept_enabled(self, enabled: bool) -> None:
        super().set_accept_enabled(enabled)
        if enabled or self.alive or self._listeners_closed:
            return
        self._listeners_closed = True
        for listener in self.sockets:
            listener.close()
        self.log.info("stopping: new connections are refused; open requests end within %.1f s of SIGTERM",
                      drain_seconds(self.cfg.graceful_timeout))

    def _cap_keepalive(self, deadline: float) -> None:
        # Stopping: gunicorn closes its kept-alive connections by `deadline` (a short linger); ours wait
        # for their next request in `_readers` (read on the poller), so they are capped too: one idle
        # kept-alive client (a connection pool) held every stop for the whole graceful_timeout.
        super()._cap_keepalive(deadline)
        for reader in self._readers.values():
            if reader.phase == "idle":
                reader.deadline = min(reader.deadline, deadline)

    def _keepalive_after(self, conn, keepalive: bool) -> bool:  # noqa: ANN001
        # Stopping: a connection closes after its response, so the worker exits as soon as the last
        # request is done rather than lingering on kept-alive connections past the drain.
        return super()._keepalive_after(conn, keepalive and self.alive)

    def finish_request(self, conn, fs) -> None:  # noqa: ANN001 - runs on the poller thread
        admitted_at = getattr(conn, "admitted_at", None)
        if admitted_at is not None:
            conn.admitted_at = None
            self.admission.release(time.monotonic() - admitted_at)
        if fs.cancelled() or fs.exception() is not None or fs.result():
            super().finish_request(conn, fs)  # kept alive, or failed: gunicorn's way
            return
        self.nr_conns -= 1
        _close_now(conn.sock)

    # ---- reading requests on the poller ---------------------------------------------------------
    def enqueue_req(self, conn) -> None:  # noqa: ANN001 - gthread.TConn
        parser = conn.parser
        if not self._preread or (parser is not None and parser.unreader.buf.getvalue()):
            super().enqueue_req(conn)  # gunicorn holds the next request's bytes already (pipelining)
            return
        conn.sock.setblocking(False)
        self._readers[conn] = RequestReader(time.monotonic() + self.cfg.keepalive, self._max_head,
                                            self.max_body_size)
        self.poller.register(conn.sock, selectors.EVENT_READ, partial(self._on_readable, conn))

    def _on_readable(self, conn, _sock) -> None:  # noqa: ANN001
        reader = self._readers.get(conn)
        if reader is None:
            return
        try:
            data = conn.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:  # the client left before it sent a whole request
            self._close(conn)
            return
        reader.feed(data, time.monotonic())
        self._buffered += len(data)
        if reader.rejection is not None:
            self._close(conn, error_response(*reader.rejection))
        elif reader.complete:
            self._dispatch(conn)
        elif self._buffered > 64 * self.max_body_size:  # many big bodies arriving slowly at once
            self._close(conn, error_response(503, "too many request bodies are arriving at once; send it again"))
        elif reader.expect_continue:
            reader.expect_continue = False
            self._send_quietly(conn, _CONTINUE)

    def _forget(self, conn) -> RequestReader:  # noqa: ANN001
        reader = self._readers.pop(conn)
        self._buffered -= len(reader.buf)
        self.poller.unregister(conn.sock)
        return reader

    def _dispatch(self, conn) -> None:  # noqa: ANN001
        """The whole request is there: answered here (`/ping`, a full queue's 503) or served by a
        thread from the bytes read so far."""
        data = bytes(self._forget(conn).buf)
        head_end = data.find(b"\r\n\r\n") + 4
        if self.admission is not None and self._within_limits(data[:head_end]):
            decision = self.admission.decide(data[:head_end])
            if decision.answer is not None and (decision.close or head_end == len(data)):
                self._answer_now(conn, decision)
                return
            if decision.admitted:
                conn.admitted_at = time.monotonic()
        conn.preread = data
        conn.data_ready = True  # gunicorn must not wait for bytes the poller already took
        super().enqueue_req(conn)

    def _within_limits(self, head: bytes) -> bool:
        """Whether gunicorn's parser would take this head's size (else it answers 4xx itself)."""
        lines = head.split(b"\r\n")
        cfg = self.cfg
        return 4 <= len(head) and len(lines[0]) <= (cfg.limit_request_line or 8190) and \
            len(lines) - 3 <= (cfg.limit_request_fields or 100) and \
            all(len(line) <= (cfg.limit_request_field_size or 8190) for line in lines[1:])

    def _answer_now(self, conn, decision: Decision) -> None:  # noqa: ANN001
        """Send a small whole response from the poller thread; then read the connection's next
        request, or close it (asked for, or the socket would not take the response at once)."""
        try:
            sent = conn.sock.send(decision.answer)
        except OSError:
            sent = 0
        if decision.close or sent != len(decision.answer) or not self.alive:
            self.nr_conns -= 1
            _close_now(conn.sock)
            return
        self.enqueue_req(conn)

    def _close(self, conn, answer: bytes = b"") -> None:  # noqa: ANN001
        self._forget(conn)
        if answer:
            self._send_quietly(conn, answer)
        self.nr_conns -= 1
        conn.close()

    @staticmethod
    def _send_quietly(conn, data: bytes) -> None:  # noqa: ANN001
        try:
            conn.sock.send(data)  # non-blocking and small: all of it or (a gone client) nothing
        except OSError:
            pass

    def handle(self, conn):  # noqa: ANN001, ANN201 - runs on a pool thread
        data = getattr(conn, "preread", None)
        if data is not None:
            conn.preread = None
            conn.sock.setblocking(True)
            conn.init()  # plain TCP: only builds the parser
            conn.parser.unreader.unread(data)
        self._bound_stalls(conn.sock)
        return super().handle(conn)

    def _bound_stalls(self, sock: socket.socket) -> None:
        """Blocking sends and receives on `sock` give up after `write_timeout` s without progress
        (kernel timeouts: they hold whatever gunicorn does to the socket's blocking mode)."""
        seconds = int(self.write_timeout)
        tv = struct.pack("ll", seconds, int((self.write_timeout - seconds) * 1e6))
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
        except OSError:  # already gone: the request fails on its own
            pass

    def handle_request(self, req, conn):  # noqa: ANN001, ANN201 - runs on a pool thread
        try:
            return super().handle_request(req, conn)
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EWOULDBLOCK) and not isinstance(exc, TimeoutError):
                raise
            # The client took nothing for write_timeout s: its body iterator was closed (the engine
            # request aborted) on the way here; one line, not gunicorn's traceback; close.
            self.log.warning("%s %s: the client took no response byte for %g s; response cut, request aborted",
                             req.method, req.path, self.write_timeout)
            return False

    def murder_pending(self) -> None:
        """gunicorn's sweep of idle connections, plus the read deadlines of requests in progress."""
        super().murder_pending()
        now = time.monotonic()
        if now < self._next_sweep:
            return
        self._next_sweep = now + _SWEEP_S
        late = [(conn, reader) for conn, reader in self._readers.items() if reader.deadline <= now]
        answered = 0
        for conn, reader in late:
            if reader.phase == "idle":  # nothing sent since it connected or was kept alive
                self._close(conn)
            else:
                self._close(conn, error_response(408, reader.timeout_message()))
                answered += 1
        if answered:
            self.log.warning("%d connection(s) answered 408 and closed: their request did not arrive in time",
                             answered)

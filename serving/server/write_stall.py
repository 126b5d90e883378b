"""Notice a client that stopped reading its response while the kernel still absorbs the writes.

A response write only blocks once the socket's send buffer is full, and Linux grows that buffer
to megabytes: a stream whose client never reads could run to its last token (holding its thread,
queue slot and KV blocks all along) before a write ever blocks. So before each record is written,
`WriteStall.check` asks the kernel how much of what was written the client has not acknowledged
yet (SIOCOUTQ): when that backlog is not zero and the client took nothing more for `timeout`
seconds, it raises `ClientNotReading` and the response is cut (the blocked-write case is the
socket's SO_SNDTIMEO, set by serving/server/worker.py, with the same bound).
"""

from __future__ import annotations

import fcntl
import socket
import struct
import termios
import time
from collections.abc import Callable


PROBE_EVERY_S = 0.5


class ClientNotReading(TimeoutError):
    """The client took no byte of its response for the write timeout (the response is cut)."""


class WriteStall:
    """The write progress of one response on `sock` (see the module doc)."""

    def __init__(self, sock: socket.socket, timeout: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._fd = sock.fileno()
        self.timeout = timeout
        self._clock = clock
        self._written = 0  # body bytes handed to the socket (headers and chunk framing not counted)
        self._taken = -1 << 62  # what the client had acknowledged at the last progress (same offset)
        self._since = clock()
        self._next_probe = 0.0  # the kernel is asked at most every PROBE_EVERY_S

    def unacknowledged(self) -> int:
        """Bytes written to the socket that the client has not acknowledged yet."""
        return struct.unpack("i", fcntl.ioctl(self._fd, termios.TIOCOUTQ, b"\0\0\0\0"))[0]

    def check(self, size: int) -> None:
        """Before writing `size` more bytes: raise ClientNotReading if the client is stalled.

        The kernel is asked at most every PROBE_EVERY_S (a stall is still seen within the timeout
        plus that): the ioctl releases and retakes the GIL, and one per streamed token cost the HTTP
        process ~12 % of its output tokens/s on a saturated 2-copy server (bench/RESULTS.md)."""
        now = self._clock()
        if now < self._next_probe:
            self._written += size
            return
        self._next_probe = now + PROBE_EVERY_S
        try:
            backlog = self.unacknowledged()
        except OSError:  # the socket is gone: the write itself fails
            return
        taken = self._written - backlog
        if backlog == 0 or taken > self._taken:
            self._taken, self._since = taken, now
        elif now - self._since > self.timeout:
            raise ClientNotReading(f"the client took no response byte for {self.timeout:g} s")
        self._written += size


def stall_from_environ(environ: dict, timeout: float) -> WriteStall | None:
    """The guard of this WSGI request's response, or None when the server gives no socket."""
    sock = environ.get("gunicorn.socket")
    if not isinstance(sock, socket.socket) or sock.fileno() < 0:
        return None
    return WriteStall(sock, timeout)

"""Notice that an HTTP client went away while its request waits for the engine.

In: the request's socket (gunicorn puts it in the WSGI environ as `gunicorn.socket`). Out: a probe
`gone() -> bool` that the request runner polls between deltas, so a request whose client closed
its connection is aborted within a poll interval instead of at the next failed write (the 15 s
keep-alive space of a plain request). It only peeks: nothing is read off the socket.
"""

from __future__ import annotations

import select
import socket
from collections.abc import Callable, Mapping


def peer_closed(sock: socket.socket) -> bool:
    """True once the peer closed (EOF) or reset the connection; never blocks, consumes nothing.

    Bytes waiting on the socket (a pipelined next request) mean the peer is still there. A peer
    that only shut down its sending side counts as gone: HTTP/1.1 clients do not half-close.
    """
    try:
        poller = select.poll()  # not select.select: it fails on descriptors >= 1024
        poller.register(sock.fileno(), select.POLLIN | select.POLLPRI)
        events = poller.poll(0)
        if not events:
            return False
        if events[0][1] & (select.POLLERR | select.POLLNVAL):
            return True
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, InterruptedError):
        return False
    except (OSError, ValueError):  # reset, or the socket is already closed
        return True


def probe_from_environ(environ: Mapping[str, object]) -> Callable[[], bool] | None:
    """A `gone()` probe for this WSGI request's client, or None when the server gives no socket."""
    sock = environ.get("gunicorn.socket")
    if not isinstance(sock, socket.socket):
        return None
    return lambda: peer_closed(sock)

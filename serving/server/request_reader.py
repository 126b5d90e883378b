"""Where one HTTP/1.1 request ends, and by when it must have arrived (for serving/server/worker.py).

In: the bytes of a connection as they arrive (`feed`). Out: `complete` once the head and its whole
body (Content-Length or chunked) are there, and `deadline`, the time (time.monotonic()) by which
the next thing must happen: the first byte within the keep-alive idle time, the head within
HEAD_TIMEOUT_S of its first byte, the body with no gap over BODY_IDLE_TIMEOUT_S and all of it
within BODY_TIMEOUT_S. It only frames; gunicorn still parses and validates: a head it cannot frame
(a malformed length, another coding) counts as complete, so gunicorn answers the error at once
instead of this waiting for bytes. A `rejection` (status, message) is answered here and the
connection closed: a head past gunicorn's limits with no end in sight (414 / 431), a body over the
size limit (413, by its Content-Length or as its chunks arrive), and a chunked body gunicorn could
not be trusted to frame the same way (400): a chunk size that is not 1 to 15 hex digits, or a
chunk-size or trailer line over _MAX_CHUNK_LINE bytes. A request handed on is whole: the thread
that serves it never waits on the client for more.
"""

from __future__ import annotations

import re

HEAD_TIMEOUT_S = 10.0  # request line and headers, from their first byte
BODY_IDLE_TIMEOUT_S = 10.0  # the longest gap between two pieces of a body
BODY_TIMEOUT_S = 60.0  # the whole body, from the end of the head (6 MB at 100 kB/s)
_CHUNK_SIZE = re.compile(rb"[0-9A-Fa-f]{1,15}")
_MAX_CHUNK_LINE = 4096  # a chunk-size line (with extensions) longer than this is malformed


class RequestReader:
    """The bytes of one request read so far, and whether they are all there.

    Args:
        idle_deadline: when to give up on a connection that has sent nothing yet.
        max_head: head bytes after which gunicorn's parser is sure to reject the request.
        max_body: the body size limit (413 past it, chunk extensions and trailers included).
    """

    def __init__(self, idle_deadline: float, max_head: int, max_body: int) -> None:
        self.buf = bytearray()
        self.deadline = idle_deadline
        self.phase = "idle"  # idle -> head -> body
        self.complete = False
        self.rejection: tuple[int, str] | None = None  # answer this and close: never a complete request
        self.expect_continue = False  # the client waits for "100 Continue" before its body
        self._max_head = max_head
        self._max_body = max_body
        self._head_end = 0
        self._body_end: int | None = None  # Content-Length framing: where the request ends
        self._scan = 0  # chunked framing: where the next chunk-size line starts
        self._trailers = False
        self._body_by = 0.0

    def feed(self, data: bytes, now: float) -> None:
        """Add bytes that just arrived and move the deadline."""
        if self.phase == "idle":
            self.phase, self.deadline = "head", now + HEAD_TIMEOUT_S
        self.buf += data
        if self.phase == "head":
            self._find_head(data, now)
        if self.phase == "body" and not (self.complete or self.rejection):
            self._find_body_end()
            self.deadline = min(self._body_by, now + BODY_IDLE_TIMEOUT_S)

    def timeout_message(self) -> str:
        """Why a request that missed its deadline is answered 408."""
        if self.phase == "head":
            return f"the request head did not arrive within {HEAD_TIMEOUT_S:g} s"
        return (f"the request body did not arrive: no byte for {BODY_IDLE_TIMEOUT_S:g} s, or not all of it "
                f"within {BODY_TIMEOUT_S:g} s")

    def _find_head(self, data: bytes, now: float) -> None:
        # From 1: RFC 9112 lets one empty line precede the request. Resume where the last search
        # stopped: a head sent a byte at a time must not be scanned again for every byte.
        end = self.buf.find(b"\r\n\r\n", max(1, len(self.buf) - len(data) - 3))
        if end < 0:
            if len(self.buf) > self._max_head:  # gunicorn would wait for more before it rejects it
                line_ends = self.buf.find(b"\r\n", 1) >= 0
                self.rejection = (431 if line_ends else 414,
                                  f"the request {'head' if line_ends else 'line'} is over {self._max_head} bytes")
            return
        self._head_end = end + 4
        self.phase, self._body_by = "body", now + BODY_TIMEOUT_S
        lines = bytes(self.buf[:end]).lstrip(b"\r\n").split(b"\r\n")
        fields: dict[bytes, list[bytes]] = {}
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            fields.setdefault(name.strip().lower(), []).append(value.strip().lower())
        lengths = set(fields.get(b"content-length", ()))
        codings = fields.get(b"transfer-encoding")
        self.expect_continue = fields.get(b"expect") == [b"100-continue"] and lines[0].endswith(b"HTTP/1.1")
        if codings is not None:
            if lengths or not codings[-1].endswith(b"chunked"):
                self.complete = True  # gunicorn rejects or decides; nothing to wait for here
            self._scan = self._head_end
        elif len(lengths) != 1 or not (length := lengths.pop()).isdigit():
            self.complete = True  # no body, or a malformed length (gunicorn: 400)
        elif int(length) > self._max_body:
            self.rejection = (413, f"the request body is {int(length)} bytes; the limit is {self._max_body}")
        else:
            self._body_end = self._head_end + int(length)

    def _find_body_end(self) -> None:
        if self._body_end is not None:
            self.complete = len(self.buf) >= self._body_end
            return
        buf = self.buf
        while not (self.complete or self.rejection):
            line_end = buf.find(b"\r\n", self._scan, self._scan + _MAX_CHUNK_LINE + 2)
            if line_end < 0:
                if len(buf) - self._scan > _MAX_CHUNK_LINE:
                    self._malformed(f"a {'trailer' if self._trailers else 'chunk-size'} line is over "
                                    f"{_MAX_CHUNK_LINE} bytes")
                return
            line = bytes(buf[self._scan:line_end])
            if self._trailers:  # after the last chunk: trailer fields up to an empty line
                self.complete = not line
                self._scan = line_end + 2
            else:
                size = line.split(b";", 1)[0].strip()
                if not _CHUNK_SIZE.fullmatch(size):
                    self._malformed(f"a chunk size must be 1 to 15 hex digits, got {size[:20]!r}")
                    return
                self._trailers = int(size, 16) == 0
                self._scan = line_end + 2 + (0 if self._trailers else int(size, 16) + 2)
            if self._scan - self._head_end > self._max_body:
                self.rejection = (413, f"the request body is over the limit of {self._max_body} bytes")
            elif self._scan > len(buf):
                return

    def _malformed(self, why: str) -> None:
        self.rejection = (400, f"malformed chunked body: {why}")

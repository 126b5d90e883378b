"""Line reassembly over SageMaker response streams (and plain byte streams).

In: an iterable of event-stream events as boto3 yields them (``{"PayloadPart": {"Bytes": b"..."}}``,
``{"ModelStreamError": {...}}``, ``{"InternalStreamFailure": {...}}``), or of raw ``bytes`` chunks (an
HTTP response body). Out: complete lines as ``bytes`` without the trailing ``\\n``. Error events, and the
``botocore.exceptions.EventStreamError`` that botocore raises for them, become typed exceptions.

Fixes the two bugs of the AWS sample: an unknown event is skipped (never ``"..." + dict`` -> TypeError),
and a last line without ``\\n`` is returned once and the iterator then stops (never loops forever).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Any

logger = logging.getLogger(__name__)

# A line longer than this (64 MiB, DJL's max request size) means the stream is not line-framed.
MAX_LINE_BYTES = 64 * 1024 * 1024


class StreamError(Exception):
    """Base class of errors reported inside a response stream."""

    def __init__(self, message: str, error_code: str | None = None) -> None:
        super().__init__(message if error_code is None else f"{error_code}: {message}")
        self.message = message
        self.error_code = error_code


class ModelStreamError(StreamError):
    """The model's stream broke (``StreamBroken``) or timed out (``ModelInvocationTimeExceeded``)."""


class InternalStreamFailure(StreamError):
    """SageMaker failed while streaming for an unknown reason; the request may be retried."""


class LineTooLongError(StreamError):
    """The buffered, unterminated line grew beyond ``max_line_bytes``."""


_ERROR_EVENTS: dict[str, type[StreamError]] = {
    "ModelStreamError": ModelStreamError,
    "InternalStreamFailure": InternalStreamFailure,
}


def error_from_event(event: dict[str, Any]) -> StreamError | None:
    """Return the typed error for a dict-shaped error event, or None if ``event`` is not one."""
    for name, cls in _ERROR_EVENTS.items():
        if name in event:
            detail = event[name] or {}
            return cls(str(detail.get("Message", "")), detail.get("ErrorCode"))
    return None


def _error_from_exception(exc: Exception) -> StreamError | None:
    """Map botocore's ``EventStreamError`` (raised while iterating an EventStream) to our types."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return None
    error = response.get("Error") or {}
    cls = _ERROR_EVENTS.get(str(error.get("Code", "")))
    if cls is None:
        return None
    # botocore keeps only Code and Message; the ErrorCode detail of ModelStreamError is not copied.
    return cls(str(error.get("Message", "")), error.get("ErrorCode"))


def iter_payload_bytes(stream: Iterable[Any]) -> Iterator[bytes]:
    """Yield the payload bytes of each event; raise typed errors; skip unknown events.

    Args:
        stream: boto3's ``resp["Body"]`` EventStream, a list of event dicts, or an iterable of bytes.
    """
    iterator = iter(stream)
    while True:
        try:
            event = next(iterator)
        except StopIteration:
            return
        except Exception as exc:  # botocore.exceptions.EventStreamError, without importing botocore
            typed = _error_from_exception(exc)
            if typed is None:
                raise
            raise typed from exc
        if isinstance(event, (bytes, bytearray, memoryview)):
            yield bytes(event)
            continue
        if isinstance(event, dict):
            part = event.get("PayloadPart")
            if part is not None:
                yield bytes(part.get("Bytes", b""))
                continue
            typed = error_from_event(event)
            if typed is not None:
                raise typed
        # NOTE: unknown events (new event types, initial-response, etc.) are skipped, never printed.
        logger.debug("skipping unknown stream event %r", event)


class LineIterator:
    """Iterate complete lines (``bytes`` without ``\\n``) over a response stream.

    Lines split across parts are joined, several lines in one part are split, and a final line
    without ``\\n`` is returned once at the end. ``\\r`` before ``\\n`` is kept (SSE callers strip it).
    """

    def __init__(self, stream: Iterable[Any], *, max_line_bytes: int = MAX_LINE_BYTES) -> None:
        self._parts = iter_payload_bytes(stream)
        self._buffer = bytearray()
        self._scan_from = 0  # bytes of the buffer already known to hold no "\n"
        self._exhausted = False
        self._max_line_bytes = max_line_bytes

    def __iter__(self) -> LineIterator:
        return self

    def __next__(self) -> bytes:
        while True:
            newline = self._buffer.find(b"\n", self._scan_from)
            if newline >= 0:
                line = bytes(self._buffer[:newline])
                del self._buffer[: newline + 1]
                self._scan_from = 0
                return line
            self._scan_from = len(self._buffer)
            if self._exhausted:
                if self._buffer:
                    line = bytes(self._buffer)
                    self._buffer.clear()
                    self._scan_from = 0
                    return line
                raise StopIteration
            if len(self._buffer) > self._max_line_bytes:
                raise LineTooLongError(f"unterminated line over {self._max_line_bytes} bytes")
            try:
                self._buffer += next(self._parts)
            except StopIteration:
                self._exhausted = True


def iter_lines(stream: Iterable[Any]) -> Iterator[bytes]:
    """Functional form of :class:`LineIterator`."""
    return LineIterator(stream)

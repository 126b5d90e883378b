"""The caller's end of one request (`RequestStream`) and the engine states every client reports.

Why a module of its own: the edge's contract (`serving/engine/client.py`) names these types and every
engine client (`engine_loop`, `engine_process`, `replicas`) builds or returns them; here they import
nothing of the engine, so the contract and its implementations point one way.
"""

from __future__ import annotations

import enum
import queue
from collections.abc import Iterator
from typing import Protocol

from serving.outputs import StreamDelta


class _Aborts(Protocol):
    """What a stream needs of the client that made it: aborting its request."""

    def abort(self, request_id: str) -> None: ...


class EngineState(str, enum.Enum):
    LOADING = "loading"
    READY = "ready"
    DEAD = "dead"


class EngineDeadError(RuntimeError):
    """The engine thread died (or was closed); no request can be served."""


class QueueFullError(RuntimeError):
    """More unfinished requests than `max_queue_size`; the caller should answer 503."""


class RequestStream:
    """The caller's end of one request: `get()` its deltas, `close()` to abort it.

    Iterating yields deltas until all `n` samples have finished.
    """

    def __init__(self, loop: _Aborts, request_id: str, n: int) -> None:
        self.request_id = request_id
        self.n = n
        self._loop = loop
        # SimpleQueue: put/get are C calls (queue.Queue costs ~3 us more per token in Python,
        # on both the engine thread and the HTTP thread, all of it holding the GIL).
        self._queue: queue.SimpleQueue[StreamDelta | None] = queue.SimpleQueue()
        self._finished_indexes: set[int] = set()  # written by the engine thread only
        self.finished = False
        self.closed = False

    def _unfinished_indexes(self) -> list[int]:
        return [i for i in range(self.n) if i not in self._finished_indexes]

    def _put(self, delta: StreamDelta) -> bool:
        """Engine thread: deliver a delta; True when this was the request's last one."""
        if delta.finish_reason is not None:
            self._finished_indexes.add(delta.index)
            if len(self._finished_indexes) >= self.n:
                self.finished = True  # before the put: a reader that sees the last delta sees this
                self._queue.put(delta)
                return True
        self._queue.put(delta)
        return False

    def get(self, timeout: float | None = None) -> StreamDelta | None:
        """Next delta; raises queue.Empty after `timeout` seconds; None once closed."""
        if self.closed and self._queue.empty():
            return None
        return self._queue.get(timeout=timeout)

    def get_nowait(self) -> StreamDelta | None:
        """The next delta if one is already waiting, else None (never blocks; one reader per stream,
        so a non-empty queue stays non-empty until it reads; no exception on the common empty path)."""
        q = self._queue
        return None if q.empty() else q.get_nowait()

    def __iter__(self) -> Iterator[StreamDelta]:
        num_finished = 0
        while num_finished < self.n:
            delta = self.get()
            if delta is None:
                return
            if delta.finish_reason is not None:
                num_finished += 1
            yield delta

    def close(self) -> None:
        """Abort the request if it is still running (frees its KV blocks); idempotent."""
        if self.closed:
            return
        self.closed = True
        if not self.finished:
            self._loop.abort(self.request_id)

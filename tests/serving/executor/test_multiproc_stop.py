"""`MultiprocExecutor._terminate` from two threads at once closes each pipe once.

The watchdog stops the ranks when one dies while the caller may be shutting the executor down:
both ran `_terminate`, both closed the same pipes, and the second `os.close` raised EBADF (a CI run
of 2026-11-27, `test_killed_rank_fails_the_executor_within_5s_and_leaves_no_process`); with a
descriptor number reused in between it would have closed someone else's file. Real pipes, a close
slowed down to hold the race window open; no rank processes are needed for the part under test.
"""

from __future__ import annotations

import os
import threading
import time
from multiprocessing.connection import Connection

from serving.executor.multiproc import MultiprocExecutor


class _SlowClose(Connection):
    closed_fds: list[int] = []

    def _close(self, _close=os.close) -> None:  # noqa: ANN001 - Connection's own signature
        time.sleep(0.05)  # both threads inside close() at once, unless something serialises them
        _close(self._handle)
        self.closed_fds.append(self._handle)


def test_concurrent_terminates_close_each_pipe_once() -> None:
    executor = MultiprocExecutor.__new__(MultiprocExecutor)  # no ranks: only the stop path runs
    executor._procs = []  # noqa: SLF001
    executor._stop_lock = threading.Lock()  # noqa: SLF001 - what __init__ sets
    fds = [fd for _ in range(3) for fd in os.pipe()]
    executor._conns = [_SlowClose(fd) for fd in fds]  # noqa: SLF001
    errors: list[BaseException] = []

    def stop() -> None:
        try:
            executor._terminate()  # noqa: SLF001
        except BaseException as e:  # noqa: BLE001 - the test reports it
            errors.append(e)

    threads = [threading.Thread(target=stop) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not errors, errors
    assert sorted(_SlowClose.closed_fds) == sorted(fds)  # every pipe end closed, and once
    assert all(conn.closed for conn in executor._conns)  # noqa: SLF001

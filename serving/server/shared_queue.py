"""`SharedQueue`: `job_queue_size` counted over every HTTP frontend, in shared memory.

Why: with several frontends (gunicorn workers over shared engine cores, serving/server/cores.py),
each admits requests on its own poller thread (serving/server/admission.py); a per-process count
would let F frontends take F times the configured bound. The arbiter creates this before it forks
the workers, so every worker maps the same memory: one counter per frontend slot, read and changed
under one inter-process lock (a few microseconds per request). A slot belongs to one live worker
(`assign_slot`, in the arbiter's `pre_fork`); when that worker dies its slot is zeroed (its
connections, and so its admitted requests, died with it) and its replacement takes it over.

It also holds the server's start-up latch: `/ping` answers 200 only once every one of the
`frontends` has its engine clients ready (`mark_ready`), since the load balancer that got 200 from one
frontend sends requests to all of them, and a frontend still connecting answers "the model is loading"
(bench/RESULTS.md: one ready frontend of four let 34-70 requests in a few seconds meet that 503). Once
every frontend was ready the latch stays open: a replaced worker is the gunicorn restart case, served
by the others meanwhile.
"""

from __future__ import annotations

import multiprocessing as mp

_LOCK_S = 0.5  # a worker killed while holding the lock must not stop the others: past this, go on without it


class SharedQueue:
    """Admitted-and-unfinished requests per frontend slot (`slots` of them), shared by fork."""

    def __init__(self, slots: int, frontends: int = 1) -> None:
        assert slots >= frontends >= 1, (slots, frontends)
        ctx = mp.get_context("fork")
        self._counts = ctx.Array("q", slots)  # zeroed, with an inter-process lock
        self._ready = ctx.Array("b", slots)  # a slot's frontend has its engine clients ready
        self._started = ctx.Value("b", 0)  # every frontend was ready once: the start is over
        self.frontends = frontends
        self.slot: int | None = None  # this process's slot (a worker's, after `attach`)

    @property
    def slots(self) -> int:
        return len(self._counts)

    def attach(self, slot: int) -> SharedQueue:
        """In a new worker: take `slot` (zeroed) as this process's."""
        assert 0 <= slot < self.slots, (slot, self.slots)
        self.slot = slot
        self.reset(slot)
        return self

    def reset(self, slot: int) -> None:
        """Forget a slot's count and readiness (its worker exited, with its connections)."""
        with self._counts.get_lock():
            self._counts.get_obj()[slot] = 0
            self._ready.get_obj()[slot] = 0

    def mark_ready(self) -> None:
        """This slot's frontend is ready; the last of the server's frontends to be opens the latch."""
        assert self.slot is not None, "attach a slot first"
        with self._counts.get_lock():
            self._ready.get_obj()[self.slot] = 1
            if sum(self._ready.get_obj()) >= self.frontends:
                self._started.value = 1

    @property
    def started(self) -> bool:
        """Every frontend has been ready (the server's start is over)."""
        return bool(self._started.value)

    def try_acquire(self, limit: int) -> bool:
        """Admit one request for this slot unless `limit` are admitted over all slots."""
        assert self.slot is not None, "attach a slot first"
        lock = self._counts.get_lock()
        locked = lock.acquire(timeout=_LOCK_S)
        try:
            counts = self._counts.get_obj()
            if sum(counts) >= limit:
                return False
            counts[self.slot] += 1
            return True
        finally:
            if locked:
                lock.release()

    def release(self) -> None:
        """One of this slot's admitted requests ended."""
        assert self.slot is not None, "attach a slot first"
        with self._counts.get_lock():
            counts = self._counts.get_obj()
            counts[self.slot] = max(0, counts[self.slot] - 1)

    def total(self) -> int:
        """Admitted and unfinished over every frontend."""
        return sum(self._counts.get_obj())

    def free_slot(self, taken: set[int]) -> int:
        """The lowest slot no live worker holds."""
        free = [s for s in range(self.slots) if s not in taken]
        assert free, f"every frontend slot is taken ({self.slots})"
        return free[0]

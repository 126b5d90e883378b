"""The engine's token cadence: seconds between consecutive steps' outputs while it is busy.

Why: a streaming client's inter-token latency is the engine's step-to-step interval plus the
HTTP path's delivery. A client-side p99 alone cannot say which of the two made a tail; this
histogram, read at `/metrics` (`lmi_engine_token_interval_seconds`), gives the engine's half,
split by whether the step also computed prompt tokens (a chunk of an arriving prompt makes a
step longer) or only decoded. Intervals that include idle time are never recorded: the clock
restarts when the engine runs out of requests.

The histogram is plain counts over fixed bounds (no prometheus dependency in the engine); the
server's collector turns a snapshot into a Prometheus histogram, and `quantile` reads one back.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass

# Upper bounds in seconds: 1 ms resolution where decode steps and their tails live.
BOUNDS: tuple[float, ...] = tuple(x / 1000 for x in (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 17.5, 20,
                                                      25, 30, 40, 50, 75, 100, 150, 250, 500, 1000, 2500))
KINDS = ("decode", "with_prompt")


@dataclass(frozen=True, slots=True)
class IntervalSnapshot:
    """One kind's histogram at a moment: counts per bound (the last slot is above every bound)."""

    kind: str
    counts: tuple[int, ...]  # len(BOUNDS) + 1, not cumulative
    total_s: float

    @property
    def count(self) -> int:
        return sum(self.counts)

    def minus(self, earlier: IntervalSnapshot) -> IntervalSnapshot:
        """The observations made between `earlier` and this snapshot."""
        assert earlier.kind == self.kind and len(earlier.counts) == len(self.counts)
        return IntervalSnapshot(self.kind, tuple(a - b for a, b in zip(self.counts, earlier.counts)),
                                self.total_s - earlier.total_s)

    def quantile(self, q: float) -> float | None:
        """The upper bound of the bucket holding quantile q (None when empty; inf above the last bound)."""
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"quantile must be in [0, 1], got {q}")
        n = self.count
        if n == 0:
            return None
        rank = q * n
        seen = 0
        for i, c in enumerate(self.counts):
            seen += c
            if seen >= rank and c:
                return BOUNDS[i] if i < len(BOUNDS) else float("inf")
        return float("inf")


class TokenIntervals:
    """Counts of step-to-step output intervals by kind; `observe` on the engine thread, `snapshot` anywhere."""

    def __init__(self) -> None:
        self._counts = {kind: [0] * (len(BOUNDS) + 1) for kind in KINDS}
        self._total = dict.fromkeys(KINDS, 0.0)
        self._lock = threading.Lock()
        self._last: float | None = None

    def output(self, now: float, with_prompt: bool) -> None:
        """A step's outputs were read at `now` (monotonic seconds): record the interval since the last."""
        last, self._last = self._last, now
        if last is None:
            return
        dt = now - last
        assert dt >= 0.0, (now, last)
        kind = KINDS[1] if with_prompt else KINDS[0]
        with self._lock:
            self._counts[kind][bisect.bisect_left(BOUNDS, dt)] += 1
            self._total[kind] += dt

    def idle(self) -> None:
        """The engine has no request left: the next interval would include idle time, so it is not one."""
        self._last = None

    def snapshot(self) -> dict[str, IntervalSnapshot]:
        with self._lock:
            return {kind: IntervalSnapshot(kind, tuple(self._counts[kind]), self._total[kind]) for kind in KINDS}


def merge_snapshots(per_engine: list[dict[str, IntervalSnapshot]]) -> dict[str, IntervalSnapshot]:
    """Several engines' snapshots (model copies) as one: counts and totals summed per kind."""
    assert per_engine, "nothing to merge"
    out = {}
    for kind in KINDS:
        parts = [snap[kind] for snap in per_engine]
        out[kind] = IntervalSnapshot(kind, tuple(sum(c) for c in zip(*(p.counts for p in parts))),
                                     sum(p.total_s for p in parts))
    return out

"""Prometheus metrics of the HTTP server (`GET /metrics`), one registry per app.

Counters and histograms are fed by the request path (`serving/server/request_runner.py`); queue depth,
running sequences and KV block usage are read from the engine loop's stats at scrape time.

Several HTTP frontends (serving/server/cores.py): the arbiter sets PROMETHEUS_MULTIPROC_DIR before it
forks them, so prometheus_client keeps each frontend's counters and histograms in its own file there,
and `share` makes a scrape of any frontend render the sum over every frontend (those that exited
included: counters do not go back), with the engine gauges read from the cores (every frontend's
requests) and `lmi_requests_in_flight` from the shared admission count. The files cannot drop a
series: an adapter's counts are left out of the rendering while it is not registered.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from serving.engine.speculator import PER_POSITION_PREFIX, SPEC_PREFIX
from serving.engine.token_intervals import BOUNDS

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _EngineCollector:
    """Reads engine stats (a dict) when Prometheus scrapes."""

    def __init__(self, stats: Callable[[], dict], inflight: Callable[[], int]) -> None:
        self._stats = stats
        self._inflight = inflight

    def collect(self):  # noqa: ANN201 - prometheus collector protocol
        stats = self._stats() or {}
        total = stats.get("num_kv_blocks", 0)
        free = stats.get("num_free_kv_blocks", 0)
        rows = (
            ("lmi_requests_in_flight", "requests admitted and not finished (waiting + running)", self._inflight()),
            ("lmi_queue_depth", "sequences waiting to be scheduled", stats.get("num_requests_waiting", 0)),
            ("lmi_running_sequences", "sequences in the running batch", stats.get("num_requests_running", 0)),
            ("lmi_kv_blocks_used", "KV cache blocks in use", total - free),
            ("lmi_kv_blocks_free", "KV cache blocks free", free),
            ("lmi_kv_blocks_total", "KV cache blocks in all", total),
            ("lmi_preemptions", "sequences preempted so far", stats.get("num_preemptions", 0)),
        )
        for name, doc, value in rows:
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], float(value or 0))
            yield g
        routed = stats.get("routed_per_copy")
        if routed:  # model copies behind one endpoint (serving/engine/replicas.py)
            c = CounterMetricFamily("lmi_copy_routed_requests", "requests routed to each model copy", labels=["copy"])
            for index, count in enumerate(routed):
                c.add_metric([str(index)], float(count))
            yield c
            c = CounterMetricFamily("lmi_prefix_affinity_hits", "requests routed to the copy that saw their prefix")
            c.add_metric([], float(stats.get("prefix_affinity_hits", 0)))
            yield c
        yield from _speculation(stats)
        intervals = stats.get("token_intervals")
        if intervals:
            h = HistogramMetricFamily(
                "lmi_engine_token_interval_seconds",
                "seconds between consecutive engine steps' outputs while busy (the engine's part of the "
                "inter-token latency), by whether the step also computed prompt tokens",
                labels=["step"])
            for kind, snap in intervals.items():
                cumulative, buckets = 0, []
                for bound, count in zip((*BOUNDS, float("inf")), snap.counts):
                    cumulative += count
                    buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
                h.add_metric([kind], buckets, sum_value=snap.total_s)
            yield h


def _speculation(stats: dict):  # noqa: ANN202 - a generator of metric families
    """Speculative decoding counters, under vLLM's names (`vllm:spec_decode_*`), when it is on."""
    if SPEC_PREFIX + "num_drafts" not in stats:
        return
    for name, doc in (("num_drafts", "verify steps (one per speculating sequence per step)"),
                      ("num_draft_tokens", "draft tokens proposed"),
                      ("num_accepted_tokens", "draft tokens accepted")):
        c = CounterMetricFamily("lmi_spec_decode_" + name, doc)
        c.add_metric([], float(stats[SPEC_PREFIX + name]))
        yield c
    c = CounterMetricFamily("lmi_spec_decode_num_accepted_tokens_per_pos", "draft tokens accepted, by position",
                            labels=["position"])
    for key, value in stats.items():
        if key.startswith(PER_POSITION_PREFIX):
            c.add_metric([key.removeprefix(PER_POSITION_PREFIX)], float(value))
    yield c


class _Registered:
    """Every frontend's counters, less the series of adapters that are no longer registered."""

    def __init__(self, collector: object, adapters: Callable[[], Iterable[str]]) -> None:
        self._collector = collector
        self._adapters = adapters

    def collect(self):  # noqa: ANN201 - prometheus collector protocol
        live = None
        for family in self._collector.collect():  # type: ignore[attr-defined]
            if family.name == "lmi_adapter_requests":
                live = set(self._adapters()) if live is None else live
                family.samples = [s for s in family.samples if s.labels.get("adapter") in live]
            yield family


class Metrics:
    """The counters/histograms of one app and the text exposition."""

    def __init__(self, stats: Callable[[], dict], inflight: Callable[[], int]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("lmi_requests", "HTTP requests by route and status", ["route", "status"],
                                registry=self.registry)
        self.ttft = Histogram("lmi_time_to_first_token_seconds", "time from request to first token",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.tpot = Histogram("lmi_time_per_output_token_seconds", "mean time per output token after the first",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.generated = Counter("lmi_generated_tokens", "output tokens generated", registry=self.registry)
        self.adapter_requests = Counter("lmi_adapter_requests", "prompts submitted on a LoRA adapter", ["adapter"],
                                        registry=self.registry)
        self._engine = _EngineCollector(stats, inflight)
        self.registry.register(self._engine)
        self._multiprocess_dir: str | None = None

    def share(self, inflight: Callable[[], int], adapters: Callable[[], Iterable[str]]) -> None:
        """Render every frontend's counters (prometheus_client's multiprocess files) and the server's
        in-flight count from now on (see the module docstring); `adapters`: the names registered now
        (a series in the files cannot be removed: those of other adapters are left out instead)."""
        path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        assert path, "PROMETHEUS_MULTIPROC_DIR is set by the arbiter before the frontends start"
        self._multiprocess_dir = path
        self._adapters = adapters
        self._engine._inflight = inflight

    def forget_adapter(self, name: str) -> None:
        """Drop the series of an adapter that was unregistered (no-op when it never served)."""
        try:
            self.adapter_requests.remove(name)
        except KeyError:
            pass

    def observe_request(self, route: str, status: int) -> None:
        self.requests.labels(route=route, status=str(status)).inc()

    def render(self) -> bytes:
        if self._multiprocess_dir is None:
            return generate_latest(self.registry)
        from prometheus_client.multiprocess import MultiProcessCollector

        registry = CollectorRegistry()
        registry.register(_Registered(MultiProcessCollector(None, path=self._multiprocess_dir), self._adapters))
        registry.register(self._engine)
        return generate_latest(registry)

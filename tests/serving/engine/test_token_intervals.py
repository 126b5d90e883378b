"""The engine's token cadence histogram: counting, idle gaps left out, replicas merged, /metrics text."""

from __future__ import annotations

import time

import pytest
from fake_runner import CONFIG, FakeRunner, collect

from serving.engine.engine_loop import EngineLoop
from serving.engine.llm_engine import LLMEngine
from serving.engine.replicas import ReplicaSet
from serving.engine.token_intervals import BOUNDS, TokenIntervals, merge_snapshots
from serving.sampling_params import SamplingParams
from serving.server.metrics import Metrics


def test_intervals_land_in_their_buckets_and_idle_gaps_are_not_intervals() -> None:
    t = TokenIntervals()
    t.output(10.0, with_prompt=True)  # the first output after idle starts the clock: no interval
    t.output(10.0045, with_prompt=False)  # 4.5 ms
    t.output(10.016, with_prompt=True)  # 11.5 ms, a step with a prompt chunk
    t.idle()
    t.output(99.0, with_prompt=False)  # after idle: 82 s is not an interval
    t.output(99.0025, with_prompt=False)  # 2.5 ms
    snap = t.snapshot()
    dec, pre = snap["decode"], snap["with_prompt"]
    assert dec.count == 2 and pre.count == 1
    assert dec.counts[BOUNDS.index(0.005)] == 1 and dec.counts[BOUNDS.index(0.003)] == 1
    assert pre.counts[BOUNDS.index(0.012)] == 1
    assert dec.total_s == pytest.approx(0.007) and pre.total_s == pytest.approx(0.0115)
    assert dec.quantile(0.5) == 0.003 and dec.quantile(1.0) == 0.005 and pre.quantile(0.99) == 0.012
    assert snap["decode"].quantile(0.0) == 0.003


def test_quantile_edges_and_deltas() -> None:
    t = TokenIntervals()
    assert t.snapshot()["decode"].quantile(0.5) is None
    t.output(0.0, False)
    t.output(5.0, False)  # above the last bound
    before = t.snapshot()
    assert before["decode"].quantile(0.5) == float("inf")
    t.output(5.0008, False)
    delta = t.snapshot()["decode"].minus(before["decode"])
    assert delta.count == 1 and delta.quantile(0.5) == 0.001
    with pytest.raises(ValueError, match="quantile"):
        delta.quantile(1.5)


def test_merge_sums_counts_of_copies() -> None:
    a, b = TokenIntervals(), TokenIntervals()
    for t in (a, b):
        t.output(0.0, False)
        t.output(0.002, False)
    b.output(0.0105, True)
    merged = merge_snapshots([a.snapshot(), b.snapshot()])
    assert merged["decode"].count == 2 and merged["with_prompt"].count == 1
    assert merged["decode"].total_s == pytest.approx(0.004)


class SlowRunner(FakeRunner):
    """Each step takes at least `delay` seconds: the engine's intervals must show it."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay

    def execute(self, plan):  # noqa: ANN001, ANN201
        time.sleep(self.delay)
        return super().execute(plan)


def test_the_engine_records_one_interval_per_step_after_the_first_and_none_across_idle() -> None:
    runner = SlowRunner(0.004)
    loop = EngineLoop(CONFIG, engine_factory=lambda cfg: LLMEngine(cfg, runner)).start()
    assert loop.wait_ready(10)
    try:
        collect(loop.add_request("a", [5, 6, 7], SamplingParams(max_tokens=5)))
        time.sleep(0.2)  # idle: not an interval
        collect(loop.add_request("b", [5, 6, 7, 8], SamplingParams(max_tokens=3)))
        snap = loop.stats()["token_intervals"]
        # Request a: a prompt step then 4 decode steps -> 4 intervals after the first output;
        # request b after idle: 2 intervals. Every step here but the two first decode.
        assert snap["decode"].count == 4 + 2 and snap["with_prompt"].count == 0
        assert snap["decode"].quantile(0.0) >= 0.004  # no interval shorter than a step
        assert snap["decode"].total_s < 0.2  # the idle gap is in none of them
    finally:
        loop.close()


def test_replica_set_merges_and_metrics_exposes_a_histogram() -> None:
    runners = [SlowRunner(0.002), SlowRunner(0.002)]
    factories = iter(runners)
    rs = ReplicaSet([EngineLoop(CONFIG, engine_factory=lambda cfg, r=next(factories): LLMEngine(cfg, r))
                     for _ in runners]).start()
    assert rs.wait_ready(10)
    try:
        for i in range(4):
            collect(rs.add_request(f"r{i}", [1 + i, 2, 3], SamplingParams(max_tokens=4)))
        stats = rs.stats()
        assert stats["token_intervals"]["decode"].count == 4 * 3
        text = Metrics(rs.stats, lambda: 0).render().decode()
        assert 'lmi_engine_token_interval_seconds_count{step="decode"} 12.0' in text
        assert 'lmi_engine_token_interval_seconds_bucket{le="+Inf",step="decode"} 12.0' in text
        assert 'lmi_engine_token_interval_seconds_bucket{le="0.001",step="decode"} 0.0' in text
        assert 'lmi_engine_token_interval_seconds_count{step="with_prompt"} 0.0' in text
    finally:
        rs.close()

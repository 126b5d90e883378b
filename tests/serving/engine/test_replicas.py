"""ReplicaSet: model copies behind one endpoint (fake executors, real EngineLoops and engines).

Routing goes to the copy with the fewest open requests; a prompt long enough for affinity goes to
its prefix's home copy (the same in every process: several frontends agree) unless that copy is
busier by more than the slack;
one dead copy makes the set dead; gauges are summed over the copies.
"""

from __future__ import annotations

import threading

from fake_runner import CONFIG, FakeRunner, collect

from serving.engine.engine_loop import EngineLoop
from serving.engine.request_stream import EngineState
from serving.engine.llm_engine import LLMEngine
from serving.engine.replicas import ReplicaSet
from serving.sampling_params import SamplingParams


def _set(runners: list[FakeRunner], **kw) -> ReplicaSet:
    loops = [EngineLoop(CONFIG, engine_factory=lambda cfg, r=r: LLMEngine(cfg, r)) for r in runners]
    replicas = ReplicaSet(loops, **kw).start()
    assert replicas.wait_ready(10) and replicas.state is EngineState.READY
    return replicas


def test_requests_go_to_the_least_loaded_copy():
    gate = threading.Event()
    runners = [FakeRunner(gate=gate), FakeRunner(gate=gate)]
    replicas = _set(runners, affinity_tokens=0)
    try:
        streams = [replicas.add_request(f"r{i}", [1, 2, 3 + i], SamplingParams(max_tokens=3)) for i in range(6)]
        assert replicas.num_routed == [3, 3]  # alternating while loads tie
        assert [loop.num_open_requests for loop in replicas.loops] == [3, 3]
        gate.set()
        for s in streams:
            assert collect(s)[-1].finish_reason == "length"
        # copy 0 busy with 4 long requests -> the next 4 all go to copy 1
        gate.clear()
        busy = [replicas.loops[0].add_request(f"b{i}", [5, 6], SamplingParams(max_tokens=3)) for i in range(4)]
        more = [replicas.add_request(f"m{i}", [7, 8, 9], SamplingParams(max_tokens=3)) for i in range(4)]
        assert replicas.num_routed == [3, 7]
        gate.set()
        for s in busy + more:
            collect(s)
        stats = replicas.stats()
        assert stats["num_copies"] == 2 and stats["num_kv_blocks"] == 64 and stats["num_unfinished_requests"] == 0
        assert stats["routed_per_copy"] == [3, 7]
    finally:
        gate.set()
        replicas.close()
    assert replicas.state is EngineState.DEAD and replicas.closing


def test_prefix_affinity_keeps_a_shared_prefix_on_one_copy_within_the_slack():
    gate = threading.Event()
    replicas = _set([FakeRunner(gate=gate), FakeRunner(gate=gate)], affinity_tokens=8, affinity_slack=2)
    try:
        prefix = list(range(10, 18))
        first = replicas.add_request("p0", prefix + [1], SamplingParams(max_tokens=2))
        home = replicas.num_routed.index(1)
        streams = [first] + [replicas.add_request(f"p{i}", prefix + [i], SamplingParams(max_tokens=2))
                             for i in range(1, 4)]
        # loads on the home copy: 1, 2, 3 against 0 elsewhere: within a slack of 2 twice, then not
        assert replicas.num_routed[home] == 3 and replicas.num_affinity_hits == 2
        short = replicas.add_request("short", [1, 2], SamplingParams(max_tokens=2))  # below 8 tokens: no key
        gate.set()
        for s in streams + [short]:
            assert collect(s)[-1].finish_reason == "length"
    finally:
        gate.set()
        replicas.close()


def test_one_dead_copy_makes_the_set_dead():
    replicas = _set([FakeRunner(), FakeRunner(fail_on_step=1)], affinity_tokens=0)
    try:
        streams = [replicas.add_request(f"d{i}", [1, 2], SamplingParams(max_tokens=2)) for i in range(2)]
        ends = sorted(collect(s)[-1].finish_reason for s in streams)
        assert ends == ["error", "length"]
        assert replicas.state is EngineState.DEAD and "boom" in str(replicas.error) and replicas.was_ready
    finally:
        replicas.close()


def test_a_prefix_has_the_same_home_copy_in_every_frontend_and_process():
    import subprocess
    import sys

    replicas = _set([FakeRunner(), FakeRunner(), FakeRunner()], affinity_tokens=8)
    try:
        prompts = [[i, i + 1] * 4 + [99] for i in range(12)] + [f"system prompt {i}: be brief. " for i in range(12)]
        homes = [replicas.route(p) for p in prompts]
        again = _set([FakeRunner(), FakeRunner(), FakeRunner()], affinity_tokens=8)  # another frontend
        try:
            assert [again.route(p) for p in prompts] == homes
        finally:
            again.close()
        assert len(set(homes)) == 3  # the prefixes spread over the copies
        # Another process (Python's own str hash is salted per process; the home is not).
        code = ("from serving.engine.replicas import ReplicaSet\n"
                "r = ReplicaSet.__new__(ReplicaSet); r.affinity_tokens = 8\n"
                f"print([r._prefix_key(p, None) % 3 for p in {prompts!r}])")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                             env={"PYTHONHASHSEED": "random", "PYTHONPATH": ":".join(sys.path)})
        assert out.stdout.strip() == str(homes), out.stderr
    finally:
        replicas.close()

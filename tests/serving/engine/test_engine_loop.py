"""LLMEngine + EngineLoop on a fake runner: streams, n>1, abort, health states, death, queue bound."""

from __future__ import annotations

import queue
import threading
import time

import pytest

from serving.engine.llm_engine import LLMEngine
from serving.engine_config import CacheConfig, EngineConfig
from serving.engine.engine_loop import EngineLoop
from serving.engine.request_stream import EngineDeadError, EngineState, QueueFullError
from serving.sampling_params import SamplingParams
from serving.executor.batch_state import BatchState
from serving.executor.executor import Executor
from serving.executor.plan import ExecutorInfo, SampledToken, StepOutput, StepPlan

from fake_runner import CONFIG, FakeRunner, _iter, collect, start_loop

def test_stream_of_one_request() -> None:
    runner = FakeRunner()
    loop = start_loop(runner)
    try:
        assert loop.state is EngineState.READY and loop.max_model_len == 128
        deltas = collect(loop.add_request("a", [5, 6, 7], SamplingParams(max_tokens=4, logprobs=0)))
        assert [d.token_ids for d in deltas] == [(100,), (101,), (102,), (103,)]
        assert deltas[0].prompt_token_ids == (5, 6, 7) and deltas[1].prompt_token_ids is None
        assert [d.finish_reason for d in deltas] == [None, None, None, "length"]
        assert deltas[-1].num_output_tokens == 4 and deltas[0].logprobs == (-0.5,)
        stats = loop.stats()
        assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"] == 32 and stats["state"] == "ready"
    finally:
        loop.close()
    assert loop.state is EngineState.DEAD


def test_n_samples_and_eos_finish_reason() -> None:
    runner = FakeRunner()
    loop = start_loop(runner)
    try:
        deltas = collect(loop.add_request("b", list(range(10, 20)), SamplingParams(n=3, max_tokens=2)))
        finals = sorted((d.index, d.finish_reason) for d in deltas if d.finish_reason)
        assert finals == [(0, "length"), (1, "length"), (2, "length")]
        deltas = collect(loop.add_request("c", [1, 2], SamplingParams(max_tokens=5, stop_token_ids=[101])))
        assert deltas[-1].finish_reason == "eos_token" and deltas[-1].token_ids == (101,)
        assert deltas[-1].extra == {"stop_reason": 101}
    finally:
        loop.close()


def test_abort_frees_blocks_at_once() -> None:
    gate = threading.Event()
    runner = FakeRunner(gate=gate)
    loop = start_loop(runner)
    try:
        stream = loop.add_request("x", list(range(9)), SamplingParams(max_tokens=50))
        for _ in range(500):  # wait until the request is inside a step
            if runner.num_steps:
                break
            time.sleep(0.01)
        stream.close()
        gate.set()
        deltas = collect_all(stream)
        assert deltas[-1].finish_reason == "abort"
        for _ in range(100):
            if loop.stats()["num_free_kv_blocks"] == 32 and loop.stats()["num_unfinished_requests"] == 0:
                break
            time.sleep(0.02)
        assert loop.stats()["num_free_kv_blocks"] == 32
    finally:
        loop.close()


def collect_all(stream) -> list:
    out = []
    while True:
        d = stream._queue.get(timeout=10)
        out.append(d)
        if d.finish_reason is not None:
            return out


def test_exception_in_step_marks_engine_dead_and_fails_callers() -> None:
    runner = FakeRunner(fail_on_step=3)
    loop = start_loop(runner)
    s1 = loop.add_request("r1", [1, 2, 3], SamplingParams(max_tokens=20))
    s2 = loop.add_request("r2", [4, 5], SamplingParams(n=2, max_tokens=20))
    d1 = collect(s1)
    d2 = collect(s2)
    assert d1[-1].finish_reason == "error" and "boom" in d1[-1].error
    assert sorted(d.index for d in d2 if d.finish_reason == "error") == [0, 1]
    assert loop.state is EngineState.DEAD and isinstance(loop.error, RuntimeError)
    with pytest.raises(EngineDeadError):
        loop.add_request("r3", [1], SamplingParams(max_tokens=1))
    with pytest.raises(EngineDeadError):
        loop.wait_ready(0)
    loop.close()


def test_load_failure_is_reported() -> None:
    def factory(cfg):
        raise OSError("weights not found")

    loop = EngineLoop(CONFIG, engine_factory=factory).start()
    with pytest.raises(EngineDeadError, match="weights not found"):
        loop.wait_ready(10)
    assert loop.state is EngineState.DEAD and isinstance(loop.error, OSError)


def test_bad_requests_raise_synchronously_and_queue_is_bounded() -> None:
    gate = threading.Event()
    runner = FakeRunner(gate=gate)
    loop = start_loop(runner, max_queue_size=1)
    try:
        with pytest.raises(ValueError, match="max_model_len"):
            loop.add_request("long", list(range(120)), SamplingParams(max_tokens=20))
        with pytest.raises(ValueError, match="token ids"):
            loop.add_request("bad", [5000], SamplingParams(max_tokens=2))
        first = loop.add_request("q1", [1, 2], SamplingParams(max_tokens=2))
        with pytest.raises(QueueFullError):
            loop.add_request("q2", [1, 2], SamplingParams(max_tokens=2))
        gate.set()
        assert collect(first)[-1].finish_reason == "length"
        with pytest.raises(queue.Empty):
            first.get(timeout=0.05)
    finally:
        gate.set()
        loop.close()


def test_close_aborts_running_requests() -> None:
    gate = threading.Event()
    runner = FakeRunner(gate=gate)
    loop = start_loop(runner)
    stream = loop.add_request("z", [1, 2, 3], SamplingParams(max_tokens=100))
    threading.Timer(0.2, gate.set).start()
    loop.close()
    deltas = collect_all(stream)
    assert deltas[-1].finish_reason == "abort"
    with pytest.raises(EngineDeadError):
        loop.add_request("z2", [1], SamplingParams(max_tokens=1))


def test_a_failing_request_is_failed_alone_and_the_engine_stays_healthy() -> None:
    """One request that breaks the step: it gets an error record, the others finish whole."""
    gate = threading.Event()
    runner = FakeRunner(gate=gate, poison_min_tokens=3)
    loop = start_loop(runner)
    try:
        good = [loop.add_request(f"g{i}", [1, 2, 3 + i], SamplingParams(max_tokens=6)) for i in range(3)]
        bad = loop.add_request("bad", [4, 5], SamplingParams(max_tokens=6, min_tokens=3))
        gate.set()
        bad_deltas = collect(bad)
        assert bad_deltas[-1].finish_reason == "error" and "IndexError" in bad_deltas[-1].error
        for stream in good:
            deltas = collect(stream)
            assert [t for d in deltas for t in d.token_ids] == [100, 101, 102, 103, 104, 105]
            assert deltas[-1].finish_reason == "length"
        assert loop.state is EngineState.READY and runner.num_resets >= 1
        assert collect(loop.add_request("after", [7], SamplingParams(max_tokens=2)))[-1].finish_reason == "length"
        stats = loop.stats()
        assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"] and stats["num_unfinished_requests"] == 0
    finally:
        gate.set()
        loop.close()


def test_failures_that_keep_coming_kill_the_engine() -> None:
    runner = FakeRunner(poison_min_tokens=1)
    loop = start_loop(runner)
    try:
        for i in range(8):
            deltas = collect(loop.add_request(f"p{i}", [1, 2], SamplingParams(max_tokens=4, min_tokens=1)))
            assert deltas[-1].finish_reason == "error"
            if loop.state is EngineState.DEAD:
                break
        assert loop.state is EngineState.DEAD
    finally:
        loop.close()


class OrderRunner(FakeRunner):
    """Logs each launch (and whether it carries a prompt chunk) and each read of a step's tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple[str, int, bool]] = []

    def execute(self, plan: StepPlan) -> StepOutput:
        out = super().execute(plan)
        step, prompt = self.num_steps, any(n > 1 for n in plan.num_tokens)
        self.log.append(("launch", step, prompt))
        tokens = out.sampled
        return StepOutput(resolve=lambda: (self.log.append(("read", step, prompt)), tokens)[1])


def launch_order(**config) -> list[tuple[str, int, bool]]:
    """The launches and reads of an async engine: "a" decodes, then "b"'s prompt arrives."""
    import dataclasses

    runner = OrderRunner()
    engine = LLMEngine(dataclasses.replace(CONFIG, async_scheduling=True, **config), runner)
    engine.add_request("a", None, SamplingParams(max_tokens=8), prompt_token_ids=[5, 6, 7])
    for _ in range(4):
        engine.step()
    engine.add_request("b", None, SamplingParams(max_tokens=3), prompt_token_ids=[9, 8, 7, 6, 5])
    while engine.has_unfinished_requests():
        engine.step()
    return runner.log


def test_async_steps_read_the_launched_tokens_before_launching_a_prompt_chunk() -> None:
    """With async scheduling a decode step is launched before the previous one's tokens are read;
    when streams keep pace (a server's `max_prefill_tokens_while_decoding`), a step that carries a
    prompt chunk is launched only after they are (its launch can block for most of its length, and
    the streams would wait for it on top of their own step)."""
    log = launch_order(max_prefill_tokens_while_decoding=16)
    launches = [(i, step, prompt) for i, (kind, step, prompt) in enumerate(log) if kind == "launch"]
    prompt_launches = [(i, step) for i, step, prompt in launches if prompt]
    assert len(prompt_launches) == 2  # a's prompt, then b's while a decodes
    for i, step in prompt_launches:
        read = {s for kind, s, _ in log[:i] if kind == "read"}
        assert read == set(range(1, step)), (step, log)  # every earlier step's tokens were read first
    # Decode steps still overlap: some decode launch comes before the previous step's read.
    overlapped = [step for i, step, prompt in launches
                  if not prompt and step > 1 and ("read", step - 1, False) not in log[:i]]
    assert overlapped, log


def test_offline_async_steps_overlap_prompt_launches_too() -> None:
    """Offline (no cap: nobody waits per token) the prompt step is launched while the previous
    step runs, like any other: its host work overlaps the device."""
    log = launch_order()
    overlapped = [step for i, (kind, step, prompt) in enumerate(log)
                  if kind == "launch" and prompt and step > 1 and ("read", step - 1, False) not in log[:i]]
    assert overlapped, log

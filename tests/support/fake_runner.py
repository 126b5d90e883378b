"""A fake executor and helpers for engine tests that need no model: an `Executor` that emits token
100 + output index (it can block on an event or raise on a step), the engine config it suits, and
stream collectors. Shared by the engine-loop, replica, token-interval and offline-API tests."""

from __future__ import annotations

import threading

from serving.engine.engine_loop import EngineLoop
from serving.engine.llm_engine import LLMEngine
from serving.engine_config import CacheConfig, EngineConfig
from serving.executor.batch_state import BatchState
from serving.executor.executor import Executor
from serving.executor.plan import ExecutorInfo, SampledToken, StepOutput, StepPlan

CONFIG = EngineConfig(block_size=4, max_num_seqs=8, max_num_batched_tokens=64, skip_tokenizer_init=True)


class FakeRunner(Executor):
    """An executor that emits token 100 + output index; can block on an event or raise on a step.

    It keeps the workers' mirror of the sequences (`BatchState`) from the plans, as a real
    worker does, so it also checks that the plans carry what a worker needs.
    """

    def __init__(self, fail_on_step: int | None = None, gate: threading.Event | None = None,
                 poison_min_tokens: int | None = None) -> None:
        self.info = ExecutorInfo(model_dir=".", cache=CacheConfig(4, 32, 1, 1, 1, "float32", 128), vocab_size=1000,
                                 eos_token_ids=(2,), device_type="cpu", devices=("cpu",))
        self.batch = BatchState()
        self.fail_on_step = fail_on_step
        self.gate = gate
        self.num_steps = 0
        self.freed: list[int] = []
        # A request whose min_tokens equals this makes any step that samples it raise (a bug in
        # one request's path, as an out-of-vocabulary stop id once was).
        self.poison_min_tokens = poison_min_tokens
        self.num_resets = 0

    def execute(self, plan: StepPlan) -> StepOutput:
        self.freed.extend(plan.finished_seq_ids)
        seqs = self.batch.apply(plan)
        self.num_steps += 1
        if self.gate is not None:
            self.gate.wait(10)
        if self.fail_on_step is not None and self.num_steps >= self.fail_on_step:
            raise RuntimeError("boom: CUDA error (simulated)")
        sampled = [seq for flag, seq in zip(plan.sample, seqs) if flag]
        if any(seq.params.min_tokens == self.poison_min_tokens for seq in sampled):
            raise IndexError("index 49152 is out of bounds (simulated)")
        for start, n, seq in zip(plan.starts, plan.num_tokens, seqs):
            assert len(seq.token_ids) >= start + n and len(seq.block_table) * 4 >= start + n, "plan out of sync"
        return StepOutput([SampledToken(100 + seq.num_output_tokens, logprob=-0.5) for seq in sampled])

    def reset(self) -> None:
        self.batch.clear()
        self.num_resets += 1


def start_loop(runner: FakeRunner, **kw) -> EngineLoop:
    loop = EngineLoop(CONFIG, engine_factory=lambda cfg: LLMEngine(cfg, runner), **kw).start()
    assert loop.wait_ready(10)
    return loop


def collect(stream, timeout: float = 10.0) -> list:
    return [d for d in _iter(stream, timeout)]


def _iter(stream, timeout: float):
    done: set[int] = set()
    while len(done) < stream.n:
        d = stream.get(timeout=timeout)
        if d.finish_reason is not None:
            done.add(d.index)
        yield d

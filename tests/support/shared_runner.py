"""Test helper: engines (`LLM`s) built over one shared, already loaded `ModelRunner`.

Loading the model once per module and building a fresh engine per test keeps the engine-level
tests fast on the CPU; on exit, every engine built must have ended all its requests and freed
every KV block (a leak fails the test that caused it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from serving.engine.llm_engine import LLMEngine
from serving.engine_config import EngineConfig
from serving.executor.executor import InProcessExecutor
from serving.executor.model_runner import ModelRunner
from serving.llm import LLM


class SharedRunnerExecutor(InProcessExecutor):
    """The single-device executor over a runner the test module already loaded and owns: it starts
    with the runner emptied, and shutting it down leaves the runner loaded for the next engine."""

    def __init__(self, runner: ModelRunner) -> None:  # (no super().__init__: that loads a model)
        runner.reset()
        self.runner, self.info = runner, runner.info()

    def shutdown(self) -> None:
        self.runner = None  # type: ignore[assignment]


@contextlib.contextmanager
def llms_on_runner(model_dir: str, runner, tokenizer, **defaults: object) -> Iterator[Callable[..., LLM]]:  # noqa: ANN001
    """Yields `make(**engine options) -> LLM` (`defaults` fill options not given)."""
    made: list[LLM] = []

    def make(**options: object) -> LLM:
        llm = LLM.from_engine(LLMEngine(EngineConfig(model=model_dir, **{**defaults, **options}),
                                        SharedRunnerExecutor(runner), tokenizer))
        made.append(llm)
        return llm

    yield make
    for llm in made:
        engine = llm.llm_engine
        assert not engine.has_unfinished_requests()
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks, "KV blocks leaked"
        assert all(b.ref_count == 0 for b in engine.block_manager.blocks)

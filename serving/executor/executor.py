"""The engine's one door to the devices: `Executor.execute(plan) -> StepOutput`, once per step.

An executor owns one worker per GPU (rank). `InProcessExecutor` runs a single worker on the
engine's own thread (one device, no tensor parallelism: the fastest path, no copies).
`MultiprocExecutor` (serving/executor/multiproc.py) spawns one process per rank, sends each
plan to all of them and reads the sampled tokens back from rank 0; it is used for tensor
parallelism and for model replicas (each replica's workers outside the HTTP process's GIL).
`serving/executor/factory.py` picks one of them.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable


from serving.engine_config import EngineConfig
from serving.executor.plan import ExecutorInfo, StepOutput, StepPlan


class WorkerFailedError(RuntimeError):
    """A worker process died, hung or could not start: the executor cannot run steps."""


class Executor(abc.ABC):
    """Runs `StepPlan`s on the workers. `info` describes the loaded model (one source)."""

    info: ExecutorInfo

    @abc.abstractmethod
    def execute(self, plan: StepPlan) -> StepOutput:
        """Launch one step on every worker; the output resolves to tokens on first `.sampled`."""

    # Whether `execute` takes a plan whose guided masks come later (`StepPlan.masks` None), through
    # `sample_deferred(masks)` before the next `execute`: the engine then fills them while the
    # step's forward runs. Executors without it get every plan with its masks.
    supports_deferred_masks = False

    def sample_deferred(self, masks: object) -> None:
        raise NotImplementedError

    @abc.abstractmethod
    def reset(self) -> None:
        """Every worker forgets its sequences (after a failed step, all are recomputed)."""

    def set_failure_callback(self, callback: Callable[[BaseException], None]) -> None:
        """`callback(error)` runs once, on a watchdog thread, if a worker dies or hangs."""

    def shutdown(self) -> None:
        """Stop the workers and free their devices (idempotent)."""


class InProcessExecutor(Executor):
    """One worker on the caller's thread: the single-device path."""

    def __init__(self, config: EngineConfig, model_dir: str | None = None, device: str | None = None) -> None:
        import torch

        from serving.executor.model_runner import ModelRunner

        runner = ModelRunner.__new__(ModelRunner)
        try:
            runner.__init__(config, model_dir, device=torch.device(device) if device else None)
        except BaseException:
            with contextlib.suppress(Exception):  # a failed device may fail this too
                runner.close()  # what a failed start allocated goes back now, not when its traceback goes
            raise
        self.runner = runner
        self.info = runner.info()

    supports_deferred_masks = True

    def execute(self, plan: StepPlan) -> StepOutput:
        if self.runner is None:
            raise WorkerFailedError("the executor is shut down")
        return self.runner.execute(plan)

    def sample_deferred(self, masks: object) -> None:
        self.runner.sample_deferred(masks)

    def reset(self) -> None:
        self.runner.reset()

    def shutdown(self) -> None:
        runner, self.runner = self.runner, None  # type: ignore[assignment]
        if runner is not None:
            runner.close()  # weights, KV cache, CUDA graphs: freed now, whoever still holds the runner

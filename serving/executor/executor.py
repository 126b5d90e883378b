"""The engine's one door to the devices: `Executor.execute(plan) -> StepOutput`, once per step.

An executor owns one worker per GPU (rank). `InProcessExecutor` runs a single worker on the
engine's own thread (one device, no tensor parallelism: the fastest path, no copies).
`MultiprocExecutor` (serving/executor/multiproc.py) spawns one process per rank, sends each
plan to all of them and reads the sampled tokens back from rank 0; it is used for tensor
parallelism and for model replicas (each replica's workers outside the HTTP process's GIL).
"""

from __future__ import annotations

import abc
from collections.abc import Callable

from typing import TYPE_CHECKING

from serving.engine_config import EngineConfig
from serving.executor.plan import ExecutorInfo, StepOutput, StepPlan

if TYPE_CHECKING:
    from serving.executor.model_runner import ModelRunner


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

        self.runner = ModelRunner(config, model_dir, device=torch.device(device) if device else None)
        self.info = self.runner.info()

    @classmethod
    def from_runner(cls, runner: ModelRunner) -> InProcessExecutor:
        """Wrap a runner that is already loaded (tests share one between engines); it starts empty."""
        executor = cls.__new__(cls)
        runner.reset()
        executor.runner, executor.info = runner, runner.info()
        return executor

    supports_deferred_masks = True

    def execute(self, plan: StepPlan) -> StepOutput:
        return self.runner.execute(plan)

    def sample_deferred(self, masks: object) -> None:
        self.runner.sample_deferred(masks)

    def reset(self) -> None:
        self.runner.reset()

    def shutdown(self) -> None:
        self.runner = None  # type: ignore[assignment]  # drop the model and KV cache


def make_executor(config: EngineConfig, model_dir: str | None, devices: tuple[str, ...] | None = None,
                  multiprocess: bool | None = None) -> Executor:
    """The executor for `config.tensor_parallel_size` ranks on `devices` (default: the first ones).

    `multiprocess`: force worker processes even for one rank (replicas do, to keep each
    replica's device work off the HTTP process's GIL); default only when there are several ranks.
    """
    tp = config.tensor_parallel_size
    if devices is None:
        devices = default_devices(config, tp)
    if len(devices) != tp:
        raise ValueError(f"tensor_parallel_size={tp} needs {tp} devices, got {list(devices)}")
    if tp == 1 and not multiprocess:
        return InProcessExecutor(config, model_dir, devices[0])
    from serving.executor.multiproc import MultiprocExecutor

    return MultiprocExecutor(config, model_dir, devices)


def visible_device_count(config: EngineConfig) -> int:
    """GPUs this process may use (0 when the engine runs on the CPU)."""
    import torch

    if config.device == "cpu" or not torch.cuda.is_available():
        return 0
    return torch.cuda.device_count()


def default_devices(config: EngineConfig, count: int, first: int = 0) -> tuple[str, ...]:
    """`count` devices from index `first`: GPUs when the engine runs on CUDA, else CPU ranks."""
    gpus = visible_device_count(config)
    if gpus == 0:
        if config.device == "cuda":
            raise RuntimeError("device='cuda' was asked for but CUDA is not available")
        return ("cpu",) * count
    if first + count > gpus:
        raise ValueError(f"tensor_parallel_degree={count} (from device {first}) exceeds the {gpus} visible GPUs; "
                         "lower TENSOR_PARALLEL_DEGREE / option.tensor_parallel_degree")
    return tuple(f"cuda:{first + i}" for i in range(count))

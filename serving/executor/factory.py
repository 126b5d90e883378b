"""`make_executor`: the executor for a configuration, on which devices.

Kept apart from the executors themselves so that `executor.py` (the interface and the
in-process executor) and `multiproc.py` (which subclasses it) import one way only.
"""

from __future__ import annotations

from serving.engine_config import EngineConfig
from serving.executor.executor import Executor, InProcessExecutor
from serving.executor.multiproc import MultiprocExecutor


def make_executor(config: EngineConfig, model_dir: str | None, devices: tuple[str, ...] | None = None,
                  multiprocess: bool | None = None) -> Executor:
    """The executor for `config.tensor_parallel_size` ranks on `devices` (default: the first ones).

    `multiprocess`: force worker processes even for one rank (replicas do, to keep each
    replica's device work off the HTTP process's GIL); default: `config.distributed_executor_backend`
    says "mp", or there are several ranks.
    """
    if devices is None:
        devices = config.rank_devices(visible_device_count(config))
    assert len(devices) == config.tensor_parallel_size, (  # devices come from EngineConfig.rank_devices
        f"tensor_parallel_size={config.tensor_parallel_size} needs as many devices, got {list(devices)}")
    if multiprocess is None:
        multiprocess = config.distributed_executor_backend == "mp"
    if config.tensor_parallel_size == 1 and not multiprocess:
        return InProcessExecutor(config, model_dir, devices[0])
    return MultiprocExecutor(config, model_dir, devices)


def visible_device_count(config: EngineConfig) -> int:
    """GPUs this process may use (0 when the engine runs on the CPU)."""
    import torch

    if config.device == "cpu" or not torch.cuda.is_available():
        if config.device == "cuda":
            raise RuntimeError("device='cuda' was asked for but CUDA is not available")
        return 0
    return torch.cuda.device_count()

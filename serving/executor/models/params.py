"""What every layer's parameters share: how they are made, marked and filled from a checkpoint.

Parameters carry a `weight_loader(param, loaded, shard_id)` that `serving/executor/weights.py`
calls with a checkpoint tensor or a lazy safetensors slice (`get_slice`): a loader indexes only
the rows/columns its rank holds (`read_checkpoint`), so a rank never reads a whole sharded tensor.
Parameters that hold a per-rank slice are marked `tp_sharded = True` (for dummy weights).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from serving.executor.parallel import TPShard

SINGLE = TPShard()  # one process holds everything


class TensorSlice(Protocol):
    """A lazily read checkpoint tensor (safetensors `safe_open(...).get_slice(name)`)."""

    def get_shape(self) -> list[int]: ...

    def __getitem__(self, index: object) -> torch.Tensor: ...


Loaded = torch.Tensor | TensorSlice


def checkpoint_shape(loaded: Loaded) -> tuple[int, ...]:
    """The shape of a checkpoint tensor or lazy slice, read without reading the tensor."""
    return tuple(loaded.shape) if isinstance(loaded, torch.Tensor) else tuple(loaded.get_shape())


def read_checkpoint(loaded: Loaded, dim: int = 0, start: int = 0, size: int | None = None) -> torch.Tensor:
    """Elements [start, start + size) of `loaded` along `dim` (all when size is None); only those are read."""
    if size is None:
        return loaded if isinstance(loaded, torch.Tensor) else loaded[:]
    if isinstance(loaded, torch.Tensor):
        return loaded.narrow(dim, start, size)
    return loaded[(slice(None),) * dim + (slice(start, start + size),)]


def check_shape(loaded: Loaded, expected: tuple[int, ...], what: str = "parameter") -> None:
    """A clear error when a checkpoint tensor's shape is not the parameter's."""
    if checkpoint_shape(loaded) != expected:
        raise ValueError(f"checkpoint tensor shape {checkpoint_shape(loaded)} != {what} shape {expected}")


def new_param(*shape: int) -> nn.Parameter:
    """An uninitialised, frozen parameter (filled by its loader or by dummy weights)."""
    # Device and dtype come from the construction context (see models.build_model).
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def mark_sharded(sharded: bool, *params: nn.Parameter | None) -> None:
    """Mark `params` as holding this rank's slice (`tp_sharded`) or the whole tensor."""
    for p in params:
        if p is not None:
            p.tp_sharded = sharded


def default_weight_loader(param: torch.Tensor, loaded: Loaded, shard_id: object = None) -> None:
    """Copy a whole checkpoint tensor into `param` (replicated parameters; shapes must match)."""
    assert shard_id is None, f"unexpected shard {shard_id!r} for an unpacked parameter"
    check_shape(loaded, tuple(param.shape))
    param.data.copy_(read_checkpoint(loaded))

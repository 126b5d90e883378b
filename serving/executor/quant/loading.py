"""Which slice of a quantized checkpoint tensor each tensor-parallel rank holds, and reading it.

A linear layer describes itself with a `LinearSpec`: its input rows K (row-parallel layers hold
[in_start, in_start + in_size) of in_full) and its output parts (column-parallel layers hold rows
[start, start + size) of each part: q|k|v, gate|up). A quantized parameter carries a `QuantAxes`:
which checkpoint axis runs along K and which along N, and how many K rows / N columns one element
covers there (a GPTQ qweight row packs 32 // bits input rows; a scales row is one group; an AWQ
qweight column packs 8 output columns). `load_sharded` reads only this rank's block, checking the
checkpoint's shape and that the rank's boundaries fall on whole elements (whole words, whole groups).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch


class Part(Protocol):
    """One output part of a layer (layers.OutputPart): this rank holds rows [start, start + size) of `full`."""

    full: int
    start: int
    size: int


@dataclass(frozen=True)
class LinearSpec:
    """The shape of one rank's linear layer in input rows (K) and output parts (N)."""

    in_full: int
    in_start: int
    in_size: int
    parts: Mapping[str, Part]
    offsets: Mapping[str, tuple[int, int]]  # part -> (offset in this rank's N, size)
    name: str = ""  # the HF module name, for messages

    @property
    def out_size(self) -> int:
        return sum(size for _, size in self.offsets.values())

    @property
    def out_full(self) -> int:
        return sum(p.full for p in self.parts.values())

    @property
    def is_sharded(self) -> bool:
        return self.in_size != self.in_full or any(p.size != p.full for p in self.parts.values())


@dataclass(frozen=True)
class QuantAxes:
    """How a checkpoint tensor's axes map to K and N (None: the tensor has no such axis)."""

    in_dim: int | None = None
    in_unit: int = 1  # input rows per element along in_dim
    in_whole: bool = False  # every rank keeps the whole in_dim (act-order groups, per-channel scales)
    out_dim: int | None = None
    out_unit: int = 1  # output columns per element along out_dim


def _units(value: int, unit: int, what: str, spec: LinearSpec) -> int:
    if value % unit:
        raise ValueError(f"{spec.name or 'layer'}: {what} {value} is not a multiple of {unit}, so this "
                         "tensor-parallel split does not fall on whole packed words / groups")
    return value // unit


def make_loader(spec: LinearSpec, axes: QuantAxes) -> Callable[[torch.Tensor, object, object], None]:
    """A `weight_loader(param, loaded, shard_id)` for a parameter laid out as `axes` says."""

    def load(param: torch.Tensor, loaded: object, shard_id: object = None) -> None:
        load_sharded(param, loaded, shard_id, spec, axes)

    return load


def load_sharded(param: torch.Tensor, loaded: object, shard_id: object, spec: LinearSpec, axes: QuantAxes) -> None:
    """Copy this rank's block of checkpoint tensor `loaded` (a tensor or lazy slice) into `param`.

    `shard_id` None: the whole (possibly fused, parts in order) tensor; else that part alone.
    """
    names = list(spec.parts) if shard_id is None else [str(shard_id)]
    if any(n not in spec.parts for n in names):
        raise ValueError(f"unknown shard {shard_id!r} (parts: {list(spec.parts)})")
    shape = tuple(loaded.shape) if isinstance(loaded, torch.Tensor) else tuple(loaded.get_shape())
    want = list(param.shape)
    src: list[slice] = [slice(None)] * param.dim()
    dst: list[slice] = [slice(None)] * param.dim()
    if axes.in_dim is not None:
        if axes.in_whole:
            want[axes.in_dim] = param.shape[axes.in_dim]
        else:
            want[axes.in_dim] = -(-spec.in_full // axes.in_unit)
            start = _units(spec.in_start, axes.in_unit, "input row", spec)
            src[axes.in_dim] = slice(start, start + _units(spec.in_size, axes.in_unit, "input rows", spec))
    if axes.out_dim is not None:
        want[axes.out_dim] = _units(sum(spec.parts[n].full for n in names), axes.out_unit, "output size", spec)
    if tuple(want) != shape:
        raise ValueError(f"checkpoint tensor shape {shape} != expected {tuple(want)}"
                         + (f" (part {shard_id!r})" if shard_id is not None else ""))
    if axes.out_dim is None:
        param.data.copy_(_read(loaded, src))
        return
    row = 0  # where this part starts in the checkpoint tensor, in output columns
    for name in names:
        part, (offset, size) = spec.parts[name], spec.offsets[name]
        begin = _units(row + part.start, axes.out_unit, f"{name!r} output column", spec)
        n = _units(size, axes.out_unit, f"{name!r} output columns", spec)
        src[axes.out_dim] = slice(begin, begin + n)
        dst[axes.out_dim] = slice(offset // axes.out_unit, offset // axes.out_unit + n)
        param.data[tuple(dst)].copy_(_read(loaded, src))
        row += part.full


def _read(loaded: object, index: list[slice]) -> torch.Tensor:
    if isinstance(loaded, torch.Tensor):
        return loaded[tuple(index)]
    return loaded[tuple(index) if index else ...]  # type: ignore[index]

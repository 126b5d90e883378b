"""Giving a worker's device memory back when its engine shuts down, whoever still holds the objects.

Dropping references is not enough: a frame kept alive by a reference cycle (a lazy import or a
Triton compile under the constructor) can hold the model or the KV cache in one of its locals
until the cyclic collector runs. So shutdown empties the tensors themselves: every parameter,
buffer and tensor attribute of the model is pointed at an empty tensor, and the storage goes
back to the allocator as soon as the last view of it does.
"""

from __future__ import annotations

import dataclasses

import torch


def release_tensor(t: torch.Tensor) -> None:
    """Point `t` at an empty storage (its old one is freed once no other tensor views it)."""
    with torch.no_grad():
        t.data = torch.empty(0, dtype=t.dtype, device=t.device)


def release_module(module: torch.nn.Module) -> None:
    """Empty every parameter, buffer and tensor attribute of `module` and its submodules.

    The module cannot run afterwards; this is for a model that is being thrown away. Attributes
    set on parameters go too: a `weight_loader` bound to the layer that owns the parameter is a
    reference cycle (layer -> parameter -> bound method -> layer) only the collector would free.
    """
    for m in module.modules():
        for t in (*m._parameters.values(), *m._buffers.values()):  # noqa: SLF001 - nn.Module's own tables
            if t is not None:
                release_tensor(t)
                vars(t).clear()
        for name, value in list(vars(m).items()):
            if isinstance(value, torch.Tensor):  # plain attributes (KV cache views, shared RoPE tables)
                setattr(m, name, torch.empty(0))
            elif dataclasses.is_dataclass(value) and any(  # hand-off objects holding tensors (L2 hints)
                    isinstance(getattr(value, f.name), torch.Tensor) for f in dataclasses.fields(value)):
                setattr(m, name, None)

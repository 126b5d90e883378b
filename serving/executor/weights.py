"""Weight loading: safetensors checkpoints (single or sharded) -> our model's parameters.

A model may rename checkpoint tensors (`checkpoint_name`: nested or differently named modules; None
skips a tensor) and re-lay them out (`checkpoint_tensor`: GPT-2's transposed Conv1D weights).
HF names map to ours one-to-one except packed projections, which go through each parameter's
`weight_loader` with a shard id (q_proj -> qkv_proj["q"], gate_proj -> gate_up_proj["0"], ...;
the model's `packed_modules_mapping`). Every parameter (every shard of a packed one) must be
filled, or loading fails naming what is missing. `load_format="dummy"` fills random weights
of the right shapes on the device instead (benchmarks without a checkpoint).

Tensor parallel: tensors are handed to the loaders as lazy safetensors slices (`get_slice`), so
each rank reads from disk only the rows/columns its parameters hold (a replicated parameter,
e.g. a norm weight, is read whole). Dummy weights are deterministic per (seed, rank, name): a
parameter that holds a per-rank slice (`tp_sharded`) is drawn from a generator seeded with the
rank too, so ranks together do NOT hold the slices of the one model a single GPU would draw
(that would mean every rank drawing every full tensor, too slow for 70B); replicated parameters
are the same on every rank, and with one rank everything is as it always was.

Quantized layers: their tensors (qweight, scales, weight_scale, ...) load like any other through
their loaders; a parameter marked `optional_in_checkpoint` may be absent (GPTQ's g_idx without
desc_act, fp8 input scales); after loading (or the dummy fill, which draws packed int32 words and
positive scales through each parameter's `fill_dummy`) every quantized layer converts its tensors
to the kernels' layout once (`quant.process_weights_after_loading`). Before that, a parameter
holding NaN or Inf fails the load naming its checkpoint tensors (`finite_weights.py`).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from serving.executor.finite_weights import check_finite
from serving.executor.models.params import TensorSlice
from serving.executor.quant import process_weights_after_loading

logger = logging.getLogger(__name__)

# Checkpoint tensors we never need (buffers some exporters save; FP8 checkpoints' KV-cache scales:
# the KV cache stays in the model dtype here).
_SKIP_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached",
                  ".kv_scale", ".k_scale", ".v_scale")


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: from the index if sharded, else model.safetensors."""
    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [d / f for f in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"shards listed in {index} are missing: {missing}")
        return files
    if (d / "model.safetensors").is_file():
        return [d / "model.safetensors"]
    files = sorted(d.glob("*.safetensors"))
    if files:
        return files
    raise FileNotFoundError(
        f"no safetensors weights in {d} (expected model.safetensors or model.safetensors.index.json); "
        "PyTorch .bin checkpoints are not supported"
    )


def iterate_checkpoint(model_dir: str | Path) -> Iterator[tuple[str, TensorSlice]]:
    """Yield (HF name, lazy slice) for every tensor of the checkpoint, shard file by shard file.

    Nothing is read until the slice is indexed (`slice[a:b]`, `slice[:, a:b]`, `slice[:]`).
    """
    from safetensors import SafetensorError, safe_open

    for path in checkpoint_files(model_dir):
        try:
            f = safe_open(str(path), framework="pt", device="cpu")
        except SafetensorError as exc:  # truncated, empty or not safetensors: name the file
            raise ValueError(f"cannot read the checkpoint file {path}: {exc} (incomplete download or not a "
                             "safetensors file?)") from None
        with f:
            for name in f.keys():
                yield name, f.get_slice(name)


def load_weights(model: nn.Module, model_dir: str | Path) -> None:
    """Fill `model`'s parameters from the checkpoint in `model_dir` (dtype cast on copy)."""
    t0 = time.monotonic()
    params = dict(model.named_parameters())
    mapping: dict[str, tuple[str, str]] = getattr(model, "packed_modules_mapping", {})
    tied = getattr(model, "lm_head", None) is None
    rename = getattr(model, "checkpoint_name", None)  # a model whose checkpoint nests or adds modules
    transform = getattr(model, "checkpoint_tensor", None)  # a model whose checkpoint lays a tensor out otherwise
    filled: dict[str, set[str | None]] = {}
    loads: dict[str, list[tuple[str | None, str]]] = {}  # our parameter -> (shard, checkpoint tensor) loaded into it
    unexpected: list[str] = []
    with torch.no_grad():
        for name, loaded in iterate_checkpoint(model_dir):
            checkpoint_name = name
            if rename is not None and (name := rename(name)) is None:
                continue  # a tensor of a part this model does not run (a vision tower)
            if name.endswith(_SKIP_SUFFIXES) or (tied and name.startswith("lm_head.")):
                continue
            target, shard = name, None
            for hf_piece, (ours, shard_id) in mapping.items():
                if f".{hf_piece}." in name:
                    target, shard = name.replace(f".{hf_piece}.", f".{ours}."), shard_id
                    break
            param = params.get(target)
            if param is None:
                unexpected.append(name)
                continue
            _check_not_integer(name, loaded, param)
            if transform is not None:  # by the checkpoint's (renamed) name: q_proj and k_proj apart
                loaded = transform(name, loaded)
            try:
                param.weight_loader(param, loaded, shard)
            except ValueError as e:
                raise ValueError(f"cannot load checkpoint tensor {name!r}: {e}") from None
            filled.setdefault(target, set()).add(shard)
            loads.setdefault(target, []).append((shard, checkpoint_name))
    if unexpected:
        raise ValueError(f"checkpoint has tensors the model does not expect: {unexpected[:8]}"
                         f"{' ...' if len(unexpected) > 8 else ''}")
    missing = [n for n, p in params.items()
               if not _complete(model, n, filled.get(n)) and not getattr(p, "optional_in_checkpoint", False)]
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks weights for: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    check_finite(_loaded_regions(model, params, loads), str(model_dir))
    process_weights_after_loading(model)
    logger.info("loaded %d tensors from %s in %.2f s", len(params), model_dir, time.monotonic() - t0)


def _loaded_regions(model: nn.Module, params: dict[str, nn.Parameter],
                    loads: dict[str, list[tuple[str | None, str]]]) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint tensor, what it filled) for the NaN/Inf check: the rows of its part in a packed
    parameter (q_proj's rows of qkv_proj), else the whole parameter once, named by all it holds."""
    for target, items in loads.items():
        param = params[target]
        if getattr(param, "values_not_loaded", False):  # its loader reads nothing (FP8's static input_scale)
            continue
        offsets = getattr(model.get_submodule(target.rsplit(".", 1)[0]), "shard_offsets", None) \
            if "." in target else None
        rows = sum(size for _, size in offsets.values()) if offsets else None
        if offsets and param.dim() and param.shape[0] == rows and all(
                shard is not None and str(shard) in offsets for shard, _ in items):
            for shard, name in items:
                offset, size = offsets[str(shard)]
                yield name, param.detach().narrow(0, offset, size)
        else:
            yield ", ".join(name for _, name in items), param


_INTEGER_DTYPES = {"BOOL", "U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64",  # safetensors' names
                   "TORCH.BOOL", "TORCH.UINT8", "TORCH.INT8", "TORCH.INT16", "TORCH.INT32", "TORCH.INT64"}


def _check_not_integer(name: str, loaded: TensorSlice, param: torch.Tensor) -> None:
    """An integer tensor cast into a floating-point weight is garbage that would be served: such a
    checkpoint is quantized in a way its config.json does not declare (no quantization_config)."""
    dtype = loaded.get_dtype() if hasattr(loaded, "get_dtype") else str(getattr(loaded, "dtype", ""))
    if param.is_floating_point() and dtype.upper() in _INTEGER_DTYPES:
        raise ValueError(f"checkpoint tensor {name!r} holds {dtype} integers for a floating-point weight: the "
                         "checkpoint is quantized but its config.json has no quantization_config saying how "
                         "(or names a format this server does not read); refusing to serve it as garbage")


def _complete(model: nn.Module, name: str, shards: set[str | None] | None) -> bool:
    if not shards:
        return False
    if None in shards:
        return True
    module = model.get_submodule(name.rsplit(".", 1)[0])
    return set(getattr(module, "shard_offsets", {})) <= shards


def init_dummy_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Random weights of the right shapes, made on the parameters' device, deterministic by seed.

    Norm weights are ones and biases zeros, as a freshly initialised HF model has them. Under
    tensor parallelism a per-rank slice is seeded by (seed, rank, name) (see the module docstring).
    """
    shard = getattr(model, "tp_shard", None)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if "norm" in name:
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                key = name
                if shard is not None and shard.world_size > 1 and getattr(param, "tp_sharded", False):
                    key = f"{name}@rank{shard.rank}/{shard.world_size}"
                gen = torch.Generator(device=param.device).manual_seed(seed + _stable_hash(key))
                fill = getattr(param, "fill_dummy", None)
                if fill is not None:  # quantized tensors: packed words, positive scales, valid g_idx
                    fill(param, gen, std)
                else:
                    param.normal_(0.0, std, generator=gen)
    process_weights_after_loading(model)


def _stable_hash(name: str) -> int:
    # Python's hash() is salted per process; seeds must not depend on it.
    h = 0
    for ch in name.encode():
        h = (h * 131 + ch) % (2**31)
    return h

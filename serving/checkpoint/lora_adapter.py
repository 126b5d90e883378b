"""Reads and checks a PEFT LoRA adapter directory against the base model: `read_adapter`.

Shared by the engine (checks an adapter when it is registered: config and tensor shapes only,
nothing loaded) and the executor's workers (load the tensors into their host cache). In: a dir
with `adapter_config.json` + `adapter_model.safetensors`, the base model's `ModelArgs`, the
largest rank allowed. Out: `AdapterWeights`, per (layer, projection) A [r, in] and B [out, r]
float32 with the scaling (alpha / r, or alpha / sqrt(r) with rsLoRA) folded into B; fused PEFT
targets (Phi-3's `qkv_proj`, `gate_up_proj`) are split into their q/k/v and gate/up parts.
Anything we cannot apply exactly raises ValueError naming it.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from serving.checkpoint.model_config import ModelArgs

# The projections an adapter may target, as PEFT names them (fused ones are split on load).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass
class AdapterWeights:
    """One adapter's tensors: `tensors[(layer, target)] = (A [r, in], B [out, r] * scaling)`, float32."""

    rank: int
    scaling: float
    tensors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def targets(self) -> set[str]:
        return {name for _, name in self.tensors}


def projection_shapes(args: ModelArgs) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each target projection of the whole (unsharded) model."""
    h, q, kv, i = args.hidden_size, args.num_attention_heads * args.head_dim, \
        args.num_key_value_heads * args.head_dim, args.intermediate_size
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
              "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
    shapes["qkv_proj"] = (h, q + 2 * kv)
    shapes["gate_up_proj"] = (h, 2 * i)
    return shapes


def _config(path: Path) -> dict:
    if not path.is_dir():
        raise ValueError(f"LoRA adapter {str(path)!r} is not a directory")
    cfg_file = path / "adapter_config.json"
    if not cfg_file.is_file():
        raise ValueError(f"LoRA adapter {str(path)!r} has no adapter_config.json (a PEFT adapter dir is expected)")
    if not (path / "adapter_model.safetensors").is_file():
        found = "adapter_model.bin" if (path / "adapter_model.bin").is_file() else "no weights file"
        raise ValueError(f"LoRA adapter {str(path)!r} has {found}; only adapter_model.safetensors is read "
                         "(re-save the adapter with PEFT's save_pretrained(safe_serialization=True))")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"LoRA adapter {str(path)!r}: adapter_config.json is not valid JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"LoRA adapter {str(path)!r}: adapter_config.json must be a JSON object, "
                         f"got {type(cfg).__name__}")
    return cfg


def _check_config(cfg: dict, where: str, max_rank: int) -> tuple[int, float]:
    """(rank, scaling) of a PEFT LoRA config, or ValueError for what we cannot apply exactly."""
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}: peft_type {cfg.get('peft_type')!r} is not supported (LORA only)")
    unsupported = [(k, cfg.get(k)) for k in ("use_dora", "fan_in_fan_out", "lora_bias") if cfg.get(k)]
    unsupported += [(k, cfg.get(k)) for k in ("modules_to_save", "rank_pattern", "alpha_pattern",
                                              "trainable_token_indices") if cfg.get(k)]
    if cfg.get("bias", "none") != "none":
        unsupported.append(("bias", cfg.get("bias")))
    if unsupported:
        listed = ", ".join(f"{k}={v!r}" for k, v in unsupported)
        raise ValueError(f"{where}: {listed} is not supported (plain LoRA on {', '.join(LORA_TARGETS)} only)")
    rank = cfg.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"{where}: adapter_config.json 'r' must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise ValueError(f"{where}: rank {rank} exceeds max_lora_rank={max_rank}; "
                         f"raise option.max_lora_rank to at least {rank}")
    alpha = cfg.get("lora_alpha", rank)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise ValueError(f"{where}: adapter_config.json 'lora_alpha' must be a finite number, got {alpha!r}")
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    return rank, float(scaling)


def read_adapter(path: str | Path, args: ModelArgs, max_rank: int, load: bool = True) -> AdapterWeights:
    """Check the PEFT adapter at `path` against the base model; with `load`, read its tensors.

    Raises ValueError (what is wrong, and with what) for a missing/unsupported file, a rank over
    `max_rank`, a module we cannot apply (embeddings, lm_head, anything outside the attention
    and MLP projections) or a shape that does not match the base model.
    """
    from safetensors import SafetensorError

    path = Path(path)
    where = f"LoRA adapter {str(path)!r}"
    rank, scaling = _check_config(_config(path), where, max_rank)
    shapes = projection_shapes(args)
    out = AdapterWeights(rank, scaling)
    found: dict[tuple[int, str], dict[str, torch.Tensor | tuple[int, ...]]] = {}
    try:
        _read_tensors(path, where, args, rank, load, shapes, found)
    except SafetensorError as exc:  # a truncated or malformed file: the client's input, not our fault
        raise ValueError(f"{where}: adapter_model.safetensors cannot be read: {exc}") from None
    for (layer, target), pair in found.items():
        if set(pair) != {"A", "B"}:
            raise ValueError(f"{where}: layer {layer} {target} has lora_{''.join(pair)} without its pair")
        if not load:
            continue
        a, b = pair["A"], pair["B"] * scaling  # type: ignore[operator]
        if target in _FUSED:  # one A shared by the parts, B split by their output rows
            sizes = [shapes[p][1] for p in _FUSED[target]]
            for part, b_part in zip(_FUSED[target], b.split(sizes)):  # type: ignore[union-attr]
                out.tensors[(layer, part)] = (a, b_part.contiguous())  # type: ignore[assignment]
        else:
            out.tensors[(layer, target)] = (a, b)  # type: ignore[assignment]
    if not found:
        raise ValueError(f"{where}: adapter_model.safetensors holds no LoRA tensors")
    return out


def _read_tensors(path: Path, where: str, args: ModelArgs, rank: int, load: bool,
                  shapes: dict[str, tuple[int, int]], found: dict) -> None:
    """Check (and with `load`, read) every tensor of the adapter into `found`; ValueError naming it."""
    from safetensors import safe_open

    with safe_open(str(path / "adapter_model.safetensors"), framework="pt") as f:
        for key in f.keys():
            m = _KEY.search(key)
            if m is None or m.group(2) not in shapes:
                raise ValueError(f"{where}: tensor {key!r} targets a module LoRA cannot be applied to here "
                                 f"(supported targets: {', '.join(LORA_TARGETS)})")
            layer, target, ab = int(m.group(1)), m.group(2), m.group(3)
            if layer >= args.num_hidden_layers:
                raise ValueError(f"{where}: tensor {key!r} is for layer {layer}; the base model has "
                                 f"{args.num_hidden_layers} layers")
            d_in, d_out = shapes[target]
            expected = (rank, d_in) if ab == "A" else (d_out, rank)
            shape = tuple(f.get_slice(key).get_shape())
            if shape != expected:
                raise ValueError(f"{where}: tensor {key!r} has shape {list(shape)}, the base model needs "
                                 f"{list(expected)} (rank {rank}); was it trained on another model?")
            found.setdefault((layer, target), {})[ab] = f.get_tensor(key).float() if load else shape

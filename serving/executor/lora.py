"""Multi-LoRA on one worker: adapter slots on the device, a host cache, and the wrapped projections.

`LoRAManager` wraps each decoder layer's qkv_proj, o_proj, gate_up_proj and down_proj in a
`LoRALinear` once the base weights are loaded (layers.py is untouched), and owns per projection
two stacked slot tensors: A `[max_loras, slices * max_lora_rank, in_local]` and B `[max_loras,
out_local, max_lora_rank]`, zero-padded to the rank, the scaling folded into B. Plans say
which adapter each slot holds (`StepPlan.lora_loads`: slot -> (name, id, path), or None to
free it); the manager reads adapters from disk into an LRU host cache of `max_cpu_loras` and
copies them into their slot (stream-ordered: a step still running on the old contents is not
disturbed). Per step the runner stages each token row's slot (-1: base) in a persistent device
buffer; the forward groups rows by slot once (`kernels.lora_segments`) and every wrapped
projection adds its rows' x·Aᵀ·Bᵀ (`kernels.lora_shrink` / `lora_expand`). The buffer is
persistent, so CUDA graphs capture all of it: decode graphs, and each piece of the piecewise
graphs for steps with prompt tokens (`rows` wraps every piece).

Tensor parallel: column-parallel projections (qkv, gate_up) keep A whole and this rank's rows
of B (its part of each packed slice); row-parallel ones (o, down) keep this rank's columns of
A and all of B, and all-reduce the small shrink output before expanding.
"""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch import nn

import kernels
from serving.engine_config import EngineConfig
from serving.executor import parallel
from serving.executor.models.layers import ColumnParallelLinear, RowParallelLinear
from serving.lora_adapter import AdapterWeights, read_adapter
from serving.model_config import ModelArgs

logger = logging.getLogger(__name__)

AdapterKey = tuple[str, int, str]  # (lora_name, lora_int_id, lora_path): what a plan loads into a slot


class LoRABatch:
    """This forward's rows grouped by slot (`kernels.lora_segments`), shared by every wrapped projection."""

    def __init__(self) -> None:
        self.segments: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


class LoRALinear(nn.Module):
    """A base projection plus each row's adapter (if any): y = base(x) + x·A[slot]ᵀ·B[slot]ᵀ.

    `parts` are the PEFT targets packed in the base output, in order, with (start, size) of
    this rank's rows of each in the full part; `in_part` is (start, size) of this rank's input
    columns for a row-parallel base (None: all of them).
    """

    def __init__(self, base: nn.Module, parts: list[tuple[str, int, int]], in_part: tuple[int, int] | None,
                 in_local: int, num_slots: int, max_rank: int, batch: LoRABatch, like: torch.Tensor) -> None:
        super().__init__()
        self.base = base
        self.parts = parts
        self.in_part = in_part
        self.slice_sizes = tuple(size for _, _, size in parts)
        self.batch = batch
        self.max_rank = max_rank
        self.reduce_shrink = in_part is not None
        # (sizes from the layer geometry, not base.weight: a quantized base holds no float weight)
        self.lora_a = torch.zeros(num_slots, len(parts) * max_rank, in_local, dtype=like.dtype, device=like.device)
        self.lora_b = torch.zeros(num_slots, sum(self.slice_sizes), max_rank, dtype=like.dtype, device=like.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        seg = self.batch.segments
        if seg is None:
            return y
        partials = kernels.lora_shrink(x, self.lora_a, *seg)  # [P, T, slices * r] float32
        if self.reduce_shrink:  # this rank saw only its input columns: sum the partial products
            partials = parallel.all_reduce(partials.sum(0, keepdim=True))
        kernels.lora_expand(y, partials, self.lora_b, self.slice_sizes, *seg)
        return y

    def write_slot(self, slot: int, layer: int, weights: AdapterWeights | None) -> None:
        """Copy `weights` (this layer's parts; None = nothing) into `slot`, zero elsewhere."""
        a_slot, b_slot = self.lora_a[slot], self.lora_b[slot]
        a_slot.zero_()
        b_slot.zero_()
        if weights is None:
            return
        r_max, col = self.max_rank, 0
        for p, (name, start, size) in enumerate(self.parts):
            pair = weights.tensors.get((layer, name))
            if pair is not None:
                a, b = pair  # [r, in_full], [out_full, r]
                r = a.shape[0]
                if self.in_part is not None:
                    a = a[:, self.in_part[0] : self.in_part[0] + self.in_part[1]]
                a_slot[p * r_max : p * r_max + r].copy_(a, non_blocking=True)
                b_slot[col : col + size, :r].copy_(b[start : start + size], non_blocking=True)
            col += size


_QKV = {"q": "q_proj", "k": "k_proj", "v": "v_proj"}  # our packed part -> PEFT target
_GATE_UP = {"0": "gate_proj", "1": "up_proj"}


def _column_parts(base: ColumnParallelLinear, names: dict[str, str]) -> list[tuple[str, int, int]]:
    """(PEFT target, start, size) of each packed part this rank holds, in the weight's row order."""
    return [(names[key], part.start, part.size) for key, part in base.parts.items()]


class LoRAManager:
    """Slots, host cache and per-step slot staging for one worker (see the module docstring)."""

    def __init__(self, model: nn.Module, config: EngineConfig, args: ModelArgs, max_num_tokens: int) -> None:
        self.num_slots = config.max_loras
        self.max_rank = config.max_lora_rank
        self.max_host = config.num_cpu_loras
        self.args = args
        self.batch = LoRABatch()
        self.layers: list[list[LoRALinear]] = []
        like = model.model.norm.weight  # the model's dtype and device
        device = like.device
        h = args.hidden_size
        inter_local = args.intermediate_size // parallel.tp_world_size()
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append([
                self._wrap(attn, "qkv_proj", _column_parts(attn.qkv_proj, _QKV), h, like),
                self._wrap(attn, "o_proj", [("o_proj", 0, h)], attn.q_size, like),
                self._wrap(mlp, "gate_up_proj", _column_parts(mlp.gate_up_proj, _GATE_UP), h, like),
                self._wrap(mlp, "down_proj", [("down_proj", 0, h)], inter_local, like),
            ])
        # Each token row's slot (-1: base); persistent, so the decode graphs read it on replay.
        self.token_slots = torch.full((max_num_tokens,), -1, dtype=torch.int64, device=device)
        self.slot_keys: list[AdapterKey | None] = [None] * self.num_slots
        self.host: OrderedDict[AdapterKey, AdapterWeights] = OrderedDict()
        nbytes = sum(m.lora_a.numel() * m.lora_a.element_size() + m.lora_b.numel() * m.lora_b.element_size()
                     for layer in self.layers for m in layer)
        logger.info("LoRA: %d slots of rank <= %d on %s (%.1f MiB), host cache of %d adapters",
                    self.num_slots, self.max_rank, device, nbytes / 2**20, self.max_host)

    def _wrap(self, parent: nn.Module, attr: str, parts: list[tuple[str, int, int]], in_local: int,
              like: torch.Tensor) -> LoRALinear:
        base = getattr(parent, attr)
        in_part = (base.in_start, in_local) if isinstance(base, RowParallelLinear) and base.reduce else None
        wrapped = LoRALinear(base, parts, in_part, in_local, self.num_slots, self.max_rank, self.batch, like)
        setattr(parent, attr, wrapped)
        return wrapped

    # ---- slots ---------------------------------------------------------------------------

    def apply_loads(self, loads: dict[int, AdapterKey | None]) -> None:
        """Fill or free slots as the plan says (adapters read from the host cache, else from disk)."""
        for slot, key in loads.items():
            if self.slot_keys[slot] == key:
                continue
            if key is None:  # freed (its adapter was removed): nor keep it in host memory
                self.host.pop(self.slot_keys[slot], None)  # type: ignore[arg-type]
            weights = self._host_weights(key) if key is not None else None
            for i, layer in enumerate(self.layers):
                for module in layer:
                    module.write_slot(slot, i, weights)
            self.slot_keys[slot] = key

    def _host_weights(self, key: AdapterKey) -> AdapterWeights:
        weights = self.host.get(key)
        if weights is not None:
            self.host.move_to_end(key)
            return weights
        weights = read_adapter(Path(key[2]), self.args, self.max_rank)
        self.host[key] = weights
        while len(self.host) > self.max_host:
            self.host.popitem(last=False)
        return weights

    # ---- per step ------------------------------------------------------------------------

    def stage(self, chunk_slots: list[int] | None, num_tokens: list[int]) -> None:
        """Write each token row's slot (chunk i's slot repeated over its rows; None: all base)."""
        total = sum(num_tokens)
        if chunk_slots is None:
            self.token_slots.fill_(-1)
            return
        rows = np.repeat(np.asarray(chunk_slots, dtype=np.int64), num_tokens)
        self.token_slots[:total].copy_(torch.from_numpy(rows), non_blocking=True)
        self.token_slots[total:].fill_(-1)  # padded graph rows stay on the base model

    def forward(self, model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The model's forward with this step's rows grouped by slot (capturable in a CUDA graph)."""
        with self.rows(input_ids.shape[0]):
            return model(input_ids, positions)

    @contextlib.contextmanager
    def rows(self, num_tokens: int) -> Iterator[None]:
        """Within: the wrapped projections see the first `num_tokens` staged rows grouped by slot.

        Computed on the device from `token_slots`, so a CUDA graph (a whole decode step, or one
        piece of a step with prompt tokens) captures the grouping too and replays it each step."""
        self.batch.segments = kernels.lora_segments(self.token_slots[:num_tokens], self.num_slots)
        try:
            yield
        finally:
            self.batch.segments = None

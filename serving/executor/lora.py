"""Multi-LoRA on one worker: adapter slots on the device, a host cache, and the wrapped projections.

`LoRAManager` wraps each decoder layer's qkv_proj, o_proj, gate_up_proj and down_proj in a
`LoRALinear` once the base weights are loaded (models/linear.py is untouched), and owns per projection
two stacked slot tensors: A `[max_loras, slices * max_lora_rank, in_local]` and B `[max_loras,
out_local, max_lora_rank]`, zero-padded to the rank, the scaling folded into B. Plans say
which adapter each slot holds (`StepPlan.lora_loads`: slot -> (name, id, path), or None to
free it); the manager reads adapters from disk into an LRU host cache of `max_cpu_loras` and
copies them into their slot (stream-ordered: a step still running on the old contents is not
disturbed). Per step the runner stages the rows grouped by slot: the host knows each row's slot,
so `stage` groups them with numpy (`kernels.lora_segments_host`) and copies the result into one
persistent device buffer (one pinned, asynchronous copy); every wrapped projection adds its
rows' x·Aᵀ·Bᵀ (`kernels.lora_shrink`, then `lora_expand`). CUDA graphs (the decode graphs and
the mixed-step graphs) only read that buffer: no grouping kernels.

`LORA_VARIANT` picks how a projection runs its adapters (read when a forward is traced, so set
it before the engine captures its graphs): "stream" (the default: the shrink on a side stream,
concurrent with the base GEMM, reading only x; the expand after the join) or "split" (shrink,
then expand, both after the base GEMM; also what "stream" falls back to off CUDA). Stream is the
fastest at every batch size measured (bench/RESULTS.md run 15, H200, one Llama-3-8B layer, 16
slots of rank 16, CUDA graph, us added per layer: T=1 +17.2 vs split's +36.4, T=256 +83.1
vs +87.4; batch-1 8B decode 1.067x the base model's ms/token, bar 1.15). A fused shrink->expand
kernel and an "auto" choice between it and split were removed: the fused launch was slower
everywhere (+70 us per layer at T=1, +371 at T=256).

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
from serving.executor.models.linear import ColumnParallelLinear, RowParallelLinear
from serving.checkpoint.lora_adapter import AdapterWeights, read_adapter
from serving.checkpoint.model_config import ModelArgs

logger = logging.getLogger(__name__)

LORA_VARIANT = "stream"  # "stream" | "split" (module docstring); bench/lora*.py and tests set it
VARIANTS = ("stream", "split")

AdapterKey = tuple[str, int, str]  # (lora_name, lora_int_id, lora_path): what a plan loads into a slot


class LoRABatch:
    """This forward's rows grouped by slot (views of the staged buffer), shared by every wrapped
    projection, and the side stream of the "stream" variant."""

    def __init__(self) -> None:
        self.segments: tuple[torch.Tensor, ...] | None = None
        self.side_stream: torch.cuda.Stream | None = None

    def side(self, device: torch.device) -> torch.cuda.Stream:
        if self.side_stream is None:
            self.side_stream = torch.cuda.Stream(device=device)
        return self.side_stream


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
        seg = self.batch.segments
        if seg is None:
            return self.base(x)
        assert LORA_VARIANT in VARIANTS, LORA_VARIANT
        if LORA_VARIANT == "stream" and x.is_cuda:
            # Fork/join (capturable): the shrink reads only x, so it overlaps the base GEMM.
            # NOTE: no record_stream needed: every later side-stream op waits on the main stream
            # first (the next fork), so neither x nor the partials are reused under the shrink.
            main = torch.cuda.current_stream(x.device)
            side = self.batch.side(x.device)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                partials = kernels.lora_shrink(x, self.lora_a, *seg)  # [P, T, slices * r] float32
            y = self.base(x)
            main.wait_stream(side)
        else:
            y = self.base(x)
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
        if args.num_experts or args.plain_mlp:
            kind = "a mixture-of-experts model" if args.num_experts else "a model with a plain (ungated) MLP"
            raise ValueError(f"LoRA adapters on {kind} ({args.architecture}) are not supported: "
                             "serve it without option.enable_lora")
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
        # Rows grouped by slot, one persistent int32 buffer that every graph reads on replay:
        # [seg_starts S | seg_counts S | block_slot NB | block_m0 NB | sorted_rows max_num_tokens],
        # NB enough blocks for max_num_tokens rows (a smaller forward reads a prefix of each).
        s, nb = self.num_slots, kernels.lora_num_blocks(max_num_tokens, self.num_slots)
        self.max_blocks = nb
        self._offsets = (0, s, 2 * s, 2 * s + nb, 2 * s + 2 * nb)
        size = 2 * s + 2 * nb + max_num_tokens
        self.segment_buf = torch.zeros(size, dtype=torch.int32, device=device)
        self.segment_buf[2 * s : 2 * s + nb].fill_(-1)  # no blocks until a step is staged
        self._host_buf = torch.zeros(size, dtype=torch.int32, pin_memory=device.type == "cuda")
        self._copied: torch.cuda.Event | None = None  # the last copy out of _host_buf
        self._staged_base = True  # the buffer holds "every row on the base model"
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
        """Group this step's rows by slot on the host (chunk i's slot over its rows; None: all
        base) and copy the result into the device buffer: one asynchronous copy, no kernels.

        Padded graph rows (past the step's rows) are listed in no segment: the base model."""
        if chunk_slots is None or all(s < 0 for s in chunk_slots):
            if self._staged_base:
                return
            slots = np.zeros(0, dtype=np.int64)
        else:
            slots = np.repeat(np.asarray(chunk_slots, dtype=np.int64), num_tokens)
        rows, starts, counts, block_slot, block_m0 = kernels.lora_segments_host(slots, self.num_slots,
                                                                                self.max_blocks)
        o = self._offsets
        n = o[4] + rows.shape[0]
        if self._copied is not None:
            # NOTE: the previous step's copy may still be queued (no host sync since): wait for
            # it before overwriting the pinned buffer (as step_inputs does).
            self._copied.synchronize()
        host = self._host_buf.numpy()
        host[o[0] : o[1]] = starts
        host[o[1] : o[2]] = counts
        host[o[2] : o[3]] = block_slot
        host[o[3] : o[4]] = block_m0
        host[o[4] : n] = rows
        self.segment_buf[:n].copy_(self._host_buf[:n], non_blocking=True)
        if self.segment_buf.is_cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()
        self._staged_base = slots.shape[0] == 0

    def forward(self, model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The model's forward with this step's rows grouped by slot (capturable in a CUDA graph)."""
        with self.rows(input_ids.shape[0]):
            return model(input_ids, positions)

    def segments(self, num_tokens: int) -> tuple[torch.Tensor, ...]:
        """Views of the staged grouping for a forward of `num_tokens` rows (>= the staged rows):
        (sorted_rows, seg_starts, seg_counts, block_slot, block_m0), as `kernels.lora_segments`."""
        o, nb = self._offsets, kernels.lora_num_blocks(num_tokens, self.num_slots)
        buf = self.segment_buf
        return (buf[o[4] : o[4] + num_tokens], buf[o[0] : o[1]], buf[o[1] : o[2]],
                buf[o[2] : o[2] + nb], buf[o[3] : o[3] + nb])

    @contextlib.contextmanager
    def rows(self, num_tokens: int) -> Iterator[None]:
        """Within: the wrapped projections see the first `num_tokens` staged rows grouped by slot.

        Views of the persistent buffer `stage` fills, so a CUDA graph (a whole decode step, or
        a step with prompt tokens) reads each step's grouping with no op of its own."""
        self.batch.segments = self.segments(num_tokens)
        try:
            yield
        finally:
            self.batch.segments = None

"""Linear layers, tensor-parallel aware, float or quantized.

Every layer takes the `TPShard` of this process (default: single process) and holds only its slice
(`serving/executor/parallel.py` says how shapes split):
- `ColumnParallelLinear` / `PackedColumnParallelLinear`: output rows split, no communication
  (qkv_proj holds this rank's query heads and its KV heads; gate_up_proj its MLP columns);
- `RowParallelLinear`: input columns split, partial outputs summed with one all-reduce
  (o_proj, down_proj; a bias is added by rank 0 only, so once).
With one rank every layer runs exactly the single-process ops (no collective).
Packed parameters are filled from separate HF tensors (q|k|v -> qkv_proj, gate|up -> gate_up_proj,
`shard_id` = the part) or from a checkpoint that is already fused (Phi-3, `shard_id` None).
Quantized layers: a linear layer built with a `LinearMethod` (`serving/executor/quant/`) lets it
create, load and apply its checkpoint tensors (qweight/scales/..., each loaded by this rank's
slice as its `LinearSpec` says); without one the layer is the plain float path, unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from serving.executor import parallel
from serving.executor.models.params import (
    SINGLE,
    Loaded,
    check_shape,
    default_weight_loader,
    mark_sharded,
    new_param,
    read_checkpoint,
)
from serving.executor.models.weight_prefetch import note
from serving.executor.parallel import TPShard
from serving.executor.quant import LinearMethod, LinearSpec

class Linear(nn.Module):
    """y = x W^T (+ b), W stored [out_features, in_features] as in HF; replicated on every rank.

    With a `quant_method` (and the layer's `spec`), the method creates the weight tensors instead.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 quant_method: LinearMethod | None = None, spec: LinearSpec | None = None) -> None:
        super().__init__()
        self.quant_method = quant_method
        if quant_method is not None and quant_method.creates_weights:
            quant_method.create_weights(self, spec or LinearSpec(in_features, 0, in_features,
                                                                 {"": even_part(out_features, SINGLE)},
                                                                 {"": (0, out_features)}))
        else:
            self.weight = new_param(out_features, in_features)
            self.weight.weight_loader = self.weight_loader
        self.bias = new_param(out_features) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: torch.Tensor, loaded: Loaded, shard_id: object = None) -> None:
        default_weight_loader(param, loaded, shard_id)

    def _linear(self, x: torch.Tensor, bias: torch.Tensor | None, gated: bool = False,
                push: object = None) -> torch.Tensor:
        note(self)  # the run order the L2 hints are linked from (models/weight_prefetch.py)
        return self._compute(x, bias, gated, push)

    def _compute(self, x: torch.Tensor, bias: torch.Tensor | None, gated: bool = False,
                 push: object = None) -> torch.Tensor:
        # gated: the weight is a packed [gate | up]; the result is silu(gate) * up. push: the fused
        # all-reduce's buffers (`parallel.push_target`), where a row-parallel partial's GEMV may send its rows
        if self.quant_method is None:
            w = self.weight
            if (x.is_cuda and x.dim() == 2 and x.shape[0] <= 16 and x.dtype == w.dtype
                    and kernels.use_skinny(x.shape[0], w.shape[0], w.shape[1], w.dtype, x.device)):
                if push is not None and kernels.skinny_can_push(x, w):
                    out = kernels.skinny_linear(x, w, None, bias, push=push)  # the returned rows unwritten
                    parallel.note_pushed(out)
                    return out
                # decode rows: one bandwidth-bound launch (with the activation in its epilogue when gated)
                return kernels.skinny_linear(x, w, None, bias, gated=gated)
            y = F.linear(x, w, bias)
            return kernels.silu_and_mul(y) if gated else y
        return self.quant_method.apply(self, x, bias, gated=gated)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.bias)


@dataclass(frozen=True)
class OutputPart:
    """The output rows [start, start + size) that this rank holds of a projection with `full` rows."""

    full: int
    start: int
    size: int


def even_part(full: int, shard: TPShard) -> OutputPart:
    """This rank's even share of `full` output rows."""
    start, size = shard.split(full)
    return OutputPart(full, start, size)


class ColumnParallelLinear(Linear):
    """Output dim split over ranks: y_local = x W_local^T (+ b_local), no communication.

    `parts` (used by `PackedColumnParallelLinear`) stacks several checkpoint projections along the
    output dim, each contributing the rows of its `OutputPart`; `shard_offsets[name]` is where a
    part's rows sit in this rank's weight.
    """

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, shard: TPShard = SINGLE,
        *, parts: dict[str, OutputPart] | None = None, quant_method: LinearMethod | None = None, name: str = "",
    ) -> None:
        parts = parts if parts is not None else {"": even_part(out_features, shard)}
        assert sum(p.full for p in parts.values()) == out_features
        offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for part_name, part in parts.items():
            offsets[part_name] = (offset, part.size)
            offset += part.size
        spec = LinearSpec(in_features, 0, in_features, parts, offsets, name)
        super().__init__(in_features, offset, bias, quant_method, spec)
        self.parts = parts
        self.shard_offsets = offsets
        mark_sharded(any(p.size != p.full for p in parts.values()), getattr(self, "weight", None), self.bias)

    def weight_loader(self, param: torch.Tensor, loaded: Loaded, shard_id: object = None) -> None:
        """`shard_id` None: the whole (possibly fused, parts in order) tensor; else that part alone."""
        if shard_id is None:
            names = list(self.parts)
        elif str(shard_id) in self.parts:
            names = [str(shard_id)]
        else:
            raise ValueError(f"unknown shard {shard_id!r} (parts: {list(self.parts)})")
        check_shape(loaded, (sum(self.parts[n].full for n in names), *param.shape[1:]),
                     "parameter" if shard_id is None else f"shard {shard_id!r}")
        row = 0  # where this part starts in the checkpoint tensor
        for name in names:
            part, (offset, size) = self.parts[name], self.shard_offsets[name]
            param.data.narrow(0, offset, size).copy_(read_checkpoint(loaded, 0, row + part.start, size))
            row += part.full


class PackedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections in one GEMM (q|k|v, gate|up), one `OutputPart` each.

    A checkpoint may hold the parts separately (q_proj/k_proj/v_proj, loaded with shard_id = the
    part's name) or already fused in `parts` order (Phi-3's qkv_proj, shard_id None).
    """

    def __init__(self, in_features: int, parts: dict[str, OutputPart], bias: bool = False,
                 quant_method: LinearMethod | None = None, name: str = "") -> None:
        super().__init__(in_features, sum(p.full for p in parts.values()), bias, parts=parts,
                         quant_method=quant_method, name=name)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of this [gate | up] projection (two parts of one size): `kernels.silu_and_mul`
        of `forward(x)`, except that decode rows on the GEMVs get it from the GEMV's epilogue (one
        launch and no [M, 2 I] round trip less in every layer; the same rounding)."""
        sizes = [size for _, size in self.shard_offsets.values()]
        assert len(sizes) == 2 and sizes[0] == sizes[1], f"not a [gate | up] pair: {sizes}"
        return self._linear(x, self.bias, gated=True)


class RowParallelLinear(Linear):
    """Input dim split over ranks: y = all_reduce(x_local W_local^T) (+ b, added by rank 0 only)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, shard: TPShard = SINGLE,
                 in_part: tuple[int, int] | None = None, quant_method: LinearMethod | None = None,
                 name: str = "", reduce: bool = True) -> None:
        """`in_part` = (start, size) of this rank's input columns when not an even split (o_proj
        under an uneven head split). `reduce=False`: return this rank's partial sum; the caller
        all-reduces it with others (the experts of an MoE block: one all-reduce for all of them)."""
        in_start, size = in_part if in_part is not None else shard.split(in_features)
        spec = LinearSpec(in_features, in_start, size, {"": OutputPart(out_features, 0, out_features)},
                          {"": (0, out_features)}, name)
        super().__init__(size, out_features, bias, quant_method, spec)
        self.in_start, self.full_in_features, self.out_features = in_start, in_features, out_features
        assert reduce or not bias or shard.world_size == 1, "a partial sum with a bias would add it on every rank"
        self.reduce = reduce and shard.world_size > 1
        self.bias_rank = shard.rank == 0
        mark_sharded(shard.world_size > 1, getattr(self, "weight", None))

    def weight_loader(self, param: torch.Tensor, loaded: Loaded, shard_id: object = None) -> None:
        if param.dim() == 1:  # the bias: replicated
            default_weight_loader(param, loaded, shard_id)
            return
        assert shard_id is None, f"unexpected shard {shard_id!r} for a row-parallel parameter"
        check_shape(loaded, (param.shape[0], self.full_in_features))
        param.data.copy_(read_checkpoint(loaded, 1, self.in_start, param.shape[1]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.reduce:
            return self._linear(x, self.bias)
        return parallel.all_reduce(self.partial(x))

    def partial(self, x: torch.Tensor, push: bool = False) -> torch.Tensor:
        """This rank's share of `forward(x)` before the all-reduce (the bias on rank 0 only), for a
        caller that sums it itself (fused with the residual add and norm: `RMSNorm.add_and_norm`).
        `push`: the caller passes the result, unchanged, to `parallel.all_reduce_rms_norm` next; a
        decode-sized float GEMV then sends its rows straight into that kernel's buffers from its
        epilogue (`parallel.push_target`) and leaves the returned tensor unwritten."""
        bias = self.bias if self.bias_rank or not self.reduce else None
        peers = parallel.push_target(x.shape[0], self.out_features, x.dtype) if push and self.reduce else None
        return self._linear(x, bias, push=peers)


def sums_later(module: nn.Module) -> bool:
    """Whether `module` is a row-parallel projection whose all-reduce a caller may take over
    (`module.partial(x)`, then sum): not wrapped (LoRA adds to the summed output) and on > 1 rank."""
    return type(module) is RowParallelLinear and module.reduce

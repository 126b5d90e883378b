"""The MLPs of a decoder layer: `GatedMLP` (SwiGLU / GeGLU: gate|up packed, down) and `PlainMLP`
(fc_in, an activation, fc_out: the LayerNorm decoders), each column- then row-parallel."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from serving.executor.models.linear import (
    ColumnParallelLinear,
    PackedColumnParallelLinear,
    RowParallelLinear,
    even_part,
)
from serving.executor.models.params import SINGLE
from serving.executor.parallel import TPShard
from serving.executor.quant import linear_method
from serving.checkpoint.quantization import QuantConfig

# activation name in HF configs -> the function (gelu_new / gelu_fast: the tanh approximation, as gelu_pytorch_tanh)
ACTIVATIONS = {"gelu": F.gelu, "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
                "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
                "gelu_fast": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu,
                "relu2": lambda x: F.relu(x).square()}


class GatedMLP(nn.Module):
    """SwiGLU MLP: down(silu(gate(x)) * up(x)), gate|up packed as gate_up_proj (this rank's columns);
    `activation="gelu_pytorch_tanh"`: GeGLU, gelu (tanh approximation) in place of silu (Gemma).
    `reduce=False`: under tensor parallelism, this rank's partial output (an MoE expert's)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, shard: TPShard = SINGLE,
                 quant: QuantConfig | None = None, prefix: str = "mlp", activation: str = "silu",
                 reduce: bool = True) -> None:
        super().__init__()
        assert activation in ("silu", "gelu_pytorch_tanh"), activation
        self.activation = activation
        part = even_part(intermediate_size, shard)
        gate_up = linear_method(quant, f"{prefix}.gate_proj", f"{prefix}.up_proj")
        self.gate_up_proj = PackedColumnParallelLinear(hidden_size, {"0": part, "1": part}, bias, gate_up,
                                                       f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, shard,
                                           quant_method=linear_method(quant, f"{prefix}.down_proj"),
                                           name=f"{prefix}.down_proj", reduce=reduce)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self._activated(x))

    def partial(self, x: torch.Tensor, push: bool = False) -> torch.Tensor:
        """This rank's share of `forward(x)` before its all-reduce (`linear.sums_later(self.down_proj)`);
        `push` as `RowParallelLinear.partial`'s."""
        return self.down_proj.partial(self._activated(x), push)

    def _activated(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation == "silu":
            if isinstance(self.gate_up_proj, PackedColumnParallelLinear):  # not wrapped (by LoRA)
                return self.gate_up_proj.silu_and_mul(x)
            return kernels.silu_and_mul(self.gate_up_proj(x))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


class PlainMLP(nn.Module):
    """fc_out(act(fc_in(x))) (gelu, relu, relu^2): fc_in holds this rank's columns, fc_out sums over the ranks."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, shard: TPShard,
                 quant: QuantConfig | None, prefix: str, activation: str) -> None:
        super().__init__()
        self.act = ACTIVATIONS[activation]
        self.fc_in = ColumnParallelLinear(hidden_size, intermediate_size, bias, shard,
                                          quant_method=linear_method(quant, f"{prefix}.fc_in"), name=f"{prefix}.fc_in")
        self.fc_out = RowParallelLinear(intermediate_size, hidden_size, bias, shard,
                                        quant_method=linear_method(quant, f"{prefix}.fc_out"), name=f"{prefix}.fc_out")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(self.act(self.fc_in(x)))

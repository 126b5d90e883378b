"""The norms every decoder shares, replicated on every rank: `RMSNorm` (with the residual add fused,
Llama's and Gemma's) and `LayerNorm` (with bias: the LayerNorm decoders; without: Cohere's)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from serving.executor import parallel
from serving.executor.models.params import default_weight_loader, new_param
from serving.executor.models.weight_prefetch import note

class RMSNorm(nn.Module):
    """RMSNorm with optional fused residual add (kernels.rms_norm); replicated. `unit_offset`:
    Gemma's norm (the weight stored as w - 1, applied in float32 before the cast)."""

    def __init__(self, hidden_size: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = new_param(hidden_size)
        self.weight.weight_loader = default_weight_loader
        self.eps = eps
        self.unit_offset = unit_offset
        # the next linear layer's weight, warmed in L2 by the fused all-reduce's launch (models/weight_prefetch.py)
        self.l2_hint = None
        # the next linear layer reads FP8 rows: write them here (quant/fp8.link_fp8_rows, kernels/fp8_rows.py)
        self.fp8_rows = False

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return kernels.rms_norm(x, self.weight, self.eps, residual, self.unit_offset, fp8_rows=self.fp8_rows)

    def add_and_norm(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                     reduce: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """A block's input norm with the residual stream carried fused: (normed, residual). The first
        block has no residual yet: its input becomes it. `reduce`: `hidden` is this rank's partial
        sum of a row-parallel projection, all-reduced here (fused with the add and norm where the
        custom all-reduce allows)."""
        note(self)  # the run order the L2 hints are linked from (models/weight_prefetch.py)
        if reduce:
            return parallel.all_reduce_rms_norm(hidden, self.weight, self.eps, residual, self.unit_offset,
                                                self.l2_hint)
        if residual is None:
            return self(hidden), hidden
        return self(hidden, residual)


class LayerNorm(nn.Module):
    """LayerNorm over the last dim with weight and bias (`nn.LayerNorm`'s arithmetic); replicated on
    every rank. `bias=False`: Cohere's, computed in float32 and cast back, as transformers does;
    `unit_offset`: Nemotron's LayerNorm1P, scaled by 1 + weight."""

    def __init__(self, hidden_size: int, eps: float, bias: bool = True, unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = new_param(hidden_size)
        self.weight.weight_loader = default_weight_loader
        self.bias = new_param(hidden_size) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = default_weight_loader
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None:
            return F.layer_norm(x.float(), self.weight.shape, self.weight.float(), None, self.eps).to(x.dtype)
        weight = self.weight + 1.0 if self.unit_offset else self.weight
        return F.layer_norm(x, self.weight.shape, weight, self.bias, self.eps)

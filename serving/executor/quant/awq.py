"""AWQ int4 (GEMM layout) linear layers, repacked at load into the kernels' GPTQ-order layout.

Checkpoint (AutoAWQ / llm-compressor `version: gemm`, K input rows, N output columns, G groups):
  qweight int32 [K, N / 8]      8 output columns per word, nibble j = column AWQ_PACK_ORDER[j]
  qzeros  int32 [K / G, N / 8]  the same interleaved packing; real zero points (no +1)
  scales  fp16  [K / G, N]
At load: qweight -> [K / 8, N] packed along K (GPTQ's order), zeros -> float [K / G, N]; then the
layer runs exactly as a GPTQ one without g_idx (int4: repacked once more, `use_fast_int4`). Tensor parallel splits the packed N / 8 columns
before the repack (column-parallel) or the K rows on group boundaries (row-parallel).
"""

from __future__ import annotations

import torch
from torch import nn

from serving.executor.quant.gptq import GroupQuantLinearMethod, _param
from serving.executor.quant.loading import LinearSpec, QuantAxes
from serving.executor.quant.packing import awq_to_natural_columns, pack_int32, unpack_int32


class AWQLinearMethod(GroupQuantLinearMethod):
    """AWQ GEMM checkpoints; computes through the same kernel after `process_weights_after_loading`."""

    def create_weights(self, layer: nn.Module, spec: LinearSpec) -> None:
        g, groups, whole = self.group_layout(spec)
        n = spec.out_size
        _param(layer, "qweight", (spec.in_size, n // self.pf), torch.int32, spec,
               QuantAxes(in_dim=0, out_dim=1, out_unit=self.pf))
        _param(layer, "qzeros", (groups, n // self.pf), torch.int32, spec,
               QuantAxes(in_dim=0, in_unit=g, in_whole=whole, out_dim=1, out_unit=self.pf))
        _param(layer, "scales", (groups, n), torch.get_default_dtype(), spec,
               QuantAxes(in_dim=0, in_unit=g, in_whole=whole, out_dim=1))
        self.set_layout(layer, spec, g, groups, whole)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        q = awq_to_natural_columns(unpack_int32(layer.qweight.data, self.bits, dim=1))  # [K, N]
        layer.qweight = nn.Parameter(pack_int32(q, self.bits, dim=0), requires_grad=False)  # [K / 8, N]
        zeros = awq_to_natural_columns(unpack_int32(layer.qzeros.data, self.bits, dim=1))
        layer.zeros = nn.Parameter(zeros.to(layer.scales.dtype), requires_grad=False)  # [groups, N]
        del layer.qzeros
        layer.g_idx = None
        self.use_fast_int4(layer)

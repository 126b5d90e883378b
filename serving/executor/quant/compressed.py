"""compressed-tensors `pack-quantized` integer weights (llm-compressor W4A16 / W8A16), repacked at load.

Checkpoint (HF weight orientation, N output rows, K input columns, G groups, pf = 32 // bits):
  weight_packed     int32 [N, K / pf]   along K, value j of a word at bits [bits*j, bits*j + bits),
                                        stored as q + 2**(bits-1) (unsigned)
  weight_scale      fp16  [N, K / G]
  weight_zero_point int32 [N / pf, K / G] (asymmetric only) packed along N, offset as the weights
  weight_g_idx      int32 [K]           (actorder "group" only)
  weight_shape      int64 [2]           (read and checked against the layer)
w = (q - z) * s in either's unsigned form, so after transposing to [K, N] and repacking q along K
the layer runs through `kernels.quant_linear` exactly as a GPTQ one (symmetric: z = 2**(bits-1)).
"""

from __future__ import annotations

import torch
from torch import nn

from serving.executor.quant.gptq import GroupQuantLinearMethod, _fill_g_idx, _param, _same_g_idx_loader
from serving.executor.quant.loading import LinearSpec, QuantAxes
from serving.executor.quant.packing import pack_int32, unpack_int32


class CompressedIntLinearMethod(GroupQuantLinearMethod):
    """pack-quantized checkpoints; the same kernel call after `process_weights_after_loading`."""

    def create_weights(self, layer: nn.Module, spec: LinearSpec) -> None:
        g, groups, whole = self.group_layout(spec)
        n = spec.out_size
        _param(layer, "weight_packed", (n, spec.in_size // self.pf), torch.int32, spec,
               QuantAxes(in_dim=1, in_unit=self.pf, out_dim=0))
        _param(layer, "weight_scale", (n, groups), torch.get_default_dtype(), spec,
               QuantAxes(in_dim=1, in_unit=g, in_whole=whole, out_dim=0))
        if not self.quant.sym:
            _param(layer, "weight_zero_point", (n // self.pf, groups), torch.int32, spec,
                   QuantAxes(in_dim=1, in_unit=g, in_whole=whole, out_dim=0, out_unit=self.pf))
        g_idx = _param(layer, "weight_g_idx", (spec.in_size,), torch.int32, spec, QuantAxes(in_dim=0),
                       optional=not self.quant.desc_act)
        g_idx.weight_loader = _same_g_idx_loader(g_idx.weight_loader, spec)
        g_idx.fill_dummy = _fill_g_idx(spec.in_start, g, self.quant.desc_act)
        shape = _param(layer, "weight_shape", (2,), torch.int64, spec, QuantAxes(), optional=True)
        shape.weight_loader = _shape_checker(spec)
        shape.fill_dummy = lambda param, gen, std: None
        self.set_layout(layer, spec, g, groups, whole)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        q = unpack_int32(layer.weight_packed.data, self.bits, dim=1)  # [N, K]
        scales = layer.weight_scale.data.t().contiguous()  # [groups, N]
        if self.quant.sym:
            zeros = torch.full_like(scales, float(1 << (self.bits - 1)))
        else:
            zeros = unpack_int32(layer.weight_zero_point.data, self.bits, dim=0)[: scales.shape[1]].t().to(scales.dtype)
            del layer.weight_zero_point
        g_idx = layer.weight_g_idx.data if self.quant.desc_act else None
        for name in ("weight_packed", "weight_scale", "weight_g_idx", "weight_shape"):
            delattr(layer, name)
        layer.qweight = nn.Parameter(pack_int32(q.t(), self.bits, dim=0), requires_grad=False)  # [K / pf, N]
        layer.scales = nn.Parameter(scales, requires_grad=False)
        layer.zeros = nn.Parameter(zeros.contiguous(), requires_grad=False)
        layer.g_idx = None if g_idx is None else nn.Parameter(g_idx, requires_grad=False)
        if g_idx is not None:
            self.sort_act_order(layer)
        self.use_fast_int4(layer)


def _shape_checker(spec: LinearSpec):
    """weight_shape holds the part's [N, K]: it must be the layer's."""

    def load(param: torch.Tensor, loaded: object, shard_id: object = None) -> None:
        value = (loaded if isinstance(loaded, torch.Tensor) else loaded[...]).tolist()  # type: ignore[index]
        names = list(spec.parts) if shard_id is None else [str(shard_id)]
        want = [sum(spec.parts[n].full for n in names), spec.in_full]
        if value != want:
            raise ValueError(f"weight_shape {value} != the layer's [output, input] {want}")

    return load

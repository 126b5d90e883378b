"""GPTQ int4/int8 linear layers: the checkpoint's qweight/qzeros/scales/g_idx -> `kernels.quant_linear`.

Checkpoint (AutoGPTQ / GPTQModel, K = input rows, N = output columns, G = group_size):
  qweight int32 [K / pf, N]   pf = 32 // bits values of consecutive rows per word (the kernels' order)
  qzeros  int32 [K / G, N / pf] packed along N; v1 checkpoints (checkpoint_format "gptq") store zero - 1
  scales  fp16  [K / G, N]
  g_idx   int32 [K]           group of each input row (act-order / desc_act permutes it)
After loading, zeros are unpacked to float [groups, N] (+1 for v1) and scales cast to the
activation dtype: w[k, n] = (q[k, n] - zeros[g, n]) * scales[g, n], g = g_idx[k] or k // G.
Act-order (desc_act) layers whose groups are whole (G rows each) get their rows sorted by group at
load, so the kernel reads contiguous groups without g_idx (its fast paths) and the layer gathers
its input columns in that order (`act_perm`, one index_select per layer).
int4 layers whose groups are `k // G` (no g_idx left) can be repacked once (`use_fast_int4`) into
`kernels.int4_kchunk_linear`'s layout (`kchunk` [K / 32, N, 4]: 32 rows of a column per 16 bytes, for
its decode GEMV) once `KCHUNK_INT4` is on, or `kernels.int4_linear`'s (`packed` [K, N / 8], packed
along N) once `REPACKED_INT4` is on (off: measured slower than the general kernel, see below), and run
there at every M; the rest (int8, g_idx kept on a row-parallel rank), and every layer while both are
off, stay on `kernels.quant_linear`.
Tensor parallel: column-parallel layers split N (whole words of qzeros: 8 columns for int4);
row-parallel layers split K on group boundaries, or, with desc_act, keep every group's scales and
zeros and their rows' g_idx (a rank's rows may reference any group).
"""

from __future__ import annotations

import torch
from torch import nn

import kernels
from serving.executor.quant.loading import LinearSpec, QuantAxes, make_loader
from serving.executor.quant.packing import pack_int32, unpack_int32
from serving.checkpoint.quantization import QuantConfig


def _param(layer: nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype, spec: LinearSpec,
           axes: QuantAxes, optional: bool = False) -> nn.Parameter:
    p = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    p.weight_loader = make_loader(spec, axes)
    p.tp_sharded = spec.is_sharded
    p.fill_dummy = _fill_dummy
    if optional:
        p.optional_in_checkpoint = True
    layer.register_parameter(name, p)
    return p


def _fill_dummy(param: torch.Tensor, gen: torch.Generator, std: float) -> None:
    """Random packed words / positive scales (benchmarks' dummy weights)."""
    if param.dtype == torch.int32:
        param.copy_(torch.randint(-(2**31), 2**31, param.shape, generator=gen, device=param.device,
                                  dtype=torch.int64).to(torch.int32))
    else:  # scales: |N(0, std)| / 4 keeps (q - z) * s near the unquantized std
        param.normal_(0.0, std / 4, generator=gen).abs_()


# Serving takes the repacked int4 kernels only once they beat the general ones: on an H100 (bench/RESULTS.md,
# `bench/quant_speed.py`) the repacked GEMV ran the 8B's batch-1 linears in 14.5 ms against the general
# kernel's 2.7 ms (bf16 5.4 ms), and its tiles were slower from M = 64 up; not tuned yet.
REPACKED_INT4 = False
# The k-chunk layout (`kernels.int4_kchunk_linear`: 32 rows of a column in 16 bytes) for its decode GEMV;
# ahead of REPACKED_INT4 when both are on. On: `bench/int4_sweep.py` on an H100 (bench/RESULTS.md run 36) ran
# the 8B's batch-1 linears in 2.17 ms against the general kernel's 2.71 (bf16 5.51), and M = 16 in 3.70
# against 5.02; `--large` (bench/RESULTS.md run 41): M = 64 in 6.64 ms against dequantise + cuBLAS's
# 11.63 (bf16 5.68), M = 128 in 8.86 against 12.17 (`int4_kchunk_gemm`, no bf16 copy of the weight).
# Layers with act-order (g_idx) keep the general kernel.
KCHUNK_INT4 = True


class GroupQuantLinearMethod:
    """Shared part of the integer formats: groups, zeros, the kernel call."""

    creates_weights = True

    def __init__(self, quant: QuantConfig) -> None:
        self.quant = quant
        self.bits, self.pf = quant.bits, quant.pack_factor

    def group_layout(self, spec: LinearSpec) -> tuple[int, int, bool]:
        """(G in input rows, groups this rank holds, keep every group) for this layer."""
        q, name = self.quant, spec.name or "layer"
        if spec.in_full % self.pf or spec.in_size % self.pf:
            raise ValueError(f"{name}: input size {spec.in_size} of {spec.in_full} is not a multiple of {self.pf} "
                             f"({q.bits}-bit values per int32)")
        if q.group_size is None:  # per output channel: one group, every rank keeps it
            return spec.in_full, 1, True
        g = q.group_size
        if spec.in_full % g:
            raise ValueError(f"{name}: input size {spec.in_full} is not a multiple of group_size {g}")
        if q.desc_act and spec.in_size != spec.in_full:
            return g, spec.in_full // g, True
        if spec.in_start % g or spec.in_size % g:
            raise ValueError(f"{name}: the tensor-parallel split of its {spec.in_full} input rows at "
                             f"[{spec.in_start}, {spec.in_start + spec.in_size}) does not fall on group_size {g} "
                             "boundaries; use a tensor parallel degree that does, or a checkpoint with a smaller group")
        return g, spec.in_size // g, False

    def create_weights(self, layer: nn.Module, spec: LinearSpec) -> None:
        g, groups, whole = self.group_layout(spec)
        n, dtype = spec.out_size, torch.get_default_dtype()
        _param(layer, "qweight", (spec.in_size // self.pf, n), torch.int32, spec,
               QuantAxes(in_dim=0, in_unit=self.pf, out_dim=1))
        _param(layer, "qzeros", (groups, n // self.pf), torch.int32, spec,
               QuantAxes(in_dim=0, in_unit=g, in_whole=whole, out_dim=1, out_unit=self.pf))
        _param(layer, "scales", (groups, n), dtype, spec, QuantAxes(in_dim=0, in_unit=g, in_whole=whole, out_dim=1))
        g_idx = _param(layer, "g_idx", (spec.in_size,), torch.int32, spec, QuantAxes(in_dim=0),
                       optional=not self.quant.desc_act)
        g_idx.weight_loader = _same_g_idx_loader(g_idx.weight_loader, spec)
        g_idx.fill_dummy = _fill_g_idx(spec.in_start, g, self.quant.desc_act)
        self.set_layout(layer, spec, g, groups, whole)

    def set_layout(self, layer: nn.Module, spec: LinearSpec, g: int, groups: int, whole: bool) -> None:
        """The kernel's group size (this rank's K for one per-channel group) and no input permutation yet."""
        layer.quant_group_size = g if not whole or groups > 1 else spec.in_size
        layer.register_buffer("act_perm", None, persistent=False)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        zeros = unpack_int32(layer.qzeros.data, self.bits, dim=1)[:, : layer.scales.shape[1]] + self.quant.zero_offset
        layer.zeros = nn.Parameter(zeros.to(layer.scales.dtype), requires_grad=False)  # [groups, N]
        del layer.qzeros
        if not self.quant.desc_act:  # rows in natural order: the kernel derives k // G itself
            del layer.g_idx
            layer.g_idx = None
        else:
            self.sort_act_order(layer)
        self.use_fast_int4(layer)

    def use_fast_int4(self, layer: nn.Module) -> None:
        """Repack an int4 layer without g_idx into a fast kernel's layout: `qweight` [K / 8, N] becomes
        `kchunk` [K / 32, N, 4] (KCHUNK_INT4) or `packed` [K, N / 8] (REPACKED_INT4). Others keep
        `qweight` (`packed` and `kchunk` None) and the general kernel."""
        k, n = layer.qweight.shape[0] * self.pf, layer.qweight.shape[1]
        g = layer.quant_group_size
        layer.packed = layer.kchunk = None
        if self.bits != 4 or layer.g_idx is not None:
            return
        if KCHUNK_INT4 and k % 32 == 0 and (g >= k or g % 32 == 0):
            layer.kchunk = nn.Parameter(kernels.repack_int4_kchunk(layer.qweight.data), requires_grad=False)
            del layer.qweight
        elif REPACKED_INT4 and n % 8 == 0 and (g >= k or (g % 16 == 0 and g & (g - 1) == 0)):
            layer.packed = nn.Parameter(kernels.repack_int4(layer.qweight.data), requires_grad=False)
            del layer.qweight

    def sort_act_order(self, layer: nn.Module) -> None:
        """Rows sorted by group when every group is whole here (not on a row-parallel rank that holds
        rows of groups it shares): g_idx is dropped and `act_perm` gathers the input to match."""
        g_idx = layer.g_idx.data.long()
        k, g = g_idx.shape[0], layer.quant_group_size
        perm = torch.argsort(g_idx, stable=True)
        natural = torch.arange(k, device=g_idx.device)
        if layer.scales.shape[0] * g != k or not torch.equal(g_idx[perm], natural // g):
            return  # groups split over ranks (or uneven): the kernel reads g_idx
        if not torch.equal(perm, natural):
            q = unpack_int32(layer.qweight.data, self.bits, dim=0)[perm]  # [K, N], rows in group order
            layer.qweight = nn.Parameter(pack_int32(q, self.bits, dim=0), requires_grad=False)
            layer.act_perm = perm
        del layer.g_idx
        layer.g_idx = None

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None, gated: bool = False
              ) -> torch.Tensor:
        if layer.act_perm is not None:
            x = x.index_select(-1, layer.act_perm)  # [M, K] in the rows' sorted order
        if layer.kchunk is not None:
            return kernels.int4_kchunk_linear(x, layer.kchunk, layer.scales, layer.zeros, layer.quant_group_size, bias,
                                              gated=gated)
        if layer.packed is not None:
            y = kernels.int4_linear(x, layer.packed, layer.scales, layer.zeros, layer.quant_group_size, bias)
        else:
            y = kernels.quant_linear(x, layer.qweight, layer.scales, layer.zeros, layer.g_idx, self.bits,
                                     layer.quant_group_size, bias)
        return kernels.silu_and_mul(y) if gated else y


def _same_g_idx_loader(load, spec: LinearSpec):
    """Parts of a fused layer (q|k|v, gate|up) read the same input, so GPTQ gives them the same act
    order: each part's g_idx must equal the first one loaded."""
    seen: dict[str, torch.Tensor] = {}

    def loader(param: torch.Tensor, loaded: object, shard_id: object = None) -> None:
        load(param, loaded, shard_id)
        if seen and not torch.equal(param.data, next(iter(seen.values()))):
            raise ValueError(f"{spec.name}: g_idx of part {shard_id!r} differs from part {next(iter(seen))!r}'s; "
                             "a fused layer needs one act order for all its parts")
        seen[str(shard_id)] = param.data.clone()

    return loader


def _fill_g_idx(in_start: int, group: int, act_order: bool):
    """Dummy g_idx: natural groups, or with act-order a random order of this rank's rows (as GPTQ's
    desc_act permutes them), so benchmarks run the act-order path."""
    def fill(param: torch.Tensor, gen: torch.Generator, std: float) -> None:
        rows = torch.arange(in_start, in_start + param.shape[0], device=param.device)
        if act_order:
            rows = in_start + torch.randperm(param.shape[0], generator=gen, device=param.device)
        param.copy_((rows // group).to(torch.int32))
    return fill


GPTQLinearMethod = GroupQuantLinearMethod  # the checkpoint layout IS the kernels' layout

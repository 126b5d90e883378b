"""FP8 (e4m3) weight linear layers -> `kernels.fp8_linear` (decode-sized calls, M <= 16, run the
one-launch `kernels.skinny_linear` inside it wherever `kernels.use_skinny` says so for the shape).

Checkpoint (AutoFP8 / vLLM `quant_method: fp8`, llm-compressor `float-quantized`): `weight`
float8_e4m3fn [N, K] as HF lays weights out, `weight_scale` float32 per tensor (a scalar or [1])
or per output channel ([N] or [N, 1]), and optionally `input_scale` (static activation scales;
read and dropped: activations are scaled per token at run time). Every layer keeps one float32
scale per output channel [N]: a fused q|k|v layer's three per-tensor scales become the rows of
their parts. With `option.quantize=fp8` on a bf16/fp16 checkpoint the layer loads its weight as an
unquantized one and `process_weights_after_loading` converts it (`kernels.quantize_fp8`); that
needs an sm_89+ GPU (`check_fp8_device`).

Above 16 rows the activations go in as FP8 with one scale per token. The op before each layer can
write them (`kernels/fp8_rows.py`: the RMSNorm before qkv / gate_up, the SwiGLU of a gated gate_up
before down), saving a quantisation launch a linear: `link_fp8_rows` marks those ops from one traced
forward (`models/weight_prefetch.tracing`), whatever the architecture.
"""

from __future__ import annotations

import torch
from torch import nn

import kernels
from serving.executor.quant.loading import LinearSpec, QuantAxes, load_sharded, make_loader
from serving.checkpoint.quantization import QuantConfig, QuantizationError


def check_fp8_device(device: torch.device) -> None:
    """Raise QuantizationError unless `device` can run FP8 matmuls (compute capability 8.9+)."""
    if device.type != "cuda":
        raise QuantizationError(f"option.quantize=fp8 converts weights to FP8 at load, which needs an NVIDIA GPU "
                                f"with compute capability 8.9+ (Ada, Hopper); this engine runs on {device.type}. "
                                "Serve an FP8 checkpoint instead, or unset option.quantize")
    cap = torch.cuda.get_device_capability(device)
    if cap < (8, 9):
        raise QuantizationError(f"option.quantize=fp8 needs a GPU with compute capability 8.9+ (Ada, Hopper); "
                                f"{torch.cuda.get_device_name(device)} has {cap[0]}.{cap[1]}")


def _fill_dummy_fp8(param: torch.Tensor, gen: torch.Generator, std: float) -> None:
    param.copy_(torch.randn(param.shape, generator=gen, device=param.device).clamp_(-4, 4))


def _fill_dummy_scale(param: torch.Tensor, gen: torch.Generator, std: float) -> None:
    param.fill_(std)


class FP8LinearMethod:
    """Weights from an FP8 checkpoint (`from_checkpoint`) or quantized at load."""

    def __init__(self, quant: QuantConfig) -> None:
        self.quant = quant
        self.creates_weights = quant.from_checkpoint  # else: the layer's own unquantized weight

    def create_weights(self, layer: nn.Module, spec: LinearSpec) -> None:
        weight = nn.Parameter(torch.empty(spec.out_size, spec.in_size, dtype=torch.float8_e4m3fn), requires_grad=False)
        weight.weight_loader = make_loader(spec, QuantAxes(in_dim=1, out_dim=0))
        weight.fill_dummy = _fill_dummy_fp8
        scale = nn.Parameter(torch.empty(spec.out_size, dtype=torch.float32), requires_grad=False)
        scale.weight_loader = lambda p, loaded, shard_id=None: _load_scale(p, loaded, shard_id, spec)
        scale.fill_dummy = _fill_dummy_scale
        # Static activation scales: accepted (one per part), not used.
        input_scale = nn.Parameter(torch.empty(len(spec.parts), dtype=torch.float32), requires_grad=False)
        input_scale.weight_loader = lambda p, loaded, shard_id=None: None
        input_scale.optional_in_checkpoint = True
        input_scale.values_not_loaded = True  # its memory is never filled: the NaN/Inf check skips it
        for name, p in (("weight", weight), ("weight_scale", scale), ("input_scale", input_scale)):
            p.tp_sharded = spec.is_sharded
            layer.register_parameter(name, p)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.quant.from_checkpoint:
            del layer.input_scale
            return
        weight, scale = kernels.quantize_fp8(layer.weight.data)
        layer.weight = nn.Parameter(weight, requires_grad=False)
        layer.weight_scale = nn.Parameter(scale.float().reshape(-1), requires_grad=False)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None, gated: bool = False
              ) -> torch.Tensor:
        # fp8_rows (`link_fp8_rows`): a gated layer's SwiGLU feeds an FP8 down projection
        return kernels.fp8_linear(x, layer.weight, layer.weight_scale, bias, gated=gated,
                                  fp8_rows=gated and vars(layer).get("fp8_rows", False))


def link_fp8_rows(trace: list[nn.Module], linear_type: type) -> int:
    """Set `fp8_rows` on every module of `trace` (modules in the order one forward ran them: norms
    and linear layers) whose next `linear_type` module runs the FP8 method: those norms, and the SwiGLU
    of those gated layers, then write the per-token FP8 rows that layer reads. Returns how many were set."""
    linked = 0
    next_fp8 = False
    for module in reversed(trace):
        fp8 = next_fp8
        if isinstance(module, linear_type):
            next_fp8 = isinstance(getattr(module, "quant_method", None), FP8LinearMethod)
        if fp8 != vars(module).get("fp8_rows", False):
            vars(module)["fp8_rows"] = fp8
            linked += fp8
    return linked


def _load_scale(param: torch.Tensor, loaded: object, shard_id: object, spec: LinearSpec) -> None:
    """A per-tensor scale fills its part's rows; a per-channel one is sliced like the weight's rows."""
    shape = tuple(loaded.shape) if isinstance(loaded, torch.Tensor) else tuple(loaded.get_shape())
    if shape in ((), (1,)):
        value = loaded if isinstance(loaded, torch.Tensor) else loaded[...]
        names = list(spec.parts) if shard_id is None else [str(shard_id)]
        if shard_id is None and len(names) > 1:
            raise ValueError("a fused layer needs one weight_scale per output channel, got one per tensor")
        offset, size = spec.offsets[names[0]]
        param.data[offset: offset + size].fill_(float(value.reshape(())))
        return
    if len(shape) == 2 and shape[1] == 1:
        loaded = (loaded if isinstance(loaded, torch.Tensor) else loaded[...]).reshape(-1)
    load_sharded(param, loaded, shard_id, spec, QuantAxes(out_dim=0))

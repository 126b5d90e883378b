"""Linear methods: how a quantized linear layer creates, loads and computes with its weights.

As in vLLM, a layer built with a `LinearMethod` asks it to `create_weights` (registering the
checkpoint's tensors with loaders that read this rank's slice), the weight loader fills them,
`process_weights_after_loading` turns them into the kernels' layout once, and `apply` computes
y = x W + b. A layer without one (None) is the unquantized path, unchanged. `linear_method`
picks the method for a module from the model's `QuantConfig` (None when the module is skipped).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from serving.executor.quant.awq import AWQLinearMethod
from serving.executor.quant.compressed import CompressedIntLinearMethod
from serving.executor.quant.fp8 import FP8LinearMethod, check_fp8_device, link_fp8_rows
from serving.executor.quant.gptq import GPTQLinearMethod
from serving.executor.quant.loading import LinearSpec
from serving.checkpoint.quantization import QuantConfig, QuantizationError


class LinearMethod(Protocol):
    """What a quantized linear layer delegates to (see the module docstring)."""

    creates_weights: bool

    def create_weights(self, layer: nn.Module, spec: LinearSpec) -> None: ...

    def process_weights_after_loading(self, layer: nn.Module) -> None: ...

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None, gated: bool = False
              ) -> torch.Tensor:
        """x @ W^T + bias; `gated`: W is a packed [gate | up] and the result silu(gate) * up."""


_METHODS = {"gptq": GPTQLinearMethod, "awq": AWQLinearMethod, "fp8": FP8LinearMethod,
            "compressed-tensors": CompressedIntLinearMethod}


def linear_method(quant: QuantConfig | None, *modules: str) -> LinearMethod | None:
    """The method of the layer that computes HF modules `modules` (q_proj, k_proj, v_proj for a fused
    qkv_proj), or None when unquantized. A fused layer cannot mix skipped and quantized parts."""
    if quant is None:
        return None
    skipped = [quant.skips(m) for m in modules]
    if all(skipped):
        return None
    if any(skipped):
        raise QuantizationError(f"{quant.source}: {[m for m, s in zip(modules, skipped) if s]} are left "
                                f"unquantized but {[m for m, s in zip(modules, skipped) if not s]} are not; "
                                "they run as one fused layer here")
    return _METHODS[quant.method](quant)


def process_weights_after_loading(model: nn.Module) -> None:
    """Turn every quantized layer's loaded tensors into the kernels' layout (once, after loading)."""
    with torch.no_grad():
        for module in model.modules():
            method = getattr(module, "quant_method", None)
            if method is not None:
                method.process_weights_after_loading(module)


def check_device(quant: QuantConfig | None, device: torch.device) -> None:
    """Raise QuantizationError when `device` cannot run `quant` (fp8 conversion at load needs sm_89+)."""
    if quant is not None and quant.method == "fp8" and not quant.from_checkpoint:
        check_fp8_device(device)


__all__ = ["LinearMethod", "LinearSpec", "check_device", "link_fp8_rows", "linear_method",
           "process_weights_after_loading"]

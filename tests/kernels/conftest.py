"""Kernel tests run the Triton kernels on CUDA when present, else in Triton's CPU interpreter.

`triton.jit` reads TRITON_INTERPRET when a kernel is decorated (module import), so it is set
here, before the test modules import `kernels.*` launchers; any launcher module imported
earlier in the same run is reloaded so its kernels are re-decorated as interpreted. Only the
Triton launcher modules are touched: the reference path and other test folders are unaffected.
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

_TRITON_MODULES = (
    "kernels.l2_prefetch",  # before the launchers that import its `prefetch_share`
    "kernels.cache_ops",
    "kernels.paged_decode_attention",
    "kernels.prefill_attention",
    "kernels.mixed_attention",
    "kernels.fp8_rows",  # before rms_norm and activation, which import its `store_fp8_row`
    "kernels.rms_norm",
    "kernels.rotary",
    "kernels.activation",
    "kernels.sampling",
    "kernels.lora",
    "kernels.int4_common",
    "kernels.int4_gemv",
    "kernels.int4_matmul",
    "kernels.int4_repacked",
    "kernels.fp8_gemv",  # before skinny_linear, which imports its GemvConfig
    "kernels.skinny_linear",
    "kernels.fp8_gemm",  # before fp8_matmul, which imports it
    "kernels.fp8_gemm_tma",  # likewise
    "kernels.fp8_matmul",
    "kernels.all_reduce_norm",
    "kernels.stage_inputs",
)

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    for _name in _TRITON_MODULES:
        if _name in sys.modules:
            importlib.reload(sys.modules[_name])


@pytest.fixture(scope="session")
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"

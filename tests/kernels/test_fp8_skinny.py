"""The small-M FP8 kernels (`kernels/fp8_skinny.py`) vs the dequantised-weight reference: interpreter
on CPU, compiled on CUDA. Both kernels, per-channel and per-tensor scales, split-K, bias, K and N tails."""

from __future__ import annotations

import pytest
import torch

from kernels import quant_reference
from kernels.fp8_skinny import FP8Config, fp8_skinny_linear, fp8_skinny_linear_impl, pick_fp8_config

CASES = [
    # (dtype, K, N, M, per_channel, config); block_m 1 is the GEMV
    (torch.float32, 256, 48, 1, True, FP8Config(1, 16, 64, 1, 4, 1)),
    (torch.float32, 200, 40, 1, False, FP8Config(1, 16, 64, 3, 4, 1)),  # K tail, N tail, split
    (torch.float16, 256, 64, 1, True, FP8Config(1, 16, 128, 2, 4, 1)),
    (torch.float16, 256, 48, 2, True, FP8Config(16, 32, 64, 1, 4, 1)),
    (torch.float32, 200, 40, 9, False, FP8Config(16, 32, 64, 2, 4, 1)),
    (torch.float16, 256, 64, 16, True, FP8Config(16, 32, 64, 4, 4, 1)),
]


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


@pytest.mark.parametrize("dtype, K, N, M, per_channel, config", CASES)
def test_fp8_skinny_matches_reference(device, dtype, K, N, M, per_channel, config):
    g = torch.Generator().manual_seed(K + N + M)
    weight, scale = quant_reference.quantize_fp8(torch.randn(N, K, generator=g))
    if not per_channel:
        scale = scale.max().reshape(())
    weight, scale = weight.to(device), scale.to(device)
    x = torch.randn(M, K, generator=g).to(dtype).to(device)
    bias = torch.randn(N, generator=g).to(dtype).to(device)
    dense = weight.double() * (scale.double().reshape(-1, 1) if per_channel else scale.double())
    ref = x.double() @ dense.t() + bias.double()
    for _ in range(2):  # the second call checks that split-K counters reset themselves
        out = fp8_skinny_linear_impl(x, weight, scale, bias, config=config)
        assert out.dtype == dtype and out.shape == (M, N)
        assert _rel_err(out, ref) < (2e-3 if dtype == torch.float16 else 1e-5)
    assert _rel_err(fp8_skinny_linear(x, weight, scale), ref - bias.double()) < 2e-3


def test_pick_fp8_config():
    assert pick_fp8_config(1, 4096, 4096, 132).block_m == 1
    assert pick_fp8_config(16, 4096, 4096, 132).block_m == 16
    assert pick_fp8_config(2, 4096, 4096, 132) == pick_fp8_config(16, 4096, 4096, 132)

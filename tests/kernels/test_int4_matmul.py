"""Triton quantized linear (int4/int8) vs the torch reference: interpreter on CPU, compiled on CUDA.

Tiny shapes (the interpreter is ~1000x slower than torch) and fp16/fp32 inputs (bf16 arithmetic is
wrong in the interpreter). Every tiling branch is exercised: per-tile groups, act-order, split
unpack, split-K with its self-resetting counters, bias, a K tail.
"""

from __future__ import annotations

import pytest
import torch
from quant_helpers import make_int_weight

from kernels import quant_reference
from kernels.int4_matmul import MatmulConfig, pick_config, quant_linear, quant_linear_impl

CASES = [
    # (bits, dtype, group_size, act_order, M, config); block_m < 16 is the GEMV kernel
    (4, torch.float32, 128, False, 1, MatmulConfig(1, 32, 128, 2, 1, 1)),
    (4, torch.float16, 64, False, 2, MatmulConfig(2, 32, 64, 1, 1, 1)),
    (4, torch.float16, 64, False, 3, MatmulConfig(4, 32, 64, 2, 1, 1)),
    (8, torch.float16, 128, False, 4, MatmulConfig(4, 32, 64, 2, 1, 1)),
    (4, torch.float16, 64, False, 1, MatmulConfig(1, 32, 64, 2, 1, 1, fma_tile=True)),
    (4, torch.float32, 32, False, 2, MatmulConfig(2, 32, 32, 2, 1, 1, fma_tile=True)),
    (4, torch.float16, 32, False, 3, MatmulConfig(16, 32, 32, 1, 4, 1)),
    (4, torch.float16, 64, False, 5, MatmulConfig(16, 32, 64, 2, 4, 1)),
    (4, torch.float16, 128, False, 5, MatmulConfig(16, 32, 128, 2, 4, 1, True)),
    (4, torch.float16, 256, False, 18, MatmulConfig(16, 32, 128, 1, 4, 1, True)),
    (8, torch.float16, 128, False, 17, MatmulConfig(16, 32, 64, 3, 4, 1, True)),
    (4, torch.float32, 64, True, 20, MatmulConfig(16, 32, 32, 1, 4, 1)),
    (8, torch.float32, 256, False, 2, MatmulConfig(16, 32, 64, 2, 4, 1)),
    (4, torch.float16, 32, True, 33, MatmulConfig(32, 32, 64, 2, 4, 1)),
    (4, torch.float16, 64, False, 7, MatmulConfig(16, 32, 128, 1, 4, 1)),  # group < block_k: per-row path
]


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


@pytest.mark.parametrize("bits, dtype, group_size, act_order, M, config", CASES)
def test_quant_linear_matches_reference(device, bits, dtype, group_size, act_order, M, config):
    K, N = max(128, group_size), 96  # tiny: the CPU interpreter runs these
    w = make_int_weight(K, N, bits, group_size, act_order, dtype, seed=M, device=device)
    x = torch.randn(M, K).to(dtype).to(device)
    bias = torch.randn(N).to(dtype).to(device)
    ref = quant_reference.quant_linear(x, w.qweight, w.scales, w.zeros, w.g_idx, bits, group_size, bias)
    for _ in range(2):  # the second call checks that split-K counters reset themselves
        out = quant_linear_impl(x, w.qweight, w.scales, w.zeros, w.g_idx, bits, group_size, bias, config=config)
        assert out.dtype == dtype and out.shape == (M, N)
        assert _rel_err(out, ref) < (2e-3 if dtype == torch.float16 else 1e-5)


def test_public_launcher_k_tail_and_strided_x(device):
    # K not a multiple of the tile; x a column slice of a wider buffer (row stride != K).
    K, N, M = 96 + 64, 64, 4
    w = make_int_weight(K, N, 4, 32, False, torch.float16, device=device)
    wide = torch.randn(M, K + 32).to(torch.float16).to(device)
    x = wide[:, :K]
    out = quant_linear(x, w.qweight, w.scales, w.zeros, None, 4, 32)
    ref = quant_reference.quant_linear(x, w.qweight, w.scales, w.zeros, None, 4, 32)
    assert _rel_err(out, ref) < 2e-3


def test_pick_config_buckets():
    gemv = pick_config(1, 4096, 4096, 128, 4, False, 132)
    assert gemv.block_m == 1 and gemv.split_k > 1 and 128 % gemv.block_k == 0
    assert pick_config(1, 4096, 4096, 128, 4, True, 132).block_m == 16  # act-order: the tile kernel
    small = pick_config(3, 4096, 4096, 128, 4, False, 132)
    assert small == pick_config(2, 4096, 4096, 128, 4, False, 132)  # one tiling per bucket
    assert small.block_m == 16 and small.split_k > 1
    assert pick_config(16, 4096, 4096, 32, 4, False, 132).block_k == 32
    assert pick_config(64, 4096, 28672, 128, 4, False, 132).block_m == 64
    assert pick_config(65, 4096, 4096, 128, 4, False, 132).block_m == 0  # dequantise + cuBLAS
    # The splits the H200 sweep found best at the 8B shapes (132 SMs).
    assert pick_config(1, 6144, 4096, 128, 4, False, 132).split_k == 32
    assert pick_config(1, 28672, 4096, 128, 4, False, 132).split_k == 16
    assert pick_config(16, 6144, 4096, 128, 4, False, 132).split_k == 11
    assert pick_config(16, 28672, 4096, 128, 4, False, 132).split_k == 3


def test_dense_path_matches_reference(device):
    w = make_int_weight(256, 96, 4, 64, True, torch.float16, seed=3, device=device)
    x = torch.randn(70, 256).to(torch.float16).to(device)
    bias = torch.randn(96).to(torch.float16).to(device)
    out = quant_linear(x, w.qweight, w.scales, w.zeros, w.g_idx, 4, 64, bias)  # M > 64: dense path
    ref = quant_reference.quant_linear(x, w.qweight, w.scales, w.zeros, w.g_idx, 4, 64, bias)
    assert _rel_err(out, ref) < 2e-3

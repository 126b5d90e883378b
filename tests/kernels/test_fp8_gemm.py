"""The FP8 GEMM (`kernels/fp8_gemm.py`) against its torch reference (`quant_reference.fp8_scaled_matmul`):
Triton's interpreter on CPU (tiny shapes, fp32 out), compiled on CUDA (sm_89+; the 8B shapes at the
rows serving sends it, bf16 out, inside a CUDA graph too). Every branch: row and column tails, a K
tail (masked loads), split-K (partials summed by the last split, counters reset for the next call),
bias; the picker's buckets and where serving uses it."""

from __future__ import annotations

import pytest
import torch

from kernels import quant_reference
from kernels.fp8_gemm import Fp8GemmConfig, fp8_gemm, pick_fp8_gemm_config, use_fp8_gemm
from quant_helpers import check_fp8_gemm
from quant_helpers import fp8_gemm_operands as _operands
from quant_helpers import rel_err as _rel


CASES = [
    # (M, N, K, config)
    (5, 72, 96, Fp8GemmConfig(16, 32, 32, 1, 4, 1)),  # row, column and K tails
    (20, 64, 128, Fp8GemmConfig(16, 32, 32, 3, 4, 1)),  # split-K over 4 K tiles (splits of 2, 2, 0 tiles)
    (33, 96, 160, Fp8GemmConfig(32, 64, 64, 2, 4, 2, group_m=2)),  # split-K with a K tail, grouped order
]


@pytest.mark.parametrize("M, N, K, config", CASES)
def test_fp8_gemm_matches_reference(device, M, N, K, config):
    if device == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 tensor cores need sm_89+")
    # the second call checks that the split-K counters reset themselves
    check_fp8_gemm(lambda *a: fp8_gemm(*a, config), M, N, K, device, calls=2)


def test_pick_and_use():
    # buckets: one tiling (and one split) for every M inside a bucket, so M moving never recompiles
    for lo, hi in ((17, 32), (33, 64), (65, 128)):
        assert len({pick_fp8_gemm_config(m, 6144, 4096, 132) for m in range(lo, hi + 1)}) == 1
    # the sweep's winners at the 8B shapes (H200, 132 SMs; bench/RESULTS.md run 57)
    assert pick_fp8_gemm_config(32, 6144, 4096, 132) == Fp8GemmConfig(16, 64, 128, 2, 4, 4)
    assert pick_fp8_gemm_config(64, 4096, 4096, 132) == Fp8GemmConfig(64, 64, 128, 3, 4, 4)
    assert pick_fp8_gemm_config(64, 28672, 4096, 132) == Fp8GemmConfig(64, 128, 128, 1, 4, 4)
    assert pick_fp8_gemm_config(128, 4096, 14336, 132) == Fp8GemmConfig(64, 64, 128, 2, 4, 4)
    assert not use_fp8_gemm(16, 4096, 4096) and use_fp8_gemm(17, 4096, 4096) and use_fp8_gemm(128, 4096, 4096)
    assert use_fp8_gemm(64, 28672, 4096) and not use_fp8_gemm(65, 28672, 4096)
    assert not use_fp8_gemm(129, 4096, 4096)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("K, N", [(4096, 6144), (4096, 28672), (14336, 4096)])
def test_fp8_gemm_8b_shapes_and_graph_replay(K, N):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 tensor cores need sm_89+")
    for m in (17, 32, 64, 100, 128):
        x_q, x_scale, w_q, w_scale, bias = _operands(m, N, K, "cuda", seed=m)
        ref = quant_reference.fp8_scaled_matmul(x_q, x_scale, w_q, w_scale, bias)
        out = fp8_gemm(x_q, x_scale, w_q, w_scale, bias)
        assert out.dtype == torch.bfloat16 and _rel(out, ref) < 1e-2, (m, _rel(out, ref))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_gemm(x_q, x_scale, w_q, w_scale, bias)
    for _ in range(2):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert _rel(out, ref) < 1e-2

"""The TMA FP8 GEMM (`kernels/fp8_gemm_tma.py`) against its torch reference (`quant_reference.fp8_scaled_matmul`):
Triton's interpreter on CPU (tiny shapes, fp32 out), compiled on Hopper (the 8B shapes at the rows serving sends
it, bf16 out, inside a CUDA graph too). Every branch: row, column and K tails (the TMA boxes' zero fill), bias,
fewer programs than tiles (the persistent loop, also flattened with the K loop), no rows; the picker's wave model."""

from __future__ import annotations

import pytest
import torch

from kernels import quant_reference
from kernels.fp8_gemm_tma import (
    _TILINGS, MAX_ROWS, MIN_ROWS, Fp8TmaConfig, estimate_us, fp8_gemm_tma, pick_fp8_tma_config, use_fp8_gemm_tma)
from quant_helpers import check_fp8_gemm
from quant_helpers import fp8_gemm_operands as _operands
from quant_helpers import rel_err as _rel

CASES = [
    # (M, N, K, config); on CPU the persistent grid is 4 x per_sm programs
    (5, 72, 96, Fp8TmaConfig(16, 32, 32, 4, 2)),  # row, column and K tails, 6 tiles on 4 programs
    (20, 64, 128, Fp8TmaConfig(16, 32, 32, 4, 2, flatten=True)),  # 4 K tiles a tile, 4 tiles on 4 programs
    (33, 96, 160, Fp8TmaConfig(32, 64, 64, 4, 2, per_sm=2)),  # a K tail, 4 tiles on 8 programs
    (70, 96, 160, Fp8TmaConfig(16, 32, 64, 4, 3, flatten=True)),  # 15 tiles on 4 programs, flattened, a K tail
]


@pytest.mark.parametrize("M, N, K, config", CASES)
def test_fp8_gemm_tma_matches_reference(device, M, N, K, config):
    if device == "cuda" and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("TMA needs sm_90+")
    check_fp8_gemm(lambda *a: fp8_gemm_tma(*a, config), M, N, K, device)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("K, N", [(4096, 6144), (4096, 28672), (14336, 4096)])
@pytest.mark.parametrize("config", [t.config for t in _TILINGS] + [Fp8TmaConfig(128, 256, 128, 8, 3, flatten=True)])
def test_fp8_gemm_tma_8b_shapes_and_graph_replay(K, N, config):
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("TMA needs sm_90+")
    for m in (129, 200, 256, 288, 512):
        x_q, x_scale, w_q, w_scale, bias = _operands(m, N, K, "cuda", seed=m)
        ref = quant_reference.fp8_scaled_matmul(x_q, x_scale, w_q, w_scale, bias)
        out = fp8_gemm_tma(x_q, x_scale, w_q, w_scale, bias, torch.bfloat16, config)
        assert out.dtype == torch.bfloat16 and _rel(out, ref) < 1e-2, (m, _rel(out, ref))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_gemm_tma(x_q, x_scale, w_q, w_scale, bias, torch.bfloat16, config)
    for _ in range(2):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert _rel(out, ref) < 1e-2


def test_pick_follows_the_wave_model():
    tilings = [t.config for t in _TILINGS]
    for m in (129, 200, 256, 272, 288, 400, 1000, 2048):
        for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (3072, 4096), (14336, 4096)):
            picked = pick_fp8_tma_config(m, n, k, 132)
            assert picked in tilings
            assert estimate_us(_TILINGS[tilings.index(picked)], m, n, k, 132) == min(
                estimate_us(t, m, n, k, 132) for t in _TILINGS)
    # the waves decide: at 288 rows of gate_up, 128-row tiles make 3 x 112 = 336 units (3 waves of 132), 64-row
    # tiles 5 x 112 = 560 units (5 waves) of half the work each; at 256 rows the 128-row tiles fill 2 waves
    assert pick_fp8_tma_config(288, 28672, 4096, 132).block_m == 64
    assert pick_fp8_tma_config(256, 28672, 4096, 132) == _TILINGS[0].config
    # the same rows always get the same tiling (no timing in the pick: the sums do not change between runs)
    assert len({pick_fp8_tma_config(300, 28672, 4096, 132) for _ in range(3)}) == 1
    assert not use_fp8_gemm_tma(MIN_ROWS - 1, 4096, 4096) and use_fp8_gemm_tma(MIN_ROWS, 4096, 4096)
    assert use_fp8_gemm_tma(MAX_ROWS, 4096, 4096) and not use_fp8_gemm_tma(MAX_ROWS + 1, 4096, 4096)
    assert not use_fp8_gemm_tma(256, 4096, 4104)  # a row pitch of 4104 bytes is not 16-byte aligned


def test_picked_tilings_compile_for_sm90():
    # Every candidate compiles for sm_90 to TMA copies and wgmma without spilling (Triton's own ptxas, no GPU).
    from sm90_compile import run_script

    assert run_script("fp8_tma_sm90_compile.py").count("ok ") == 4 * len(_TILINGS)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("gated", [False, True])
def test_fp8_linear_takes_the_tma_kernel_from_129_rows(monkeypatch, gated):
    # Serving's entry (`fp8_linear` -> `scaled_mm_linear`) sends 129-2048 rows here on Hopper: the same values
    # as the torch reference, and the TMA launcher is what ran.
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the TMA path is Hopper's")
    from kernels import fp8_matmul

    calls = []
    real = fp8_matmul.fp8_gemm_tma
    monkeypatch.setattr(fp8_matmul, "fp8_gemm_tma", lambda *a: calls.append(a[-1]) or real(*a))
    gen = torch.Generator().manual_seed(1)
    w = (torch.randn(1024, 512, generator=gen) * 0.02).cuda()
    w_q, w_scale = quant_reference.quantize_fp8(w)
    for m in (128, 129, 300, 2048, 2049):
        x = torch.randn(m, 512, generator=gen).to("cuda", torch.bfloat16)
        ref = quant_reference.fp8_scaled_matmul(*quant_reference.quantize_fp8(x), w_q, w_scale, None, torch.float32)
        if gated:
            ref = torch.nn.functional.silu(ref[:, :512]) * ref[:, 512:]
        out = fp8_matmul.fp8_linear(x, w_q, w_scale, gated=gated)
        assert out.shape == ref.shape and out.dtype == torch.bfloat16 and _rel(out, ref) < 1e-2, (m, _rel(out, ref))
    assert calls == [pick_fp8_tma_config(m, 1024, 512, torch.cuda.get_device_properties(0).multi_processor_count)
                     for m in (129, 300, 2048)]

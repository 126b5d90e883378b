"""The k-chunk int4 tensor-core paths for many rows (`kernels/int4_kchunk_gemm.py`, and `_kchunk_dot_kernel`
with bigger tiles and grouped program order) vs the fp64 product of the dequantised weight: interpreter
on CPU with fp32 x (bf16 arithmetic is wrong in the interpreter), compiled on CUDA. Rows past one tile
(65..130), N and K that the tiles do not divide, groups of 32 / 128 rows or one group, bias, split-K,
one dot per K tile or one per nibble, and GROUP_M bands; and every tiling the picker or the sweep can
pick compiled for sm_90."""

from __future__ import annotations

import pytest
import torch
from quant_helpers import make_int_weight
from sm90_compile import run_script

from kernels import quant_reference
from kernels.int4_kchunk import DENSE, GEMM_JOIN, GEMM_NIBBLES, KChunkConfig, int4_kchunk_linear_impl, pick_kchunk_config


def J(bm, bn, bk, split=1, group_m=1):
    return KChunkConfig(bm, bn, bk, split, 4, 1, group_m=group_m, gemm=GEMM_JOIN)


def N(bm, bn, bk, split=1, group_m=1):
    return KChunkConfig(bm, bn, bk, split, 4, 1, group_m=group_m, gemm=GEMM_NIBBLES)


CASES = [
    # (K, group_size, M, N, config)
    (256, 128, 65, 72, J(32, 32, 64)),  # 3 row tiles, the last with 1 row; a partial column tile
    (256, 128, 70, 72, N(32, 32, 128)),
    (224, 32, 97, 40, J(32, 32, 128, split=2, group_m=2)),  # K tail (224 = 128 + 96), groups inside a tile
    (224, 32, 130, 40, N(64, 32, 128, split=2, group_m=3)),
    (160, 160, 100, 72, J(32, 64, 64, group_m=2)),  # one group, K tail
    (160, 160, 66, 100, J(16, 64, 32)),  # one chunk a K tile
    (480, 160, 90, 40, N(16, 32, 256, split=2)),  # groups across tiles, K tail inside the last
    (256, 64, 129, 72, KChunkConfig(32, 32, 128, 1, 4, group_m=2)),  # the 8-sub-dot kernel, grouped order
    (288, 32, 80, 40, KChunkConfig(64, 32, 128, 3, 4, group_m=4)),  # its K tail, split-K
]


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


@pytest.mark.parametrize("K, group_size, M, N, config", CASES)
def test_large_m_paths_match_dequantised_product(device, K, group_size, M, N, config):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    w = make_int_weight(K, N, 4, group_size, False, torch.float32, seed=M + K + N)
    packed = quant_reference.repack_int4_kchunk(w.qweight).to(device)
    x = torch.randn(M, K).to(dtype).to(device)
    bias = torch.randn(N).to(dtype).to(device)
    scales, zeros = w.scales.to(dtype).to(device), w.zeros.to(dtype).to(device)
    dense = quant_reference.int4_kchunk_linear(x.double(), packed, scales.double(), zeros.double(), group_size)
    assert _rel_err(dense, x.double() @ (w.dense.double().to(device))) < 1e-2  # the oracle itself
    for _ in range(2):  # the second call checks that split-K counters reset themselves
        out = int4_kchunk_linear_impl(x, packed, scales, zeros, group_size, bias, config=config)
        assert out.dtype == dtype and out.shape == (M, N)
        assert _rel_err(out, dense + bias.double()) < tol
    no_bias = int4_kchunk_linear_impl(x, packed, scales, zeros, group_size, None, config=config)
    assert _rel_err(no_bias, dense) < tol


def test_picked_and_swept_tilings_compile_for_sm90():
    # The interpreter runs programs the compiler rejects: compile every tensor-core tiling the picker
    # returns above 16 rows, and the sweep's candidates, for sm_90 (Triton's ptxas, no GPU needed).
    out = run_script("kchunk_sm90_compile.py")
    assert out.count("ok ") >= 20 and "wgmma=False" not in out


def test_pick_many_rows_buckets():
    shapes = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))  # the 8B's qkv, o, gate_up, down
    for n, k in shapes:
        # one compiled variant per bucket: the same config for every M inside it
        for lo, hi in ((17, 64), (65, 128), (129, 256), (257, 4096)):
            assert len({pick_kchunk_config(m, n, k, 128, 132) for m in range(lo, hi + 1)}) == 1, (n, k, lo)
        cfg = pick_kchunk_config(64, n, k, 128, 132)
        assert cfg.gemm == GEMM_JOIN and cfg.block_m == 64  # no dense copy of the weight up to 64 rows
        assert pick_kchunk_config(300, n, k, 128, 132) == DENSE  # prefill: dequantise once, then cuBLAS
    # where the sweeps found the GEMM ahead of dequantise + cuBLAS (H100 run 41, H200 run 68)
    assert pick_kchunk_config(128, 28672, 4096, 128, 132) == KChunkConfig(128, 128, 64, 1, 8, 3, gemm=GEMM_JOIN)
    assert pick_kchunk_config(100, 4096, 14336, 128, 132).gemm == GEMM_JOIN
    assert pick_kchunk_config(100, 4096, 4096, 128, 132) == DENSE  # o: dequantise + cuBLAS won at 128
    assert pick_kchunk_config(100, 6144, 4096, 128, 132) == DENSE  # qkv: the same (H200 80 rows 31.3 / 45.1 us)
    assert pick_kchunk_config(256, 28672, 4096, 128, 132) == DENSE  # gate_up above 128 rows (H200 170.7 / 202.8)
    assert pick_kchunk_config(256, 6144, 4096, 128, 132) == DENSE

"""The GEMVs' gated epilogue: a packed [gate | up] weight in, silu(gate) * up out, in one launch.

`kernels/fp8_gemv.py` (FP8 and bf16 weights) and the k-chunk int4 GEMV (`kernels/int4_kchunk.py`)
with `gated=True` must give the same bits as the same tiling without it followed by
`kernels/activation.py` (the unfused path the MLP ran before): every mode, split-K (twice: the
counters reset), bias, M below the program's rows, an I that the last tile covers only in part.
The interpreter runs them on CPU, compiled on CUDA; an fp64 oracle bounds both. One exception on CPU:
the fp16 tensor-core mode's dots run as numpy matmuls there, whose summation order can follow the
operands' widths on some CPUs (an AMD EPYC: 16 of 220 values 2e-5 apart), so that mode is held to
fp32 rounding on CPU and to bits on CUDA.
"""

from __future__ import annotations

import pytest
import torch
from quant_helpers import make_int_weight

import kernels
from kernels import quant_reference, reference
from kernels.activation import silu_and_mul
from kernels.fp8_gemv import MODE_ACC, MODE_DOT16, MODE_ROWSUM, GemvConfig, fp8_gemv
from kernels.int4_kchunk import KChunkConfig, int4_kchunk_linear_impl


def _oracle(y: torch.Tensor) -> torch.Tensor:
    gate, up = y.double().chunk(2, dim=-1)
    return gate * torch.sigmoid(gate) * up


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all()
    return float((out.double() - ref).norm() / ref.norm())


GEMV_CASES = [
    # (weights, I, K, M, bias, config)
    ("fp8", 24, 256, 1, True, GemvConfig(MODE_ACC, 16, 64, 2, 1, 4, 1)),
    ("fp8", 20, 400, 1, False, GemvConfig(MODE_ACC, 16, 64, 2, 3, 4, 1)),  # split 3, K tail, a partial tile
    ("fp8", 36, 512, 2, True, GemvConfig(MODE_ACC, 8, 128, 1, 2, 4, 3)),  # smem pipelining
    ("fp8", 20, 400, 3, True, GemvConfig(MODE_ROWSUM, 16, 32, 4, 3, 4, 1)),
    ("fp8", 20, 400, 11, True, GemvConfig(MODE_DOT16, 32, 64, 2, 2, 4, 3)),
    ("bf16", 24, 256, 1, True, GemvConfig(MODE_ACC, 8, 64, 2, 1, 4, 1)),
    ("bf16", 20, 400, 1, False, GemvConfig(MODE_ACC, 16, 64, 2, 3, 4, 1)),
    ("bf16", 36, 512, 2, True, GemvConfig(MODE_ACC, 16, 128, 1, 2, 4, 3)),
    ("bf16", 20, 400, 4, False, GemvConfig(MODE_ROWSUM, 16, 32, 4, 3, 4, 1)),
]


@pytest.mark.parametrize("weights, I, K, M, with_bias, config", GEMV_CASES)
def test_word_gemv_gated_is_the_unfused_gemv_then_silu_mul(device, weights, I, K, M, with_bias, config):
    g = torch.Generator().manual_seed(I * K + M)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    if weights == "fp8":
        w, scale = quant_reference.quantize_fp8(torch.randn(2 * I, K, generator=g))
        scale, dense = scale.to(device), w.double() * scale.double().reshape(-1, 1)
    else:
        w, scale = torch.randn(2 * I, K, generator=g).bfloat16(), None
        dense = w.double()
    w = w.to(device)
    x = (torch.randn(M, K, generator=g) * 0.5).half().to(dtype).to(device)  # fp16-exact: DOT16 converts it
    bias = torch.randn(2 * I, generator=g).bfloat16().to(dtype).to(device) if with_bias else None
    unfused = silu_and_mul(fp8_gemv(x, w, scale, bias, config))
    for _ in range(2):  # the second launch finds its split-K counters back at zero
        fused = fp8_gemv(x, w, scale, bias, config, gated=True)
        assert fused.shape == (M, I) and fused.dtype == x.dtype
        if device == "cpu" and config.mode == MODE_DOT16:
            torch.testing.assert_close(fused, unfused, rtol=1e-4, atol=1e-6)
        else:
            assert torch.equal(fused, unfused), config
    y = x.double() @ dense.to(device).t() + (bias.double() if bias is not None else 0)
    assert _rel_err(fused, _oracle(y)) < (1e-5 if dtype == torch.float32 else 2e-2)


INT4_CASES = [
    # (dtype, K, group_size, M, config); block_m < 16: the GEMV's epilogue, else the fallback
    (torch.float32, 256, 128, 1, KChunkConfig(1, 64, 64, 1, 2)),
    (torch.float16, 256, 64, 1, KChunkConfig(1, 128, 64, 3, 2)),  # 2 columns a thread, split-K
    (torch.float16, 256, 128, 2, KChunkConfig(2, 64, 128, 2, 1)),
    (torch.float16, 256, 64, 3, KChunkConfig(4, 32, 32, 4, 1)),  # 3 of 4 rows
    (torch.float16, 160, 160, 1, KChunkConfig(1, 64, 64, 2, 2, pairs=False)),  # one group, a K tail
    (torch.float16, 256, 128, 5, KChunkConfig(16, 64, 128, 1, 4)),  # tensor cores: activation kernel after
]


@pytest.mark.parametrize("dtype, K, group_size, M, config", INT4_CASES)
def test_int4_gemv_gated_is_the_unfused_gemv_then_silu_mul(device, dtype, K, group_size, M, config):
    I = 52  # the last column tile is partial
    w = make_int_weight(K, 2 * I, 4, group_size, False, dtype, seed=M + K)
    packed = quant_reference.repack_int4_kchunk(w.qweight).to(device)
    scales, zeros = w.scales.to(device), w.zeros.to(device)
    x = torch.randn(M, K).to(dtype).to(device)
    bias = torch.randn(2 * I).to(dtype).to(device)
    unfused = silu_and_mul(int4_kchunk_linear_impl(x, packed, scales, zeros, group_size, bias, config=config))
    for _ in range(2):
        fused = int4_kchunk_linear_impl(x, packed, scales, zeros, group_size, bias, config=config, gated=True)
        assert fused.shape == (M, I) and fused.dtype == dtype
        assert torch.equal(fused, unfused), config
    ref = _oracle(x.double() @ w.dense.double().to(device) + bias.double())
    assert _rel_err(fused, ref) < (5e-3 if dtype == torch.float16 else 1e-5)


def test_gated_rejects_an_odd_row_count(device):
    x = torch.randn(1, 64).to(device)
    w = torch.randn(15, 64).bfloat16().to(device)
    with pytest.raises(ValueError, match="even"):
        fp8_gemv(x, w, None, None, GemvConfig(MODE_ACC, 16, 32, 1, 1, 4, 1), gated=True)
    with pytest.raises(ValueError, match="even"):
        fp8_gemv(x, w[:14], None, None, GemvConfig(MODE_ACC, 7, 32, 1, 1, 4, 1), gated=True)
    q = make_int_weight(64, 15, 4, 32, False, torch.float32, seed=3)
    with pytest.raises(ValueError, match="even"):
        int4_kchunk_linear_impl(x, quant_reference.repack_int4_kchunk(q.qweight).to(device), q.scales.to(device),
                                q.zeros.to(device), 32, config=KChunkConfig(1, 64, 32, 1, 2), gated=True)


def test_public_ops_take_gated_on_cpu_as_their_reference_then_silu_mul():
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(3, 64, generator=g), torch.randn(40, 64, generator=g)
    want = reference.silu_and_mul(quant_reference.skinny_linear(x, w))
    assert torch.equal(kernels.skinny_linear(x, w, gated=True), want)
    q, scale = quant_reference.quantize_fp8(w)
    assert torch.equal(kernels.fp8_linear(x, q, scale, gated=True),
                       reference.silu_and_mul(kernels.fp8_linear(x, q, scale)))
    iw = make_int_weight(64, 40, 4, 32, False, torch.float32, seed=4)
    packed = quant_reference.repack_int4_kchunk(iw.qweight)
    assert torch.equal(kernels.int4_kchunk_linear(x, packed, iw.scales, iw.zeros, 32, gated=True),
                       reference.silu_and_mul(kernels.int4_kchunk_linear(x, packed, iw.scales, iw.zeros, 32)))

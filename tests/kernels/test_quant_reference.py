"""The quantized-linear torch references (the CPU path) against dense matmuls built in the test."""

from __future__ import annotations

import pytest
import torch
from quant_helpers import make_int_weight, pack_codes

import kernels
from kernels import quant_reference

K, N, M = 256, 48, 5


def test_pack_codes_layout():
    # Row k of column n sits at bits [bits * (k % pack), ...) of word k // pack: GPTQ's order.
    q = torch.arange(16).reshape(16, 1) % 16
    words = pack_codes(q, 4)
    assert words.shape == (2, 1)
    assert words[0, 0].item() == 0x76543210
    assert words[1, 0].item() & 0xFFFFFFFF == 0xFEDCBA98  # int32 holds it as a negative number


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128, K])
@pytest.mark.parametrize("act_order", [False, True])
def test_quant_linear_matches_dense(bits, group_size, act_order):
    w = make_int_weight(K, N, bits, group_size, act_order, torch.float32, seed=bits + group_size)
    x = torch.randn(M, K)
    bias = torch.randn(N)
    out = kernels.quant_linear(x, w.qweight, w.scales, w.zeros, w.g_idx, bits, group_size, bias)
    expected = (x.double() @ w.dense.double() + bias.double()).float()
    assert out.shape == (M, N) and out.dtype == torch.float32
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_quant_linear_half_inputs_keep_dtype(dtype):
    w = make_int_weight(K, N, 4, 128, False, dtype)
    x = torch.randn(M, K).to(dtype)
    out = quant_reference.quant_linear(x, w.qweight, w.scales, w.zeros, None, 4, 128)
    expected = x.double() @ w.dense.double()
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=2e-2)


def test_unpack_inverts_pack():
    q = torch.randint(0, 16, (64, 7))
    assert torch.equal(quant_reference.unpack_int_weight(pack_codes(q, 4), 4), q.to(torch.int32))
    q8 = torch.randint(0, 256, (64, 7))
    assert torch.equal(quant_reference.unpack_int_weight(pack_codes(q8, 8), 8), q8.to(torch.int32))


@pytest.mark.parametrize("per_channel", [False, True])
def test_fp8_linear_matches_dense(per_channel):
    torch.manual_seed(0)
    w_fp8 = (torch.randn(N, K) * 4).to(torch.float8_e4m3fn)
    scale = torch.rand(N) + 0.1 if per_channel else torch.tensor(0.37)
    x = torch.randn(M, K)
    bias = torch.randn(N)
    out = kernels.fp8_linear(x, w_fp8, scale.float(), bias)
    dense = w_fp8.double() * (scale.double()[:, None] if per_channel else scale.double())
    expected = (x.double() @ dense.T + bias.double()).float()
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


def test_quantize_fp8_round_trip():
    torch.manual_seed(0)
    w = torch.randn(N, K) * torch.linspace(0.01, 10, N)[:, None]
    w_fp8, scale = kernels.quantize_fp8(w)
    assert w_fp8.dtype == torch.float8_e4m3fn and scale.shape == (N,) and scale.dtype == torch.float32
    # Each row's largest magnitude lands on the largest finite e4m3 value.
    torch.testing.assert_close(w_fp8.float().abs().amax(dim=1), torch.full((N,), 448.0))
    back = w_fp8.float() * scale[:, None]
    assert ((back - w).abs() <= w.abs() * 2**-4 + scale[:, None] * 2**-9).all()  # e4m3: 3 mantissa bits

"""Quantized linear kernels vs the torch references at Llama-3-8B layer shapes (skipped without CUDA).

int4/int8: the Triton kernel against the fp32 reference for every decode and prefill M bucket, every
group size, act-order on and off, bf16 and fp16; and replayed from a CUDA graph. FP8: the dynamic
per-token path (`torch._scaled_mm`) against the dequantised reference, whose activations are not
quantised: e4m3's 3 mantissa bits put that gap near 3 % by relative Frobenius error.
"""

from __future__ import annotations

import functools

import pytest
import torch

import kernels
from kernels import quant_reference
from kernels.int4_matmul import MatmulConfig, quant_linear_impl

pytestmark = pytest.mark.gpu

SHAPES = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]  # (K, N) of the 8B layers
MS = [1, 3, 16, 64, 256, 1024]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


@functools.lru_cache(maxsize=2)
def _gpu_int_weight(k: int, n: int, bits: int, group_size: int, act_order: bool, dtype: torch.dtype):
    """Random codes packed on the GPU (same layout as quant_helpers.pack_codes)."""
    g = torch.Generator(device="cuda").manual_seed(k + n + group_size)
    pack = 32 // bits
    q = torch.randint(0, 2**bits, (k // pack, pack, n), device="cuda", generator=g, dtype=torch.int64)
    shifts = (torch.arange(pack, device="cuda") * bits)[None, :, None]
    words = (q << shifts).sum(dim=1)  # disjoint bit fields: sum == or
    qweight = (words - (words >= 2**31).long() * 2**32).to(torch.int32)
    num_groups = k // group_size
    scales = ((torch.rand(num_groups, n, device="cuda", generator=g) + 0.5) / 2**bits).to(dtype)
    zeros = torch.randint(0, 2**bits, (num_groups, n), device="cuda", generator=g).to(dtype)
    g_idx = None
    if act_order:
        g_idx = (torch.randperm(k, device="cuda", generator=g) // group_size).to(torch.int32)
    return qweight, scales, zeros, g_idx


@pytest.mark.parametrize("K, N", SHAPES)
@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int4_real_shapes(K, N, group_size, act_order, dtype):
    group_size = K if group_size == -1 else group_size
    qweight, scales, zeros, g_idx = _gpu_int_weight(K, N, 4, group_size, act_order, dtype)
    bias = torch.randn(N, device="cuda", dtype=dtype) if N == 6144 else None
    for m in MS:
        x = torch.randn(m, K, device="cuda", dtype=dtype)
        out = kernels.quant_linear(x, qweight, scales, zeros, g_idx, 4, group_size, bias)
        ref = quant_reference.quant_linear(x, qweight, scales, zeros, g_idx, 4, group_size, bias)
        err = rel_err(out, ref)
        assert err < (1e-2 if dtype == torch.bfloat16 else 2e-3), (m, err)


@pytest.mark.parametrize("group_size, act_order", [(128, False), (-1, False), (128, True)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int8_real_shape(group_size, act_order, dtype):
    K, N = 4096, 6144
    group_size = K if group_size == -1 else group_size
    qweight, scales, zeros, g_idx = _gpu_int_weight(K, N, 8, group_size, act_order, dtype)
    for m in (1, 16, 256):
        x = torch.randn(m, K, device="cuda", dtype=dtype)
        out = kernels.quant_linear(x, qweight, scales, zeros, g_idx, 8, group_size)
        ref = quant_reference.quant_linear(x, qweight, scales, zeros, g_idx, 8, group_size)
        assert rel_err(out, ref) < (1e-2 if dtype == torch.bfloat16 else 2e-3)


PATHS = [
    # every kernel path at a real shape, whatever pick_config chooses today (block_m < 16: GEMV rows;
    # 0: dequantise + cuBLAS; split_unpack: one sub-dot per packed slot)
    MatmulConfig(1, 256, 128, 8, 2, 1), MatmulConfig(1, 512, 64, 4, 4, 1), MatmulConfig(1, 128, 128, 1, 1, 1),
    MatmulConfig(2, 256, 128, 4, 2, 1), MatmulConfig(4, 512, 128, 2, 4, 1),
    MatmulConfig(1, 512, 64, 16, 4, 1, fma_tile=True), MatmulConfig(2, 256, 64, 8, 2, 1, fma_tile=True),
    MatmulConfig(16, 64, 128, 4, 4, 3, True), MatmulConfig(16, 128, 64, 2, 4, 3),
    MatmulConfig(64, 64, 128, 2, 4, 3), MatmulConfig(128, 64, 64, 1, 4, 4), MatmulConfig(128, 128, 128, 2, 8, 3, True),
    MatmulConfig(0, 0, 0, 1, 0, 0),
]


@pytest.mark.parametrize("config", PATHS, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("act_order", [False, True])
def test_int4_every_path(config, act_order):
    if act_order and 0 < config.block_m < 16:
        pytest.skip("the GEMV kernel takes no g_idx (pick_config sends act-order to the tile kernel)")
    K, N = 14336, 4096
    qweight, scales, zeros, g_idx = _gpu_int_weight(K, N, 4, 128, act_order, torch.bfloat16)
    bias = torch.randn(N, device="cuda", dtype=torch.bfloat16)
    m = config.block_m if 0 < config.block_m < 16 else 37
    x = torch.randn(m, K, device="cuda", dtype=torch.bfloat16)
    out = quant_linear_impl(x, qweight, scales, zeros, g_idx, 4, 128, bias, config)
    ref = quant_reference.quant_linear(x, qweight, scales, zeros, g_idx, 4, 128, bias)
    assert rel_err(out, ref) < 1e-2


def _graph_of(fn):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # warm-up: compiles, creates the split-K counters
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    return g, out


@pytest.mark.parametrize("m", [1, 8])
@pytest.mark.parametrize("K, N", [(4096, 6144), (14336, 4096)])
def test_int4_cuda_graph(m, K, N):
    qweight, scales, zeros, _ = _gpu_int_weight(K, N, 4, 128, False, torch.bfloat16)
    x = torch.randn(m, K, device="cuda", dtype=torch.bfloat16)
    g, out = _graph_of(lambda: kernels.quant_linear(x, qweight, scales, zeros, None, 4, 128))
    for _ in range(3):  # new inputs each replay; split-K counters must reset every time
        x.copy_(torch.randn_like(x))
        g.replay()
        ref = quant_reference.quant_linear(x, qweight, scales, zeros, None, 4, 128)
        assert rel_err(out, ref) < 1e-2


def _fp8_weight(n: int, k: int, per_channel: bool):
    w = torch.randn(n, k, device="cuda") * 0.02
    if per_channel:
        return kernels.quantize_fp8(w)
    scale = (w.abs().amax() / 448.0).float()
    return (w / scale).to(torch.float8_e4m3fn), scale


@pytest.mark.parametrize("K, N", SHAPES)
@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_real_shapes(K, N, per_channel, dtype):
    weight, scale = _fp8_weight(N, K, per_channel)
    bias = torch.randn(N, device="cuda", dtype=dtype) if N == 6144 else None
    for m in (1, 16, 256):
        x = torch.randn(m, K, device="cuda", dtype=dtype)
        out = kernels.fp8_linear(x, weight, scale, bias)
        ref = quant_reference.fp8_linear(x, weight, scale, bias)
        assert out.dtype == dtype and rel_err(out, ref) < 6e-2


def test_fp8_quantize_rows_and_graph():
    from kernels.fp8_rows import quantize_rows_fp8

    x = torch.randn(37, 4096, device="cuda", dtype=torch.bfloat16) * torch.rand(37, 1, device="cuda")
    q, s = quantize_rows_fp8(x)
    torch.testing.assert_close(s, x.float().abs().amax(dim=1, keepdim=True) / 448.0)
    expected = (x.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert (q.float() - expected.float()).abs().le(expected.float().abs() * 2**-3).all()

    weight, scale = _fp8_weight(6144, 4096, True)
    x8 = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16)
    g, out = _graph_of(lambda: kernels.fp8_linear(x8, weight, scale))
    x8.copy_(torch.randn_like(x8))
    g.replay()
    assert rel_err(out, quant_reference.fp8_linear(x8, weight, scale)) < 6e-2

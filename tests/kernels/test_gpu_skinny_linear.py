"""The skinny linear at the real per-rank decode shapes vs the fp32 reference (skipped without CUDA).

Llama-3-8B and -70B projections at TP = 1, 2, 4, M = 1..16, bf16 and FP8 weights, the picked tiling
(split-K wherever N is narrow); replay from a CUDA graph; the dispatch through `kernels.fp8_linear`.
"""

from __future__ import annotations

import functools

import pytest
import torch

import kernels
from kernels import quant_reference
from kernels.skinny_linear import pick_skinny_config, skinny_linear

pytestmark = pytest.mark.gpu

FP8 = torch.float8_e4m3fn
MODELS = {"8b": (4096, 14336, 32, 8), "70b": (8192, 28672, 64, 8)}  # hidden, inter, q heads, kv heads


def _shapes() -> list[tuple[int, int]]:
    out = []
    for h, inter, qh, kvh in MODELS.values():
        for tp in (1, 2, 4):
            for k, n in ((h, (qh + 2 * kvh) * 128 // tp), (qh * 128 // tp, h), (h, 2 * inter // tp), (inter // tp, h)):
                if (k, n) not in out:
                    out.append((k, n))
    return out


def _max_rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all()
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max())


@functools.lru_cache(maxsize=2)
def _weight(k: int, n: int, wdtype: torch.dtype):
    g = torch.Generator(device="cuda").manual_seed(k + n)
    w = torch.randn(n, k, device="cuda", generator=g)
    if wdtype == FP8:
        return kernels.quantize_fp8(w)
    return (w / 64).to(wdtype), None


@pytest.mark.parametrize("wdtype", [torch.bfloat16, FP8])
@pytest.mark.parametrize("K, N", _shapes())
def test_real_shapes(K, N, wdtype):
    w, scale = _weight(K, N, wdtype)
    for m in (1, 2, 3, 4, 7, 8, 13, 16):
        x = torch.randn(m, K, device="cuda", dtype=torch.bfloat16)
        bias = torch.randn(N, device="cuda", dtype=torch.bfloat16) if m == 3 else None
        ref = quant_reference.skinny_linear(x.float(), w, scale, bias)
        out = skinny_linear(x, w, scale, bias)
        assert out.dtype == torch.bfloat16 and out.shape == (m, N)
        assert _max_rel(out, ref) < 1e-2, (m, pick_skinny_config(m, N, K, wdtype, 132))


@pytest.mark.parametrize("m", [1, 4, 16])
@pytest.mark.parametrize("wdtype", [torch.bfloat16, FP8])
def test_cuda_graph_split_k(m, wdtype):
    K, N = 4096, 1536  # 8B qkv at TP=4: split along K
    w, scale = _weight(K, N, wdtype)
    x = torch.randn(m, K, device="cuda", dtype=torch.bfloat16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        skinny_linear(x, w, scale)  # warm-up: compiles, creates the split-K counters
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = skinny_linear(x, w, scale)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        g.replay()
        torch.cuda.synchronize()
        assert _max_rel(out, quant_reference.skinny_linear(x.float(), w, scale)) < 1e-2


def test_dispatch():
    w, scale = _weight(4096, 4096, FP8)
    dev = torch.device("cuda")
    assert kernels.use_skinny(1, 4096, 4096, FP8, dev) in (True, False)
    assert not kernels.use_skinny(17, 4096, 4096, FP8, dev)
    for m in (1, 16, 17):
        x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        ref = quant_reference.fp8_linear(x.float(), w, scale).float()
        assert _max_rel(kernels.fp8_linear(x, w, scale), ref) < 6e-2  # above 16 rows: quantised activations
        assert _max_rel(kernels.skinny_linear(x[:16], w, scale), ref[:16]) < 1e-2

"""Builders for the quantized-linear tests: random codes packed by the documented layout, with an
independent dense oracle (dequantised from the codes themselves, never by unpacking qweight)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class IntWeight:
    """A random quantized [K, N] weight in the canonical layout, plus its dense fp32 value."""

    qweight: torch.Tensor  # [K * bits // 32, N] int32
    scales: torch.Tensor  # [num_groups, N]
    zeros: torch.Tensor  # [num_groups, N]
    g_idx: torch.Tensor | None  # [K] int32
    bits: int
    group_size: int
    dense: torch.Tensor  # [K, N] fp32: (q - zeros[g]) * scales[g]


def pack_codes(q: torch.Tensor, bits: int) -> torch.Tensor:
    """[K, N] codes in [0, 2**bits) -> int32 [K * bits // 32, N]: row k at bits bits * (k % pack)."""
    pack = 32 // bits
    num_rows, n = q.shape
    words = torch.zeros(num_rows // pack, n, dtype=torch.int64)
    for k in range(pack):
        words |= q[k::pack].to(torch.int64) << (bits * k)
    return (words - (words >= 2**31).to(torch.int64) * 2**32).to(torch.int32)  # two's complement


def make_int_weight(
    k: int, n: int, bits: int, group_size: int, act_order: bool, dtype: torch.dtype, seed: int = 0,
    device: str = "cpu",
) -> IntWeight:
    """Random codes, scales (so that w has unit-ish scale) and integer zero points."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 2**bits, (k, n), generator=g)
    num_groups = k // group_size
    scales = ((torch.rand(num_groups, n, generator=g) + 0.5) / 2**bits).to(dtype)
    zeros = torch.randint(0, 2**bits, (num_groups, n), generator=g).to(dtype)
    if act_order:
        groups = torch.randperm(k, generator=g) // group_size  # each group still has group_size rows
        g_idx = groups.to(torch.int32)
    else:
        groups = torch.arange(k) // group_size
        g_idx = None
    dense = (q.double() - zeros.double()[groups]) * scales.double()[groups]
    return IntWeight(
        pack_codes(q, bits).to(device), scales.to(device), zeros.to(device),
        None if g_idx is None else g_idx.to(device), bits, group_size, dense.float().to(device),
    )


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """|out - ref| / |ref| (Frobenius), in float64."""
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def fp8_gemm_operands(M: int, N: int, K: int, device: str, seed: int = 0) -> list[torch.Tensor]:
    """The FP8 GEMMs' operands, seeded: (x_q, x_scale) per token, (w_q, w_scale) per output channel, and a bias."""
    from kernels import quant_reference

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=gen)
    w = torch.randn(N, K, generator=gen) * 0.02
    x_q, x_scale = quant_reference.quantize_fp8(x)
    w_q, w_scale = quant_reference.quantize_fp8(w)
    bias = torch.randn(N, generator=gen)
    return [t.to(device) for t in (x_q, x_scale, w_q, w_scale, bias)]


def check_fp8_gemm(run, M: int, N: int, K: int, device: str, calls: int = 1) -> None:
    """An FP8 GEMM launcher `run(x_q, x_scale, w_q, w_scale, bias, out_dtype)` against
    `quant_reference.fp8_scaled_matmul` with fp32 out: `calls` times with the bias (a split's counters reset
    themselves between calls), once without, and with no rows."""
    from kernels import quant_reference

    x_q, x_scale, w_q, w_scale, bias = fp8_gemm_operands(M, N, K, device, seed=M)
    ref = quant_reference.fp8_scaled_matmul(x_q, x_scale, w_q, w_scale, bias, torch.float32)
    for _ in range(calls):
        out = run(x_q, x_scale, w_q, w_scale, bias, torch.float32)
        assert out.shape == (M, N) and out.dtype == torch.float32
        assert rel_err(out, ref) < 1e-5
    no_bias = run(x_q, x_scale, w_q, w_scale, None, torch.float32)
    assert rel_err(no_bias, ref - bias) < 1e-5
    assert run(x_q[:0], x_scale[:0], w_q, w_scale, None, torch.float32).shape == (0, N)

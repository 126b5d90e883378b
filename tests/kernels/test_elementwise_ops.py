"""Triton RMSNorm (+ fused residual), rotary embedding and SiLU-and-mul vs the references."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import tol

from kernels import reference
from kernels.activation import silu_and_mul
from kernels.rms_norm import rms_norm
from kernels.rotary import rotary_embedding


@pytest.mark.parametrize("dtype, hidden", [(torch.float32, 64), (torch.float16, 80)])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("unit_offset", [False, True])
def test_rms_norm(device, dtype, hidden, with_residual, unit_offset):
    x = torch.randn(5, hidden).to(dtype).to(device)
    w = (1 + 0.1 * torch.randn(hidden)).to(dtype).to(device)
    res = torch.randn(5, hidden).to(dtype).to(device) if with_residual else None
    x_before = x.clone()
    out = rms_norm(x, w, 1e-5, res, unit_offset)
    ref = reference.rms_norm(x, w, 1e-5, res, unit_offset)
    assert torch.equal(x, x_before)
    if with_residual:
        torch.testing.assert_close(out[0], ref[0], **tol(dtype))
        torch.testing.assert_close(out[1], ref[1], **tol(dtype))
    else:
        torch.testing.assert_close(out, ref, **tol(dtype))


@pytest.mark.parametrize("dtype, head_dim, rot_dim, three_d", [
    (torch.float32, 64, 64, False),
    (torch.float16, 128, 128, True),
    (torch.float32, 80, 32, False),
])
def test_rotary_in_place(device, dtype, head_dim, rot_dim, three_d):
    num_tokens, num_heads, num_kv_heads = 4, 4, 2
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim).to(dtype).to(device)
    q = qkv[:, : num_heads * head_dim]
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim]
    if three_d:
        q, k = q.view(num_tokens, num_heads, head_dim), k.view(num_tokens, num_kv_heads, head_dim)
    inv = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2).float() / rot_dim))
    freqs = torch.outer(torch.arange(32).float(), inv)
    cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)
    positions = torch.tensor([0, 3, 31, 7], device=device)
    q_ref, k_ref = q.clone(), k.clone()
    rotary_embedding(positions, q, k, cache, head_dim)
    reference.rotary_embedding(positions, q_ref, k_ref, cache, head_dim)
    torch.testing.assert_close(q, q_ref, **tol(dtype))
    torch.testing.assert_close(k, k_ref, **tol(dtype))


@pytest.mark.parametrize("dtype, d", [(torch.float32, 64), (torch.float16, 40)])
def test_silu_and_mul(device, dtype, d):
    x = torch.randn(2, 3, 2 * d).to(dtype).to(device)
    torch.testing.assert_close(silu_and_mul(x), reference.silu_and_mul(x), **tol(dtype))


def test_package_ops_stay_dispatchers_after_launcher_imports():
    import kernels
    import kernels.paged_decode_attention  # noqa: F401  (would shadow the op without the guard)
    import kernels.prefill_attention  # noqa: F401
    import kernels.rms_norm  # noqa: F401

    for name in ("paged_decode_attention", "prefill_attention", "rms_norm"):
        assert callable(getattr(kernels, name)), name


def test_rms_norm_unit_offset_is_gemmas_norm():
    """Gemma's RMSNorm (transformers' order: float32 throughout, scaled by 1 + w, one cast)."""
    torch.manual_seed(0)
    x = torch.randn(7, 96).to(torch.bfloat16)
    w = (0.3 * torch.randn(96)).to(torch.bfloat16)
    xf = x.float()
    want = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + w.float())).to(torch.bfloat16)
    assert torch.equal(reference.rms_norm(x, w, 1e-6, unit_offset=True), want)
    assert not torch.equal(reference.rms_norm(x, w + 1, 1e-6), want)  # Llama's rounding order differs

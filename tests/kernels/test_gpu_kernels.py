"""Kernels vs references at real Llama shapes in bf16 on the GPU (skipped without CUDA).

The reference computes in fp32 from the same bf16 inputs; bf16 outputs land within ~1e-2 of it
by relative Frobenius error (METHOD.md's band for bf16 operands).
"""

from __future__ import annotations

import random

import pytest
import torch
from kernel_helpers import make_paged_cache

import kernels
from kernels import reference

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


@pytest.mark.parametrize("num_seqs, head_dim", [(1, 128), (64, 128), (37, 64), (8, 80)])
def test_decode_real_shapes(num_seqs, head_dim):
    rng = random.Random(num_seqs)
    lens = [rng.randint(1, 2048) for _ in range(num_seqs)]
    lens[0] = 1
    k, v, tables, seq_lens = make_paged_cache(lens, 8, head_dim, 16, BF16, "cuda", seed=num_seqs)
    q = torch.randn(num_seqs, 32, head_dim, device="cuda", dtype=BF16)
    out = kernels.paged_decode_attention(q, k, v, tables, seq_lens, head_dim**-0.5)
    ref = reference.paged_decode_attention(q, k, v, tables, seq_lens, head_dim**-0.5)
    assert rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("head_dim", [64, 128])
def test_prefill_real_shapes(head_dim):
    chunks = [(0, 1000), (512, 300), (1500, 1), (16, 777)]
    lens = [c + q for c, q in chunks]
    k, v, tables, seq_lens = make_paged_cache(lens, 8, head_dim, 16, BF16, "cuda")
    starts = [0]
    for _, n in chunks:
        starts.append(starts[-1] + n)
    qsl = torch.tensor(starts, dtype=torch.int32, device="cuda")
    q = torch.randn(starts[-1], 32, head_dim, device="cuda", dtype=BF16)
    out = kernels.prefill_attention(q, k, v, tables, qsl, seq_lens, 1000, head_dim**-0.5)
    ref = reference.prefill_attention(q, k, v, tables, qsl, seq_lens, 1000, head_dim**-0.5)
    assert rel_err(out, ref) < 1e-2


def test_elementwise_real_shapes():
    x = torch.randn(300, 4096, device="cuda", dtype=BF16)
    res = torch.randn_like(x)
    w = torch.randn(4096, device="cuda", dtype=BF16)
    out, new_res = kernels.rms_norm(x, w, 1e-5, res)
    ref, ref_res = reference.rms_norm(x, w, 1e-5, res)
    assert rel_err(out, ref) < 1e-2 and torch.equal(new_res, ref_res)
    assert rel_err(kernels.rms_norm(x, w, 1e-5), reference.rms_norm(x, w, 1e-5)) < 1e-2

    gu = torch.randn(300, 2 * 14336, device="cuda", dtype=BF16)
    assert rel_err(kernels.silu_and_mul(gu), reference.silu_and_mul(gu)) < 1e-2

    qkv = torch.randn(300, (32 + 16) * 128, device="cuda", dtype=BF16)
    q, kk = qkv[:, : 32 * 128], qkv[:, 32 * 128 : 40 * 128]
    inv = 1.0 / (500000 ** (torch.arange(0, 128, 2, device="cuda").float() / 128))
    freqs = torch.outer(torch.arange(4096, device="cuda").float(), inv)
    cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    pos = torch.randint(0, 4096, (300,), device="cuda")
    q_ref, k_ref = q.clone(), kk.clone()
    kernels.rotary_embedding(pos, q, kk, cache, 128)
    reference.rotary_embedding(pos, q_ref, k_ref, cache, 128)
    assert rel_err(q, q_ref) < 1e-2 and rel_err(kk, k_ref) < 1e-2

    key = torch.randn(300, 8, 128, device="cuda", dtype=BF16)
    val = torch.randn_like(key)
    slots = torch.randperm(64 * 16, device="cuda")[:300]
    slots[::7] = -1
    kc = torch.randn(64, 16, 8, 128, device="cuda", dtype=BF16)
    vc = torch.randn_like(kc)
    kc2, vc2 = kc.clone(), vc.clone()
    kernels.write_kv_cache(key, val, kc, vc, slots)
    reference.write_kv_cache(key, val, kc2, vc2, slots)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)


def test_decode_under_cuda_graph_matches_eager():
    lens = [5, 100, 1]
    k, v, tables, seq_lens = make_paged_cache(lens, 8, 128, 16, BF16, "cuda")
    q = torch.randn(3, 32, 128, device="cuda", dtype=BF16)
    eager = kernels.paged_decode_attention(q, k, v, tables, seq_lens, 0.1)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        kernels.paged_decode_attention(q, k, v, tables, seq_lens, 0.1)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = kernels.paged_decode_attention(q, k, v, tables, seq_lens, 0.1)
    seq_lens.copy_(torch.tensor([6, 101, 2], dtype=torch.int32))
    graph.replay()
    ref = reference.paged_decode_attention(q, k, v, tables, seq_lens, 0.1)
    assert rel_err(static_out, ref) < 1e-2
    assert not torch.equal(static_out, eager)

"""The repacked-int4 kernels (`kernels/int4_repacked.py`) vs the torch references: interpreter on CPU,
compiled on CUDA. Tiny shapes and fp16/fp32 (bf16 arithmetic is wrong in the interpreter); every
branch: the GEMV with and without split-K, the tile kernel with tile groups, per-row groups, one
group per channel, split-K, bias, a K tail, and the load-time repack from GPTQ's layout."""

from __future__ import annotations

import pytest
import torch
from quant_helpers import make_int_weight

from kernels import quant_reference
from kernels.int4_repacked import Int4Config, int4_linear, int4_linear_impl, pick_int4_config

CASES = [
    # (dtype, K, group_size, M, config); block_m 1 is the GEMV
    (torch.float32, 256, 128, 1, Int4Config(1, 256, 64, 1, 1, 1)),
    (torch.float16, 256, 64, 1, Int4Config(1, 256, 32, 3, 1, 1)),
    (torch.float16, 256, 64, 1, Int4Config(1, 512, 32, 2, 1, 1)),  # 2 adjacent words a thread
    (torch.float16, 192, 192, 1, Int4Config(1, 256, 64, 2, 1, 1)),  # one group, K = 3 tiles
    (torch.float16, 160, 160, 1, Int4Config(1, 256, 64, 2, 1, 1)),  # one group, a K tail
    (torch.float16, 256, 128, 2, Int4Config(16, 64, 64, 1, 4, 1)),
    (torch.float16, 256, 32, 5, Int4Config(16, 64, 64, 2, 4, 1)),  # groups smaller than the tile
    (torch.float32, 256, 64, 17, Int4Config(16, 128, 64, 3, 4, 1)),
    (torch.float16, 160, 160, 33, Int4Config(32, 64, 64, 2, 4, 1)),  # per channel, K tail
]


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def test_repack_matches_gptq_layout():
    w = make_int_weight(64, 24, 4, 32, False, torch.float32, seed=1)
    packed = quant_reference.repack_int4(w.qweight)
    assert packed.shape == (64, 3) and packed.dtype == torch.int32
    assert torch.equal(quant_reference.unpack_int4_repacked(packed), quant_reference.unpack_int_weight(w.qweight, 4))
    x = torch.randn(3, 64)
    want = x @ w.dense
    got = quant_reference.int4_linear(x, packed, w.scales, w.zeros, 32)
    assert _rel_err(got, want) < 1e-6


@pytest.mark.parametrize("dtype, K, group_size, M, config", CASES)
def test_int4_linear_matches_reference(device, dtype, K, group_size, M, config):
    N = 8 * 72  # 72 words: the last column tile is partial
    w = make_int_weight(K, N, 4, group_size, False, dtype, seed=M + K)
    packed = quant_reference.repack_int4(w.qweight).to(device)
    x = torch.randn(M, K).to(dtype).to(device)
    bias = torch.randn(N).to(dtype).to(device)
    ref = x.double() @ w.dense.double().to(device) + bias.double()
    for _ in range(2):  # the second call checks that split-K counters reset themselves
        out = int4_linear_impl(x, packed, w.scales, w.zeros, group_size, bias, config=config)
        assert out.dtype == dtype and out.shape == (M, N)
        assert _rel_err(out, ref) < (2e-3 if dtype == torch.float16 else 1e-5)
    no_bias = int4_linear_impl(x, packed, w.scales, w.zeros, group_size, None, config=config)
    assert _rel_err(no_bias, ref - bias.double()) < (2e-3 if dtype == torch.float16 else 1e-5)


def test_public_launcher_and_strided_x(device):
    K, N, M = 128, 512, 3
    w = make_int_weight(K, N, 4, 64, False, torch.float16, seed=5)
    packed = quant_reference.repack_int4(w.qweight).to(device)
    wide = torch.randn(M, K + 32).to(torch.float16).to(device)
    x = wide[:, :K]
    out = int4_linear(x, packed, w.scales, w.zeros, 64)
    assert _rel_err(out, quant_reference.int4_linear(x, packed, w.scales, w.zeros, 64)) < 2e-3


def test_pick_int4_config_buckets():
    gemv = pick_int4_config(1, 4096, 4096, 128, 132)
    assert gemv.block_m == 1 and 128 % gemv.block_k == 0 and gemv.split_k > 1
    assert pick_int4_config(3, 4096, 4096, 128, 132) == pick_int4_config(16, 4096, 4096, 128, 132)
    assert pick_int4_config(16, 4096, 4096, 32, 132).block_k == 32
    assert pick_int4_config(2048, 4096, 4096, 128, 132).split_k == 1
    # one split per bucket: no second compiled variant (USE_SPLIT) as M moves inside it
    assert len({pick_int4_config(m, 4096, 1024, 128, 132) for m in range(65, 257)}) == 1
    for m in (1, 16, 64, 256, 2048):
        assert pick_int4_config(m, 4096, 14336, 14336, 132).block_k >= 16  # per channel

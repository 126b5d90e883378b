"""The k-chunk int4 kernels (`kernels/int4_kchunk.py`) vs the torch references: interpreter on CPU,
compiled on CUDA. Tiny shapes and fp16/fp32 (bf16 arithmetic is wrong in the interpreter); every
branch: the GEMV at 1, 2 and 4 rows (fewer rows than the program holds), several columns a thread,
one or two nibbles per shift, FMA tiles or per-nibble sums, split-K, one group per channel with a K tail, the tensor-core kernel with groups smaller than its
tile, the dense dequantisation for large M, and the load-time repack from GPTQ's layout."""

from __future__ import annotations

import pytest
import torch
from quant_helpers import make_int_weight
from sm90_compile import run_script

from kernels import int4_kchunk_mma, quant_reference
from kernels.activation import silu_and_mul
from kernels.int4_kchunk import (GEMM_MMA, GEMM_WGMMA, GEMM_WS, KChunkConfig, int4_kchunk_linear, int4_kchunk_linear_impl,
                                 pick_kchunk_config)

CASES = [
    # (dtype, K, group_size, M, config); block_m < 16 is the GEMV
    (torch.float32, 256, 128, 1, KChunkConfig(1, 64, 64, 1, 2)),
    (torch.float16, 256, 64, 1, KChunkConfig(1, 128, 64, 3, 2)),  # 2 columns a thread, split-K
    (torch.float16, 256, 128, 2, KChunkConfig(2, 64, 128, 2, 1)),
    (torch.float16, 256, 64, 3, KChunkConfig(4, 32, 32, 4, 1)),  # 3 of 4 rows
    (torch.float16, 160, 160, 1, KChunkConfig(1, 64, 64, 2, 2)),  # one group, a K tail
    (torch.float16, 256, 128, 1, KChunkConfig(1, 64, 64, 3, 2, pairs=False)),  # one nibble per shift
    (torch.float16, 256, 64, 4, KChunkConfig(4, 64, 64, 2, 2, reduce_each=True)),  # no FMA tile
    (torch.float32, 160, 160, 2, KChunkConfig(2, 32, 32, 1, 1, pairs=False, reduce_each=True)),
    (torch.float16, 256, 128, 5, KChunkConfig(16, 64, 128, 1, 4)),
    (torch.float16, 512, 64, 16, KChunkConfig(16, 32, 256, 2, 4)),  # groups smaller than the tile, split-K
    (torch.float32, 256, 128, 17, KChunkConfig(16, 64, 128, 1, 4)),  # 2 row tiles
    (torch.float16, 256, 64, 40, KChunkConfig(64, 32, 128, 2, 4)),
    (torch.float16, 256, 64, 70, KChunkConfig(0, 0, 0, 1, 0)),  # the dense weight, then a matmul
    (torch.float32, 160, 160, 3, KChunkConfig(0, 0, 0, 1, 0)),  # one group, dense
]


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def test_repack_matches_gptq_layout():
    w = make_int_weight(96, 24, 4, 32, False, torch.float32, seed=1)
    packed = quant_reference.repack_int4_kchunk(w.qweight)
    assert packed.shape == (3, 24, 4) and packed.dtype == torch.int32
    codes = quant_reference.unpack_int_weight(w.qweight, 4)
    assert torch.equal(quant_reference.unpack_int4_kchunk(packed), codes)
    # the documented layout itself: nibble j of word w of packed[c, n] is row 32 c + 4 j + w
    for c, n, word, j in ((0, 0, 0, 0), (2, 5, 3, 7), (1, 23, 1, 4)):
        assert (int(packed[c, n, word]) >> (4 * j)) & 0xF == int(codes[32 * c + 4 * j + word, n])
    x = torch.randn(3, 96)
    assert _rel_err(quant_reference.int4_kchunk_linear(x, packed, w.scales, w.zeros, 32), x @ w.dense) < 1e-6
    with pytest.raises(ValueError, match="multiple of 32"):
        quant_reference.repack_int4_kchunk(w.qweight[:3])


@pytest.mark.parametrize("dtype, K, group_size, M, config", CASES)
def test_int4_kchunk_linear_matches_reference(device, dtype, K, group_size, M, config):
    N = 72  # the last column tile is partial
    w = make_int_weight(K, N, 4, group_size, False, dtype, seed=M + K)
    packed = quant_reference.repack_int4_kchunk(w.qweight).to(device)
    x = torch.randn(M, K).to(dtype).to(device)
    bias = torch.randn(N).to(dtype).to(device)
    ref = x.double() @ w.dense.double().to(device) + bias.double()
    scales, zeros = w.scales.to(device), w.zeros.to(device)
    for _ in range(2):  # the second call checks that split-K counters reset themselves
        out = int4_kchunk_linear_impl(x, packed, scales, zeros, group_size, bias, config=config)
        assert out.dtype == dtype and out.shape == (M, N)
        assert _rel_err(out, ref) < (2e-3 if dtype == torch.float16 else 1e-5)
    no_bias = int4_kchunk_linear_impl(x, packed, scales, zeros, group_size, None, config=config)
    assert _rel_err(no_bias, ref - bias.double()) < (2e-3 if dtype == torch.float16 else 1e-5)


MMA_CASES = [
    # (M, K, group_size, split, with_bias): `kernels/int4_kchunk_mma.py`, CUDA only (Gluon, mma.sync)
    (1, 256, 128, 1, False),
    (2, 512, 128, 3, True),  # split-K, uneven splits
    (5, 384, 384, 2, True),  # one group
    (8, 1024, 256, 4, False),  # groups of two tiles
    (9, 512, 128, 1, True),  # 16 padded rows
    (16, 512, 128, 2, False),
    (24, 512, 128, 2, True),  # x padded to 32 rows
    (40, 256, 128, 1, False),  # 64 (not picked: the launcher takes up to 64)
]


def _cuda_case(M: int, K: int, group_size: int, with_bias: bool, dtype: torch.dtype) -> tuple:
    """x, the k-chunk weight (packed, scales, zeros), bias and the fp64 reference, on CUDA, N = 200 (the last
    column tile partial)."""
    N = 200
    w = make_int_weight(K, N, 4, group_size, False, dtype, seed=M + K)
    packed = quant_reference.repack_int4_kchunk(w.qweight).cuda()
    x = torch.randn(M, K, dtype=dtype, device="cuda")
    bias = torch.randn(N, dtype=dtype, device="cuda") if with_bias else None
    ref = x.double() @ w.dense.double().cuda() + (bias.double() if with_bias else 0)
    return x, packed, w.scales.cuda(), w.zeros.cuda(), bias, ref


WGMMA_CASES = [
    # (M, K, group_size, split, with_bias, (block_m, block_n, warps, stages)): `kernels/int4_kchunk_wgmma.py`, sm_90
    (1, 256, 128, 1, False, (64, 128, 4, 3)),  # one row of a 64-row tile
    (70, 512, 128, 3, True, (64, 128, 4, 3)),  # 2 row tiles, split-K (uneven), more K tiles than stages
    (100, 384, 384, 1, True, (32, 128, 4, 4)),  # one group, 4 row tiles
    (130, 1024, 256, 2, False, (128, 256, 8, 3)),  # groups of two tiles, 8 warps
    (300, 512, 128, 1, True, (256, 128, 8, 3)),  # 2 stages
    (16, 640, 128, 1, False, (16, 128, 4, 4)),
    (12, 512, 128, 3, True, (16, 64, 4, 4)),  # 64-column programs (picked at 9-16 rows)
]


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.skipif(not _sm90(), reason="Gluon wgmma kernel: sm_90 only")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M, K, group_size, split, with_bias, tiling", WGMMA_CASES)
def test_wgmma_matches_reference(dtype, M, K, group_size, split, with_bias, tiling):
    x, packed, scales, zeros, bias, ref = _cuda_case(M, K, group_size, with_bias, dtype)
    N = ref.shape[1]
    block_m, block_n, warps, stages = tiling
    config = KChunkConfig(block_m, block_n, 128, split, warps, stages, gemm=GEMM_WGMMA)
    for _ in range(2):  # the second call finds its split-K counters back at zero
        out = int4_kchunk_linear_impl(x, packed, scales, zeros, group_size, bias, config=config)
        assert out.dtype == dtype and out.shape == (M, N)
        assert _rel_err(out, ref) < (5e-3 if dtype == torch.bfloat16 else 2e-3), config
    gated = int4_kchunk_linear_impl(x, packed, scales, zeros, group_size, bias, config=config, gated=True)
    torch.testing.assert_close(gated, silu_and_mul(out), rtol=0, atol=0)  # the same result, then the activation


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Gluon kernel: CUDA only")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M, K, group_size, split, with_bias", MMA_CASES)
def test_mma_matches_reference(dtype, M, K, group_size, split, with_bias):
    x, packed, scales, zeros, bias, ref = _cuda_case(M, K, group_size, with_bias, dtype)
    N = ref.shape[1]
    for block_n in (64, 128):
        config = KChunkConfig(16, block_n, 128, split, 4, gemm=GEMM_MMA)
        for _ in range(2):  # the second call finds its split-K counters back at zero
            out = int4_kchunk_linear_impl(x, packed, scales, zeros, group_size, bias, config=config)
            assert out.dtype == dtype and out.shape == (M, N)
            assert _rel_err(out, ref) < (5e-3 if dtype == torch.bfloat16 else 2e-3), (block_n, config)
        for _ in range(2):  # [gate | up] columns: the epilogue's silu(gate) * up is the activation's, bit for bit
            gated = int4_kchunk_linear_impl(x, packed, scales, zeros, group_size, bias, config=config, gated=True)
            torch.testing.assert_close(gated, silu_and_mul(out), rtol=0, atol=0)
    # the same weights through the picker's path at 2-16 rows give the other kernels' result
    gemv = int4_kchunk_linear_impl(x, packed, scales, zeros, group_size, bias,
                                   config=pick_kchunk_config(M, N, K, group_size, 132))
    assert _rel_err(out, gemv.double()) < 1e-2


def test_mma_variants_compile_for_sm90_and_keep_the_pdl_contract():
    # CI has no GPU: compile every GEMM_MMA variant the picker returns (Gluon, bf16 and fp16, PDL on) for sm_90,
    # and every GEMM_WGMMA variant (no spills)
    out = run_script("mma_sm90_compile.py")
    assert out.count("ok ") >= 4 and out.count("ok wgmma") >= 4 and "FAIL" not in out, out


def test_wgmma_picked_at_9_to_128_rows_where_it_won():
    def pick(m, n, k, group=128, wgmma=True):
        return pick_kchunk_config(m, n, k, group, 132, mma=True, wgmma=wgmma)

    shapes = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))
    for m in (25, 32, 33, 64):
        assert all(pick(m, n, k).gemm == GEMM_WGMMA for n, k in shapes), m
    assert pick(64, 28672, 4096).block_m == 64 and pick(32, 28672, 4096).block_m == 32  # 64-row programs
    assert all(pick(20, n, k).gemm == GEMM_WGMMA for n, k in shapes)  # ahead of mma.sync from 17 rows
    assert pick(20, 6144, 4096, wgmma=False).gemm == GEMM_MMA
    assert pick(100, 4096, 14336).gemm == GEMM_WGMMA and pick(100, 28672, 4096).gemm != GEMM_WGMMA
    assert pick(129, 4096, 14336).gemm != GEMM_WGMMA and pick(8, 28672, 4096).gemm != GEMM_WGMMA
    assert all(pick(12, n, k).block_m == 16 for n, k in shapes)  # 16-row programs at 9-16 rows
    assert pick(12, 6144, 4096).block_n == 64 and pick(12, 28672, 4096).block_n == 128
    assert pick(32, 6144, 4096, wgmma=False).gemm != GEMM_WGMMA  # only where the caller says it runs
    assert pick(32, 6144, 4096, group=64).gemm != GEMM_WGMMA  # groups of 64: not its tile
    for lo, hi in ((9, 16), (17, 32), (33, 64), (65, 128)):  # one split (one compiled variant) per bucket
        assert len({pick(m, 4096, 14336) for m in range(lo, hi + 1)}) == 1
    with pytest.raises(ValueError, match="GEMM_WGMMA"):
        w = make_int_weight(128, 64, 4, 128, False, torch.float16, seed=4)
        int4_kchunk_linear_impl(torch.randn(40, 128).half(), quant_reference.repack_int4_kchunk(w.qweight), w.scales,
                                w.zeros, 128, config=pick(40, 64, 128))


def test_ws_picked_on_wide_weights_at_33_to_512_rows():
    def pick(m, n=28672, k=4096, group=128, ws=True):
        return pick_kchunk_config(m, n, k, group, 132, mma=True, wgmma=True, ws=ws)

    def ws(block_m, parts, split=1, chunk=0):
        return KChunkConfig(block_m, 128, 64, split, 4, 4, gemm=GEMM_WS, dq_parts=parts, row_chunk=chunk)

    assert pick(33) == pick(64) == ws(64, 2)
    assert pick(65) == pick(128) == ws(128, 3)
    assert pick(129) == pick(256) == ws(256, 1)  # two MMA warp groups
    assert pick(257) == pick(512) == ws(256, 1, chunk=256)  # a launch per 256 rows, then one for the rest
    assert pick(32).gemm == GEMM_WGMMA and pick(513).gemm != GEMM_WS
    assert pick(256, ws=False).gemm != GEMM_WS  # only where the caller says it runs
    # long K (the 8B down, 14,336 x 4,096): 129-256 and 321-512 rows, K split to fill one wave of 132 programs
    assert pick(129, 4096, 14336) == pick(192, 4096, 14336) == ws(256, 1, split=4)  # 32 tiles
    assert pick(193, 4096, 14336) == pick(256, 4096, 14336) == ws(128, 3, split=2)  # 64 tiles
    assert pick(384, 4096, 14336) == ws(256, 1, split=2) and pick(512, 4096, 14336) == ws(256, 1, split=2)
    assert all(pick(m, 4096, 14336).gemm != GEMM_WS for m in (32, 257, 320, 513))
    # qkv, o and down at 33-128 rows: 64-row programs (128-row ones on long K above 64 rows), K split to one wave
    assert pick(33, 6144, 4096) == pick(64, 6144, 4096) == ws(64, 2, split=2)  # 48 tiles
    assert pick(65, 6144, 4096) == pick(128, 6144, 4096) == ws(64, 2, split=1)  # 96 tiles
    assert pick(40, 4096, 4096) == ws(64, 2, split=4) and pick(128, 4096, 4096) == ws(64, 2, split=2)
    assert pick(64, 4096, 14336) == ws(64, 2, split=4) and pick(65, 4096, 14336) == ws(128, 3, split=4)
    for n, k in ((6144, 4096), (4096, 4096)):  # qkv and o keep dequantise + cuBLAS above 128 rows
        assert all(pick(m, n, k).gemm != GEMM_WS for m in (129, 256, 512)), (n, k)
    assert all(pick(m, 2048, 4096).gemm != GEMM_WS for m in (40, 128, 256))  # smaller weights keep their paths
    assert pick(128, group=32).gemm != GEMM_WS  # a 64-row K tile across two groups
    assert pick(128, group=4096).gemm == GEMM_WS and pick(128, k=4128, group=4128).gemm != GEMM_WS  # K % 64
    for lo, hi, variants in ((33, 64, 1), (65, 128, 1), (129, 256, 1), (257, 512, 1)):  # one compiled variant each
        assert len({pick(m) for m in range(lo, hi + 1)}) == variants
    with pytest.raises(ValueError, match="GEMM_WS"):  # CPU x: not the kernel's
        w = make_int_weight(128, 64, 4, 128, False, torch.bfloat16, seed=4)
        int4_kchunk_linear_impl(torch.randn(40, 128).bfloat16(), quant_reference.repack_int4_kchunk(w.qweight),
                                w.scales, w.zeros, 128, config=pick(40))


def test_group_tiles_is_the_k_tiles_a_scale_group_spans():
    # the Gluon kernels' GROUP_TILES constexpr: tile t reads scale row t // GROUP_TILES (0: one group over K)
    assert int4_kchunk_mma.group_tiles(4096, 128) == 1 and int4_kchunk_mma.group_tiles(1024, 256) == 2
    assert int4_kchunk_mma.group_tiles(384, 384) == 0 and int4_kchunk_mma.group_tiles(384, 4096) == 0
    with pytest.raises(AssertionError):
        int4_kchunk_mma.group_tiles(4096, 64)  # groups smaller than a tile: not these kernels' weights


def test_mma_config_needs_cuda_and_half_precision():
    w = make_int_weight(128, 64, 4, 128, False, torch.float16, seed=4)
    packed = quant_reference.repack_int4_kchunk(w.qweight)
    config = KChunkConfig(16, 64, 128, 1, 4, gemm=GEMM_MMA)
    with pytest.raises(ValueError, match="GEMM_MMA"):
        int4_kchunk_linear_impl(torch.randn(3, 128).half(), packed, w.scales, w.zeros, 128, config=config)
    # the picker offers it only where the caller says it runs, on multiples of 128
    assert pick_kchunk_config(4, 6144, 4096, 128, 132, mma=True).gemm == GEMM_MMA
    assert pick_kchunk_config(4, 6144, 4096, 128, 132).gemm != GEMM_MMA
    assert pick_kchunk_config(1, 28672, 4096, 128, 132, mma=True).block_m == 1  # the GEMV on wide weights at one row
    assert pick_kchunk_config(1, 6144, 4096, 128, 132, mma=True, gated=True).block_m == 1  # ... and on gated ones
    assert pick_kchunk_config(1, 6144, 4096, 128, 132, mma=True).gemm == GEMM_MMA  # but not on the others
    assert pick_kchunk_config(1, 4096, 14336, 128, 132, mma=True).gemm == GEMM_MMA
    assert pick_kchunk_config(2, 6144, 4096, 128, 132, mma=True) == KChunkConfig(16, 128, 128, 11, 4, gemm=GEMM_MMA)
    assert pick_kchunk_config(2, 28672, 4096, 128, 132, mma=True).split_k == 2  # ~1 program per SM on gate|up
    # the gated epilogue: 256 columns, 4 warps, ~2 programs per SM on the packed gate|up
    assert pick_kchunk_config(2, 28672, 4096, 128, 132, mma=True, gated=True) == KChunkConfig(16, 256, 128, 3, 4,
                                                                                              gemm=GEMM_MMA)
    assert pick_kchunk_config(1, 28672, 4096, 128, 132, mma=True, gated=True).gemm != GEMM_MMA  # the GEMV's
    assert pick_kchunk_config(12, 4096, 4096, 128, 132, mma=True).gemm != GEMM_MMA  # small weights: the tiles
    assert pick_kchunk_config(12, 28672, 4096, 128, 132, mma=True).num_warps == 4
    assert pick_kchunk_config(4, 6144, 4096, 64, 132, mma=True).gemm != GEMM_MMA  # groups of 64
    # one split per bucket (no second compiled variant as M moves inside it)
    assert len({pick_kchunk_config(m, 6144, 4096, 128, 132, mma=True) for m in range(1, 9)}) == 1
    assert len({pick_kchunk_config(m, 6144, 4096, 128, 132, mma=True) for m in range(9, 17)}) == 1
    assert len({pick_kchunk_config(m, 6144, 4096, 128, 132, mma=True) for m in range(17, 25)}) == 1
    assert pick_kchunk_config(25, 6144, 4096, 128, 132, mma=True).gemm != GEMM_MMA
    assert pick_kchunk_config(20, 4096, 14336, 128, 132, mma=True).num_warps == 8  # long weights: 256 columns


def test_public_launcher_and_strided_x(device):
    K, N, M = 128, 64, 3
    w = make_int_weight(K, N, 4, 64, False, torch.float16, seed=5)
    packed = quant_reference.repack_int4_kchunk(w.qweight).to(device)
    wide = torch.randn(M, K + 32).to(torch.float16).to(device)
    x = wide[:, :K]
    out = int4_kchunk_linear(x, packed, w.scales.to(device), w.zeros.to(device), 64)
    want = quant_reference.int4_kchunk_linear(x, packed, w.scales.to(device), w.zeros.to(device), 64)
    assert _rel_err(out, want) < 2e-3


def test_gemv_rejects_tiles_across_groups():
    w = make_int_weight(128, 64, 4, 32, False, torch.float16, seed=2)
    packed = quant_reference.repack_int4_kchunk(w.qweight)
    with pytest.raises(ValueError, match="dividing group_size"):
        int4_kchunk_linear_impl(torch.randn(1, 128).half(), packed, w.scales, w.zeros, 32,
                                config=KChunkConfig(1, 64, 64, 1, 2))


def test_pick_kchunk_config_buckets():
    assert pick_kchunk_config(65, 4096, 4096, 128, 132).block_m == 0
    # one split per bucket: no second compiled variant (USE_SPLIT) as M moves inside it
    for lo, hi in ((3, 4), (5, 16), (17, 64)):
        assert len({pick_kchunk_config(m, 4096, 4096, 128, 132).split_k for m in range(lo, hi + 1)}) == 1
    # the sweep's winners at the 8B shapes (H100, 132 SMs)
    assert pick_kchunk_config(1, 6144, 4096, 128, 132) == KChunkConfig(1, 256, 128, 11, 4)
    assert pick_kchunk_config(1, 28672, 4096, 128, 132) == KChunkConfig(1, 512, 64, 10, 4)
    assert pick_kchunk_config(2, 4096, 14336, 128, 132) == KChunkConfig(2, 256, 128, 16, 4)
    assert pick_kchunk_config(16, 28672, 4096, 128, 132) == KChunkConfig(16, 64, 128, 2, 4, 3)
    for m in (1, 2, 3, 4, 16, 64):
        cfg = pick_kchunk_config(m, 4096, 4096, 128, 132)
        assert cfg.block_m >= m and cfg.block_k % 32 == 0 and cfg.split_k > 1
        assert cfg.block_m >= 16 or 128 % cfg.block_k == 0
    assert pick_kchunk_config(1, 4096, 4096, 32, 132).block_k == 32
    assert pick_kchunk_config(1, 4096, 14336, 14336, 132).block_k == 128  # per channel


def test_sub_dot_order_puts_each_sub_dot_in_16_contiguous_columns():
    # int4_kchunk_wgmma's permuted x: column 128 t + 16 j + q holds x's column 128 t + 32 (q // 4) + q % 4 + 4 j
    # (sub-dot j's operand), a permutation of each 128-column tile
    from kernels.int4_kchunk_wgmma import sub_dot_order

    x = torch.arange(3 * 384, dtype=torch.float32).reshape(3, 384)
    p = sub_dot_order(x)
    for t, j, q in ((0, 0, 0), (0, 1, 5), (1, 7, 15), (2, 3, 9)):
        assert torch.equal(p[:, 128 * t + 16 * j + q], x[:, 128 * t + 32 * (q // 4) + q % 4 + 4 * j])
    assert torch.equal(p.sort(dim=1).values, x)

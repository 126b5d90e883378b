"""The int4 warp-specialised Gluon GEMM (`kernels/int4_kchunk_ws.py`) against its torch reference
(`quant_reference.int4_kchunk_linear`): on Hopper at the 8B shapes and at odd ones (row and column tails, one scale
group for the whole K, groups of 64 rows, bias), inside a CUDA graph too; on CPU its variants compile for sm_90
(Gluon has no interpreter)."""

from __future__ import annotations

import functools

import pytest
import torch

from kernels import quant_reference
from kernels.int4_kchunk import GEMM_WS, int4_kchunk_linear, int4_kchunk_linear_impl, pick_kchunk_config
from kernels.int4_kchunk_ws import fits, int4_kchunk_ws
from quant_helpers import make_int_weight
from quant_helpers import rel_err as _rel

hopper = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                            reason="needs a Hopper GPU")


def _operands(M, N, K, group, dtype, seed):
    w = make_int_weight(K, N, 4, group, False, dtype, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=gen).to("cuda", dtype)
    bias = torch.randn(N, generator=gen).to("cuda", dtype)
    return x, quant_reference.repack_int4_kchunk(w.qweight).cuda(), w.scales.cuda(), w.zeros.cuda(), bias


def test_fits_says_what_the_kernel_takes():
    w = make_int_weight(256, 64, 4, 128, False, torch.bfloat16, seed=0)
    packed, s, z = quant_reference.repack_int4_kchunk(w.qweight), w.scales, w.zeros
    x = torch.zeros(8, 256, dtype=torch.bfloat16)
    assert fits(x, packed, s, z, 128) and fits(x, packed, s, z, 64) and fits(x, packed, s, z, 1024)
    assert not fits(x, packed, s, z, 32)  # a 64-row K tile across two groups
    assert not fits(x.float(), packed, s, z, 128)
    assert not fits(x, packed, s.half(), z, 128)  # scales read as x's type
    assert not fits(torch.zeros(8, 260, dtype=torch.bfloat16)[:, :256], packed, s, z, 128)  # a 520-byte row pitch
    assert not fits(torch.zeros(8, 96, dtype=torch.bfloat16), packed[:3], s[:1], z[:1], 96)  # K not a multiple of 64
    w12 = make_int_weight(256, 12, 4, 128, False, torch.bfloat16, seed=0)  # 12 columns: a 24-byte scale row pitch
    assert not fits(x, quant_reference.repack_int4_kchunk(w12.qweight), w12.scales, w12.zeros, 128)


def test_variants_compile_for_sm90():
    from sm90_compile import run_script

    out = run_script("int4_ws_sm90_compile.py")
    assert out.count("ok ") == 18 and "FAIL" not in out, out  # 3 row tilings x 2 dtypes x 3 variants


@hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M, N, K, group, block_m, stages, dq_warps, split, parts", [
    (65, 200, 256, 64, 64, 4, 4, 1, 2),  # row and column tails, a group a K tile, two dequantising partitions
    (130, 136, 384, 128, 128, 3, 8, 1, 1),  # two K tiles a group, a column tail, the stages reused, 8 warps
    (33, 384, 192, 192, 128, 6, 4, 3, 1),  # one group for the whole K, split in three one-tile parts
    (256, 256, 64, 64, 128, 4, 8, 1, 1),  # one K tile
    (100, 256, 640, 128, 64, 4, 8, 4, 1),  # 10 K tiles in splits of 3, 3, 3, 1 (a group across a split's edge)
    (70, 264, 1408, 128, 128, 4, 4, 2, 3),  # 22 K tiles split 11 + 11 over three partitions, a 528-byte pitch
    (129, 128, 448, 64, 64, 3, 4, 1, 2),  # 7 K tiles over two partitions (an odd count)
    (300, 200, 384, 128, 256, 4, 8, 1, 1),  # two MMA warp groups: 256-row programs, a row tail of 44, a column tail
    (257, 136, 640, 64, 256, 3, 4, 2, 1),  # 256 rows and one more, split in two, three stages reused
    (200, 128, 256, 256, 256, 4, 4, 1, 1),  # 256-row programs fed by one 4-warp partition, one group
])
def test_int4_ws_matches_reference(dtype, M, N, K, group, block_m, stages, dq_warps, split, parts):
    x, packed, scales, zeros, bias = _operands(M, N, K, group, dtype, seed=M + N)
    ref = quant_reference.int4_kchunk_linear(x.float(), packed, scales.float(), zeros.float(), group, bias.float())
    wbuf, raw = (3, 6) if parts == 3 else (2, 8)
    run = functools.partial(int4_kchunk_ws, block_m=block_m, stages=stages, wbuf=wbuf, dq_warps=dq_warps, split=split,
                            raw=raw, dq_parts=parts)
    out = run(x, packed, scales, zeros, group, bias)
    assert out.shape == (M, N) and out.dtype == dtype and _rel(out, ref) < 1e-2, _rel(out, ref)
    no_bias = run(x, packed, scales, zeros, group, None)
    assert _rel(no_bias, ref - bias.float()) < 1e-2
    # the same weights rounded as the dequantised model's: bitwise what cuBLAS-free fp32 sums of them give
    dense = quant_reference.int4_kchunk_linear(torch.eye(K, dtype=dtype, device="cuda"), packed, scales, zeros, group)
    assert torch.equal(run(torch.eye(K, dtype=dtype, device="cuda"), packed, scales, zeros, group, None), dense)


@hopper
@pytest.mark.parametrize("K, N", [(4096, 6144), (4096, 28672), (14336, 4096)])
@pytest.mark.parametrize("block_m, stages, dq_warps, parts", [(128, 4, 4, 2), (128, 4, 8, 1), (64, 4, 4, 3),
                                                              (256, 4, 8, 1)])
def test_int4_ws_8b_shapes_and_graph_replay(K, N, block_m, stages, dq_warps, parts):
    run = functools.partial(int4_kchunk_ws, block_m=block_m, stages=stages, wbuf=6 if parts == 3 else 2,
                            dq_warps=dq_warps, raw=6 if parts == 3 else 8, dq_parts=parts)
    for m in (65, 128, 200, 256, 300):
        x, packed, scales, zeros, bias = _operands(m, N, K, 128, torch.bfloat16, seed=m)
        ref = quant_reference.int4_kchunk_linear(x, packed, scales, zeros, 128, bias)
        out = run(x, packed, scales, zeros, 128, bias)
        assert _rel(out, ref) < 1e-2, (m, _rel(out, ref))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(x, packed, scales, zeros, 128, bias)
    for _ in range(2):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert _rel(out, ref) < 1e-2


@hopper
@pytest.mark.parametrize("M", [40, 64, 65, 300, 400])
@pytest.mark.parametrize("gated", [False, True])
def test_the_op_takes_it_on_wide_weights(M, gated):
    # int4_kchunk_linear (what serving calls) on a wide gate|up-like weight: the picker sends 33-512 rows here (300
    # and 400: a launch of 256 rows, then 44 rows in 64-row programs / 144 in 256-row ones)
    N, K = 16384, 256
    assert pick_kchunk_config(M, N, K, 128, 132, mma=True, wgmma=True, ws=True).gemm == GEMM_WS
    x, packed, scales, zeros, bias = _operands(M, N, K, 128, torch.bfloat16, seed=M)
    ref = quant_reference.int4_kchunk_linear(x.float(), packed, scales.float(), zeros.float(), 128, bias.float())
    if gated:
        ref = torch.nn.functional.silu(ref[:, :N // 2]) * ref[:, N // 2:]
    out = int4_kchunk_linear(x, packed, scales, zeros, 128, bias, gated=gated)
    assert out.shape == ref.shape and out.dtype == torch.bfloat16 and _rel(out, ref) < 1e-2, _rel(out, ref)
    # the path the picker took before this kernel, on the same operands: the same result
    prev = pick_kchunk_config(M, N, K, 128, 132, mma=True, wgmma=True)
    assert prev.gemm != GEMM_WS
    assert _rel(int4_kchunk_linear_impl(x, packed, scales, zeros, 128, bias, prev, gated=gated), ref) < 1e-2
    # scales and zero points of another type than x's: the op casts them to x's (fp16 -> bf16 rounding only)
    assert _rel(int4_kchunk_linear(x, packed, scales.half(), zeros.half(), 128, bias, gated=gated), ref) < 1e-2


@hopper
@pytest.mark.parametrize("M, N", [(129, 512), (200, 512), (400, 512), (40, 2048), (100, 2048)])
def test_the_op_takes_it_on_long_k(M, N):
    # a down-like weight (K 8192; 512 columns: 4 column tiles, or 2048): 64-, 128- or 256-row programs, K split to
    # fill a wave
    K = 8192
    config = pick_kchunk_config(M, N, K, 128, torch.cuda.get_device_properties(0).multi_processor_count, mma=True,
                                wgmma=True, ws=True)
    assert config.gemm == GEMM_WS and config.split_k > 1, config
    x, packed, scales, zeros, bias = _operands(M, N, K, 128, torch.bfloat16, seed=M)
    ref = quant_reference.int4_kchunk_linear(x.float(), packed, scales.float(), zeros.float(), 128, bias.float())
    out = int4_kchunk_linear(x, packed, scales, zeros, 128, bias)
    assert _rel(out, ref) < 1e-2, _rel(out, ref)
    again = int4_kchunk_linear(x, packed, scales, zeros, 128, bias)  # the split's counters were left at zero
    assert torch.equal(out, again)

"""The skinny linear (`kernels/skinny_linear.py`) vs its fp64 oracle: interpreter on CPU, compiled on CUDA.

Every way to multiply (FMA with a 3-D register tile, FMA reduced per tile, tensor-core dot), float
and FP8 weights (per-channel and per-tensor scales), split-K on and off (twice: the counters reset),
bias, odd M from 1 to 16, N and K not multiples of the block; then the shape-only choices.
"""

from __future__ import annotations

import pytest
import torch

from kernels import quant_reference
from kernels.fp8_gemv import MODE_ACC, MODE_DOT16, GemvConfig
from kernels.skinny_linear import (
    CARDS,
    MODE_DOT,
    MODE_FMA,
    MODE_FMA_REDUCE,
    SkinnyConfig,
    card_of,
    card_of_name,
    cublas_wins,
    m_bucket,
    pick_skinny_config,
    skinny_linear,
    skinny_linear_impl,
    use_skinny,
)

FP8 = torch.float8_e4m3fn


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all()
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def _weights(N: int, K: int, wdtype: torch.dtype, per_channel: bool, device: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g)
    if wdtype != FP8:
        return w.to(wdtype).to(device), None
    q, scale = quant_reference.quantize_fp8(w)
    if not per_channel:
        scale = scale.max().reshape(())
    return q.to(device), scale.to(device)


def _oracle(x, w, scale, bias):
    dense = w.double()
    if scale is not None:
        dense = dense * (scale.double().reshape(-1, 1) if scale.numel() > 1 else scale.double())
    y = x.double() @ dense.t()
    return y + bias.double() if bias is not None else y


def _act_dtype(device: str, wdtype: torch.dtype) -> torch.dtype:
    # the interpreter runs in fp32; on CUDA x matches a float weight, bf16 for FP8
    if device == "cpu":
        return torch.float32
    return wdtype if wdtype != FP8 else torch.bfloat16


CASES = [
    # (weight dtype, per_channel, K, N, M, config, bias)
    (torch.bfloat16, True, 256, 48, 1, SkinnyConfig(MODE_FMA, 16, 64, 1, 4, 1), True),
    (torch.bfloat16, True, 200, 40, 3, SkinnyConfig(MODE_FMA, 16, 64, 3, 4, 1), False),  # K, N tails, split
    (torch.float16, True, 256, 64, 2, SkinnyConfig(MODE_FMA, 8, 128, 2, 4, 1), True),
    (torch.bfloat16, True, 200, 40, 5, SkinnyConfig(MODE_FMA_REDUCE, 16, 64, 1, 4, 1), True),
    (torch.float16, True, 256, 72, 7, SkinnyConfig(MODE_FMA_REDUCE, 32, 64, 4, 4, 1), False),
    (torch.bfloat16, True, 200, 40, 11, SkinnyConfig(MODE_DOT, 32, 64, 2, 4, 1), True),
    (torch.bfloat16, True, 256, 64, 16, SkinnyConfig(MODE_DOT, 32, 64, 1, 4, 1), False),
    (FP8, True, 256, 48, 1, SkinnyConfig(MODE_FMA, 16, 128, 1, 4, 1), True),
    (FP8, False, 400, 40, 1, SkinnyConfig(MODE_FMA, 16, 128, 3, 4, 1), False),  # per tensor, tails, split
    (FP8, True, 400, 40, 3, SkinnyConfig(MODE_FMA_REDUCE, 16, 128, 2, 4, 1), True),
    (FP8, False, 256, 64, 9, SkinnyConfig(MODE_DOT, 32, 64, 4, 4, 1), True),
    (FP8, True, 400, 72, 13, SkinnyConfig(MODE_DOT, 32, 64, 1, 4, 1), False),
    (FP8, True, 256, 40, 16, SkinnyConfig(MODE_FMA_REDUCE, 16, 64, 5, 4, 1), True),  # split 5 of 4 tiles
    # num_stages > 1 in the FMA modes: tl.range pipelining instead of the register double buffer
    (FP8, True, 400, 40, 1, SkinnyConfig(MODE_FMA, 16, 128, 2, 4, 3), True),
    (torch.bfloat16, True, 200, 40, 2, SkinnyConfig(MODE_FMA, 8, 64, 1, 4, 3), False),
    (torch.bfloat16, True, 256, 40, 4, SkinnyConfig(MODE_FMA_REDUCE, 16, 64, 3, 4, 3), True),
    # sub > 1: each tile's column slices share one accumulator
    (FP8, True, 400, 40, 1, SkinnyConfig(MODE_FMA, 16, 128, 2, 4, 3, 4), True),
    (torch.bfloat16, True, 256, 40, 2, SkinnyConfig(MODE_FMA, 8, 128, 1, 4, 4, 2), False),
    (FP8, False, 512, 72, 3, SkinnyConfig(MODE_FMA_REDUCE, 16, 128, 2, 4, 3, 2), True),
]


@pytest.mark.parametrize("wdtype, per_channel, K, N, M, config, with_bias", CASES)
def test_skinny_matches_oracle(device, wdtype, per_channel, K, N, M, config, with_bias):
    w, scale = _weights(N, K, wdtype, per_channel, device, K + N + M)
    g = torch.Generator().manual_seed(M)
    dtype = _act_dtype(device, wdtype)
    x = torch.randn(M, K, generator=g).to(dtype).to(device)
    bias = torch.randn(N, generator=g).to(dtype).to(device) if with_bias else None
    ref = _oracle(x, w, scale, bias)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for _ in range(2):  # the second call checks that the split-K counters reset themselves
        out = skinny_linear_impl(x, w, scale, bias, config=config)
        assert out.dtype == dtype and out.shape == (M, N)
        assert _rel_err(out, ref) < tol
    # the picked tiling and the torch reference agree with the oracle too (FP8 at M = 3-4 picks the fp16
    # tensor-core GEMV, which rounds the interpreter's fp32 x to fp16; bf16 x on a GPU converts exactly)
    pick = pick_skinny_config(M, N, K, wdtype, 132)
    fp16_x = isinstance(pick, GemvConfig) and pick.mode == MODE_DOT16 and dtype == torch.float32
    assert _rel_err(skinny_linear(x, w, scale, bias), ref) < (2e-3 if fp16_x else tol)
    assert _rel_err(quant_reference.skinny_linear(x, w, scale, bias), ref) < (1e-5 if dtype == torch.float32 else 1e-2)


def test_skinny_strided_x_and_errors(device):
    w, scale = _weights(40, 128, FP8, True, device, 1)
    # not contiguous along K; fp16-exact values (FP8 at M = 3 runs the fp16 tensor-core GEMV)
    x = torch.randn(3, 256).half().float().to(device)[:, ::2]
    assert _rel_err(skinny_linear(x, w, scale), _oracle(x, w, scale, None)) < 1e-5
    with pytest.raises(ValueError, match="at most 16"):
        skinny_linear(torch.randn(17, 128).to(device), w, scale)
    with pytest.raises(ValueError, match="scale"):
        skinny_linear(torch.randn(2, 128).to(device), w, None)
    with pytest.raises(ValueError, match="do not chain"):
        skinny_linear(torch.randn(2, 64).to(device), w, scale)


def test_fp8_weight_not_word_aligned_takes_the_skinny_kernel(device):
    # a K slice starting mid-word cannot be read as int32 words: the picker's GEMV tiling gives way
    w, scale = _weights(40, 132, FP8, True, device, 3)
    w = w[:, 2:130]
    x = torch.randn(1, 128).half().float().to(device)
    assert _rel_err(skinny_linear(x, w, scale), _oracle(x, w, scale, None)) < 1e-5


def test_pick_and_use_skinny():
    assert [m_bucket(m) for m in (1, 2, 3, 5, 8, 9, 16)] == [1, 2, 4, 8, 8, 16, 16]
    for wdtype in (torch.bfloat16, FP8):
        # one variant per M bucket: M within a bucket gets the same tiling
        assert pick_skinny_config(3, 4096, 4096, wdtype, 132) == pick_skinny_config(4, 4096, 4096, wdtype, 132)
        assert pick_skinny_config(9, 4096, 4096, wdtype, 132) == pick_skinny_config(16, 4096, 4096, wdtype, 132)
        # a narrow N is split along K to fill the GPU; a wide one is not
        narrow = pick_skinny_config(1, 512, 4096, wdtype, 132)
        wide = pick_skinny_config(1, 57344, 8192, wdtype, 132)
        assert narrow.split_k > 1 and wide.split_k == 1
        assert use_skinny(1, 4096, 4096, wdtype, torch.device("cpu")) is False  # the CPU keeps torch
    # FP8 at M <= 4: kernels/fp8_gemv.py's tilings (bench/RESULTS.md runs 41-42), FMA at M = 1-2,
    # fp16 tensor cores at 3-4
    assert [pick_skinny_config(m, 4096, 4096, FP8, 132).mode for m in (1, 2, 3, 4)] == [MODE_ACC] * 2 + [MODE_DOT16] * 2
    assert isinstance(pick_skinny_config(5, 4096, 4096, FP8, 132), SkinnyConfig)
    # bf16 at M = 1-2: the same GEMV reading two bf16 a word (bench/gemv_bf16.py, RESULTS run 49)
    assert [pick_skinny_config(m, 4096, 4096, torch.bfloat16, 132).mode for m in (1, 2)] == [MODE_ACC] * 2
    assert isinstance(pick_skinny_config(3, 4096, 4096, torch.bfloat16, 132), SkinnyConfig)
    with pytest.raises(AssertionError):  # slices need the pipelined FMA loop
        skinny_linear_impl(torch.randn(1, 128), torch.randn(8, 128).bfloat16(), None, None,
                           SkinnyConfig(MODE_FMA, 8, 128, 1, 4, 1, 2))
    assert use_skinny(1, 4096, 4096, torch.float32, torch.device("cpu")) is False
    # the measured rules (H100 sweeps, RESULTS runs 36, 41, 49): bf16 keeps cuBLAS from 3 rows (the GEMV at 1-2);
    # FP8 runs skinny at M <= 4 everywhere (fp8_gemv) and at M >= 5 except the mid-size wide gate_up shapes
    assert all(cublas_wins(m, 6144, 4096, 2) for m in (3, 7, 16))
    assert not any(cublas_wins(m, n, 4096, 2) for m in (1, 2) for n in (1536, 6144, 28672, 128256))
    assert not any(cublas_wins(m, n, k, 1) for k, n in ((4096, 28672), (4096, 1536), (8192, 57344)) for m in (1, 2, 4))
    assert cublas_wins(5, 28672, 4096, 1) and cublas_wins(16, 14336, 8192, 1)
    assert not cublas_wins(2, 57344, 8192, 1) and not cublas_wins(8, 7168, 4096, 1)
    assert not cublas_wins(16, 6144, 4096, 1) and not cublas_wins(4, 4096, 14336, 1)


def test_per_card_tilings():
    # The H200 replaces two FP8 buckets (bench/RESULTS.md run 72): M = 1 splits K to ~2 programs per SM (at 8B
    # TP=1 o and down split in two, qkv and gate_up do not), M = 5-8 to ~2 instead of ~4; everything else is
    # the default table's.
    assert "H200" in CARDS
    for n, k, default_split, h200_split in ((4096, 4096, 1, 2), (4096, 14336, 1, 2), (6144, 4096, 1, 1),
                                            (28672, 4096, 1, 1)):
        default, h200 = (pick_skinny_config(1, n, k, FP8, 132, card) for card in ("", "H200"))
        assert (default.split_k, h200.split_k) == (default_split, h200_split), (n, k)
        assert default._replace(split_k=0) == h200._replace(split_k=0)
    default, h200 = (pick_skinny_config(8, 4096, 4096, FP8, 132, card) for card in ("", "H200"))
    assert isinstance(h200, SkinnyConfig) and h200._replace(split_k=0) == default._replace(split_k=0)
    assert h200.split_k < default.split_k
    for m, wdtype in ((2, FP8), (4, FP8), (16, FP8), (1, torch.bfloat16), (8, torch.bfloat16)):
        assert pick_skinny_config(m, 4096, 4096, wdtype, 132, "H200") == pick_skinny_config(m, 4096, 4096, wdtype, 132)
    with pytest.raises(ValueError, match="card 'B200'"):
        pick_skinny_config(1, 4096, 4096, FP8, 132, "B200")
    assert card_of(torch.device("cpu")) == ""
    assert [card_of_name(n) for n in ("NVIDIA H200", "NVIDIA H200 NVL", "NVIDIA GH200 480GB", "NVIDIA H100 80GB HBM3",
                                      "NVIDIA A100-SXM4-80GB")] == ["H200", "H200", "", "", ""]
    if torch.cuda.is_available():
        assert card_of(torch.device("cuda", 0)) == card_of_name(torch.cuda.get_device_name(0))


def test_bench_tile_variants(monkeypatch):
    # bench/tiles.py (bench/decode_profile.py --tiles): a variant replaces buckets on top of the default tables
    import sys

    from bench import tiles

    module = sys.modules["kernels.skinny_linear"]
    for name in ("_GEMV_TABLE", "_BF16_GEMV_TABLE", "_TABLE", "_CARD_GEMV_TABLE", "_CARD_TABLE"):
        monkeypatch.setattr(module, name, {k: (dict(v) if isinstance(v, dict) else v)
                                           for k, v in getattr(module, name).items()})
    assert tiles.parse("card") == tiles.parse(" default ") == {}
    assert tiles.parse("gemv1=0,16,512,1,4,3,2.5 skinny8=2,32,512,4,3,2") == {
        ("gemv", 1): (0, 16, 512, 1, 4, 3, 2.5), ("skinny", 8): (2, 32, 512, 4, 3, 2)}
    for bad in ("gemv1=0,16", "gemv8=0,16,512,1,4,3,2", "fast", "skinny3=2,32,512,4,3,2"):
        with pytest.raises(ValueError, match="tile variant"):
            tiles.parse(bad)
    tiles.apply("card")
    assert pick_skinny_config(1, 4096, 4096, FP8, 132, "H200").split_k == 2  # untouched
    tiles.apply("gemv1=0,16,512,1,4,3,1 bf16gemv2=0,16,256,1,4,1,1")
    assert module._CARD_GEMV_TABLE == {} and module._CARD_TABLE == {}  # the card's buckets are gone
    assert pick_skinny_config(1, 4096, 4096, FP8, 132, "H200") == GemvConfig(MODE_ACC, 16, 512, 1, 1, 4, 3)
    assert pick_skinny_config(2, 4096, 4096, torch.bfloat16, 132).stages == 1


def test_picked_tilings_compile_for_sm90():
    # The interpreter runs programs the compiler rejects; compile every tiling the picker can return
    # for sm_90 (no GPU needed: Triton's own ptxas) in a process without TRITON_INTERPRET.
    from sm90_compile import run_script

    assert run_script("sm90_compile.py").count("ok ") >= 10

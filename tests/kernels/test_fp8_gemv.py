"""The FP8 GEMV (`kernels/fp8_gemv.py`) vs an fp64 oracle and `quant_reference.skinny_linear`.

On CPU the interpreter runs the kernels with fp32 x (and Triton's cast where the GPU uses inline
asm); on CUDA the same cases run compiled with bf16 x. Every mode (un-reduced accumulator, per-tile
row sums, fp16 tensor cores), register prefetch and smem pipelining, unroll 1/2/4, per-channel and
per-tensor scales, bias, split-K (twice: the counters reset), odd M, N and K tails.
"""

from __future__ import annotations

import pytest
import torch

from kernels import quant_reference
from kernels.fp8_gemv import MODE_ACC, MODE_DOT16, MODE_ROWSUM, GemvConfig, fp8_gemv, gemv_config

FP8 = torch.float8_e4m3fn


def _case(N: int, K: int, M: int, per_channel: bool, with_bias: bool, device: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    q, scale = quant_reference.quantize_fp8(torch.randn(N, K, generator=g))
    if not per_channel:
        scale = scale.max().reshape(())
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    # x exactly representable in fp16 too: MODE_DOT16 converts it (exact here, so one tolerance for all)
    x = torch.randn(M, K, generator=g).half().to(dtype)
    bias = torch.randn(N, generator=g).to(dtype) if with_bias else None
    return x.to(device), q.to(device), scale.to(device), None if bias is None else bias.to(device)


def _oracle(x, q, scale, bias):
    dense = q.double() * (scale.double().reshape(-1, 1) if scale.numel() > 1 else scale.double())
    y = x.double() @ dense.t()
    return y + bias.double() if bias is not None else y


def _rel_err(out, ref) -> float:
    assert torch.isfinite(out).all()
    return float((out.double() - ref.double()).norm() / ref.double().norm())


CASES = [
    # (N, K, M, per_channel, bias, config)
    (40, 256, 1, True, True, GemvConfig(MODE_ACC, 16, 64, 2, 1, 4, 1)),
    (40, 400, 1, False, False, GemvConfig(MODE_ACC, 16, 64, 2, 3, 4, 1)),  # K tail, split 3, per tensor
    (24, 512, 2, True, True, GemvConfig(MODE_ACC, 8, 128, 1, 2, 4, 3)),  # smem pipelining
    (40, 400, 3, True, False, GemvConfig(MODE_ROWSUM, 16, 32, 4, 3, 4, 1)),
    (72, 512, 4, False, True, GemvConfig(MODE_ROWSUM, 32, 64, 2, 1, 4, 1)),
    (40, 400, 4, True, True, GemvConfig(MODE_ACC, 16, 32, 4, 2, 4, 1)),
    (64, 256, 1, True, False, GemvConfig(MODE_ROWSUM, 64, 32, 2, 1, 4, 3)),
    (40, 400, 11, True, True, GemvConfig(MODE_DOT16, 32, 64, 2, 2, 4, 3)),
    (64, 256, 1, False, False, GemvConfig(MODE_DOT16, 32, 64, 1, 1, 4, 1)),
    (48, 256, 16, True, True, GemvConfig(MODE_DOT16, 16, 64, 1, 4, 4, 3)),
    # the pipelined FMA loop (stages > 1): unrolled sub-tiles, a K tail, a split left empty by an explicit
    # tiling (400 columns in steps of 128 over 3 splits: 2, 2, 0 iterations)
    (40, 400, 1, False, True, GemvConfig(MODE_ACC, 16, 64, 2, 3, 4, 3)),
    (40, 512, 2, True, False, GemvConfig(MODE_ROWSUM, 16, 32, 4, 1, 4, 2)),
    (24, 128, 4, True, True, GemvConfig(MODE_ACC, 8, 32, 4, 1, 4, 4)),
]


@pytest.mark.parametrize("N, K, M, per_channel, with_bias, config", CASES)
def test_fp8_gemv_matches_oracle(device, N, K, M, per_channel, with_bias, config):
    x, q, scale, bias = _case(N, K, M, per_channel, with_bias, device, N + K + M)
    ref = _oracle(x, q, scale, bias)
    tol = 1e-5 if x.dtype == torch.float32 else 1e-2
    for _ in range(2):  # the second call checks that the split-K counters reset themselves
        out = fp8_gemv(x, q, scale, bias, config)
        assert out.dtype == x.dtype and out.shape == (M, N)
        assert _rel_err(out, ref) < tol, config
    assert _rel_err(quant_reference.skinny_linear(x, q, scale, bias), ref) < tol


def test_dot16_launches_without_pdl(device, monkeypatch):
    # the fp16 tensor-core mode made the engine's FP8 8B step at 3-4 requests 4.76 ms instead of 3.57 with PDL
    # (bench/RESULTS.md run 68): it opts out; the FMA modes keep it
    import kernels.fp8_gemv as module

    asked = []
    real = module.launch_options
    monkeypatch.setattr(module, "launch_options", lambda x, enabled=True: asked.append(enabled) or real(x, enabled))
    x, q, scale, _ = _case(40, 256, 4, True, False, device, 1)
    tol = 1e-5 if x.dtype == torch.float32 else 1e-2
    for config in (GemvConfig(MODE_DOT16, 32, 64, 1, 1, 4, 1), GemvConfig(MODE_ACC, 16, 64, 1, 1, 4, 1)):
        assert _rel_err(fp8_gemv(x, q, scale, None, config), _oracle(x, q, scale, None)) < tol
    assert asked == [False, True]


def test_gemv_config_splits_narrow_n_only():
    narrow = gemv_config(1536, 4096, MODE_ACC, 16, 512, 1, 4, 1, 4, 132)
    wide = gemv_config(28672, 4096, MODE_ACC, 16, 512, 1, 4, 1, 4, 132)
    assert narrow.split_k > 1 and wide.split_k == 1
    # no split is left without K iterations
    cfg = gemv_config(64, 4096, MODE_ACC, 64, 512, 2, 4, 1, 4, 132)
    iters = 4096 // (512 * 2)
    per = -(-iters // cfg.split_k)
    assert (cfg.split_k - 1) * per < iters


def test_fp8_gemv_rejects_bad_input(device):
    x, q, scale, _ = _case(16, 64, 2, True, False, device, 1)
    cfg = GemvConfig(MODE_ACC, 16, 32, 1, 1, 4, 1)
    with pytest.raises(ValueError, match="rows"):
        fp8_gemv(torch.zeros(5, 64, dtype=x.dtype, device=device), q, scale, None, cfg)  # FMA modes: M <= 4
    with pytest.raises(ValueError, match="scale"):
        fp8_gemv(x, q, None, None, cfg)
    with pytest.raises(ValueError, match="chain"):
        fp8_gemv(x[:, :32], q, scale, None, cfg)
    with pytest.raises(ValueError, match="float8"):
        fp8_gemv(x, q.float(), scale, None, cfg)
    with pytest.raises(ValueError, match="words"):  # a column slice starting mid-word
        fp8_gemv(x[:, :60], q[:, 2:62], scale, None, cfg)


BF16_CASES = [
    # (N, K, M, bias, config): bf16 weights, two a word (FMA modes)
    (40, 256, 1, True, GemvConfig(MODE_ACC, 16, 64, 2, 1, 4, 1)),
    (40, 400, 1, False, GemvConfig(MODE_ACC, 16, 64, 2, 3, 4, 1)),  # K tail, split 3
    (24, 512, 2, True, GemvConfig(MODE_ACC, 8, 128, 1, 2, 4, 3)),  # smem pipelining
    (40, 400, 3, False, GemvConfig(MODE_ROWSUM, 16, 32, 4, 3, 4, 1)),
    (72, 512, 4, True, GemvConfig(MODE_ROWSUM, 32, 64, 2, 1, 4, 1)),
    (40, 400, 1, True, GemvConfig(MODE_ACC, 16, 64, 2, 3, 4, 3)),  # pipelined, a split left empty
]


@pytest.mark.parametrize("N, K, M, with_bias, config", BF16_CASES)
def test_bf16_weights_match_oracle(device, N, K, M, with_bias, config):
    g = torch.Generator().manual_seed(N * K + M)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    w = torch.randn(N, K, generator=g).bfloat16().to(device)
    x = torch.randn(M, K, generator=g).bfloat16().to(dtype).to(device)
    bias = torch.randn(N, generator=g).bfloat16().to(dtype).to(device) if with_bias else None
    ref = x.double() @ w.double().t() + (bias.double() if bias is not None else 0)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for _ in range(2):
        out = fp8_gemv(x, w, None, bias, config)
        assert out.dtype == x.dtype and out.shape == (M, N)
        assert _rel_err(out, ref) < tol, config
    # column 2 c is a word's low half: a weight tensor with one nonzero per row puts it where it belongs
    w1 = torch.zeros(8, K, dtype=torch.bfloat16, device=device)
    w1[torch.arange(8), torch.arange(8) * 3 + 1] = 1.0
    got = fp8_gemv(x, w1, None, None, config)
    assert torch.equal(got, x[:, torch.arange(8, device=device) * 3 + 1].to(got.dtype))


def test_bf16_weights_reject_scale_and_dot16(device):
    w = torch.randn(16, 64).bfloat16().to(device)
    x = torch.randn(2, 64).bfloat16().to(torch.float32 if device == "cpu" else torch.bfloat16).to(device)
    with pytest.raises(ValueError, match="bf16"):
        fp8_gemv(x, w, torch.ones(1, device=device), None, GemvConfig(MODE_ACC, 16, 32, 1, 1, 4, 1))
    with pytest.raises(ValueError, match="bf16"):
        fp8_gemv(x, w, None, None, GemvConfig(MODE_DOT16, 16, 32, 1, 1, 4, 1))
    with pytest.raises(ValueError, match="words"):  # starts mid-word
        fp8_gemv(x[:, :62], w[:, 1:63], None, None, GemvConfig(MODE_ACC, 16, 32, 1, 1, 4, 1))

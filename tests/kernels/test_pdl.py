"""Programmatic dependent launch (kernels/pdl.py).

CPU: the knob's parsing and that it is off off CUDA; every PDL kernel compiled for sm_90 keeps the
contract in program order (release before wait, no store before the wait, weight prologues before it).
GPU: a decode chain of PDL kernels gives the same bits as without PDL, eager and replayed from a
CUDA graph; whole models (bf16, GPTQ int4, FP8) give the same greedy tokens with `OPEN_LMI_PDL` 1 and 0,
with their decode graphs captured.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import kernels
from kernels import pdl

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
needs_sm90 = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                                reason="needs a CUDA GPU of sm_90 or later")


@pytest.fixture
def fresh_knob(monkeypatch):  # noqa: ANN001, ANN201
    pdl._enabled_on.cache_clear()
    yield monkeypatch
    pdl._enabled_on.cache_clear()


def test_off_for_cpu_tensors_and_bad_values_raise(fresh_knob) -> None:  # noqa: ANN001
    assert not pdl.enabled_for(torch.zeros(1))
    assert pdl.launch_kwargs(False) == {}
    assert pdl.launch_kwargs(True) == {"launch_pdl": True}
    if torch.cuda.is_available():
        fresh_knob.setenv(pdl.ENV, "maybe")
        with pytest.raises(ValueError, match="OPEN_LMI_PDL"):
            pdl.enabled_for(torch.zeros(1, device="cuda"))


def test_every_pdl_kernel_keeps_the_contract_on_sm90() -> None:
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "support", "pdl_sm90_compile.py")],
                          capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    # 14 kernels (the fused all-reduce and the FP8/bf16 GEMV also as they run with pushed rows, the RMSNorm
    # and SwiGLU also as they write FP8 rows, the decode attention also with the step's RoPE), 1 hinted
    assert len(lines) == 15 and all(ln.startswith("ok ") for ln in lines), done.stdout
    # the GEMVs' first weight tiles leave before the wait (the point of launching them early)
    assert all(int(ln.split("loads_before_wait=")[1].split()[0]) > 0 for ln in lines if "gemv" in ln or "norm" in ln)
    assert any(ln.startswith("ok all_reduce_rms_norm+hint ") and "prefetches=" in ln for ln in lines)


def _chain(x, w_norm, w1, w2, residual):  # noqa: ANN001, ANN202
    # norm -> skinny GEMV -> SwiGLU -> skinny GEMV -> norm with the residual: each reads the previous output
    h = kernels.rms_norm(x, w_norm, 1e-5)
    gu = kernels.skinny_linear(h, w1, None, None)
    a = kernels.silu_and_mul(gu)
    y = kernels.skinny_linear(a, w2, None, None)
    return kernels.rms_norm(y, w_norm, 1e-5, residual)


@needs_sm90
def test_chain_same_bits_with_and_without_pdl_eager_and_in_a_graph(fresh_knob) -> None:  # noqa: ANN001
    g = torch.Generator(device="cuda").manual_seed(0)
    d, f = 2048, 5632
    x = torch.randn(1, d, device="cuda", generator=g).bfloat16()
    residual = torch.randn(1, d, device="cuda", generator=g).bfloat16()
    w_norm = torch.rand(d, device="cuda", generator=g).bfloat16() + 0.5
    w1 = (torch.randn(2 * f, d, device="cuda", generator=g) / d ** 0.5).bfloat16()
    w2 = (torch.randn(d, f, device="cuda", generator=g) / f ** 0.5).bfloat16()
    results = {}
    for flag in ("0", "1"):
        fresh_knob.setenv(pdl.ENV, flag)
        pdl._enabled_on.cache_clear()
        assert pdl.enabled_for(x) == (flag == "1")
        eager = _chain(x, w_norm, w1, w2, residual)
        static_x = x.clone()
        _chain(static_x, w_norm, w1, w2, residual)  # compile before capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = _chain(static_x, w_norm, w1, w2, residual)
        replays = []
        for i in range(3):  # new inputs each replay: a kernel reading stale data would show
            static_x.copy_(x.roll(97 * i, dims=1))  # (a scaled x would norm to the same row)
            graph.replay()
            replays.append(tuple(t.clone() for t in out))
        torch.cuda.synchronize()
        results[flag] = (eager, replays)
    for a, b in zip(results["0"][0], results["1"][0]):
        assert torch.equal(a, b)
    for ra, rb in zip(results["0"][1], results["1"][1]):
        for a, b in zip(ra, rb):
            assert torch.equal(a, b)
    assert not torch.equal(results["1"][1][0][0], results["1"][1][1][0])  # the replays did see new inputs


@needs_sm90
@pytest.mark.parametrize("quantize", ["bf16", "gptq", "fp8"])
def test_same_tokens_with_and_without_pdl(tmp_path, fresh_knob, quantize) -> None:  # noqa: ANN001
    sys.path.insert(0, os.path.join(ROOT, "tests", "support"))
    from dummy_model import dummy_llm, greedy_batches

    tokens = {}
    for flag in ("1", "0"):
        fresh_knob.setenv(pdl.ENV, flag)
        pdl._enabled_on.cache_clear()
        llm = dummy_llm("llama-3.2-1b", tmp_path, max_num_seqs=8, quantize=quantize)
        assert llm.llm_engine.executor.runner.graph_runner is not None  # decode graphs captured
        tokens[flag] = greedy_batches(llm)
    assert tokens["1"] == tokens["0"]

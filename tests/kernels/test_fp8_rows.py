"""FP8 rows written by the op before an FP8 linear (`kernels/fp8_rows.py`): the RMSNorm and the SwiGLU
write, beside their bf16 result, exactly what quantising that result in a launch of its own gives; views
and copies of the result carry none; `quant/fp8.link_fp8_rows` marks the right modules; on CUDA
the FP8 linear's output is bitwise the same with and without the rows, and an FP8 engine links them
and generates the same greedy tokens either way.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import kernels
from kernels import fp8_rows
from kernels.activation import silu_and_mul
from kernels.fp8_rows import Fp8Rows, attach, attached, quantize_rows_fp8
from kernels.rms_norm import rms_norm


def _rows(m: int, k: int, device: str) -> torch.Tensor:
    """bf16 rows of spread magnitudes, one of them all zero."""
    x = torch.randn(m, k) * torch.logspace(-2, 2, m)[:, None]
    x[m // 2] = 0
    return x.to(torch.bfloat16).to(device)


def _same_as_separate(out: torch.Tensor) -> None:
    rows = attached(out)
    assert rows is not None
    q, scale = quantize_rows_fp8(out)
    assert torch.equal(rows.scale, scale)
    assert torch.equal(rows.q.view(torch.uint8), q.view(torch.uint8))
    want = (out.float().abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 448.0)
    torch.testing.assert_close(rows.scale, want, rtol=0, atol=0)


@pytest.mark.parametrize("hidden", [64, 80])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("unit_offset", [False, True])
def test_rms_norm_rows_are_the_separate_quantisation(device, hidden, with_residual, unit_offset):
    x = _rows(19, hidden, device)
    w = (1 + 0.1 * torch.randn(hidden)).to(torch.bfloat16).to(device)
    res = _rows(19, hidden, device).flip(0) if with_residual else None
    plain = rms_norm(x, w, 1e-5, res, unit_offset)
    fused = rms_norm(x, w, 1e-5, res, unit_offset, fp8_rows=True)
    if with_residual:
        assert torch.equal(plain[1], fused[1])
        plain, fused = plain[0], fused[0]
    assert torch.equal(plain, fused)
    assert attached(plain) is None
    _same_as_separate(fused)


@pytest.mark.parametrize("d", [40, 1500])  # one block; two blocks with a tail
def test_silu_and_mul_rows_are_the_separate_quantisation(device, d):
    x = _rows(21, 2 * d, device) / 10  # gates within exp's float32 range
    plain = silu_and_mul(x)
    fused = silu_and_mul(x, fp8_rows=True)
    assert torch.equal(plain, fused)
    _same_as_separate(fused)


def test_silu_rows_wider_than_a_program_holds_fall_back(device):
    d = fp8_rows.ROW_BLOCK_MAX + 8
    x = _rows(17, 2 * d, device) / 10
    out = silu_and_mul(x, fp8_rows=True)
    assert attached(out) is None and torch.equal(out, silu_and_mul(x))


def test_quantize_rows_whole_and_in_two_passes_agree(device):
    from kernels.fp8_rows import _quantize_rows_kernel

    x = _rows(5, 3000, device)
    q, scale = quantize_rows_fp8(x)  # the whole row at once (4,096 wide)
    q2, scale2 = torch.empty_like(q), torch.empty_like(scale)
    _quantize_rows_kernel[(5,)](x, q2, scale2, 3000, x.stride(0), q2.stride(0), BLOCK=1024, WHOLE=False)
    assert torch.equal(scale, scale2) and torch.equal(q.view(torch.uint8), q2.view(torch.uint8))


def test_attached_rows_stay_with_the_tensor_object():
    with torch.inference_mode():  # as the engine runs: inference tensors
        x = torch.randn(20, 32, dtype=torch.bfloat16)
        rows = Fp8Rows(torch.zeros(20, 32, dtype=torch.float8_e4m3fn), torch.ones(20, 1))
        attach(x, rows)
        assert attached(x) is rows
        assert attached(x[:4]) is None and attached(x.clone()) is None  # views and copies carry nothing
        assert attached(x.view(20, 32)) is None
    with pytest.raises(AssertionError):
        attach(x, Fp8Rows(torch.zeros(19, 32, dtype=torch.float8_e4m3fn), torch.ones(19, 1)))


def test_rows_are_wanted_only_where_a_linear_reads_them():
    cpu = torch.zeros(32, 64, dtype=torch.bfloat16)
    assert not fp8_rows.wanted(cpu)
    # the dispatchers write nothing off the Triton path, and return the same values
    w = torch.ones(64, dtype=torch.bfloat16)
    assert attached(kernels.rms_norm(cpu, w, 1e-5, fp8_rows=True)) is None
    assert attached(kernels.silu_and_mul(cpu, fp8_rows=True)) is None


def test_link_fp8_rows_marks_the_ops_before_fp8_linears():
    from serving.executor.quant.fp8 import FP8LinearMethod, link_fp8_rows

    class Lin(nn.Module):
        def __init__(self, fp8: bool) -> None:
            super().__init__()
            self.quant_method = FP8LinearMethod.__new__(FP8LinearMethod) if fp8 else None

    norm1, qkv, o, norm2, gate_up, down, final = nn.Identity(), Lin(True), Lin(False), nn.Identity(), Lin(True), \
        Lin(True), nn.Identity()
    trace = [norm1, qkv, o, norm2, gate_up, down, final]
    assert link_fp8_rows(trace, Lin) == 4  # norm1, o (its flag unused: not gated), norm2, gate_up
    flags = [vars(m).get("fp8_rows", False) for m in trace]
    assert flags == [True, False, True, True, True, False, False]
    down.quant_method = None  # an unquantized down projection: gate_up's SwiGLU writes none
    assert link_fp8_rows(trace, Lin) == 0
    assert vars(gate_up)["fp8_rows"] is False and vars(norm2)["fp8_rows"] is True


def _fp8_cuda() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


@pytest.mark.skipif(not _fp8_cuda(), reason="per-token FP8 rows need a Hopper GPU")
@pytest.mark.parametrize("m", [17, 64, 300])
def test_fp8_linear_is_bitwise_the_same_with_the_rows(m):
    K, I = 4096, 14336
    w_qkv, s_qkv = kernels.quantize_fp8(torch.randn(6144, K, device="cuda") * 0.02)
    w_gu, s_gu = kernels.quantize_fp8(torch.randn(2 * I, K, device="cuda") * 0.02)
    w_down, s_down = kernels.quantize_fp8(torch.randn(K, I, device="cuda") * 0.02)
    x = torch.randn(m, K, device="cuda", dtype=torch.bfloat16)
    res = torch.randn(m, K, device="cuda", dtype=torch.bfloat16)
    norm_w = torch.ones(K, device="cuda", dtype=torch.bfloat16)
    normed, _ = kernels.rms_norm(x, norm_w, 1e-5, res, fp8_rows=True)
    assert attached(normed) is not None
    assert torch.equal(kernels.fp8_linear(normed, w_qkv, s_qkv), kernels.fp8_linear(normed.clone(), w_qkv, s_qkv))
    act = kernels.fp8_linear(normed, w_gu, s_gu, gated=True, fp8_rows=True)
    assert attached(act) is not None
    _same_as_separate(act)
    assert torch.equal(kernels.fp8_linear(act, w_down, s_down), kernels.fp8_linear(act.clone(), w_down, s_down))


@pytest.mark.skipif(not _fp8_cuda(), reason="per-token FP8 rows need a Hopper GPU")
@pytest.mark.parametrize("enforce_eager", [True, False])
def test_fp8_engine_links_the_rows_and_keeps_its_tokens(tmp_path, enforce_eager):
    from dummy_model import make_dummy_model_dir

    from serving import LLM, SamplingParams

    model_dir = make_dummy_model_dir("llama-3.2-1b", tmp_path / "m")
    llm = LLM(str(model_dir), load_format="dummy", dtype="bfloat16", max_num_seqs=32, max_model_len=512,
              gpu_memory_utilization=0.3, skip_tokenizer_init=True, quantization="fp8", enforce_eager=enforce_eager,
              enable_prefix_caching=False)  # the second run's steps then have the first run's shapes
    model = llm.llm_engine.executor.runner.model.model
    layer = model.layers[0]
    assert layer.input_layernorm.fp8_rows and layer.post_attention_layernorm.fp8_rows
    assert layer.mlp.gate_up_proj.fp8_rows and not model.norm.fp8_rows
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, detokenize=False)
    prompts = [{"prompt_token_ids": list(range(1000 + 7 * i, 1000 + 7 * i + n))} for i, n in enumerate((5, 40, 23))]
    prompts += [{"prompt_token_ids": [3000 + i, 17]} for i in range(20)]  # 23 decode rows a step
    with_rows = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    if enforce_eager:  # eager steps read the flags every forward: the same tokens without the rows
        for module in llm.llm_engine.executor.runner.model.modules():
            if "fp8_rows" in vars(module):
                vars(module)["fp8_rows"] = False
        without = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert with_rows == without
    assert all(len(t) == 12 for t in with_rows)
    llm.shutdown()

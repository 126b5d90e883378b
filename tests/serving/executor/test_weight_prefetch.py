"""L2 hints of decode steps (serving/executor/models/weight_prefetch.py, kernels/l2_prefetch.py).

CPU: the trace of a real forward gives each norm the weight of the linear layer that runs after
it (Llama: input norm -> qkv, post-attention norm -> gate_up, the final norm none), which tensor
a layer's kernel reads (float and int4), the knob's parsing, teardown dropping the hints, and the
standalone prefetch kernel's sm_90 compile. The hinted all-reduce itself: tests/kernels/
test_all_reduce_norm.py (simulated peers) and test_l2_hints.py; over real peers, the TP=2 token
agreement of tests/serving/executor/test_gpu_all_reduce.py runs with the hints on (the default).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from serving.executor.models import weight_prefetch
from serving.executor.models.linear import Linear
from serving.executor.models.weight_prefetch import ENV, link_l2_hints, prefetch_bytes, tracing, weight_tensor

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _tiny_llama(layers: int = 2):
    from serving.checkpoint.model_args import ModelArgs
    from serving.executor.models import build_model

    args = ModelArgs.from_dict({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64, "hidden_size": 32,
        "intermediate_size": 48, "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    })
    return args, build_model(args, torch.float32, torch.device("cpu"), 64)


def _traced_forward(args, model, tokens: int = 3) -> list[torch.nn.Module]:  # noqa: ANN001
    from serving.executor.attention_metadata import AttentionMetadata, forward_context

    kv = torch.zeros(2, args.num_hidden_layers, 2, 16, 2, args.head_dim)
    for i, layer in enumerate(model.attention_layers):
        layer.bind_kv_cache(kv[0, i], kv[1, i])
    meta = AttentionMetadata(
        slot_mapping=torch.arange(tokens), query_start_loc=torch.tensor([0, tokens], dtype=torch.int32),
        seq_lens=torch.tensor([tokens], dtype=torch.int32), block_tables=torch.zeros(1, 1, dtype=torch.int32),
        num_decodes=0, num_decode_tokens=0, max_query_len=tokens, max_seq_len=tokens)
    with tracing() as trace, forward_context(meta):
        model(torch.arange(tokens), torch.arange(tokens))
    return trace


def test_hints_follow_the_run_order(monkeypatch) -> None:  # noqa: ANN001
    import kernels

    args, model = _tiny_llama(2)
    trace = _traced_forward(args, model)
    # off CUDA no hint is made (no cache to warm): every module is linked to None
    assert link_l2_hints(trace, Linear, 1 << 20) == 0
    assert all(getattr(m, "l2_hint", None) is None for m in model.modules())
    # a stand-in hint names the tensor it was made for: each module gets its successor's weight
    monkeypatch.setattr(kernels, "l2_hint", lambda t, nbytes: (t.data_ptr(), nbytes))
    assert link_l2_hints(trace, Linear, 1 << 20) == 2 * 2
    for layer in model.model.layers:
        assert layer.input_layernorm.l2_hint == (layer.self_attn.qkv_proj.weight.data_ptr(), 1 << 20)
        assert layer.post_attention_layernorm.l2_hint == (layer.mlp.gate_up_proj.weight.data_ptr(), 1 << 20)
    assert model.model.norm.l2_hint is None  # the LM head runs outside the forward
    assert link_l2_hints(trace, Linear, 0) == 0  # 0 bytes: off
    assert weight_prefetch._trace is None  # noqa: SLF001 - the trace ended with its block


def test_teardown_drops_the_hints() -> None:
    import kernels
    from serving.executor.teardown import release_module

    args, model = _tiny_llama(1)
    norm = model.model.layers[0].input_layernorm
    norm.l2_hint = kernels._mod("l2_prefetch").l2_hint(model.model.layers[0].self_attn.qkv_proj.weight, 4096)  # noqa: SLF001
    assert norm.l2_hint is not None
    release_module(model)
    assert norm.l2_hint is None


def test_weight_tensor_is_what_the_quantized_kernel_reads() -> None:
    layer = torch.nn.Module()
    layer.qweight = torch.zeros(4, 8, dtype=torch.int32)
    assert weight_tensor(layer) is layer.qweight
    layer.kchunk = torch.zeros(2, 8, 4, dtype=torch.int32)  # repacked at load: qweight is deleted then
    assert weight_tensor(layer) is layer.kchunk
    layer.kchunk = torch.zeros(8, 8).t()  # not contiguous: not a prefetch target
    assert weight_tensor(layer) is layer.qweight
    assert weight_tensor(torch.nn.Module()) is None


def test_knob_parsing(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.delenv(ENV, raising=False)
    # unset: the size measured best per degree (bench/RESULTS.md runs 53, 55): 4 MiB at 2 ranks, 16 at 4 and 8
    assert prefetch_bytes(4) == prefetch_bytes(8) == int(weight_prefetch.DEFAULT_MB * (1 << 20)) == 16 << 20
    assert prefetch_bytes(2) == 4 << 20
    monkeypatch.setenv(ENV, "6")
    assert prefetch_bytes(2) == prefetch_bytes(4) == 6 << 20
    monkeypatch.setenv(ENV, "0.5")
    assert prefetch_bytes(4) == 1 << 19
    monkeypatch.setenv(ENV, "0")
    assert prefetch_bytes(4) == 0
    for bad in ("lots", "-1"):
        monkeypatch.setenv(ENV, bad)
        with pytest.raises(ValueError, match=ENV):
            prefetch_bytes(4)


def test_reference_is_a_checked_no_op() -> None:
    import kernels

    t = torch.arange(12.0)
    kernels.l2_prefetch(t, 1 << 20)
    assert torch.equal(t, torch.arange(12.0))
    with pytest.raises(AssertionError):
        kernels.l2_prefetch(torch.zeros(4, 4).t(), 64)


def test_kernel_compiles_for_sm90_with_its_prefetches() -> None:
    pytest.importorskip("triton")
    script = (
        "import sys; sys.path[:0] = [{root!r}, {support!r}]\n"
        "from sm90_compile import compile_variant\n"
        "from kernels.l2_prefetch import _prefetch_kernel, _BLOCK, _BULK_CHUNK, _LINE, MODE_BULK, MODE_LINE\n"
        "for mode, unit, op in ((MODE_BULK, _BULK_CHUNK, 'cp.async.bulk.prefetch.L2.global'),\n"
        "                       (MODE_LINE, _LINE, 'prefetch.global.L2::evict_last')):\n"
        "    k = compile_variant(_prefetch_kernel, dict(UNIT=unit, MODE=mode, BLOCK=_BLOCK), {{'base_ptr': '*u8'}},\n"
        "                        ('base_ptr',), _BLOCK // 32, 1)\n"
        "    n = sum(op in line for line in k.asm['ptx'].splitlines() if not line.strip().startswith('.loc'))\n"
        "    print(mode, n)\n"
        "    assert n == 1, (mode, n)\n"
    ).format(root=ROOT, support=os.path.join(ROOT, "tests", "support"))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]

"""The L2 weight prefetch of decode steps (serving/executor/models/weight_prefetch.py).

CPU: the chain's order over a real model, which tensor a layer's kernel reads (float and int4),
the knob's parsing, that nothing is linked off CUDA, and the kernel's sm_90 compile keeping its
prefetch instructions. GPU: the same tokens with the prefetch on and off (bf16), with the decode
graphs captured (a graph whose side stream did not rejoin would fail to capture); an int4 model
links no prefetch.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from serving.executor.models.linear import Linear
from serving.executor.models.weight_prefetch import (
    ENV,
    link_chain,
    link_weight_prefetch,
    prefetch_bytes,
    prefetch_chain,
    weight_tensor,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _tiny_llama(layers: int = 2):
    from serving.checkpoint.model_args import ModelArgs
    from serving.executor.models import build_model

    args = ModelArgs.from_dict({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64, "hidden_size": 32,
        "intermediate_size": 48, "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    })
    return build_model(args, torch.float32, torch.device("cpu"), 64)


def test_chain_follows_a_decoder_layers_run_order() -> None:
    model = _tiny_llama(2)
    names = {id(m): n for n, m in model.named_modules()}
    chain = [names[id(m)] for m in prefetch_chain(model, Linear)]
    per_layer = ["self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"]
    assert chain == [f"model.layers.{i}.{p}" for i in range(2) for p in per_layer]
    for m in prefetch_chain(model, Linear):
        assert weight_tensor(m) is m.weight


def test_linking_aliases_the_next_weight_without_new_parameters() -> None:
    from serving.executor.teardown import release_module

    model = _tiny_llama(2)
    params = [n for n, _ in model.named_parameters()]
    chain = prefetch_chain(model, Linear)
    token = object()
    link_chain(chain, token)
    assert [n for n, _ in model.named_parameters()] == params
    for here, nxt in zip(chain, chain[1:]):
        assert here.weight_prefetch is token
        assert not isinstance(here.prefetch_next, torch.nn.Parameter)
        assert here.prefetch_next.data_ptr() == nxt.weight.data_ptr()
    assert chain[-1].prefetch_next is None
    release_module(model)  # teardown drops the aliases with the weights
    assert all(m.prefetch_next is None or m.prefetch_next.numel() == 0 for m in chain)


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
    # off unless asked: no gain under tensor parallelism (run 44), a loss on one GPU since PDL (run 49)
    assert prefetch_bytes() == 0 and prefetch_bytes(tp_degree=2) == 0
    monkeypatch.setenv(ENV, "4")
    assert prefetch_bytes(tp_degree=4) == 4 << 20
    monkeypatch.setenv(ENV, "0.5")
    assert prefetch_bytes() == 1 << 19
    monkeypatch.setenv(ENV, "0")
    assert prefetch_bytes() == 0
    for bad in ("lots", "-1"):
        monkeypatch.setenv(ENV, bad)
        with pytest.raises(ValueError, match=ENV):
            prefetch_bytes()


def test_nothing_linked_off_cuda() -> None:
    model = _tiny_llama(1)
    assert link_weight_prefetch(model, Linear, torch.device("cpu")) is None
    assert all(m.weight_prefetch is None and m.prefetch_next is None for m in prefetch_chain(model, Linear))


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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("quantize", ["bf16", "gptq"])
def test_same_tokens_with_and_without_prefetch(tmp_path, monkeypatch, quantize) -> None:  # noqa: ANN001
    sys.path.insert(0, os.path.join(ROOT, "tests", "support"))
    from dummy_model import dummy_llm, greedy_batches

    tokens = {}
    for mb in ("16", "0"):
        monkeypatch.setenv(ENV, mb)
        llm = dummy_llm("llama-3.2-1b", tmp_path, max_num_seqs=8, quantize=quantize)
        runner = llm.llm_engine.executor.runner
        # quantized models never prefetch (it cost GPTQ int4 5 %: bench/RESULTS.md run 46)
        assert (runner.weight_prefetch is not None) == (mb != "0" and quantize == "bf16")
        assert runner.graph_runner is not None  # the decode graphs captured with the prefetch's side stream
        tokens[mb] = greedy_batches(llm)  # batch 4, then batch 1 (one row: every decode step prefetches)
    assert tokens["16"] == tokens["0"]

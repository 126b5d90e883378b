"""GPU memory given back: after an `LLM` (CUDA graphs on) is shut down, or its last reference
dropped, and `torch.cuda.empty_cache()`, the memory allocated and reserved is back within 300 MB
of where it was before it was built, and a second `LLM` with the default `gpu_memory_utilization`
(a KV cache sized to the free memory) builds and generates the same tokens.

The model is a small random Llama (`load_format="dummy"`, seeded), so only the engine's own
allocations are measured: weights, the KV cache, both kinds of CUDA graphs and their pools,
the sampler and the batch state (and cuBLAS's workspaces, which shutdown clears: the one first
used inside a graph capture lives in that graph's pool). The slack is for what PyTorch itself
keeps per process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from serving.llm import LLM
from serving.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu

SLACK_BYTES = 300 * 2**20
PROMPTS = [[5, 6, 7, 8], list(range(10, 60)), [3]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, detokenize=False)
CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 4096, "hidden_size": 512,
    "intermediate_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
    "head_dim": 64, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
}


def _model_dir(tmp_path: Path) -> str:
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    return str(tmp_path)


def _llm(model_dir: str) -> LLM:
    llm = LLM(model_dir, load_format="dummy", dtype="bfloat16", max_model_len=512, max_num_seqs=16,
              skip_tokenizer_init=True, seed=0)
    assert llm.llm_engine.executor.runner.graph_runner is not None, "CUDA graphs should be on"
    return llm


def _tokens(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY,
                                                                 use_tqdm=False)]


def _memory() -> tuple[int, int]:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated(), torch.cuda.memory_reserved()


def _assert_back(start: tuple[int, int], what: str) -> None:
    allocated, reserved = _memory()
    assert allocated - start[0] < SLACK_BYTES, f"{what}: {(allocated - start[0]) / 2**20:.0f} MiB still allocated"
    assert reserved - start[1] < SLACK_BYTES, f"{what}: {(reserved - start[1]) / 2**20:.0f} MiB still reserved"


def test_shutdown_gives_the_gpu_memory_back_and_a_second_llm_fits(tmp_path):
    model_dir = _model_dir(tmp_path)
    start = _memory()
    llm = _llm(model_dir)
    assert torch.cuda.memory_allocated() - start[0] > SLACK_BYTES  # the KV cache alone fills most of the GPU
    first = _tokens(llm)
    llm.shutdown()
    _assert_back(start, "after shutdown()")
    with _llm(model_dir) as again:  # sized to the free memory: it fails if the first one's is still held
        assert _tokens(again) == first
    _assert_back(start, "after the second LLM's shutdown")


def test_dropping_the_last_reference_gives_the_gpu_memory_back(tmp_path):
    model_dir = _model_dir(tmp_path)
    start = _memory()
    llm = _llm(model_dir)
    assert _tokens(llm)
    del llm  # no shutdown(), no gc.collect()
    _assert_back(start, "after del llm")


def test_shutdown_hands_the_memory_back_to_the_device(tmp_path):
    # Without the caller's own empty_cache(): what other processes (an engine's worker processes
    # built next, for tensor parallelism or replicas) see as free is back too.
    model_dir = _model_dir(tmp_path)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free_before, _ = torch.cuda.mem_get_info()
    llm = _llm(model_dir)
    assert _tokens(llm)
    llm.shutdown()
    free_after, _ = torch.cuda.mem_get_info()
    assert free_before - free_after < SLACK_BYTES, f"{(free_before - free_after) / 2**20:.0f} MiB not handed back"

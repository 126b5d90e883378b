"""Done-when 2 of issue 2: engine-level greedy identity vs transformers on tiny random models.

Llama (llama3 rope scaling, legacy rope keys), Mistral, Qwen2 (qkv bias, tied embeddings),
Phi-3 (fused qkv/gate_up), Gemma 3 (its own model class: a sliding layer, Gemma norms, GeGLU) and
Qwen3-MoE (8 experts, 3 a token: routing that changes with every token of a chunk) and GPT-2
(learned positions: each recomputed or chunked token must read its own row), each saved by transformers as >= 2 safetensors shards. All prompts
run together with block size 4 and a 32-token budget, so prefills are chunked and mixed with
decodes; a second run forces preemption, a third runs on a 2-token budget with async
scheduling. Every block must be free afterwards.
"""

from __future__ import annotations

import pytest
from hf_oracle import hf_greedy
from identity_prompts import LONG_CONTEXT
from model_fixtures import TINY_ARCHS

from serving.llm import LLM
from serving.sampling_params import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]  # tests/conftest.py

MAX_NEW = 24
PROMPTS = [
    "The capital of France is",
    "请用中文简单介绍一下长城的历史。",
    LONG_CONTEXT[:700],  # ~150 tokens: past llama3's original_max_position_embeddings (64)
    "def fibonacci(n):",
]


def _assert_all_free(llm: LLM) -> None:
    bm = llm.llm_engine.block_manager
    assert not llm.llm_engine.has_unfinished_requests()
    assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)


# Through the engine: the four Llama-family originals and the other model class (Gemma). The rest of
# TINY_ARCHS differ only inside the model, which tests/serving/executor/test_models.py checks logit by logit.
ENGINE_ARCHS = ("llama", "mistral", "qwen2", "phi3", "gemma3", "qwen3_moe", "gpt2")
assert set(ENGINE_ARCHS) <= set(TINY_ARCHS)


@pytest.mark.parametrize("arch", ENGINE_ARCHS)
def test_tiny_arch_greedy_identity(arch: str, tiny_models) -> None:  # noqa: ANN001
    path = str(tiny_models(arch))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    llm = LLM(path, block_size=4, max_num_batched_tokens=32, max_num_seqs=4, num_gpu_blocks_override=256)
    tok = llm.get_tokenizer()
    expected = [hf_greedy(path, tuple(tok.encode(p)), MAX_NEW) for p in PROMPTS]
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [tuple(o.outputs[0].token_ids) for o in outputs] == expected
    _assert_all_free(llm)
    # Forced preemption: 50 blocks x 4 = 200 tokens for ~200 prompt tokens + 4 x 24 new ones.
    small = LLM(path, block_size=4, max_num_batched_tokens=64, max_num_seqs=4, num_gpu_blocks_override=50)
    outputs = small.generate(PROMPTS, params, use_tqdm=False)
    assert [tuple(o.outputs[0].token_ids) for o in outputs] == expected
    assert small.llm_engine.scheduler.num_preemptions > 0
    _assert_all_free(small)
    # A 2-token budget with 2 sequences: while one decodes, the next prompt goes 1 token per step
    # (rows that look like decodes but sample nothing), under async scheduling (placeholders).
    tight = LLM(path, block_size=4, max_num_batched_tokens=2, max_num_seqs=2, num_gpu_blocks_override=256,
                async_scheduling=True)
    outputs = tight.generate(PROMPTS, params, use_tqdm=False)
    assert [tuple(o.outputs[0].token_ids) for o in outputs] == expected
    _assert_all_free(tight)

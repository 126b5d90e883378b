"""Tensor parallelism through the whole engine (offline `LLM`, gloo, 2 CPU ranks, fp32).

Oracle: the same engine at TP=1 (itself token-identical with transformers, see
test_engine_identity.py). Greedy tokens at TP=2 must be identical for the default model (tied
embeddings), a tiny Qwen2 with 2 KV heads (one per rank) and a tiny Llama with 1 KV head
(replicated on both ranks); with chunked prefill, prefix-cache hits, preemption and async
scheduling on. Faults (on the tiny Qwen2): a killed rank fails the executor within 5 s and leaves no process.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from model_fixtures import build_tiny_model

from serving.executor.executor import WorkerFailedError
from serving.llm import LLM
from serving.sampling_params import SamplingParams
from processes import alive

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea:",
    "List three prime numbers:",
    "Once upon a time, in a land far away, there lived a",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
OPTIONS = dict(device="cpu", dtype="float32", block_size=4, max_model_len=256, kv_cache_memory_gb=0.05)


def _tokens(llm: LLM, prompts: list[str], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def _compare(model: str, **tp_options: object) -> None:
    expected = _tokens(LLM(model, **OPTIONS), PROMPTS)
    llm = LLM(model, tensor_parallel_size=2, **{**OPTIONS, **tp_options})
    try:
        assert llm.llm_engine.info.devices == ("cpu", "cpu")
        assert _tokens(llm, PROMPTS) == expected
        assert _tokens(llm, PROMPTS[:2]) == expected[:2]  # again: served from the prefix cache
        assert llm.llm_engine.block_manager.num_prefix_hits > 0
    finally:
        llm.llm_engine.shutdown()


def test_default_model_tp2_equals_tp1_with_chunking_preemption_and_async(smollm2_path):
    # 24-token steps chunk every prompt; 60 blocks of 4 cannot hold 4 x (prompt + 12): preemption.
    _compare(str(smollm2_path), max_num_batched_tokens=24, max_num_seqs=4, num_gpu_blocks_override=40,
             async_scheduling=True)


@pytest.fixture(scope="module")
def qwen2_kv2(tmp_path_factory):  # noqa: ANN001, ANN201
    """A tiny Qwen2 with 2 KV heads (one per rank), built once for the module's three TP=2 engines."""
    return build_tiny_model("qwen2", tmp_path_factory.mktemp("tp_engine") / "qwen2", overrides={"num_key_value_heads": 2})


def test_qwen2_with_two_kv_heads_tp2_equals_tp1(qwen2_kv2):
    _compare(str(qwen2_kv2))


def test_llama_with_one_kv_head_replicated_tp2_equals_tp1(tmp_path):
    path = build_tiny_model("llama", tmp_path / "llama", overrides={"num_key_value_heads": 1})
    _compare(str(path))


def test_killed_rank_fails_the_executor_within_5s_and_leaves_no_process(qwen2_kv2):
    # The fault path (rank pipe EOF -> failure callback -> reap) does not depend on the model: the tiny
    # Qwen2 (as in the hung-rank test) starts its ranks in a third of the default model's time.
    llm = LLM(str(qwen2_kv2), tensor_parallel_size=2, **OPTIONS)
    executor = llm.llm_engine.executor
    pids = [p.pid for p in executor._procs]  # noqa: SLF001 - the test checks the process table
    failures: list[BaseException] = []
    executor.set_failure_callback(failures.append)
    assert _tokens(llm, PROMPTS[:1])
    t0 = time.monotonic()
    os.kill(pids[1], signal.SIGKILL)
    while not failures and time.monotonic() - t0 < 5.0:
        time.sleep(0.05)
    assert failures and "rank 1" in str(failures[0]), failures
    with pytest.raises(WorkerFailedError):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    deadline = time.monotonic() + 5.0
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(p) for p in pids), [p for p in pids if alive(p)]
    llm.llm_engine.shutdown()


def test_degree_that_does_not_divide_the_heads_is_a_clear_error(tmp_path):
    path = build_tiny_model("llama", tmp_path / "llama3h", overrides={
        "num_attention_heads": 3, "num_key_value_heads": 1, "hidden_size": 192})
    with pytest.raises(WorkerFailedError, match="attention heads"):
        LLM(str(path), tensor_parallel_size=2, **OPTIONS)


def test_hung_rank_fails_the_executor_within_5s(qwen2_kv2):
    """A rank that stops (SIGSTOP: no crash, no heartbeat) is a failure too, not a silent hang."""
    llm = LLM(str(qwen2_kv2), tensor_parallel_size=2, **OPTIONS)
    executor = llm.llm_engine.executor
    pids = [p.pid for p in executor._procs]  # noqa: SLF001
    failures: list[BaseException] = []
    executor.set_failure_callback(failures.append)
    t0 = time.monotonic()
    os.kill(pids[1], signal.SIGSTOP)
    try:
        while not failures and time.monotonic() - t0 < 5.0:
            time.sleep(0.05)
        assert failures and "stopped responding" in str(failures[0]), failures
        deadline = time.monotonic() + 5.0
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(alive(p) for p in pids)
    finally:
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        llm.llm_engine.shutdown()


def test_one_rank_in_a_worker_process_equals_in_process(qwen2_kv2):
    """`distributed_executor_backend="mp"` at TP=1 (the server's default on GPUs): the same tokens as
    the in-process engine, with async scheduling on, from a spawned worker that goes with the engine."""
    expected = _tokens(LLM(str(qwen2_kv2), **OPTIONS), PROMPTS)
    llm = LLM(str(qwen2_kv2), distributed_executor_backend="mp", async_scheduling=True, **OPTIONS)
    try:
        procs = llm.llm_engine.executor._procs
        assert len(procs) == 1 and procs[0].is_alive()
        assert _tokens(llm, PROMPTS) == expected
    finally:
        llm.llm_engine.shutdown()
    procs[0].join(5)
    assert not procs[0].is_alive()

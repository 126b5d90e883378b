"""Done-when 1/3/4/6 of issue 2 on the real default model (SmolLM2-135M, fp32, CPU).

Greedy 64-token continuations must be token-identical to transformers `generate` one prompt at
a time, all together, with chunked prefill, with prefix-cache hits and under forced preemption;
after every test all KV blocks are free. One ModelRunner (block size 8) is shared by the
engines of this module; each test builds its own cheap LLMEngine on it.
"""

from __future__ import annotations

import pytest
from hf_oracle import HFGreedyInBackground
from identity_prompts import LONG_A, LONG_B, PROMPTS
from shared_runner import llms_on_runner

from serving.engine_config import EngineConfig
from serving.sampling_params import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]  # tests/conftest.py

BLOCK_SIZE = 8
MAX_NEW = 64
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
# Both engine loops: synchronous, and async scheduling (step N+1 planned before step N's tokens
# are read; placeholders in the inputs; one extra step per stop), which CUDA uses by default.
BOTH_LOOPS = pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])


@pytest.fixture(scope="module")
def smol_dir() -> str:
    from serving.checkpoint.default_model import default_model_path

    return str(default_model_path())


@pytest.fixture(scope="module")
def runner(smol_dir: str):  # noqa: ANN201
    from serving.executor.model_runner import ModelRunner

    return ModelRunner(EngineConfig(model=smol_dir, block_size=BLOCK_SIZE, num_gpu_blocks_override=400, dtype="float32"))


@pytest.fixture(scope="module")
def tokenizer(smol_dir: str):  # noqa: ANN201
    from serving.engine.tokenizer import load_tokenizer

    return load_tokenizer(smol_dir)


@pytest.fixture(scope="module", autouse=True)
def expected(smol_dir: str, tokenizer):  # noqa: ANN001, ANN201
    """prompt -> transformers' greedy tokens, computed in another process (one thread, as here)
    while the engine runs its prompts on this one; a test's check waits for the prompt it needs.
    Autouse: started with the module's first test, before the runner loads, so that the oracle-free
    tests below (placed first) run while it decodes rather than the first identity check waiting on it."""
    oracle = HFGreedyInBackground(smol_dir, {p: tuple(tokenizer.encode(p)) for p in PROMPTS}, MAX_NEW)
    yield oracle
    oracle.close()


@pytest.fixture
def make_llm(smol_dir: str, runner, tokenizer):  # noqa: ANN001, ANN201
    """Build an LLM on the shared runner; on teardown check every block is free again."""
    with llms_on_runner(smol_dir, runner, tokenizer, block_size=BLOCK_SIZE, max_num_seqs=16) as make:
        yield make


def _check(outputs, prompts, expected) -> None:  # noqa: ANN001
    for prompt, out in zip(prompts, outputs):
        assert out.prompt == prompt
        got = tuple(out.outputs[0].token_ids)
        assert got == expected[prompt], f"diverged for prompt {prompt[:40]!r} at token " + str(
            next((i for i, (a, b) in enumerate(zip(got, expected[prompt])) if a != b), len(got))
        )
        assert out.outputs[0].finish_reason == "length"


def test_prompts_cover_the_brief(tokenizer) -> None:  # noqa: ANN001
    lengths = [len(tokenizer.encode(p)) for p in PROMPTS]
    assert len(PROMPTS) >= 8 and max(lengths) > 300 and min(lengths) < 10
    assert any("\u4e00" <= ch <= "\u9fff" for p in PROMPTS for ch in p)


# The tests that need no oracle run first: the oracle's ~30 s of decoding overlaps them.

@BOTH_LOOPS
def test_seeded_sampling_alone_equals_in_batch(make_llm, async_scheduling) -> None:  # noqa: ANN001
    llm = make_llm(async_scheduling=async_scheduling, enable_prefix_caching=False)
    prompts = [f"Write a short poem about the number {i}:" for i in range(16)]
    params = [SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1000 + i, max_tokens=12) for i in range(16)]
    batch = llm.generate(prompts, params, use_tqdm=False)
    for i in (0, 7, 15):
        alone = llm.generate([prompts[i]], params[i], use_tqdm=False)
        assert alone[0].outputs[0].token_ids == batch[i].outputs[0].token_ids
        assert alone[0].outputs[0].text == batch[i].outputs[0].text
    assert len({tuple(o.outputs[0].token_ids) for o in batch}) > 8  # actually random


def test_request_that_cannot_fit_is_rejected(make_llm) -> None:  # noqa: ANN001
    llm = make_llm(enable_prefix_caching=False, num_gpu_blocks_override=60)
    with pytest.raises(ValueError, match="KV cache"):
        llm.generate([LONG_A], SamplingParams(max_tokens=200), use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([LONG_A], SamplingParams(max_tokens=10_000), use_tqdm=False)
    # The engine stays usable.
    assert llm.generate(["Hi"], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


@BOTH_LOOPS
def test_stop_strings_text_and_logprobs(make_llm, async_scheduling, tokenizer) -> None:  # noqa: ANN001
    llm = make_llm(async_scheduling=async_scheduling, enable_prefix_caching=False)
    prompt = PROMPTS[0]
    full = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, logprobs=3), use_tqdm=False)[0]
    out = full.outputs[0]
    # The streamed deltas (concatenated by LLM) equal a plain decode of the ids.
    assert out.text == tokenizer.decode(out.token_ids, skip_special_tokens=True)
    for token_id, entry in zip(out.token_ids, out.logprobs):
        assert entry[token_id].rank == 1 and len(entry) == 3  # greedy: chosen is the top-1
    assert out.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs)))
    word = out.text.split()[1]  # stop on the second word of the continuation
    cut = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, stop=[word]), use_tqdm=False)[0]
    assert cut.outputs[0].finish_reason == "stop" and cut.outputs[0].stop_reason == word
    assert cut.outputs[0].text == out.text[: out.text.index(word)]
    kept = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, stop=[word],
                                                 include_stop_str_in_output=True), use_tqdm=False)[0]
    assert kept.outputs[0].text == out.text[: out.text.index(word) + len(word)]


def test_one_at_a_time(make_llm, expected) -> None:  # noqa: ANN001
    llm = make_llm(enable_prefix_caching=False)
    for prompt in PROMPTS:
        _check(llm.generate([prompt], GREEDY, use_tqdm=False), [prompt], expected)


@BOTH_LOOPS
def test_all_together(make_llm, async_scheduling, expected) -> None:  # noqa: ANN001
    llm = make_llm(async_scheduling=async_scheduling, enable_prefix_caching=False)
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    _check(outputs, PROMPTS, expected)
    assert all(len(o.outputs[0].token_ids) == MAX_NEW for o in outputs)


@BOTH_LOOPS
def test_chunked_prefill(make_llm, async_scheduling, expected) -> None:  # noqa: ANN001
    # 48-token budget: the long prompts are prefilled over 8 steps, mixed with decodes.
    llm = make_llm(async_scheduling=async_scheduling, enable_prefix_caching=False, max_num_batched_tokens=48,
                   max_num_seqs=8)
    prompts = [PROMPTS[0], LONG_A, PROMPTS[2], LONG_B, PROMPTS[5]]
    _check(llm.generate(prompts, GREEDY, use_tqdm=False), prompts, expected)
    assert llm.llm_engine.num_steps >= MAX_NEW + 373 // 48


def test_makespan_scheduling(make_llm, expected) -> None:  # noqa: ANN001
    # Longest max_tokens first, prompt chunks spread over the decode steps (a 24-token step target,
    # 48-token budget): each sample is still transformers' greedy prefix of its own length. Async
    # scheduling, as on a GPU where this is on by default (the scheduler is the same in both loops).
    llm = make_llm(async_scheduling=True, enable_prefix_caching=False, max_num_batched_tokens=48,
                   max_num_seqs=8, makespan_step_tokens=24)
    assert llm.llm_engine.scheduler.makespan_target == 24
    prompts = [PROMPTS[0], LONG_A, PROMPTS[2], LONG_B, PROMPTS[5]]
    lengths = [16, 64, 40, 8, 64]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out, n in zip(prompts, outputs, lengths):
        assert out.prompt == prompt and tuple(out.outputs[0].token_ids) == expected[prompt][:n]


@BOTH_LOOPS
def test_prefix_cache_hits(make_llm, async_scheduling, expected) -> None:  # noqa: ANN001
    llm = make_llm(async_scheduling=async_scheduling, enable_prefix_caching=True)
    first = llm.generate([LONG_A], SamplingParams(max_tokens=1), use_tqdm=False)  # fills the cache
    assert first[0].num_cached_tokens == 0
    prompts = [LONG_B, PROMPTS[0], LONG_A]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    _check(outputs, prompts, expected)
    assert outputs[2].num_cached_tokens == 368  # all full blocks but the one holding the last token
    assert outputs[0].num_cached_tokens >= 320  # the shared context
    llm.llm_engine.block_manager.reset_prefix_cache()  # the runner's KV is shared with other engines


@BOTH_LOOPS
def test_forced_preemption(make_llm, async_scheduling, expected) -> None:  # noqa: ANN001
    # 60 blocks x 8 = 480 tokens: each prompt fits alone (<= 373 + 64), together they do not.
    llm = make_llm(async_scheduling=async_scheduling, enable_prefix_caching=False, num_gpu_blocks_override=60)
    prompts = [PROMPTS[0], LONG_A, PROMPTS[5], LONG_B]
    _check(llm.generate(prompts, GREEDY, use_tqdm=False), prompts, expected)
    assert llm.llm_engine.scheduler.num_preemptions > 0

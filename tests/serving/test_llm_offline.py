"""The offline `LLM` API on a fake runner: input forms, order, vLLM finish names, best_of, n."""

from __future__ import annotations

import pytest
from fake_runner import CONFIG, FakeRunner

from serving.engine.llm_engine import LLMEngine
from serving.llm import LLM
from serving.sampling_params import SamplingParams


def make_llm(runner: FakeRunner | None = None) -> LLM:
    return LLM.from_engine(LLMEngine(CONFIG, runner or FakeRunner()))


def test_input_forms_and_order() -> None:
    llm = make_llm()
    outs = llm.generate(prompt_token_ids=[[1, 2, 3], [4, 5]], sampling_params=SamplingParams(max_tokens=3), use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [[1, 2, 3], [4, 5]]
    assert all(o.prompt is None and o.finished for o in outs)
    assert [o.outputs[0].token_ids for o in outs] == [[100, 101, 102]] * 2
    assert outs[0].outputs[0].finish_reason == "length"
    outs = llm.generate([{"prompt_token_ids": [7, 8]}, [9]], [SamplingParams(max_tokens=1), SamplingParams(max_tokens=2)],
                        use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 2]
    with pytest.raises(ValueError, match="sampling params"):
        llm.generate([[1], [2]], [SamplingParams()], use_tqdm=False)
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate(["text needs a tokenizer"], use_tqdm=False)


def test_eos_maps_to_stop_and_logprobs() -> None:
    llm = make_llm()
    params = SamplingParams(max_tokens=5, stop_token_ids=[102], logprobs=1)
    out = llm.generate([[1, 2]], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [100, 101, 102] and out.finish_reason == "stop" and out.stop_reason == 102
    assert [list(lp) for lp in out.logprobs] == [[100], [101], [102]]
    assert out.logprobs[0][100].logprob == -0.5 and out.cumulative_logprob == pytest.approx(-1.5)


def test_n_and_best_of() -> None:
    llm = make_llm()
    out = llm.generate([[1, 2, 3, 4, 5, 6]], SamplingParams(n=3, max_tokens=2), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2] and all(c.token_ids == [100, 101] for c in out.outputs)
    out = llm.generate([[1, 2]], SamplingParams(n=1, best_of=3, max_tokens=2), use_tqdm=False)[0]
    assert len(out.outputs) == 1 and out.outputs[0].logprobs is None and out.outputs[0].index == 0
    bm = llm.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_failure_mid_generate_frees_everything() -> None:
    runner = FakeRunner(fail_on_step=2)
    llm = make_llm(runner)
    with pytest.raises(RuntimeError, match="boom"):
        llm.generate([[1, 2], [3, 4]], SamplingParams(max_tokens=5), use_tqdm=False)
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks

"""The start-up warm-up leaves no trace: same outputs, counters and free KV blocks as a fresh engine."""

from __future__ import annotations


from serving import LLM, SamplingParams
from serving.engine.warmup import warm_up

PROMPTS = [[5, 17, 33, 2, 9, 41, 7], [100, 3, 3, 3, 250, 11]]


def _generate(llm: LLM, **kw: object) -> list[list[int]]:
    params = SamplingParams(max_tokens=8, ignore_eos=True, detokenize=False, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_warm_up_runs_every_path_and_leaves_the_engine_as_fresh(tiny_models) -> None:  # noqa: ANN001
    path = str(tiny_models("llama"))
    options = dict(block_size=8, enable_prefix_caching=True, seed=3)
    expected = _generate(LLM(path, **options))

    llm = LLM(path, **options)
    engine = llm.llm_engine
    fresh = engine.stats()
    seconds = warm_up(engine)
    assert seconds > 0
    after = engine.stats()
    assert after == fresh, {k: (fresh[k], after[k]) for k in fresh if fresh[k] != after[k]}
    assert not engine.has_unfinished_requests()
    assert _generate(llm) == expected


def test_reset_prefix_cache_makes_the_next_run_compute_its_prompts(tiny_models) -> None:  # noqa: ANN001
    llm = LLM(str(tiny_models("llama")), block_size=4, enable_prefix_caching=True, seed=3)
    bm = llm.llm_engine.block_manager
    first = _generate(llm, temperature=0.0)
    hits = bm.num_prefix_hits
    assert _generate(llm, temperature=0.0) == first and bm.num_prefix_hits > hits  # the prompts hit the cache
    assert llm.reset_prefix_cache() is True
    hits = bm.num_prefix_hits
    assert _generate(llm, temperature=0.0) == first and bm.num_prefix_hits == hits  # ... and no longer do

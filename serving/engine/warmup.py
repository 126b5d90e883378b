"""Start-up warm-up: run the code paths serving will hit once, before the engine says it is ready.

It exists because a fresh process pays for lazy work on its first requests: Triton kernels that
compile on their first launch (the sampling kernel, for one, is never launched by the model's
profiling forward or the CUDA-graph capture), CUDA modules that load on first use, cuBLAS
handles and workspaces for shapes not seen yet. Measured on an H200 (`bench/cold_start.py`,
bench/RESULTS.md): without it the first reference workload in a fresh process ran at 0.46x (1B)
and 0.63x (8B) the tokens/s of the second, with 7 kernel specialisations compiled inside it.

`warm_up(engine)` pushes a few short requests through the engine's normal path (scheduler,
plan, executor, sampler): a prompt that decodes alone, then prompts that join it (a step mixing
decode rows and prompt chunks), with greedy, temperature-only (the fused Gumbel kernel),
truncated (top-k / top-p) and penalised sampling, logprobs and prompt logprobs. Their outputs
are discarded, their blocks freed and the prefix cache and counters reset, so the engine
afterwards is as if nothing ran. Ids are drawn below the vocabulary size with detokenizing off,
so any tokenizer (or none) works.
"""

from __future__ import annotations

import logging
import random
import time
from typing import Any, Protocol

from serving.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_PREFIX = "__warmup__"
_MAX_STEPS = 200  # a bound, not a target: the requests below finish in about a dozen steps


class WarmableEngine(Protocol):
    """What the warm-up uses of an engine (`LLMEngine`, which calls it: no import back)."""

    vocab_size: int
    max_model_len: int
    block_manager: Any
    scheduler: Any
    num_steps: int
    num_prompt_tokens_computed: int
    num_generated_tokens: int

    def add_request(self, request_id: str, prompt: list[int], params: SamplingParams) -> object: ...

    def step(self) -> object: ...

    def has_unfinished_requests(self) -> bool: ...


def _params(max_tokens: int, **kw: object) -> SamplingParams:
    # Seeded: a seeded row draws from its own generator, so the engine's shared random stream
    # (what `seed=` in the engine options makes reproducible) is left untouched.
    kw.setdefault("seed", 7)
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, detokenize=False, **kw)


def warm_up(engine: WarmableEngine) -> float:
    """Run the warm-up requests to completion on `engine`; returns the seconds it took."""
    t0 = time.perf_counter()
    rng = random.Random(0)
    vocab = engine.vocab_size
    limit = max(2, min(engine.max_model_len - 8, 96))

    def prompt(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(min(n, limit))]

    # Each wave joins the running ones: steps mixing decode rows with prompt chunks, and batches
    # that take each sampling path (greedy, temperature only, truncated and penalised).
    waves = [
        [_params(8, temperature=0.0)],
        [_params(4, temperature=0.8)],  # temperature only: the fused Gumbel-max kernel
        [_params(3, temperature=0.7, top_p=0.9, top_k=16, repetition_penalty=1.1, presence_penalty=0.1,
                 logprobs=2),
         _params(2, prompt_logprobs=1)],
    ]
    assert not engine.has_unfinished_requests(), "warm up a fresh engine only"
    count = 0
    for wave in waves:
        for params in wave:
            engine.add_request(f"{_PREFIX}{count}", prompt(17 + 23 * count), params)
            count += 1
        engine.step()
        engine.step()
    for _ in range(_MAX_STEPS):
        if not engine.has_unfinished_requests():
            break
        engine.step()
    else:
        raise RuntimeError(f"warm-up requests did not finish within {_MAX_STEPS} steps")
    _forget(engine)
    seconds = time.perf_counter() - t0
    logger.info("warm-up: %d requests through the engine in %.2f s (kernels compiled and loaded before ready)",
                count, seconds)
    return seconds


def _forget(engine: WarmableEngine) -> None:
    """Leave no trace of the warm-up: cached blocks and the counters users read."""
    engine.block_manager.reset_prefix_cache()
    engine.block_manager.num_prefix_queries = 0
    engine.block_manager.num_prefix_hits = 0
    engine.scheduler.num_preemptions = 0
    engine.num_steps = 0
    engine.num_prompt_tokens_computed = 0
    engine.num_generated_tokens = 0

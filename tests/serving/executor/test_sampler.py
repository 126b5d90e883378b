"""Sampler unit tests on synthetic logits: masks, penalties vs hand-computed, seeds, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from serving.executor.sampler import Sampler, _truncate, generator_seed
from serving.sampling_params import SamplingParams
from serving.engine.sequence import Sequence

CPU = torch.device("cpu")


def seq(prompt=(1, 2, 3), output=(), seq_id=0, index=0, **params) -> Sequence:
    s = Sequence(seq_id=seq_id, request_id=f"r{seq_id}", prompt_token_ids=list(prompt),
                 params=SamplingParams(**params), index=index)
    s.token_ids.extend(output)
    return s


def gens(seqs):
    return [None if s.params.seed is None else torch.Generator().manual_seed(generator_seed(s.params.seed, s.index))
            for s in seqs]


def test_greedy_is_argmax_and_ignores_seed():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    seqs = [seq(seq_id=i, temperature=0.0, seed=i if i % 2 else None) for i in range(4)]
    out = Sampler(CPU)(logits, seqs, gens(seqs))
    assert [o.token_id for o in out] == logits.argmax(-1).tolist()
    assert all(o.logprob is None and o.top_logprobs is None for o in out)


def test_top_k_top_p_min_p_masks():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 4)
    logits = probs.log()
    ps = [SamplingParams(top_k=2), SamplingParams(top_p=0.75), SamplingParams(min_p=0.4),
          SamplingParams(top_k=3, top_p=0.9)]
    kept = torch.isfinite(_truncate(logits, ps))
    assert kept.tolist() == [
        [True, True, False, False],  # top-2
        [True, True, False, False],  # smallest set with mass >= 0.75
        [True, True, False, False],  # p >= 0.4 * 0.5
        [True, True, True, False],  # top-3, then mass 0.95 >= 0.9 needs all three
    ]
    # Nothing to do: logits come back unchanged.
    assert torch.equal(_truncate(logits, [SamplingParams()] * 4), logits)


def test_sampled_tokens_stay_inside_top_k():
    logits = torch.randn(1, 100, generator=torch.Generator().manual_seed(1)).repeat(64, 1)
    seqs = [seq(seq_id=i, top_k=3, temperature=2.0) for i in range(64)]
    allowed = set(logits[0].topk(3).indices.tolist())
    out = Sampler(CPU, seed=5)(logits, seqs, gens(seqs))
    assert {o.token_id for o in out} <= allowed
    assert len({o.token_id for o in out}) > 1


def test_exponential_race_matches_the_distribution():
    probs = torch.tensor([0.6, 0.25, 0.1, 0.05])
    n = 20000
    seqs = [seq(seq_id=i) for i in range(n)]
    out = Sampler(CPU, seed=3)(probs.log().repeat(n, 1), seqs, [None] * n)
    counts = torch.bincount(torch.tensor([o.token_id for o in out]), minlength=4).float() / n
    assert torch.allclose(counts, probs, atol=0.015), counts


def test_repetition_penalty_matches_hf_semantics():
    from transformers import RepetitionPenaltyLogitsProcessor

    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 4.0, 1.0]])
    s = seq(prompt=(1, 3), output=(4, 3), repetition_penalty=2.0)
    got = Sampler(CPU)._apply_penalties(logits, [s])
    assert got.tolist() == [[2.0, -2.0, 0.5, -6.0, 2.0, 1.0]]  # seen: 1 (neg), 3 (neg), 4 (pos)
    ref = RepetitionPenaltyLogitsProcessor(2.0)(torch.tensor([[1, 3, 4, 3]]), logits.clone())
    assert torch.equal(got, ref)
    assert torch.equal(logits, torch.tensor([[2.0, -1.0, 0.5, -3.0, 4.0, 1.0]]))  # input untouched


def test_presence_and_frequency_penalties_count_output_only():
    logits = torch.zeros(2, 6)
    a = seq(prompt=(5, 5, 1), output=(5, 5, 2), frequency_penalty=0.5, presence_penalty=0.25)
    b = seq(prompt=(1,), output=(), seq_id=1)
    got = Sampler(CPU)._apply_penalties(logits, [a, b])
    assert got[0].tolist() == [0.0, 0.0, -0.75, 0.0, 0.0, -1.25]  # 2: 0.5+0.25; 5: 2*0.5+0.25
    assert got[1].tolist() == [0.0] * 6


def test_min_tokens_bans_eos_and_stop_ids():
    logits = torch.zeros(3, 6)
    logits[:, 2] = 10.0  # EOS would win
    seqs = [seq(min_tokens=2, temperature=0.0, stop_token_ids=[4]), seq(seq_id=1, output=(0, 0), min_tokens=2),
            seq(seq_id=2, min_tokens=2, ignore_eos=True)]
    got = Sampler(CPU, eos_token_ids=[2])._apply_penalties(logits, seqs)
    assert math.isinf(got[0, 2]) and math.isinf(got[0, 4])
    assert got[1, 2] == 10.0  # already has 2 output tokens
    assert got[2, 2] == 10.0  # ignore_eos: EOS is just a token


@pytest.mark.parametrize("top_p", [0.95, 1.0], ids=["truncated", "fused-gumbel"])
def test_seeded_rows_reproduce_alone_and_in_any_batch(top_p):
    vocab = 64
    base = torch.randn(vocab, generator=torch.Generator().manual_seed(7))

    def run(batch_seeds, steps=12):
        sampler = Sampler(CPU, seed=11)
        seqs = [seq(seq_id=i, index=0, seed=sd, temperature=1.0, top_p=top_p) for i, sd in enumerate(batch_seeds)]
        g = gens(seqs)
        for step in range(steps):
            logits = (base + 0.1 * step).repeat(len(seqs), 1)
            for s, o in zip(seqs, sampler(logits, seqs, g)):
                s.token_ids.append(o.token_id)
        return [s.output_token_ids for s in seqs]

    alone = run([42])[0]
    assert run([None, 42, 7, None])[1] == alone
    assert run([7, None, None, 3, 42, 1, None, None, 9, 10, 11, 12, 13, 14, 15, 16])[4] == alone
    assert run([42, 43])[1] != alone  # a different seed gives a different stream


def test_temperature_only_batch_follows_softmax_law():
    # The fused path (no truncation): 3000 draws of one 8-token distribution at T=0.5.
    base = torch.tensor([2.0, 1.5, 1.0, 0.0, -1.0, -2.0, 0.5, 1.2])
    sampler = Sampler(CPU, seed=3)
    seqs = [seq(seq_id=i, temperature=0.5) for i in range(3000)]
    got = torch.tensor([o.token_id for o in sampler(base.repeat(3000, 1), seqs, gens(seqs))])
    probs = torch.softmax(base / 0.5, dim=-1)
    counts = torch.bincount(got, minlength=8).double()
    sigma = (3000 * probs * (1 - probs)).sqrt()
    assert ((counts - 3000 * probs).abs() <= 5 * sigma + 1).all(), (counts, 3000 * probs)


def test_n_samples_get_distinct_generators():
    assert generator_seed(42, 0) == 42
    assert len({generator_seed(42, i) for i in range(8)}) == 8


def test_logprobs_of_processed_distribution():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(2))
    seqs = [seq(seq_id=0, temperature=0.0, logprobs=3), seq(seq_id=1, temperature=0.5, logprobs=2, seed=1),
            seq(seq_id=2, temperature=0.0, logprobs=0)]
    out = Sampler(CPU)(logits, seqs, gens(seqs))
    ref0 = torch.log_softmax(logits[0], -1)
    assert out[0].token_id == int(logits[0].argmax())
    assert out[0].logprob == pytest.approx(float(ref0.max()))
    top = ref0.topk(3)
    assert list(out[0].top_logprobs) == top.indices.tolist()
    assert list(out[0].top_logprobs.values()) == pytest.approx(top.values.tolist())
    ref1 = torch.log_softmax(logits[1] / 0.5, -1)  # temperature applied
    assert out[1].logprob == pytest.approx(float(ref1[out[1].token_id]))
    assert len(out[1].top_logprobs) == 2
    assert out[2].top_logprobs == {} and out[2].logprob == pytest.approx(float(torch.log_softmax(logits[2], -1).max()))


def test_mixed_greedy_and_sampled_batch():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(4))
    seqs = [seq(seq_id=0, temperature=0.0), seq(seq_id=1, temperature=0.8, seed=3),
            seq(seq_id=2, temperature=0.0, repetition_penalty=1.3), seq(seq_id=3, top_k=1)]
    out = Sampler(CPU)(logits, seqs, gens(seqs))
    assert out[0].token_id == int(logits[0].argmax())
    assert out[3].token_id == int(logits[3].argmax())  # top_k=1 is greedy
    pen = Sampler(CPU)._apply_penalties(logits[2:3], [seqs[2]])
    assert out[2].token_id == int(pen.argmax())


def test_logit_bias_is_a_per_row_additive_bias():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(3))
    seqs = [seq(seq_id=0, temperature=0.0, logit_bias={7: 100.0}),  # forces token 7
            seq(seq_id=1, temperature=0.0),  # untouched row
            seq(seq_id=2, temperature=0.0, logprobs=0,
                logit_bias={int(logits[2].argmax()): -100.0, 4: 0.5})]  # bans its argmax
    biased = Sampler(CPU)._apply_penalties(logits, seqs)
    want = logits.clone()
    want[0, 7] += 100.0
    want[2, int(logits[2].argmax())] -= 100.0
    want[2, 4] += 0.5
    assert torch.equal(biased, want)
    out = Sampler(CPU)(logits, seqs, gens(seqs))
    assert out[0].token_id == 7 and out[1].token_id == int(logits[1].argmax())
    assert out[2].token_id == int(want[2].argmax()) != int(logits[2].argmax())
    assert out[2].logprob == pytest.approx(float(torch.log_softmax(want[2], -1)[out[2].token_id]))
    # sampled rows too (the fused path): a +100 bias wins every draw
    sampled = [seq(seq_id=i, temperature=1.0, seed=i, logit_bias={11: 100.0}) for i in range(4)]
    assert {o.token_id for o in Sampler(CPU)(logits[:1].repeat(4, 1), sampled, gens(sampled))} == {11}


@pytest.mark.parametrize("params", [
    dict(temperature=0.7),  # plain rows: sample_plain, the Gumbel kernel's reference
    dict(temperature=0.0),
    dict(temperature=0.8, top_k=5, repetition_penalty=1.3, seed=3),  # the per-row path
    dict(temperature=0.0, logprobs=2, presence_penalty=0.5),
])
def test_bf16_logits_sample_as_their_float32_widening(params):
    # The decode graphs hand the sampler the LM head's bf16 output; every path must draw exactly
    # what it draws from the float32 upcast of the same values (HF upcasts before processing).
    import numpy as np

    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    seqs = [seq(prompt=(1, 2, 3 + i), output=(7, 8), seq_id=i, **params) for i in range(6)]
    got, want = [], []
    for source, dest in ((logits, got), (logits.float(), want)):
        sampler = Sampler(CPU, seed=11)
        if all(s.params.seed is None and s.params.logprobs is None and s.params.top_k in (0, -1, None)
               and s.params.repetition_penalty == 1.0 and s.params.presence_penalty == 0.0 for s in seqs):
            inv_t = np.array([0.0 if s.params.greedy else 1.0 / s.params.temperature for s in seqs], np.float32)
            out = sampler.sample_plain(source, inv_t).tokens()
        else:
            out = sampler.sample(source, seqs, gens(seqs)).tokens()
        dest.extend((o.token_id, o.logprob, o.top_logprobs) for o in out)
    assert got == want


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_greedy_tokens_on_gpu_are_torch_argmax(dtype) -> None:  # noqa: ANN001
    # Up to 16 rows the split kernel takes the argmax (bench/RESULTS.md run 45); above, torch's.
    from serving.executor.sampler import greedy_tokens

    gen = torch.Generator().manual_seed(5)
    for rows in (1, 3, 16, 17):
        logits = (torch.randn(rows, 128256, generator=gen) * 4).to(dtype)
        logits[0, [7, 90000]] = 50.0  # a tie across the row's parts: the first column wins
        if rows > 1:
            logits[1] = float("-inf")  # a fully masked row: column 0, as torch gives
        logits = logits.cuda()
        assert torch.equal(greedy_tokens(logits).cpu(), logits.argmax(dim=-1).cpu()), rows

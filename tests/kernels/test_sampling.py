"""Gumbel-max sampling (Triton kernel and torch reference): the law, greedy rows, seeds.

The kernel and the reference draw from different random streams, so they are compared by law:
over many rows with the same logits, each token's frequency must match softmax(logits / T)
(within 5 binomial standard deviations), greedy rows must be the argmax, and a row's draw must
depend only on its own seed.
"""

from __future__ import annotations

import math

import pytest
import torch

from kernels import reference
from kernels.sampling import gumbel_sample


def _frequencies_match(fn, device: str, vocab: int, rows: int, temperature: float) -> None:
    torch.manual_seed(0)
    base = torch.randn(vocab) * 2.0
    logits = base.expand(rows, vocab).contiguous().to(device)
    inv_t = torch.full((rows,), 1.0 / temperature, device=device)
    seeds = torch.arange(1, rows + 1, dtype=torch.int64, device=device) * 7919
    got = fn(logits, inv_t, seeds).cpu()
    assert got.dtype == torch.int64 and got.min() >= 0 and got.max() < vocab
    probs = torch.softmax(base / temperature, dim=-1)
    counts = torch.bincount(got, minlength=vocab).double()
    for v in probs.argsort(descending=True)[:5].tolist():
        p = probs[v].item()
        sigma = math.sqrt(rows * p * (1 - p))
        assert abs(counts[v].item() - rows * p) <= 5 * sigma + 1, (v, counts[v].item(), rows * p)


@pytest.mark.parametrize("impl", ["kernel", "reference"])
def test_law_matches_softmax(device, impl):
    fn = gumbel_sample if impl == "kernel" else reference.gumbel_sample
    _frequencies_match(fn, device, vocab=40, rows=1500, temperature=0.7)


@pytest.mark.parametrize("impl", ["kernel", "reference"])
def test_greedy_rows_and_seed_only_dependence(device, impl):
    fn = gumbel_sample if impl == "kernel" else reference.gumbel_sample
    torch.manual_seed(1)
    logits = torch.randn(6, 50).to(device)
    inv_t = torch.tensor([0.0, 1.0, 0.0, 2.0, 1.0, 1.0], device=device)
    seeds = torch.tensor([5, 11, 5, 13, 11, 99], dtype=torch.int64, device=device)
    out = fn(logits, inv_t, seeds).cpu()
    assert out[0] == logits[0].argmax().cpu() and out[2] == logits[2].argmax().cpu()
    # Row 4 alone, with row 1's logits and seed, draws what row 1 drew in the batch.
    alone = fn(logits[1:2].clone(), inv_t[1:2].clone(), seeds[1:2].clone()).cpu()
    assert alone[0] == out[1]
    same = fn(logits[1:2].expand(3, 50).contiguous(), inv_t[1:2].expand(3).contiguous(),
              seeds[1:2].expand(3).contiguous()).cpu()
    assert same.tolist() == [out[1].item()] * 3


def test_vocab_spanning_several_blocks(device):
    # One huge logit in the last partial block must win a greedy row and a cold (T -> 0) row.
    vocab = 9000
    logits = torch.zeros(2, vocab, device=device)
    logits[:, vocab - 3] = 50.0
    out = gumbel_sample(logits, torch.tensor([0.0, 100.0], device=device),
                        torch.tensor([1, 2], dtype=torch.int64, device=device))
    assert out.tolist() == [vocab - 3, vocab - 3]


def test_split_rows_draw_what_one_walk_draws_and_ties_keep_the_first_column(device):
    # A row walked by 1, 2 or 3 programs (parts) draws the same token: the noise is keyed by the
    # column, and the parts' winners merge in column order, so a tie across parts keeps the first.
    torch.manual_seed(3)
    vocab = 9000  # 3 chunks of 4096
    logits = torch.randn(4, vocab) * 3
    logits[3] = 0.0
    logits[3, [100, 5000, 8999]] = 7.0  # a greedy three-way tie across all three parts
    logits = logits.to(device)
    inv_t = torch.tensor([1.0, 0.5, 2.0, 0.0], device=device)
    seeds = torch.tensor([1, 2, 3, 4], dtype=torch.int64, device=device)
    draws = [gumbel_sample(logits, inv_t, seeds, num_parts=p).tolist() for p in (1, 2, 3, 8)]
    assert all(d == draws[0] for d in draws), draws
    assert draws[0][3] == 100


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_law_at_real_vocab_on_gpu(dtype):
    # Llama-3's vocabulary (32 blocks of 4096 per row), 4096 rows, T = 0.8.
    torch.manual_seed(0)
    vocab, rows, temperature = 128256, 4096, 0.8
    base = torch.randn(vocab) * 0.5
    base[:5] = torch.tensor([6.0, 5.5, 5.0, 4.0, 3.0])
    base = base.to(dtype).float()
    logits = base.to(dtype).cuda().expand(rows, vocab).contiguous()
    got = gumbel_sample(logits, torch.full((rows,), 1 / temperature, device="cuda"),
                        torch.arange(rows, dtype=torch.int64, device="cuda") * 104729 + 1).cpu()
    probs = torch.softmax(base / temperature, dim=-1)
    counts = torch.bincount(got, minlength=vocab).double()
    for v in range(5):
        p = probs[v].item()
        assert abs(counts[v].item() - rows * p) <= 5 * math.sqrt(rows * p * (1 - p)) + 1, (v, counts[v], rows * p)

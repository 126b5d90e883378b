"""Triton Gumbel-max sampling: one pass over each row of logits -> one token id per row.

In: `logits[num_rows, vocab]` (any float dtype, row stride free), `inv_temperature[num_rows]`
float32 (0 marks a greedy row: plain argmax), `seeds[num_rows]` int64 (the row's Philox key for
this draw). Out: `[num_rows]` int64. argmax(logits / T + Gumbel noise) is an exact sample of
softmax(logits / T), so the softmax, its normalisation and every extra pass over the
[rows x vocab] logits disappear. One program per row walks the vocabulary in BLOCK chunks and
keeps the running (max, argmax); the noise of entry v is Philox(seed, v), so a row's sample
depends only on its own seed and logits, never on the rest of the batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gumbel_sample_kernel(
    logits_ptr,
    inv_temp_ptr,
    seeds_ptr,
    out_ptr,
    stride_row,
    vocab,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    inv_t = tl.load(inv_temp_ptr + row)
    seed = tl.load(seeds_ptr + row)
    greedy = inv_t == 0.0
    best_val = tl.full([], float("-inf"), tl.float32)
    best_idx = tl.full([], 0, tl.int64)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < vocab
        x = tl.load(logits_ptr + row * stride_row + cols, mask=mask, other=float("-inf")).to(tl.float32)
        u = tl.rand(seed, cols)
        # Gumbel(0, 1) = -log(-log(u)); u = 0 gives -inf (never chosen).
        noise = -tl.log(-tl.log(u))
        key = tl.where(greedy, x, x * inv_t + noise)
        key = tl.where(mask, key, float("-inf"))
        block_max = tl.max(key, 0)
        block_arg = tl.argmax(key, 0).to(tl.int64) + start
        better = block_max > best_val
        best_idx = tl.where(better, block_arg, best_idx)
        best_val = tl.where(better, block_max, best_val)
    tl.store(out_ptr + row, best_idx)


def gumbel_sample(
    logits: torch.Tensor,  # [num_rows, vocab] float
    inv_temperature: torch.Tensor,  # [num_rows] float32; 0 = greedy row
    seeds: torch.Tensor,  # [num_rows] int64: this draw's key per row
) -> torch.Tensor:
    """Sample one token per row of softmax(logits * inv_temperature); greedy rows take the argmax."""
    assert logits.dim() == 2 and logits.stride(1) == 1, "logits must be [rows, vocab] with contiguous rows"
    num_rows, vocab = logits.shape
    assert inv_temperature.shape == (num_rows,) and inv_temperature.dtype == torch.float32
    assert seeds.shape == (num_rows,) and seeds.dtype == torch.int64
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows == 0:
        return out
    block = min(4096, triton.next_power_of_2(vocab))
    _gumbel_sample_kernel[(num_rows,)](logits, inv_temperature, seeds, out, logits.stride(0), vocab, BLOCK=block)
    return out

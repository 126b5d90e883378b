"""Triton Gumbel-max sampling: one pass over each row of logits -> one token id per row.

In: `logits[num_rows, vocab]` (any float dtype, row stride free), `inv_temperature[num_rows]`
float32 (0 marks a greedy row: plain argmax), `seeds[num_rows]` int64 (the row's Philox key for
this draw). Out: `[num_rows]` int64. argmax(logits / T + Gumbel noise) is an exact sample of
softmax(logits / T), so the softmax, its normalisation and every extra pass over the
[rows x vocab] logits disappear. One program per row walks the vocabulary in BLOCK chunks and
keeps the running (max, argmax); the noise of a chunk's four quarters comes from one Philox
call per lane (`rand4x`, keyed by the row's seed), so a row's sample depends only on its own
seed and logits, never on the rest of the batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _best_of_chunk(logits_ptr, row_off, first, lanes, vocab, u, inv_t, greedy):
    """(max key, its column) over columns first + lanes; key = logit / T + Gumbel(u), or the logit."""
    cols = first + lanes
    mask = cols < vocab
    x = tl.load(logits_ptr + row_off + cols, mask=mask, other=float("-inf")).to(tl.float32)
    # Gumbel(0, 1) = -log(-log(u)); u = 0 gives -inf (never chosen).
    key = tl.where(greedy, x, x * inv_t - tl.log(-tl.log(u)))
    key = tl.where(mask, key, float("-inf"))
    return tl.max(key, 0), tl.argmax(key, 0).to(tl.int64) + first


@triton.jit
def _keep_best(best_val, best_idx, val, idx):
    """The running (max, argmax) after one more candidate; strict > keeps the first of a tie."""
    better = val > best_val
    return tl.where(better, val, best_val), tl.where(better, idx, best_idx)


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
    row_off = row * stride_row
    QUARTER: tl.constexpr = BLOCK // 4
    lanes = tl.arange(0, QUARTER)
    best_val = tl.full([], float("-inf"), tl.float32)
    best_idx = tl.full([], 0, tl.int64)
    for start in range(0, vocab, BLOCK):
        # One Philox call yields four uniforms: one per quarter of the chunk.
        u0, u1, u2, u3 = tl.rand4x(seed, start // 4 + lanes)
        v0, i0 = _best_of_chunk(logits_ptr, row_off, start, lanes, vocab, u0, inv_t, greedy)
        v1, i1 = _best_of_chunk(logits_ptr, row_off, start + QUARTER, lanes, vocab, u1, inv_t, greedy)
        v2, i2 = _best_of_chunk(logits_ptr, row_off, start + 2 * QUARTER, lanes, vocab, u2, inv_t, greedy)
        v3, i3 = _best_of_chunk(logits_ptr, row_off, start + 3 * QUARTER, lanes, vocab, u3, inv_t, greedy)
        best_val, best_idx = _keep_best(best_val, best_idx, v0, i0)
        best_val, best_idx = _keep_best(best_val, best_idx, v1, i1)
        best_val, best_idx = _keep_best(best_val, best_idx, v2, i2)
        best_val, best_idx = _keep_best(best_val, best_idx, v3, i3)
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
    block = max(16, min(4096, triton.next_power_of_2(vocab)))
    _gumbel_sample_kernel[(num_rows,)](logits, inv_temperature, seeds, out, logits.stride(0), vocab, BLOCK=block)
    return out

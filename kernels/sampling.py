"""Triton Gumbel-max sampling: one pass over each row of logits -> one token id per row.

In: `logits[num_rows, vocab]` (any float dtype, row stride free), `inv_temperature[num_rows]`
float32 (0 marks a greedy row: plain argmax), `seeds[num_rows]` int64 (the row's Philox key for
this draw). Out: `[num_rows]` int64. argmax(logits / T + Gumbel noise) is an exact sample of
softmax(logits / T), so the softmax, its normalisation and every extra pass over the
[rows x vocab] logits disappear. Programs walk a row's vocabulary in BLOCK chunks (a row is
split over several programs when rows are few, their winners merged after) keeping the running
(max, argmax); the noise of a chunk's four quarters comes from one Philox
call per lane (`rand4x`, keyed by the row's seed), so a row's sample depends only on its own
seed and logits, never on the rest of the batch.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@triton.jit
def _keys(logits_ptr, row_off, cols, vocab, u, inv_t, greedy):
    """Sampling keys of columns `cols`: logit / T + Gumbel(u), or the logit for a greedy row."""
    mask = cols < vocab
    x = tl.load(logits_ptr + row_off + cols, mask=mask, other=float("-inf")).to(tl.float32)
    # Gumbel(0, 1) = -log(-log(u)); u = 0 gives -inf (never chosen).
    key = tl.where(greedy, x, x * inv_t - tl.log(-tl.log(u)))
    return tl.where(mask, key, float("-inf"))


@triton.jit
def _keep_best(best_val, best_idx, val, idx):
    """Each lane's running (max, argmax) after one more candidate; strict > keeps a lane's first
    column of a tie (a lane visits its columns in increasing order)."""
    better = val > best_val
    return tl.where(better, val, best_val), tl.where(better, idx, best_idx)


@triton.jit(do_not_specialize=["span", "num_parts"])
def _gumbel_sample_kernel(
    logits_ptr,
    inv_temp_ptr,
    seeds_ptr,
    part_val_ptr,  # [num_rows, num_parts] float32: each part's best key
    part_idx_ptr,  # [num_rows, num_parts] int64: and its column
    stride_row,
    vocab,
    span,  # columns per part, a multiple of BLOCK
    num_parts,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    inv_t = tl.load(inv_temp_ptr + row)
    seed = tl.load(seeds_ptr + row)
    greedy = inv_t == 0.0
    row_off = row * stride_row
    QUARTER: tl.constexpr = BLOCK // 4
    lanes = tl.arange(0, QUARTER)
    # Per lane, elementwise in the loop; one reduction over the lanes at the end (reducing each
    # chunk cost four max/argmax reductions per loop step).
    best_val = tl.full([QUARTER], float("-inf"), tl.float32)
    best_idx = tl.full([QUARTER], 0, tl.int64)
    lo = part * span
    for start in range(lo, tl.minimum(lo + span, vocab), BLOCK):
        # One Philox call yields four uniforms: one per quarter of the chunk. Chunks start at the
        # same columns however the row is split, so a row's draw does not depend on the split.
        u0, u1, u2, u3 = tl.rand4x(seed, start // 4 + lanes)
        cols = start + lanes
        best_val, best_idx = _keep_best(best_val, best_idx, _keys(logits_ptr, row_off, cols, vocab, u0, inv_t, greedy),
                                        cols.to(tl.int64))
        cols += QUARTER
        best_val, best_idx = _keep_best(best_val, best_idx, _keys(logits_ptr, row_off, cols, vocab, u1, inv_t, greedy),
                                        cols.to(tl.int64))
        cols += QUARTER
        best_val, best_idx = _keep_best(best_val, best_idx, _keys(logits_ptr, row_off, cols, vocab, u2, inv_t, greedy),
                                        cols.to(tl.int64))
        cols += QUARTER
        best_val, best_idx = _keep_best(best_val, best_idx, _keys(logits_ptr, row_off, cols, vocab, u3, inv_t, greedy),
                                        cols.to(tl.int64))
    top = tl.max(best_val, 0)
    # The first column holding the maximum (as one walk over the row keeps it); a part with no
    # finite key reports -inf, which the merge never prefers.
    col = tl.min(tl.where(best_val == top, best_idx, vocab), 0)
    tl.store(part_val_ptr + row * num_parts + part, top)
    tl.store(part_idx_ptr + row * num_parts + part, tl.minimum(col, vocab - 1))


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def gumbel_sample(
    logits: torch.Tensor,  # [num_rows, vocab] float
    inv_temperature: torch.Tensor,  # [num_rows] float32; 0 = greedy row
    seeds: torch.Tensor,  # [num_rows] int64: this draw's key per row
    num_parts: int | None = None,
) -> torch.Tensor:
    """Sample one token per row of softmax(logits * inv_temperature); greedy rows take the argmax.

    Each row's vocabulary is walked by `num_parts` programs (by default enough for ~4 programs
    per SM: one program per row left most of the GPU idle, 170 us for 256 rows of 128,256), and
    the parts' winners are merged in column order, so ties keep the first column as one walk
    would. `num_parts` depends only on shapes (CUDA-graph safe); tests pin it."""
    assert logits.dim() == 2 and logits.stride(1) == 1, "logits must be [rows, vocab] with contiguous rows"
    num_rows, vocab = logits.shape
    assert inv_temperature.shape == (num_rows,) and inv_temperature.dtype == torch.float32
    assert seeds.shape == (num_rows,) and seeds.dtype == torch.int64
    if num_rows == 0:
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    block = max(16, min(4096, triton.next_power_of_2(vocab)))
    num_chunks = triton.cdiv(vocab, block)
    if num_parts is None:
        num_sms = _num_sms(logits.device.index or 0) if logits.is_cuda else 4
        num_parts = triton.cdiv(4 * num_sms, num_rows)
    span = triton.cdiv(num_chunks, max(1, min(num_parts, num_chunks))) * block
    num_parts = triton.cdiv(vocab, span)
    part_val = torch.empty((num_rows, num_parts), dtype=torch.float32, device=logits.device)
    part_idx = torch.empty((num_rows, num_parts), dtype=torch.int64, device=logits.device)
    _gumbel_sample_kernel[(num_rows, num_parts)](logits, inv_temperature, seeds, part_val, part_idx,
                                                 logits.stride(0), vocab, span, num_parts, BLOCK=block)
    if num_parts == 1:
        return part_idx[:, 0]
    # argmax returns the first of equal maxima: the lowest part, i.e. the first column of a tie
    return part_idx.gather(1, part_val.argmax(1, keepdim=True))[:, 0]

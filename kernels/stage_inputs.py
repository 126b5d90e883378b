"""Triton: one launch writes a decode step's inputs into its CUDA graph's static buffers.

Why: between two decode-graph replays a step used to launch about a dozen tiny ops (the
placeholder ids' gather and scatter, two int32 casts, the block-table gather, five copies into
the graph's buffers, two fills for the bucket's padded rows), each a launch with idle device
around it: a step's work outside its graph was ~90 us at TP=1 (bench/RESULTS.md run 45) and ~100
at TP=2. One launch instead: batch-1 decode 16-21 us a step faster on H200s (run 70: 8B TP=1 GPTQ
2.382 -> 2.361 ms, bf16 4.129 -> 4.106; TP=2 bf16 2.549 -> 2.533, GPTQ 2.025 -> 2.008).

In: the step's device views of the one host->device copy (`serving/executor/step_inputs.py`):
`ids`, `positions`, `slots`, `seq_lens` (int64, `[n]`), `rows` (each sequence's block-table row),
`fix_rows` / `fix_src` (the rows whose id is a placeholder and the row of `prev_ids`, the previous
step's sampled ids on the device, that holds it), the device block table and the width in use.
Out, in place: `out_ids[:n]` (placeholders resolved), `out_positions[:n]`, `out_slots[:n]`,
`out_seq_lens[:n]` (int32), `out_tables[:n, :width]`; rows n..bucket-1 get slot -1 and seq_len 0
(padding: no KV write, nothing attended). Same signature and result as
`kernels.reference.stage_decode_inputs`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_W = 128  # block-table entries a loop step copies
_BLOCK_F = 256  # placeholder entries a loop step scans


@triton.jit
def _stage_decode_kernel(
    ids_ptr, pos_ptr, slots_ptr, lens_ptr, rows_ptr, fix_rows_ptr, fix_src_ptr, prev_ptr, num_fix,
    table_ptr, table_stride, width, n,
    out_ids_ptr, out_pos_ptr, out_slots_ptr, out_lens_ptr, out_tables_ptr, out_stride,
    BLOCK_W: tl.constexpr, BLOCK_F: tl.constexpr,
):
    i = tl.program_id(0)  # one program a row of the bucket
    if i >= n:  # a padded row: writes no K/V, attends to nothing
        tl.store(out_slots_ptr + i, tl.full([], -1, tl.int64))
        tl.store(out_lens_ptr + i, tl.full([], 0, tl.int32))
        return
    tok = tl.load(ids_ptr + i)
    offs_f = tl.arange(0, BLOCK_F)
    for f0 in range(0, num_fix, BLOCK_F):  # this row's placeholder entry, if it has one
        ok = f0 + offs_f < num_fix
        hit = ok & (tl.load(fix_rows_ptr + f0 + offs_f, mask=ok, other=-1) == i)
        src = tl.max(tl.where(hit, tl.load(fix_src_ptr + f0 + offs_f, mask=ok, other=-1), -1), axis=0)
        if src >= 0:
            tok = tl.load(prev_ptr + src)
    tl.store(out_ids_ptr + i, tok)
    tl.store(out_pos_ptr + i, tl.load(pos_ptr + i))
    tl.store(out_slots_ptr + i, tl.load(slots_ptr + i))
    tl.store(out_lens_ptr + i, tl.load(lens_ptr + i).to(tl.int32))
    src_row = table_ptr + tl.load(rows_ptr + i).to(tl.int64) * table_stride
    dst_row = out_tables_ptr + i.to(tl.int64) * out_stride
    offs_w = tl.arange(0, BLOCK_W)
    for w0 in range(0, width, BLOCK_W):
        ok = w0 + offs_w < width
        tl.store(dst_row + w0 + offs_w, tl.load(src_row + w0 + offs_w, mask=ok), mask=ok)


def stage_decode_inputs(
    ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, seq_lens: torch.Tensor, rows: torch.Tensor,
    fix_rows: torch.Tensor, fix_src: torch.Tensor, prev_ids: torch.Tensor | None, block_table: torch.Tensor,
    width: int, out_ids: torch.Tensor, out_positions: torch.Tensor, out_slots: torch.Tensor,
    out_seq_lens: torch.Tensor, out_tables: torch.Tensor, bucket: int,
) -> None:
    """See the module docstring; one launch of `bucket` programs."""
    n = ids.shape[0]
    num_fix = fix_rows.shape[0]
    assert 0 < n <= bucket <= out_ids.shape[0] and width <= min(block_table.shape[1], out_tables.shape[1]), (
        n, bucket, out_ids.shape, width, block_table.shape, out_tables.shape)
    assert block_table.stride(1) == 1 and out_tables.stride(1) == 1 and out_seq_lens.dtype == torch.int32
    assert num_fix == 0 or prev_ids is not None, "placeholders without the previous step's ids"
    prev = prev_ids if num_fix else ids  # never read without placeholders
    _stage_decode_kernel[(bucket,)](
        ids, positions, slots, seq_lens, rows, fix_rows if num_fix else ids, fix_src if num_fix else ids, prev,
        num_fix, block_table, block_table.stride(0), width, n,
        out_ids, out_positions, out_slots, out_seq_lens, out_tables, out_tables.stride(0),
        BLOCK_W=_BLOCK_W, BLOCK_F=_BLOCK_F, num_warps=1,
    )

"""Flatten one `StepPlan` (with the worker's sequences) into the model's inputs: `StepInputs`.

Token rows are laid out sequence after sequence (decodes first, as scheduled). Decode rows
come from the persistent `InputBatch` rows by numpy ops and C-level maps (no per-sequence
Python). All integer inputs are packed into one int64 host array and moved with a single
host->device copy, then split into views (`positions`, `input_ids`, `slot_mapping`,
`query_start_loc`, `seq_lens`, `sample_rows`); block tables are gathered on the device from
the batch's mirror, after the entries written since the last step (in the same copy) are
applied to it. A decode row whose token is still a `PLACEHOLDER` (sampled by the previous
step, not yet on the host) takes its id from that step's device tensor, on the device.
`sample_rows` are the rows whose logits are sampled: the last row of each sampled entry (the
last k+1 rows of an entry verifying k draft tokens). A decode-only step that a captured decode
graph will replay skips the separate tensors: one launch writes it into the graph's static
buffers (`DecodeGraphRunner.stage`, `kernels/stage_inputs.py`), whose views it returns.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter, getitem

import numpy as np
import torch

from serving.executor.attention_metadata import AttentionMetadata
from serving.executor.batch_state import BatchState
from serving.executor.cuda_graphs import DecodeGraphRunner
from serving.executor.plan import PLACEHOLDER, StepOutput, StepPlan


@dataclass
class StepInputs:
    """Device tensors for one forward plus the host-side bookkeeping to read its outputs."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # [num_sampled] int64: row of each sampled entry, in schedule order
    # (entry index, first row, number of rows, first position) of chunks needing prompt logprobs
    prompt_logprob_chunks: list[tuple[int, int, int, int]]
    batch_rows: np.ndarray  # [num_seqs] int64: the InputBatch row of each chunk


_ROW = attrgetter("row")
_TOKEN_IDS = attrgetter("token_ids")
_pinned: torch.Tensor | None = None  # reused page-locked staging buffer for the one H2D copy
_copied: torch.cuda.Event | None = None  # marks the last copy out of it as done


def _to_device(packed: np.ndarray, device: torch.device) -> torch.Tensor:
    """One asynchronous host->device copy through a reused pinned buffer."""
    global _pinned, _copied
    n = packed.shape[0]
    if _copied is not None:
        # NOTE: a step that samples nothing (a mid-prompt chunk) ends without a host sync, so
        # the previous copy may still be queued: wait for it before overwriting the buffer.
        _copied.synchronize()
    if _pinned is None or _pinned.shape[0] < n:
        size = max(n, 1 << 16, 2 * (0 if _pinned is None else _pinned.shape[0]))
        _pinned = torch.empty(size, dtype=torch.int64, pin_memory=True)
    buf = _pinned[:n]
    buf.numpy()[:] = packed
    dev = buf.to(device, non_blocking=True)
    _copied = torch.cuda.Event()
    _copied.record()
    return dev


def prepare_inputs(
    plan: StepPlan, batch: BatchState, block_size: int, device: torch.device, prev: StepOutput | None = None,
    graphs: DecodeGraphRunner | None = None,
) -> StepInputs:
    """Build `StepInputs` for `plan`, already applied to `batch` (one H2D copy).

    Decode rows come from the batch's row columns by numpy ops; prefill chunks (few, long)
    slice their sequence's ids. `prev` is the previous step's output, needed when this step's
    decode rows carry placeholders for the tokens it sampled. `graphs`: a decode-only step that
    one of its graphs can run is staged into the graph's buffers (`DecodeGraphRunner.stage`).
    """
    ib = batch.input_batch
    nd = plan.num_decodes
    seqs = list(map(batch.seqs.__getitem__, plan.seq_ids))  # (C-level loops: map, fromiter)
    num_seqs = len(seqs)
    rows = np.fromiter(map(_ROW, seqs), dtype=np.int64, count=num_seqs)  # [S] the batch row of each chunk
    starts = np.array(plan.starts, dtype=np.int64)
    lens = np.array(plan.num_tokens, dtype=np.int64)
    d_rows, pos = rows[:nd], starts[:nd]
    # A decode computes the id at its position: the last known one (maybe a placeholder), or a
    # one-token chunk of a prompt.
    ids = np.fromiter(map(getitem, map(_TOKEN_IDS, seqs[:nd]), plan.starts[:nd]), dtype=np.int64, count=nd)
    table = ib.block_table
    ids_parts, pos_parts = [ids], [pos]
    slot_parts = [table[d_rows, pos // block_size].astype(np.int64) * block_size + pos % block_size]
    fix_rows = np.flatnonzero(ids == PLACEHOLDER)  # rows whose id is a placeholder ...
    fix_src = fix_rows  # ... and the row of `prev.token_ids` holding it
    if fix_rows.shape[0]:
        assert prev is not None and prev.rows is not None, "placeholders without the previous step's output"
        where = np.full(table.shape[0], -1, dtype=np.int64)
        where[prev.rows] = np.arange(prev.rows.shape[0])
        fix_src = where[d_rows[fix_rows]]
        missing = [plan.seq_ids[r] for r in fix_rows[fix_src < 0]]
        assert not missing, f"seqs {missing}: placeholder without its step"
    plp = [(r, r, 1, plan.starts[r]) for r in np.flatnonzero(ib.prompt_logprobs[d_rows]).tolist()
           if seqs[r].num_output_tokens == 0]
    row0 = nd
    for e in range(nd, num_seqs):
        seq, n, start = seqs[e], plan.num_tokens[e], plan.starts[e]
        end = start + n
        num_blocks = int(ib.num_blocks[rows[e]])
        assert num_blocks * block_size >= end, f"seq {seq.seq_id}: {num_blocks} blocks for {end} tokens"
        chunk = seq.token_ids[start:end]
        assert PLACEHOLDER not in chunk, f"seq {seq.seq_id}: placeholder inside a prefill chunk"
        p = np.arange(start, end, dtype=np.int64)
        ids_parts.append(np.array(chunk, dtype=np.int64))
        pos_parts.append(p)
        slot_parts.append(table[rows[e], p // block_size].astype(np.int64) * block_size + p % block_size)
        if seq.params.prompt_logprobs is not None and seq.num_output_tokens == 0:
            plp.append((e, row0, n, start))
        row0 += n
    qsl = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(lens, out=qsl[1:])
    seq_lens = starts + lens
    sample_rows = (qsl[1:] - 1)[np.array(plan.sample, dtype=bool)]
    if plan.num_drafts:
        # A verifying chunk samples at its last known token and at each draft (its last k+1 rows).
        last = qsl[1:] - 1
        sample_rows = np.concatenate([np.arange(last[i] - plan.num_drafts.get(i, 0), last[i] + 1)
                                      for i in np.flatnonzero(np.array(plan.sample, dtype=bool)).tolist()])
    width = max(int(ib.num_blocks[rows].max()) if num_seqs else 1, 1)
    dirty = ib.take_dirty()  # [3, D] block-table entries the device has not seen
    # positions first: at offset 0 they are 16-byte aligned whatever the token count (the rotary
    # kernel would otherwise be handed an aligned copy by every layer of an odd-sized step)
    parts = (*pos_parts, *ids_parts, *slot_parts, qsl, seq_lens, sample_rows, fix_rows, fix_src, rows, dirty.ravel())
    packed = np.concatenate(parts) if len(parts) else np.zeros(0, dtype=np.int64)
    dev = _to_device(packed, device) if device.type != "cpu" else torch.from_numpy(packed)
    num_tokens = int(qsl[-1])
    # Views of the one copy, in packing order (one split, not a slice per part).
    pos_t, ids_t, slot_t, qsl_t, lens_t, rows_t, fix_rows_t, fix_src_t, batch_rows_t, dirty_t = dev.split(
        [num_tokens, num_tokens, num_tokens, num_seqs + 1, num_seqs, sample_rows.shape[0], fix_rows.shape[0],
         fix_src.shape[0], num_seqs, dirty.size])
    ib.apply_dirty(dirty_t.view(3, -1))  # before any gather of the block tables
    prev_ids = prev.token_ids if fix_rows.shape[0] else None  # type: ignore[union-attr]
    if graphs is not None and nd == num_seqs and graphs.can_run(num_seqs, width):
        # A decode-graph step: its inputs go straight into the graph's buffers, in one launch.
        ids_t, pos_t, meta = graphs.stage(ids_t, pos_t, slot_t, lens_t, batch_rows_t, fix_rows_t, fix_src_t, prev_ids,
                                          ib.device_block_table, width, int(seq_lens.max()))
        return StepInputs(ids_t, pos_t, meta, rows_t, plp, rows)
    if prev_ids is not None:
        ids_t.index_copy_(0, fix_rows_t, prev_ids.index_select(0, fix_src_t))
    meta = AttentionMetadata(
        slot_mapping=slot_t,
        query_start_loc=qsl_t.to(torch.int32),
        seq_lens=lens_t.to(torch.int32),
        block_tables=ib.tables(batch_rows_t, width),
        num_decodes=nd,
        num_decode_tokens=nd,
        max_query_len=int(lens.max()) if num_seqs else 0,
        max_seq_len=int(seq_lens.max()) if num_seqs else 0,
    )
    return StepInputs(ids_t, pos_t, meta, rows_t, plp, rows)

"""Flatten one `SchedulerOutput` into the model's inputs: `StepInputs`.

Token rows are laid out sequence after sequence (decodes first, as scheduled). All integer
inputs are packed into one int64 host tensor and moved with a single host->device copy, then
sliced into views (`input_ids`, `positions`, `slot_mapping`, `query_start_loc`, `seq_lens`,
`block_tables`). `logits_indices` are the rows whose logits are needed: the last row of each
sampled entry, plus every row of chunks that want prompt logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from serving.attention_metadata import AttentionMetadata
from serving.scheduler_output import SchedulerOutput


@dataclass
class StepInputs:
    """Device tensors for one forward plus the host-side bookkeeping to read its outputs."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    sample_rows: list[int]  # row of each sampled entry, in schedule order
    # (entry index, first row, number of rows, first position) of chunks needing prompt logprobs
    prompt_logprob_chunks: list[tuple[int, int, int, int]]


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


def prepare_inputs(sched_out: SchedulerOutput, block_size: int, device: torch.device) -> StepInputs:
    """Build `StepInputs` for `sched_out` (host work in Python lists, one H2D copy)."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    qsl = [0]
    seq_lens: list[int] = []
    tables: list[list[int]] = []
    sample_rows: list[int] = []
    plp: list[tuple[int, int, int, int]] = []
    for e, item in enumerate(sched_out.scheduled):
        seq, n = item.seq, item.num_tokens
        start = seq.num_computed_tokens
        end = start + n
        num_blocks = (end + block_size - 1) // block_size
        table = seq.block_table[:num_blocks]
        assert len(table) == num_blocks, f"seq {seq.seq_id}: {len(seq.block_table)} blocks for {end} tokens"
        row0 = len(input_ids)
        input_ids.extend(seq.token_ids[start:end])
        if n == 1:
            positions.append(start)
            slots.append(table[start // block_size] * block_size + start % block_size)
        else:
            pos = range(start, end)
            positions.extend(pos)
            slots.extend([table[p // block_size] * block_size + p % block_size for p in pos])
        qsl.append(row0 + n)
        seq_lens.append(end)
        tables.append(table)
        if item.sample:
            sample_rows.append(row0 + n - 1)
        if seq.params.prompt_logprobs is not None and seq.num_output_tokens == 0:
            plp.append((e, row0, n, start))
    num_tokens = len(input_ids)
    num_seqs = len(seq_lens)
    width = max((len(t) for t in tables), default=0) or 1
    head = input_ids + positions + slots + qsl + seq_lens
    # Block tables are the bulk (num_seqs x width ids): fill them row by row through numpy
    # rather than flattening a padded Python list each step.
    packed = np.zeros(len(head) + num_seqs * width, dtype=np.int64)
    packed[: len(head)] = head
    grid = packed[len(head) :].reshape(num_seqs, width)
    for i, t in enumerate(tables):
        grid[i, : len(t)] = t
    if device.type != "cpu":
        dev = _to_device(packed, device)
    else:
        dev = torch.from_numpy(packed)
    o = 0

    def take(k: int) -> torch.Tensor:
        nonlocal o
        t = dev[o : o + k]
        o += k
        return t

    ids_t, pos_t, slot_t = take(num_tokens), take(num_tokens), take(num_tokens)
    qsl_t = take(num_seqs + 1).to(torch.int32)
    lens_t = take(num_seqs).to(torch.int32)
    tables_t = take(num_seqs * width).to(torch.int32).view(num_seqs, width)
    num_decodes = sched_out.num_decodes
    meta = AttentionMetadata(
        slot_mapping=slot_t,
        query_start_loc=qsl_t,
        seq_lens=lens_t,
        block_tables=tables_t,
        num_decodes=num_decodes,
        num_decode_tokens=num_decodes,
        max_query_len=max((qsl[i + 1] - qsl[i] for i in range(num_seqs)), default=0),
        max_seq_len=max(seq_lens, default=0),
    )
    return StepInputs(ids_t, pos_t, meta, sample_rows, plp)

"""Flatten one `StepPlan` (with the worker's sequences) into the model's inputs: `StepInputs`.

Token rows are laid out sequence after sequence (decodes first, as scheduled). All integer
inputs are packed into one int64 host array and moved with a single host->device copy, then
sliced into views (`input_ids`, `positions`, `slot_mapping`, `query_start_loc`, `seq_lens`,
`block_tables`, `sample_rows`). A decode row whose token is still a `PLACEHOLDER` (sampled by
the previous step, not yet on the host) takes its id from that step's device tensor, on the
device. `sample_rows` are the rows whose logits are sampled: the last row of each sampled entry.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from serving.executor.attention_metadata import AttentionMetadata
from serving.executor.batch_state import WorkerSeq
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
    plan: StepPlan, all_seqs: list[WorkerSeq], block_size: int, device: torch.device, prev: StepOutput | None = None
) -> StepInputs:
    """Build `StepInputs` for `plan` (host work in Python lists, one H2D copy).

    `all_seqs[i]` is the worker's sequence of chunk i of the plan. `prev` is the previous step's
    output, needed when this step's decode rows carry placeholders for the tokens it sampled.
    """
    num_decodes = plan.num_decodes
    starts, sample = plan.starts, plan.sample
    # Decodes (one token each) are the hot path of every step: built by comprehensions, not a loop.
    seqs = all_seqs[:num_decodes]
    positions = starts[:num_decodes]
    tables = [seq.block_table for seq in seqs]
    input_ids = [seq.token_ids[pos] for seq, pos in zip(seqs, positions)]
    slots = [t[p // block_size] * block_size + p % block_size for t, p in zip(tables, positions)]
    seq_lens = [p + 1 for p in positions]
    qsl = list(range(num_decodes + 1))
    # (a 1-token chunk in the middle of a prompt is a "decode" row that samples nothing)
    sample_rows = [row for row in range(num_decodes) if sample[row]]
    fix_rows: list[int] = []  # rows whose id is a placeholder ...
    fix_src: list[int] = []  # ... and the row of `prev.token_ids` holding it
    if PLACEHOLDER in input_ids:
        fix_rows = [row for row, token in enumerate(input_ids) if token == PLACEHOLDER]
        assert prev is not None, "placeholders in a step's inputs without the previous step's output"
        missing = [seqs[r].seq_id for r in fix_rows if seqs[r].seq_id not in prev.row_of]
        assert not missing, f"seqs {missing}: placeholder without its step"
        fix_src = [prev.row_of[seqs[r].seq_id] for r in fix_rows]
    plp = [(row, row, 1, pos) for row, (seq, pos) in enumerate(zip(seqs, positions))
           if seq.params.prompt_logprobs is not None and seq.num_output_tokens == 0]
    max_query_len = 1 if num_decodes else 0
    for e in range(num_decodes, len(all_seqs)):
        seq, n, start = all_seqs[e], plan.num_tokens[e], starts[e]
        end = start + n
        table = seq.block_table
        assert len(table) * block_size >= end, f"seq {seq.seq_id}: {len(table)} blocks for {end} tokens"
        row0 = len(input_ids)
        chunk = seq.token_ids[start:end]
        assert PLACEHOLDER not in chunk, f"seq {seq.seq_id}: placeholder inside a prefill chunk"
        input_ids.extend(chunk)
        pos = range(start, end)
        positions.extend(pos)
        slots.extend([table[p // block_size] * block_size + p % block_size for p in pos])
        qsl.append(row0 + n)
        seq_lens.append(end)
        tables.append(table)
        max_query_len = max(max_query_len, n)
        if sample[e]:
            sample_rows.append(row0 + n - 1)
        if seq.params.prompt_logprobs is not None and seq.num_output_tokens == 0:
            plp.append((e, row0, n, start))
    num_tokens = len(input_ids)
    num_seqs = len(seq_lens)
    # Whole block tables (a running sequence holds exactly the blocks its tokens need).
    lens = np.fromiter(map(len, tables), dtype=np.int64, count=num_seqs)
    width = int(lens.max()) if num_seqs else 1
    head = input_ids + positions + slots + qsl + seq_lens + sample_rows + fix_rows + fix_src
    packed = np.zeros(len(head) + num_seqs * width, dtype=np.int64)
    packed[: len(head)] = head
    if num_seqs:
        # Block tables are the bulk (num_seqs x width ids): one flat fill, no per-row Python.
        flat = np.fromiter(chain.from_iterable(tables), dtype=np.int64, count=int(lens.sum()))
        row_starts = np.cumsum(lens) - lens
        cols = np.arange(flat.shape[0]) - np.repeat(row_starts, lens)
        packed[len(head) + np.repeat(np.arange(num_seqs) * width, lens) + cols] = flat
    dev = _to_device(packed, device) if device.type != "cpu" else torch.from_numpy(packed)
    o = 0

    def take(k: int) -> torch.Tensor:
        nonlocal o
        t = dev[o : o + k]
        o += k
        return t

    ids_t, pos_t, slot_t = take(num_tokens), take(num_tokens), take(num_tokens)
    qsl_t = take(num_seqs + 1).to(torch.int32)
    lens_t = take(num_seqs).to(torch.int32)
    rows_t = take(len(sample_rows))
    if fix_rows:
        fix_rows_t, fix_src_t = take(len(fix_rows)), take(len(fix_src))
        ids_t.index_copy_(0, fix_rows_t, prev.token_ids.index_select(0, fix_src_t))  # type: ignore[union-attr]
    o = len(head)
    tables_t = take(num_seqs * width).to(torch.int32).view(num_seqs, width)
    meta = AttentionMetadata(
        slot_mapping=slot_t,
        query_start_loc=qsl_t,
        seq_lens=lens_t,
        block_tables=tables_t,
        num_decodes=num_decodes,
        num_decode_tokens=num_decodes,
        max_query_len=max_query_len,
        max_seq_len=max(seq_lens, default=0),
    )
    return StepInputs(ids_t, pos_t, meta, rows_t, plp)

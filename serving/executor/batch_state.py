"""The worker's mirror of the engine's running sequences, kept in step by `StepPlan`s.

It exists so the executor never holds engine objects: each worker (one per rank, maybe in
another process) applies the same plans to its own `BatchState` and so sees the same token
ids, block tables and sampling parameters as the engine did when it planned the step. Each
sequence also holds a row of the persistent `InputBatch` (`input_batch`), whose columns the
hot path of a step reads instead of the per-sequence objects (its token ids stay here: a
decode step reads one id per row, by a C-level map over the rows' lists).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from serving.executor.input_batch import InputBatch
from serving.executor.plan import PLACEHOLDER, StepPlan
from serving.sampling_params import SamplingParams


@dataclass(slots=True, eq=False)
class WorkerSeq:
    """One sequence as a worker knows it: ids (prompt + outputs, maybe a trailing PLACEHOLDER),
    block table and sampling parameters."""

    seq_id: int
    index: int
    num_prompt_tokens: int
    token_ids: list[int]
    params: SamplingParams
    block_table: list[int]
    row: int = -1  # its row of the InputBatch

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


class BatchState:
    """seq_id -> WorkerSeq (and its InputBatch row), updated by `apply(plan)`.

    Args (sizes to start with; both grow on demand):
        max_rows: sequences held at once (max_num_seqs).
        max_blocks: blocks of one sequence (max_model_len / block_size).
        device: where the block table's mirror lives.
    """

    def __init__(self, max_rows: int = 8, max_blocks: int = 16, device: torch.device | None = None) -> None:
        self.seqs: dict[int, WorkerSeq] = {}
        self.input_batch = InputBatch(max_rows, max_blocks, device)

    def apply(self, plan: StepPlan) -> list[WorkerSeq]:
        """Forget, add, sync; returns the plan's sequences in chunk order."""
        seqs = self.seqs
        batch = self.input_batch
        for seq_id in plan.finished_seq_ids:
            self.forget(seq_id)
        for seq_id in plan.preempted_seq_ids:
            self.forget(seq_id)
        for new in plan.new_seqs:
            assert PLACEHOLDER not in new.token_ids, f"seq {new.seq_id}: a new sequence holds a placeholder"
            assert new.seq_id not in seqs, f"seq {new.seq_id}: added twice"
            seq = WorkerSeq(new.seq_id, new.index, new.num_prompt_tokens, list(new.token_ids),
                            new.params, list(new.block_ids))
            seq.row = batch.add(new.seq_id, new.params, new.block_ids)
            seqs[new.seq_id] = seq
        try:
            out = [seqs[seq_id] for seq_id in plan.seq_ids]
        except KeyError as exc:
            raise AssertionError(f"seq {exc} scheduled but unknown to the worker") from None
        for i, blocks in plan.new_blocks.items():
            seq = out[i]
            seq.block_table.extend(blocks)
            batch.append_blocks(seq.row, blocks)
        for i, (start, ids) in plan.syncs.items():
            seq = out[i]
            assert start <= len(seq.token_ids), f"seq {seq.seq_id}: sync past the known ids"
            seq.token_ids[start:] = ids
        return out

    def forget(self, seq_id: int) -> None:
        """Drop a sequence and give its row back (unknown ids are ignored)."""
        if self.seqs.pop(seq_id, None) is not None:
            self.input_batch.remove(seq_id)

    def clear(self) -> None:
        self.seqs.clear()
        self.input_batch.clear()

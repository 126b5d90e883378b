"""The worker's mirror of the engine's running sequences, kept in step by `StepPlan`s.

It exists so the executor never holds engine objects: each worker (one per rank, maybe in
another process) applies the same plans to its own `BatchState` and so sees the same token
ids, block tables and sampling parameters as the engine did when it planned the step.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    """seq_id -> WorkerSeq, updated by `apply(plan)`, which lists the plan's sequences in chunk order."""

    def __init__(self) -> None:
        self.seqs: dict[int, WorkerSeq] = {}

    def apply(self, plan: StepPlan) -> list[WorkerSeq]:
        """Forget, add, sync; returns the plan's sequences in chunk order."""
        seqs = self.seqs
        for seq_id in plan.finished_seq_ids:
            seqs.pop(seq_id, None)
        for seq_id in plan.preempted_seq_ids:
            seqs.pop(seq_id, None)
        for new in plan.new_seqs:
            assert PLACEHOLDER not in new.token_ids, f"seq {new.seq_id}: a new sequence holds a placeholder"
            seqs[new.seq_id] = WorkerSeq(new.seq_id, new.index, new.num_prompt_tokens, list(new.token_ids),
                                         new.params, list(new.block_ids))
        try:
            out = [seqs[seq_id] for seq_id in plan.seq_ids]
        except KeyError as exc:
            raise AssertionError(f"seq {exc} scheduled but unknown to the worker") from None
        for i, blocks in plan.new_blocks.items():
            out[i].block_table.extend(blocks)
        for i, (start, ids) in plan.syncs.items():
            seq = out[i]
            assert start <= len(seq.token_ids), f"seq {seq.seq_id}: sync past the known ids"
            seq.token_ids[start:] = ids
        return out

    def clear(self) -> None:
        self.seqs.clear()

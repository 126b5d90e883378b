"""SchedulerOutput (live sequences) -> StepPlan (by value, for the workers): `build_plan`.

A sequence the workers do not hold goes whole (`NewSeq`); for the others only the blocks
added and the ids resolved since they were last sent (in steady async decoding: the last
token and the placeholder of the one in flight). Each `Sequence` remembers what was sent
(`in_worker`, `num_synced`, `num_blocks_sent`); the engine clears `in_worker` when the
workers are told to forget it (finished, preempted, or after a reset).
"""

from __future__ import annotations

from serving.engine.scheduler_output import SchedulerOutput
from serving.executor.plan import PLACEHOLDER, NewSeq, ScheduledChunk, StepPlan


def build_plan(step_id: int, sched_out: SchedulerOutput, finished_ids: list[int] = (),  # type: ignore[assignment]
               preempted_ids: list[int] = ()) -> StepPlan:  # type: ignore[assignment]
    """The plan of this step; updates each scheduled sequence's record of what the workers hold."""
    new: list[NewSeq] = []
    chunks: list[ScheduledChunk] = []
    for item in sched_out.scheduled:
        seq = item.seq
        ids, table = seq.token_ids, seq.block_table
        chunk = ScheduledChunk(seq.seq_id, item.start, item.num_tokens, item.sample)
        if not seq.in_worker:
            assert PLACEHOLDER not in ids[-1:], f"seq {seq.seq_id}: admitted with a token in flight"
            seq.in_worker = True
            new.append(NewSeq(seq.seq_id, seq.index, seq.num_prompt_tokens, list(ids), seq.params, list(table)))
            seq.num_synced, seq.num_blocks_sent = len(ids), len(table)
        else:
            if len(table) > seq.num_blocks_sent:
                chunk.new_block_ids = table[seq.num_blocks_sent:]
                seq.num_blocks_sent = len(table)
            n = seq.num_synced
            if len(ids) > n:
                chunk.sync_from, chunk.token_ids = n, ids[n:]
                seq.num_synced = len(ids) - 1 if ids[-1] == PLACEHOLDER else len(ids)
        chunks.append(chunk)
    return StepPlan(step_id, chunks, sched_out.num_decodes, new, list(finished_ids), list(preempted_ids))

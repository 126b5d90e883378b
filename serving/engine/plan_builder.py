"""SchedulerOutput (live sequences) -> StepPlan (by value, for the workers): `build_plan`.

A sequence the workers do not hold goes whole (`NewSeq`); for the others only the blocks
added and the ids resolved since they were last sent (in steady async decoding: the last
token and the placeholder of the one in flight). Each `Sequence` remembers what was sent
(`in_worker`, `num_synced`, `num_blocks_sent`); the engine clears `in_worker` when the
workers are told to forget it (finished, preempted, or after a reset). With `placeholders`
(async scheduling) it also stands a PLACEHOLDER in for each token the step will sample, in
the same pass over the step.
"""

from __future__ import annotations

from serving.engine.scheduler_output import SchedulerOutput
from serving.executor.plan import PLACEHOLDER, NewSeq, StepPlan


def build_plan(step_id: int, sched_out: SchedulerOutput, finished_ids: list[int] = (),  # type: ignore[assignment]
               preempted_ids: list[int] = (), placeholders: bool = False) -> StepPlan:  # type: ignore[assignment]
    """The plan of this step; updates each scheduled sequence's record of what the workers hold.

    The plan holds copies (it may cross a process), so the placeholders added after an
    item's entry never reach the workers through this plan.
    """
    scheduled = sched_out.scheduled
    new: list[NewSeq] = []
    new_blocks: dict[int, list[int]] = {}
    syncs: dict[int, tuple[int, list[int]]] = {}
    num_drafts: dict[int, int] = {}
    for i, item in enumerate(scheduled):
        seq = item.seq
        ids, table = seq.token_ids, seq.block_table
        if not seq.in_worker:
            assert PLACEHOLDER not in ids[-1:], f"seq {seq.seq_id}: admitted with a token in flight"
            seq.in_worker = True
            new.append(NewSeq(seq.seq_id, seq.index, seq.num_prompt_tokens, list(ids), seq.params, list(table)))
            seq.num_synced, seq.num_blocks_sent = len(ids), len(table)
        else:
            if len(table) > seq.num_blocks_sent:
                new_blocks[i] = table[seq.num_blocks_sent:]
                seq.num_blocks_sent = len(table)
            n = seq.num_synced
            if len(ids) > n:
                syncs[i] = (n, ids[n:])
                seq.num_synced = len(ids) - 1 if ids[-1] == PLACEHOLDER else len(ids)
        if item.num_drafts:
            num_drafts[i] = item.num_drafts  # (no placeholder: how many tokens come back is not known)
        elif placeholders and item.sample:
            assert len(ids) == item.start + item.num_tokens, f"seq {seq.seq_id}: sampled token out of order"
            ids.append(PLACEHOLDER)
    return StepPlan(
        step_id, [item.seq.seq_id for item in scheduled], [item.start for item in scheduled],
        [item.num_tokens for item in scheduled], [item.sample for item in scheduled], sched_out.num_decodes,
        new_blocks, syncs, new, list(finished_ids), list(preempted_ids), num_drafts=num_drafts,
    )

"""The scheduler's decision for one step, on the engine's live sequences.

It exists so the engine can both hand the step to the executor (as a by-value `StepPlan`,
serving/engine/llm_engine.py `_plan`) and apply the executor's answer to the same sequences
afterwards (`Scheduler.update`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from serving.engine.sequence import Sequence


@dataclass(slots=True)
class ScheduledSequence:
    """Compute `seq.token_ids[start : start + num_tokens]`.

    `start` is `seq.num_computed_tokens` when scheduled (the scheduler advances the counter at
    once, so the next step can be planned before this one's results are back). `sample` is True
    when this chunk reaches the last known token, so a next token is drawn into position
    `start + num_tokens` (False for a non-final chunk of a chunked prefill).

    `num_drafts` > 0: speculative verification. The chunk is the last known token followed by
    that many draft tokens; the step returns the accepted drafts plus one token of the target's
    own (1 to num_drafts + 1 tokens, starting at position `start + 1`).
    """

    seq: Sequence
    num_tokens: int
    sample: bool
    start: int
    num_drafts: int = 0

    @property
    def end(self) -> int:
        """One past the last computed position; also where a sampled token goes."""
        return self.start + self.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    """What runs this step. Decodes (num_tokens == 1 with context) come first, then prefills."""

    scheduled: list[ScheduledSequence]
    num_decodes: int
    preempted: list[Sequence] = field(default_factory=list)
    num_prompt_tokens: int = 0  # of the scheduled tokens, those of chunks that start in the prompt
    num_verify: int = 0  # of the scheduled chunks, those verifying draft tokens

    @property
    def speculates(self) -> bool:
        return self.num_verify > 0

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

"""The scheduler -> model runner hand-off for one engine step, and the runner's answer.

It exists so the runner never reads scheduler queues: it gets exactly which tokens of which
sequences to compute, and returns sampled tokens only for sequences that reached their end.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from serving.sequence import Sequence


@dataclass(slots=True)
class ScheduledSequence:
    """Compute `seq.token_ids[start : start + num_tokens]`, start = seq.num_computed_tokens.

    `sample` is True when this chunk reaches the last known token, so a next token is drawn
    (False for a non-final chunk of a chunked prefill).
    """

    seq: Sequence
    num_tokens: int
    sample: bool


@dataclass(slots=True)
class SchedulerOutput:
    """What runs this step. Decodes (num_tokens == 1 with context) come first, then prefills."""

    scheduled: list[ScheduledSequence]
    num_decodes: int
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class SampledToken:
    """The runner's result for one sampled sequence."""

    token_id: int
    logprob: float | None = None  # chosen token's logprob (when params.logprobs is not None)
    top_logprobs: dict[int, float] | None = None  # top-k id -> logprob
    prompt_logprobs: list[float | None] | None = None  # first step only, with prompt_logprobs


@dataclass(slots=True)
class ModelRunnerOutput:
    """Sampled tokens, aligned with the `sample=True` entries of the SchedulerOutput, in order."""

    sampled: list[SampledToken]

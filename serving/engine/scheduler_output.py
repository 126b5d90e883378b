"""The scheduler -> model runner hand-off for one engine step, and the runner's answer.

It exists so the runner never reads scheduler queues: it gets exactly which tokens of which
sequences to compute, and returns sampled tokens only for sequences that reached their end.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from serving.engine.sequence import Sequence


@dataclass(slots=True)
class ScheduledSequence:
    """Compute `seq.token_ids[start : start + num_tokens]`.

    `start` is `seq.num_computed_tokens` when scheduled (the scheduler advances the counter at
    once, so the next step can be planned before this one's results are back). `sample` is True
    when this chunk reaches the last known token, so a next token is drawn into position
    `start + num_tokens` (False for a non-final chunk of a chunked prefill).
    """

    seq: Sequence
    num_tokens: int
    sample: bool
    start: int

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


class ModelRunnerOutput:
    """Sampled tokens, aligned with the `sample=True` entries of the SchedulerOutput, in order.

    It exists so the engine can launch step N+1 before step N's tokens reach the host: a runner
    on a GPU returns it with `resolve` (waits for the device->host copy, builds the tokens on
    first access of `sampled`) and `token_ids` (the sampled ids, still on the device, row i for
    `row_of[seq_id] == i`), which the next step's inputs read in place of placeholders.
    """

    __slots__ = ("_sampled", "_resolve", "token_ids", "row_of")

    def __init__(
        self,
        sampled: list[SampledToken] | None = None,
        *,
        resolve: Callable[[], list[SampledToken]] | None = None,
        token_ids: Any = None,
        row_of: dict[int, int] | None = None,
    ) -> None:
        assert (sampled is None) != (resolve is None), "give the tokens, or a way to resolve them"
        self._sampled = sampled
        self._resolve = resolve
        self.token_ids = token_ids
        self.row_of = row_of or {}

    @property
    def sampled(self) -> list[SampledToken]:
        if self._sampled is None:
            self._sampled = self._resolve()  # type: ignore[misc]
            self._resolve = None
        return self._sampled

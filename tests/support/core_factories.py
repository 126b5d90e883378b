"""Factories shared by the engine-core unit tests (no model, no torch)."""

from __future__ import annotations

from serving.sampling_params import SamplingParams
from serving.engine.scheduler_output import SchedulerOutput
from serving.executor.plan import SampledToken, StepOutput
from serving.engine.sequence import Sequence


def make_sequence(seq_id: int, token_ids: list[int], request_id: str | None = None, index: int = 0, **params) -> Sequence:
    """A sequence with `params` as SamplingParams fields (max_tokens defaults to 16)."""
    params.setdefault("max_tokens", 16)
    return Sequence(
        seq_id=seq_id,
        request_id=request_id if request_id is not None else f"r{seq_id}",
        prompt_token_ids=list(token_ids),
        params=SamplingParams(**params),
        index=index,
    )


class FakeRunner:
    """Returns `next_token(seq)` for every sampled entry (default: 1000 + seq_id)."""

    def __init__(self, next_token=None) -> None:
        self.next_token = next_token or (lambda seq: 1000 + seq.seq_id)
        self.steps: list[list[tuple[int, int, bool]]] = []  # per step: (seq_id, num_tokens, sample)

    def execute(self, sched_out: SchedulerOutput, prev: StepOutput | None = None) -> StepOutput:
        self.steps.append([(s.seq.seq_id, s.num_tokens, s.sample) for s in sched_out.scheduled])
        return StepOutput([SampledToken(self.next_token(s.seq)) for s in sched_out.scheduled if s.sample])

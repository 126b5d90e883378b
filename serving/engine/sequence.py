"""Per-sample request state: token ids, progress counters, block table, status.

A request with `n` samples becomes `n` `Sequence`s sharing `request_id` (index 0..n-1). The
scheduler works on counters (`num_computed_tokens` vs `num_tokens`), never on phases: a prefill
is just a sequence with many uncomputed tokens, a decode one with exactly one.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from serving.lora_request import LoRARequest
from serving.sampling_params import SamplingParams


from serving.executor.plan import PLACEHOLDER  # noqa: E402  (re-exported for the engine)


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    """Why a sample ended, in LMI's vocabulary (mapped to OpenAI names at the edge)."""

    LENGTH = "length"
    EOS = "eos_token"  # EOS or one of stop_token_ids
    STOP = "stop_sequence"  # a stop string matched
    ABORT = "abort"
    ERROR = "error"


@dataclass(slots=True, eq=False)
class Sequence:
    """One sample being generated. `token_ids` = prompt ids followed by output ids."""

    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    index: int = 0
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # of the prompt, served by the prefix cache (last admission)
    block_table: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    num_preemptions: int = 0
    # Output tokens it may produce: params.max_tokens, else up to the context limit, within max_model_len
    # (resolved once, by Scheduler.add_sequences).
    max_tokens: int = 1 << 62
    # What the workers hold of it (see LLMEngine._plan): whether they know it at all, how many
    # leading ids they hold resolved, how many of its blocks they were sent.
    in_worker: bool = False
    num_synced: int = 0
    num_blocks_sent: int = 0
    lora_request: LoRARequest | None = None  # the adapter it runs on (None: the base model)
    # Draft tokens (speculative decoding) at the end of `token_ids`, being verified by a step in
    # flight: not part of the sample until that step says which were accepted.
    num_drafts: int = 0

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def num_resolved_output_tokens(self) -> int:
        """Output tokens whose ids are known (placeholders of steps in flight not counted)."""
        n = len(self.token_ids)
        while n > len(self.prompt_token_ids) and self.token_ids[n - 1] == PLACEHOLDER:
            n -= 1
        return n - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def drop_placeholders(self) -> None:
        """Remove trailing tokens that were never resolved (the sample ended before them): draft
        tokens under verification and placeholders."""
        ids = self.token_ids
        if self.num_drafts:
            del ids[len(ids) - self.num_drafts:]
            self.num_drafts = 0
        while len(ids) > len(self.prompt_token_ids) and ids[-1] == PLACEHOLDER:
            ids.pop()

"""What the engine hands back: offline results (vLLM's shapes) and streamed deltas (for HTTP).

`RequestOutput` / `CompletionOutput` mirror vLLM so offline user code runs unchanged.
`StreamDelta` is the per-step message the engine loop puts on a request's queue; the HTTP
layer turns it into LMI / OpenAI wire records (`serving/server/protocol.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Logprob:
    """Logprob of one candidate token (vLLM's `Logprob`)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# For each generated position: token id -> Logprob (the chosen token plus the top-k).
SampleLogprobs = list[dict[int, Logprob]]


@dataclass(slots=True)
class CompletionOutput:
    """One of the `n` samples of a request (vLLM's `CompletionOutput`)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # 'length' | 'stop' (OpenAI/vLLM names) | None
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """Offline result of one prompt, returned by `LLM.generate` in input order."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0


@dataclass(slots=True)
class StreamDelta:
    """News about one sample of one request after an engine step (engine thread -> HTTP thread).

    It exists so the HTTP layer never touches engine state: it reads these from the request's
    queue and formats them. Concatenating `text` over a request's deltas gives exactly the
    final text (partly matched stop strings are held back, never sent and retracted).

    `finish_reason` uses LMI's vocabulary: 'length' | 'eos_token' | 'stop_sequence' |
    'abort' | 'error'; it is set on the last delta of a sample only. Read-only by convention
    (not frozen: one is built per sample per step, and frozen construction costs 2x).
    """

    request_id: str
    index: int  # which of the n samples
    token_ids: tuple[int, ...]  # tokens generated this step (usually one)
    text: str  # text delta ('' while held back)
    logprobs: tuple[float, ...] = ()  # chosen-token logprob per token in token_ids (if asked)
    top_logprobs: tuple[dict[int, float], ...] = ()  # per token: top-k id -> logprob (if asked)
    token_texts: tuple[str, ...] = ()  # per token: its own decoded text (for details.tokens)
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # generated so far, including this delta
    prompt_token_ids: tuple[int, ...] | None = None  # on a sample's first delta only
    prompt_logprobs: tuple[float | None, ...] | None = None  # with prompt_logprobs, first delta
    num_cached_tokens: int = 0
    error: str | None = None  # message when finish_reason == 'error'
    extra: dict = field(default_factory=dict)

"""Engine-side state of one request and the `StreamDelta`s it emits."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from serving.outputs import StreamDelta
from serving.sampling_params import SamplingParams
from serving.executor.plan import SampledToken
from serving.engine.sequence import Sequence, SequenceStatus
from serving.engine.tokenizer import IncrementalDetokenizer


@dataclass
class RequestState:
    """Engine-side state of one request: its samples, their detokenizers, and what was sent.

    It exists so the engine's step loop stays about scheduling: this object turns a sample's
    progress into the `StreamDelta`s the callers read (one per step, or one at the end for
    final-only requests).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    detokenizers: list[IncrementalDetokenizer | None]
    sent_first: list[bool] = field(default_factory=list)
    arrival_time: float = field(default_factory=time.monotonic)
    # Final-only requests (offline `LLM.generate`) get one delta per sample, when it ends,
    # holding all its tokens: what the per-step deltas would have carried is kept here.
    final_only: bool = False
    logprobs: list[list[float]] = field(default_factory=list)
    top_logprobs: list[list[dict[int, float]]] = field(default_factory=list)
    prompt_logprobs: list[float | None] | None = None

    def keep(self, index: int, sampled: SampledToken) -> None:
        """Final-only request: keep this token's logprobs for the sample's one delta."""
        if sampled.logprob is not None:
            self.logprobs[index].append(sampled.logprob)
        if sampled.top_logprobs is not None:
            self.top_logprobs[index].append(sampled.top_logprobs)
        if sampled.prompt_logprobs is not None:
            self.prompt_logprobs = sampled.prompt_logprobs

    def delta(self, seq: Sequence, sampled: SampledToken | None) -> StreamDelta:
        if self.final_only:
            return self._final_delta(seq)
        index = seq.index
        det = self.detokenizers[index]
        # (a verify step's tokens come one delta each: only the last of them may end the sample)
        more = sampled.more if sampled is not None else 0
        finished = seq.status is SequenceStatus.FINISHED and not more
        text = det.take_delta(finished) if det is not None else ""
        token_ids: tuple[int, ...] = ()
        logprobs: tuple[float, ...] = ()
        top: tuple[dict[int, float], ...] = ()
        token_texts: tuple[str, ...] = ()
        if sampled is not None:
            token_ids = (sampled.token_id,)
            if sampled.logprob is not None:
                logprobs = (sampled.logprob,)
            if sampled.top_logprobs is not None:
                top = (sampled.top_logprobs,)
            if det is not None:
                token_texts = tuple(det.token_texts)
        prompt_ids = prompt_logprobs = None
        if not self.sent_first[index]:
            self.sent_first[index] = True
            prompt_ids = tuple(self.prompt_token_ids)
            if sampled is not None and sampled.prompt_logprobs is not None:
                prompt_logprobs = tuple(sampled.prompt_logprobs)
        reason = seq.finish_reason.value if finished and seq.finish_reason else None
        return StreamDelta(
            request_id=self.request_id, index=index, token_ids=token_ids, text=text, logprobs=logprobs,
            top_logprobs=top, token_texts=token_texts, finish_reason=reason,
            num_prompt_tokens=seq.num_prompt_tokens, num_output_tokens=seq.num_resolved_output_tokens - more,
            prompt_token_ids=prompt_ids, prompt_logprobs=prompt_logprobs, num_cached_tokens=seq.num_cached_tokens,
            extra={"stop_reason": seq.stop_reason} if finished and seq.stop_reason is not None else {},
        )

    def _final_delta(self, seq: Sequence) -> StreamDelta:
        """The one delta of a final-only sample: everything it generated."""
        index = seq.index
        det = self.detokenizers[index]
        finished = seq.status is SequenceStatus.FINISHED
        first = not self.sent_first[index]
        self.sent_first[index] = True
        output_ids = seq.token_ids[seq.num_prompt_tokens : seq.num_prompt_tokens + seq.num_resolved_output_tokens]
        return StreamDelta(
            request_id=self.request_id, index=index, token_ids=tuple(output_ids),
            text=det.take_delta(finished) if det is not None else "",
            logprobs=tuple(self.logprobs[index]), top_logprobs=tuple(self.top_logprobs[index]),
            finish_reason=seq.finish_reason.value if finished and seq.finish_reason else None,
            num_prompt_tokens=seq.num_prompt_tokens, num_output_tokens=len(output_ids),
            prompt_token_ids=tuple(self.prompt_token_ids) if first else None,
            prompt_logprobs=tuple(self.prompt_logprobs) if first and self.prompt_logprobs is not None else None,
            num_cached_tokens=seq.num_cached_tokens,
            extra={"stop_reason": seq.stop_reason} if finished and seq.stop_reason is not None else {},
        )

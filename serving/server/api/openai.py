"""What OpenAI's (and vLLM's) APIs share, both ways: sampling fields in, and the records' common
parts out (ids, `usage`, finish reasons, logprob entries, OpenAI's error objects).

Used by the chat and completions APIs, vLLM's `/generate` and the Responses API (`serving/server/api/`).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

from serving.sampling_params import SamplingParams
from serving.server.errors import lmi_error, openai_error
from serving.server.formatters import Formatter, Result, Sample, dumps
from serving.server.protocol import common_sampling, get_bool, get_int, get_num, get_stop, show, to_sampling_params
from serving.server.structured import ToolSpec, guided_from

OPENAI_COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI / vLLM /v1/completions (and /generate) default
_OPENAI_FINISH = {"eos_token": "stop", "stop_sequence": "stop", "length": "length", "abort": "abort",
                  "error": "error"}
OPENAI_COMMON = {"model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed",
                 "presence_penalty", "frequency_penalty", "user", "logit_bias", "top_k", "min_p",
                 "repetition_penalty", "ignore_eos", "stop_token_ids", "min_tokens", "skip_special_tokens",
                 "include_stop_str_in_output", "spaces_between_special_tokens", "best_of"}


def openai_params(body: dict, max_tokens: int | None, top_logprobs: int | None,
                  lmi_route: bool, tools: ToolSpec | None = None, structured: bool = False,
                  best_of_ok: bool = False) -> SamplingParams:
    """vLLM / OpenAI sampling fields -> SamplingParams. With `best_of_ok` (completions, /generate) a
    best_of above n generates best_of samples (`n` = best_of): the caller keeps the n best (`keep_best`)."""
    kw = common_sampling(body)
    if structured:  # chat and completions: response_format, guided_*, tool_choice required / named
        kw["guided_decoding"] = guided_from(body, tools)
    kw["max_tokens"] = max_tokens
    temperature = get_num(body, "temperature", 0.0, 2.0)
    kw["temperature"] = 1.0 if temperature is None else temperature
    kw["stop"] = get_stop(body, "stop")
    if not lmi_route:
        n = get_int(body, "n", 1, 16) or 1
        best_of = get_int(body, "best_of", 1, 16)
        kw["n"] = n
        if best_of is not None:
            if best_of < n:
                raise ValueError(f"best_of must be >= n, got best_of={best_of} n={n}")
            if best_of != n:
                if not best_of_ok:
                    raise ValueError("best_of != n is not supported on this route (it is on /v1/completions "
                                     "and /generate)")
                kw["logprobs"] = 0  # the ranking reads each sampled token's logprob (`logprobs` may ask more)
            kw["n"] = kw["best_of"] = best_of
    if top_logprobs is not None:
        kw["logprobs"] = top_logprobs
    bias = _logit_bias(body)
    if bias:
        kw["logit_bias"] = bias
    user = body.get("user")  # OpenAI's end-user id: accepted, not used (no per-user policy here)
    if user is not None and not isinstance(user, str):
        raise ValueError(f"user must be a string, got {show(user)}")
    return to_sampling_params(**kw)


def _logit_bias(body: dict) -> dict | None:
    """OpenAI `logit_bias` ({"token id": bias}) with biases clamped to [-100, 100] as vLLM does; the
    ids are checked by SamplingParams (integers) and the engine (in the vocabulary)."""
    bias = body.get("logit_bias")
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be an object mapping token ids to biases, got {show(bias)}")
    out = {}
    for key, value in bias.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise ValueError(f"logit_bias values must be finite numbers, got {show(value)} for {show(key)}")
        out[key] = max(-100.0, min(100.0, float(value)))
    return out


def keep_best(body: dict, params: SamplingParams, stream: bool) -> int:
    """How many of the generated samples a best_of > n request returns (n), else 0 (all); as vLLM, a
    stream cannot rank its samples before they end, so best_of > n is refused there."""
    n = get_int(body, "n", 1, 16) or 1
    if params.n == n:
        return 0
    if stream:
        raise ValueError(f"best_of ({params.n}) > n ({n}) needs a non-streaming request: the best samples "
                         "are known only once all have ended")
    return n


def stream_usage(body: dict) -> bool:
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not isinstance(opts, dict):
        raise ValueError("stream_options must be an object")
    return get_bool(opts, "include_usage", False)


def continuous_usage(body: dict) -> bool:
    """vLLM's `stream_options.continuous_usage_stats` (with `include_usage`): usage on every chunk."""
    return stream_usage(body) and get_bool(body["stream_options"], "continuous_usage_stats", False)


def model_field(body: dict) -> str | None:
    """The `model` a client named (vLLM answers with the served name, whatever it says)."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ValueError(f"model must be a string, got {show(model)}")
    return model


class OpenAIFormat(Formatter):
    """What OpenAI's formats share: the record head, finish reasons, usage, logprob entries.

    `on_invocations`: chat records served on /invocations, in LMI's dialect there (LMI's finish
    reasons, no `model` in the head, LMI's error body).
    """

    on_invocations: ClassVar[bool] = False
    id_prefix: ClassVar[str] = "chatcmpl-"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.id = self.id_prefix + self.hex_id
        self._prefix: str | None = None  # the constant start of every streamed record (`_fast_chunk`)

    def _finish(self, reason: str | None) -> str | None:
        if reason is None or self.on_invocations:
            return reason
        return _OPENAI_FINISH.get(reason, reason)

    def _returned(self, r: Result) -> list[Sample]:
        """The samples a /v1/completions or /generate answer holds: all n in index order, or with vLLM's
        best_of > n the `keep_best` most likely, best first."""
        if self.req.keep_best:
            return r.ranked()[:self.req.keep_best]
        return [r.sample(i) for i in range(r.n)]

    def _usage(self, results: list[Result]) -> dict:
        """Prompt and completion tokens; with best_of > n the returned samples' (vLLM V0 counts those)."""
        p = sum(len(r.prompt_token_ids) for r in results)
        c = sum(len(s.token_ids) for r in results for s in self._returned(r))
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    @staticmethod
    def _sample_usage(r: Result, s: Sample) -> dict:
        """Usage so far of one choice (vLLM's continuous_usage_stats): its prompt and its tokens."""
        p, c = len(r.prompt_token_ids), len(s.token_ids)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def _head(self, obj: str) -> dict:
        head = {"id": self.id, "object": obj, "created": self.created}
        if not self.on_invocations:
            head["model"] = self.model
        return head

    def _lp_entry(self, text: str, lp: float | None, top: dict[int, float] | None) -> dict:
        entry = {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}
        tops = []
        for tid, v in sorted((top or {}).items(), key=lambda kv: -kv[1])[: self.req.top_logprobs or 0]:
            t = self.decode_token(tid)
            tops.append({"token": t, "logprob": v, "bytes": list(t.encode("utf-8"))})
        entry["top_logprobs"] = tops
        return entry

    def _usage_and_done(self, obj: str, results: list[Result]) -> bytes:
        """The end of a /v1 SSE stream: the usage chunk (`stream_options.include_usage`), `[DONE]`."""
        out = ""
        if self.req.include_usage:
            out += self._sse({**self._head(obj), "choices": [], "usage": self._usage(results)})
        return (out + "data: [DONE]\n\n").encode()

    def error_body(self, status: int, message: str) -> bytes:
        if self.on_invocations:
            return dumps(lmi_error(status, message)).encode()
        return dumps(openai_error(status, message)).encode()

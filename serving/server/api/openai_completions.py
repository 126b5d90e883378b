"""OpenAI's (legacy) completions: `POST /v1/completions`, as vLLM serves it.

In: `prompt` (a string, strings, token ids or lists of them), OpenAI / vLLM sampling fields,
`echo`, `logprobs`, `best_of`, `response_format`, `stream_options`. Out: a `text_completion`
object, or its chunks (`data: ...`, then `data: [DONE]`), with OpenAI's finish reasons.
"""

from __future__ import annotations

from flask import Blueprint, Response

from serving.outputs import StreamDelta
from serving.server.api.openai import (
    OPENAI_COMMON,
    OPENAI_COMPLETIONS_DEFAULT_MAX_TOKENS,
    OpenAIFormat,
    continuous_usage,
    keep_best,
    model_field,
    openai_params,
    stream_usage,
)
from serving.server.edge import current_edge
from serving.server.errors import stream_error
from serving.server.formatters import Result, Sample, dumps, json_scalar, json_str
from serving.server.protocol import GenerateRequest, get_bool, get_int, is_int, warn_unknown
from serving.server.structured import STRUCTURED_KEYS

blueprint = Blueprint("openai_completions", __name__)
_COMPLETIONS_KNOWN = OPENAI_COMMON | {"prompt", "echo", "logprobs", "suffix"} | STRUCTURED_KEYS


@blueprint.post("/v1/completions")
def completions() -> Response:
    return current_edge().generate("/v1/completions", parse_completions, model_field=True)


def parse_completions(body: dict) -> GenerateRequest:
    """An OpenAI `/v1/completions` body (prompt: str | [str] | [int] | [[int]])."""
    prompt = body.get("prompt")
    prompts: tuple[str, ...] = ()
    ids: tuple[tuple[int, ...], ...] = ()
    if isinstance(prompt, str):
        prompts = (prompt,)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = tuple(prompt)
    elif isinstance(prompt, list) and prompt and all(is_int(t) and t >= 0 for t in prompt):
        ids = (tuple(prompt),)
    elif (isinstance(prompt, list) and prompt and all(isinstance(p, list) and p for p in prompt)
          and all(is_int(t) and t >= 0 for p in prompt for t in p)):
        ids = tuple(tuple(p) for p in prompt)
    else:
        raise ValueError("prompt must be a string, a list of strings, or token ids")
    logprobs = get_int(body, "logprobs", 0, 20)
    stream = get_bool(body, "stream", False)
    max_tokens = get_int(body, "max_tokens", 1)
    params = openai_params(body, max_tokens or OPENAI_COMPLETIONS_DEFAULT_MAX_TOKENS, logprobs, False,
                           structured=True, best_of_ok=True)
    if logprobs is not None and get_bool(body, "echo", False):
        params = params.replace(prompt_logprobs=logprobs)  # echo: the prompt tokens' logprobs come first
    model = model_field(body)
    return GenerateRequest(
        route="completions", params=params, fmt=CompletionSse.name if stream else Completion.name,
        prompts=prompts, prompt_token_ids=ids, batch=len(prompts) + len(ids) > 1, details=True,
        echo=get_bool(body, "echo", False), top_logprobs=logprobs, include_usage=stream_usage(body),
        continuous_usage=continuous_usage(body), model=model, keep_best=keep_best(body, params, stream),
        warnings=warn_unknown(body, _COMPLETIONS_KNOWN, "completion fields"))


class CompletionFormat(OpenAIFormat):
    """What both completion formats share: the logprobs object (and the prompt's, with `echo`)."""

    id_prefix = "cmpl-"

    def _completion_logprobs(self, s: Sample, start: int, end: int, offset: int) -> dict | None:
        if self.req.top_logprobs is None:
            return None
        tops = s.top_logprobs + [{}] * (len(s.token_ids) - len(s.top_logprobs))
        out: dict = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
        for i in range(start, end):
            out["text_offset"].append(offset)
            offset += len(s.token_texts[i])
            out["token_logprobs"].append(s.logprobs[i])
            out["tokens"].append(s.token_texts[i])
            out["top_logprobs"].append({self.decode_token(t): v for t, v in tops[i].items()})
        return out

    def _echo_logprobs(self, r: Result, lp: dict | None) -> dict | None:
        """The prompt tokens' logprobs, then `lp` (the completion's), as vLLM echoes them: the first
        prompt token has none (null); each other one the model's logprob of it, its `top_logprobs`
        holding it alone (alternatives are computed for generated tokens only)."""
        if lp is None:
            return None
        lps = list(r.prompt_logprobs or ()) + [None] * len(r.prompt_token_ids)
        out: dict = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
        offset = 0
        for i, tid in enumerate(r.prompt_token_ids):
            text = self.decode_token(tid)
            out["text_offset"].append(offset)
            offset += len(text)
            out["token_logprobs"].append(lps[i] if i else None)
            out["tokens"].append(text)
            out["top_logprobs"].append({text: lps[i]} if i and lps[i] is not None else None)
        return {key: out[key] + lp[key] for key in out}


class Completion(CompletionFormat):
    """One `text_completion` object: a choice per returned sample of each prompt."""

    name = "completion"
    content_type = "application/json"

    def body(self, results: list[Result]) -> bytes:
        choices = []
        for p, r in enumerate(results):
            returned = self._returned(r)
            for i, s in enumerate(returned):
                prefix = r.prompt if self.req.echo else ""
                logprobs = self._completion_logprobs(s, 0, len(s.token_ids), len(prefix))
                choices.append({"index": p * len(returned) + i, "text": prefix + s.text,
                                "logprobs": self._echo_logprobs(r, logprobs) if prefix else logprobs,
                                "finish_reason": self._finish(s.finish_reason), "stop_reason": None})
        return dumps({**self._head("text_completion"), "choices": choices, "usage": self._usage(results)}).encode()


class CompletionSse(CompletionFormat):
    """`/v1/completions` with `stream`: a `text_completion` chunk per delta, usage and `[DONE]` last."""

    name = "completion_sse"
    content_type = "text/event-stream"
    streams = True

    def _fast_chunk(self, r: Result, s: Sample, delta: StreamDelta, prompt_index: int) -> bytes | None:
        if self.req.top_logprobs is not None:
            return None
        n_new = len(delta.token_ids)
        if self.req.echo and n_new and len(s.token_ids) == n_new:
            return None
        if self._prefix is None:
            self._prefix = dumps(self._head("text_completion"))[:-1] + ', "choices": [{"index": '
        return (f'data: {self._prefix}{json_scalar(prompt_index * r.n + delta.index)}, "text": '
                f'{json_str(delta.text)}, "logprobs": null, "finish_reason": null, "stop_reason": null}}]}}\n\n'
                ).encode()

    def _chunk(self, r: Result, s: Sample, delta: StreamDelta, prompt_index: int) -> bytes:
        n_new = len(delta.token_ids)
        end = len(s.token_ids)
        text = delta.text
        offset = len(s.text) - len(delta.text) + (len(r.prompt) if self.req.echo else 0)
        echo_now = self.req.echo and end == n_new and n_new  # the first record carries the prompt
        if echo_now:
            text = r.prompt + text
        logprobs = self._completion_logprobs(s, end - n_new, end, offset)
        rec = {**self._head("text_completion"), "choices": [
            {"index": prompt_index * r.n + delta.index, "text": text,
             "logprobs": self._echo_logprobs(r, logprobs) if echo_now else logprobs,
             "finish_reason": self._finish(delta.finish_reason), "stop_reason": None}]}
        if self.req.continuous_usage:
            rec["usage"] = self._sample_usage(r, s)
        if s.error:
            rec["error"] = stream_error(s.error)
        return self._sse(rec).encode()

    def end(self, results: list[Result]) -> bytes:
        return self._usage_and_done("text_completion", results)

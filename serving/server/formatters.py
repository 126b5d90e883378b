"""Engine deltas -> wire bytes, byte-compatible with LMI 0.28 (minus its bugs), TGI and OpenAI.

`Result` accumulates the `StreamDelta`s of one prompt (all its samples). A `Formatter` turns them
into the body of one response: `body()` for a plain answer, `start()` / `chunk()` / `end()` for a
stream (every record ends in a newline). JSON is written as LMI writes it: `json.dumps` with its
default separators and `ensure_ascii=False`, so non-ASCII text is raw UTF-8 (`"你好"`, not
`"\\u4f60\\u597d"`), on /invocations and on /v1 alike (vLLM's OpenAI server writes raw UTF-8 too);
the common mid-stream record (one per token per stream, on the HTTP thread, holding the GIL) is
filled into a string template instead, the same bytes at a fraction of the cost (`_fast_chunk`).
Finish reasons stay LMI's (`length|eos_token|stop_sequence|error`) on /invocations and become
OpenAI's (`length|stop`) on /v1.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from json.encoder import encode_basestring as _json_str

from serving.engine.scheduler import CONTEXT_OVERFLOW
from serving.outputs import StreamDelta
from serving.server.protocol import GenerateRequest
from serving.server.responses import ResponsesWriter
from serving.server.structured import parse_tool_calls
from serving.server.tool_stream import ToolCallStream

CONTENT_TYPES = {
    "json": "application/json", "tgi_json": "application/json", "tgi_generate": "application/json",
    "json_chat": "application/json",
    "chat": "application/json", "completion": "application/json", "none": "text/plain",
    "jsonlines": "application/jsonlines", "jsonlines_chat": "application/jsonlines",
    "sse": "text/event-stream", "tgi_sse": "text/event-stream", "chat_sse": "text/event-stream",
    "completion_sse": "text/event-stream", "generate": "application/json",
    "generate_stream": "application/octet-stream", "responses": "application/json",
    "responses_sse": "text/event-stream",
}
OVERFLOW_CODE = "context_length_exceeded"
_OPENAI_FINISH = {"eos_token": "stop", "stop_sequence": "stop", "length": "length", "abort": "abort",
                  "error": "error"}


def dumps(obj: object, **kw: object) -> str:
    """Every record as LMI writes it: json.dumps with ', ' / ': ' and raw UTF-8 (ensure_ascii=False);
    never NaN or Infinity, which are not JSON (see `_finite`)."""
    try:
        return json.dumps(obj, ensure_ascii=False, allow_nan=False, **kw)
    except ValueError:  # a non-finite float somewhere (rare): write it as JSON can
        return json.dumps(_finite_tree(obj), ensure_ascii=False, **kw)


LOGPROB_FLOOR = -9999.0  # what a -inf log-probability (a masked or impossible token) is written as (vLLM's)


def _finite(x: float) -> float | None:
    """A float JSON can carry: -inf -> LOGPROB_FLOOR, NaN and +inf (no meaning left) -> null."""
    if math.isfinite(x):
        return x
    return LOGPROB_FLOOR if x < 0 else None


def _finite_tree(obj: object) -> object:
    if isinstance(obj, float):
        return _finite(obj)
    if isinstance(obj, dict):
        return {k: _finite_tree(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite_tree(v) for v in obj]
    return obj


# Template records write strings with `_json_str`, the function json.dumps itself uses for them.
def _json_scalar(x: object) -> str:
    """json.dumps(x), byte for byte, for a token record's scalars (None, int, float), minus its overhead."""
    t = type(x)
    if t is float:
        return float.__repr__(x) if math.isfinite(x) else dumps(x)  # never NaN / Infinity
    if t is int:
        return int.__repr__(x)
    if x is None:
        return "null"
    return dumps(x)


# "max_tokens must be ...", "messages[0].content: only text ...": the field a message starts with.
_PARAM = re.compile(r"^([a-z_]+(?:\[\d+\])*(?:\.[a-z_]+(?:\[\d+\])*)*)(?::| must | is | holds )")


def openai_error(status: int, message: str) -> dict:
    """OpenAI's error object (`{"error": {"message", "type", "param", "code"}}`), as vLLM answers:
    `type` is `invalid_request_error` for 4xx and `server_error` for 5xx, `param` the request field
    the message names (else null), `code` the HTTP status, or OpenAI's `context_length_exceeded`
    for a request longer than the context (LangChain's ContextOverflowError and LiteLLM's
    ContextWindowExceededError are picked by that code and the message's wording)."""
    match = _PARAM.match(message)
    param = match.group(1) if match else None
    kind = "invalid_request_error" if status < 500 else "server_error"
    if status == 400 and message.startswith(CONTEXT_OVERFLOW):  # OpenAI's code for it: clients map it
        # openai>=3 puts only the message in str(error), which is what LangChain searches for the code
        return {"error": {"message": f"{message} ({OVERFLOW_CODE})", "type": kind, "param": "messages",
                          "code": OVERFLOW_CODE}}
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def _error_object(message: str) -> dict:
    """OpenAI's error object for a stream that fails after it started (its status is long sent)."""
    return {"message": message, "type": "server_error", "param": None, "code": 500}


@dataclass
class Sample:
    """What one sample (of n) produced so far."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    token_texts: list[str] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None


@dataclass
class Result:
    """All deltas of one prompt, accumulated (the HTTP thread's only view of a request)."""

    prompt: str
    prompt_token_ids: list[int]
    n: int = 1
    samples: dict[int, Sample] = field(default_factory=dict)
    prompt_logprobs: tuple[float | None, ...] | None = None
    decode_token: Callable[[int], str] | None = None

    def add(self, delta: StreamDelta) -> Sample:
        # Once per token per stream on the HTTP thread: no throwaway Sample, no list copies.
        s = self.samples.get(delta.index)
        if s is None:
            s = self.samples[delta.index] = Sample(delta.index)
        ids = delta.token_ids
        n = len(ids)
        if n:
            s.token_ids += ids
            if len(delta.token_texts) == n:
                s.token_texts += delta.token_texts
            elif n == 1:
                s.token_texts.append(delta.text)
            else:
                s.token_texts += [self.decode_token(t) if self.decode_token else "" for t in ids]
            lps = delta.logprobs
            if len(lps) >= n:
                s.logprobs += lps[:n] if len(lps) > n else lps
            else:
                s.logprobs += list(lps) + [None] * (n - len(lps))
        if delta.top_logprobs:
            s.top_logprobs += delta.top_logprobs
        s.text += delta.text
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.finish_reason is not None:
            s.finish_reason = delta.finish_reason
            s.error = delta.error
        return s

    def fail(self, message: str) -> None:
        """Mark every unfinished sample as failed (engine died, timeout, ...)."""
        for i in range(self.n):
            s = self.samples.setdefault(i, Sample(i))
            if s.finish_reason is None:
                s.finish_reason, s.error = "error", message

    @property
    def finished(self) -> bool:
        if len(self.samples) < self.n:
            return False
        for s in self.samples.values():
            if not s.finish_reason:
                return False
        return True

    @property
    def num_output_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.samples.values())

    def sample(self, i: int = 0) -> Sample:
        s = self.samples.get(i)
        if s is None:
            s = self.samples[i] = Sample(i)
        return s


class Formatter:
    """Renders one response in one wire format (`GenerateRequest.fmt`)."""

    def __init__(self, req: GenerateRequest, *, model: str = "", request_id: str | None = None,
                 created: int = 0, special_ids: frozenset[int] = frozenset(),
                 decode_token: Callable[[int], str] | None = None) -> None:
        self.req = req
        self.fmt = req.fmt
        self.model = model  # the served name (vLLM answers with it, whatever the client sent)
        hex_id = request_id or uuid.uuid4().hex
        self.id = ("cmpl-" if req.route == "completions" else "chatcmpl-") + hex_id
        # /v1/responses: its object and events (serving/server/responses.py)
        self._responses = ResponsesWriter(req, model, hex_id, created) if req.route == "responses" else None
        self.created = created
        self.special_ids = special_ids
        self.decode_token = decode_token or (lambda t: "")
        self.content_type = CONTENT_TYPES[self.fmt]
        self._role_sent: set[int] = set()
        self._tool_streams: dict[int, ToolCallStream] = {}  # per choice, with tools: the calls read so far
        self._prefix: str | None = None  # the constant start of every OpenAI chunk (see _fast_chunk)
        tgi = self.fmt.startswith("tgi")  # the constant parts of an LMI / TGI token record
        self._lp_json = '"logprob": ' if tgi else '"log_prob": '
        self._special_json = ', "special": true' if tgi else ', "special_token": true'
        self._open, self._close = ("", "\n") if self.fmt in ("jsonlines", "jsonlines_chat") else ("data: ", "\n\n")

    # ---- LMI / TGI token records --------------------------------------------------------------
    def _token(self, tid: int, text: str, lp: float | None) -> dict:
        tgi = self.fmt.startswith("tgi")
        rec = {"id": tid, "text": text, ("logprob" if tgi else "log_prob"): lp}
        if tid in self.special_ids:
            rec["special" if tgi else "special_token"] = True
        return rec

    def _details(self, r: Result, s: Sample, tokens: bool, inputs: bool = True) -> dict:
        """LMI's `details`: finish_reason, generated_tokens, inputs, tokens (non-streaming only), then
        prefill (decoder_input_details) and top_tokens (top_n_tokens > 0), streamed or not."""
        d: dict = {"finish_reason": s.finish_reason, "generated_tokens": len(s.token_ids)}
        if inputs:
            d["inputs"] = r.prompt
        if tokens:
            d["tokens"] = [self._token(t, x, lp) for t, x, lp in zip(s.token_ids, s.token_texts, s.logprobs)]
        if self.req.decoder_input_details:
            lps = list(r.prompt_logprobs or ()) + [None] * len(r.prompt_token_ids)
            d["prefill"] = [{"id": t, "text": self.decode_token(t), ("logprob" if self.fmt.startswith("tgi")
                             else "log_prob"): (lps[i] if i else None)}
                            for i, t in enumerate(r.prompt_token_ids)]
        if self.req.top_n_tokens > 0:
            d["top_tokens"] = self._top_tokens(s)
        return d

    def _top_tokens(self, s: Sample) -> list[list[dict]]:
        """Per generated token, as vLLM's logprobs dict orders them (LMI writes it as is): the chosen
        token first, then the `top_n_tokens` most likely ones, the chosen one not repeated."""
        k = self.req.top_n_tokens
        tops = s.top_logprobs + [{}] * (len(s.token_ids) - len(s.top_logprobs))
        out = []
        for tid, text, lp, top in zip(s.token_ids, s.token_texts, s.logprobs, tops):
            row = [self._token(tid, text, lp)]
            row += [self._token(t, self.decode_token(t), v)
                    for t, v in sorted(top.items(), key=lambda kv: -kv[1])[:k] if t != tid]
            out.append(row)
        return out

    def _generated_text(self, r: Result, s: Sample) -> str:
        return (r.prompt + s.text) if self.req.return_full_text else s.text

    @staticmethod
    def _ranked(r: Result) -> list[Sample]:
        """The samples, most likely first (highest cumulative logprob; ties keep their index order):
        the first is LMI's best sequence, the rest its best_of_sequences."""
        samples = [r.sample(i) for i in range(r.n)]
        if r.n == 1:
            return samples
        return sorted(samples, key=lambda s: -sum(lp for lp in s.logprobs if lp is not None))

    def _returned(self, r: Result) -> list[Sample]:
        """The samples a /v1/completions or /generate answer holds: all n in index order, or with vLLM's
        best_of > n the `keep_best` most likely, best first."""
        if self.req.keep_best:
            return self._ranked(r)[:self.req.keep_best]
        return [r.sample(i) for i in range(r.n)]

    def _best_of_object(self, r: Result) -> dict:
        """n / best_of > 1 (LMI `_json_output_formatter_best_of`): the best sequence, and the others
        in details.best_of_sequences, each with its own generated_text."""
        best, *others = self._ranked(r)
        details = {"inputs": r.prompt, **self._details(r, best, tokens=True, inputs=False)}
        details["best_of_sequences"] = [{**self._details(r, s, tokens=True, inputs=False),
                                         "generated_text": self._generated_text(r, s)} for s in others]
        obj: dict = {"generated_text": self._generated_text(r, best), "details": details}
        error = next((s.error for s in (best, *others) if s.error), None)
        if error:
            obj["error"] = error
        return obj

    def _lmi_object(self, r: Result) -> dict:
        if r.n > 1:
            return self._best_of_object(r)
        s = r.sample(0)
        obj: dict = {"generated_text": self._generated_text(r, s)}
        if self.req.details or s.finish_reason == "error":
            obj["details"] = self._details(r, s, tokens=self.req.details) if self.req.details else \
                {"finish_reason": "error"}
        if s.error:
            obj["error"] = s.error
        return obj

    # ---- OpenAI records ------------------------------------------------------------------------
    def _finish(self, reason: str | None) -> str | None:
        if reason is None or self.req.route == "invocations":
            return reason
        return _OPENAI_FINISH.get(reason, reason)

    def _usage(self, results: list[Result]) -> dict:
        """Prompt and completion tokens; with best_of > n the returned samples' (vLLM V0 counts those)."""
        p = sum(len(r.prompt_token_ids) for r in results)
        c = sum(len(s.token_ids) for r in results for s in self._returned(r))
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def _lp_entry(self, text: str, lp: float | None, top: dict[int, float] | None) -> dict:
        entry = {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}
        tops = []
        for tid, v in sorted((top or {}).items(), key=lambda kv: -kv[1])[: self.req.top_logprobs or 0]:
            t = self.decode_token(tid)
            tops.append({"token": t, "logprob": v, "bytes": list(t.encode("utf-8"))})
        entry["top_logprobs"] = tops
        return entry

    def _chat_logprobs(self, s: Sample, start: int, end: int) -> dict | None:
        if self.req.top_logprobs is None:
            return None
        tops = s.top_logprobs + [{}] * (len(s.token_ids) - len(s.top_logprobs))
        return {"content": [self._lp_entry(s.token_texts[i], s.logprobs[i], tops[i]) for i in range(start, end)]}

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

    def _sample_usage(self, r: Result, s: Sample) -> dict:
        """Usage so far of one choice (vLLM's continuous_usage_stats): its prompt and its tokens."""
        p, c = len(r.prompt_token_ids), len(s.token_ids)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def _head(self, obj: str) -> dict:
        head = {"id": self.id, "object": obj, "created": self.created}
        if self.req.route != "invocations":
            head["model"] = self.model
        return head

    # ---- plain responses -------------------------------------------------------------------------
    def body(self, results: list[Result]) -> bytes:
        """The whole non-streaming response body."""
        fmt = self.fmt
        if self._responses is not None:
            r = results[0]
            s = r.sample(0)
            return dumps(self._responses.response(ResponsesWriter.status_of(s.finish_reason, s.error), s.text,
                                                  len(r.prompt_token_ids), len(s.token_ids), self._finish(
                                                      s.finish_reason), s.error)).encode()
        if fmt in ("json", "tgi_json", "tgi_generate"):
            objs = [self._lmi_object(r) for r in results]
            if fmt == "tgi_json" or self.req.batch:  # TGI's `/generate` answers one object, its `/` a list
                return dumps(objs).encode()
            return dumps(objs[0]).encode()
        if fmt == "none":
            return "".join(self._generated_text(r, self._ranked(r)[0]) for r in results).encode()
        if fmt == "generate":  # vLLM's api_server answers through Starlette's JSONResponse (compact, UTF-8)
            return dumps(self._generate_object(results[0]), separators=(",", ":")).encode()
        if fmt in ("json_chat", "chat"):
            r = results[0]
            choices = []
            for i in range(r.n):
                s = r.sample(i)
                message, finish = self._chat_message(s)
                choices.append({"index": i, "message": message,
                                "logprobs": self._chat_logprobs(s, 0, len(s.token_ids)), "finish_reason": finish})
            return dumps({**self._head("chat.completion"), "choices": choices, "usage": self._usage(results)}).encode()
        if fmt == "completion":
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
        raise AssertionError(f"{fmt} is a streaming format")

    def _chat_message(self, s: Sample) -> tuple[dict, str | None]:
        """The assistant message and finish_reason of a chat choice; with tools, the calls parsed
        from the text (OpenAI: finish_reason "tool_calls", except for a named tool_choice)."""
        finish = self._finish(s.finish_reason)
        tools = self.req.tools
        if tools is None or s.error or finish != "stop":  # a cut-off call (length) stays text
            return {"role": "assistant", "content": s.text}, finish
        try:
            calls, content = parse_tool_calls(s.text, tools)
        except (ValueError, KeyError, TypeError):
            return {"role": "assistant", "content": s.text}, finish
        if not calls:
            return {"role": "assistant", "content": s.text}, finish
        return ({"role": "assistant", "content": content, "tool_calls": calls},
                "stop" if tools.choice == "named" else "tool_calls")

    # ---- streams ---------------------------------------------------------------------------------
    def start(self, results: list[Result]) -> bytes:
        """Bytes sent before the first delta (the role chunks of an OpenAI chat stream)."""
        if self._responses is not None:
            return self._events(self._responses.start_events(len(results[0].prompt_token_ids)))
        if self.fmt != "chat_sse":
            return b""
        out = []
        for i in range(results[0].n):
            self._role_sent.add(i)
            rec = {**self._head("chat.completion.chunk"), "choices": [
                {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None}]}
            if self.req.continuous_usage:  # before any content: none of its tokens counted yet
                p = len(results[0].prompt_token_ids)
                rec["usage"] = {"prompt_tokens": p, "completion_tokens": 0, "total_tokens": p}
            out.append(self._sse(rec))
        return "".join(out).encode()

    @staticmethod
    def _sse(obj: object) -> str:
        return f"data: {dumps(obj)}\n\n"

    @staticmethod
    def _events(events: list[dict]) -> bytes:
        """Server-sent events named by their type (the Responses API's stream)."""
        return "".join(f"event: {e['type']}\ndata: {dumps(e)}\n\n" for e in events).encode()

    def _responses_chunk(self, r: Result, s: Sample, delta: StreamDelta) -> bytes:
        events = self._responses.delta_events(delta.text)
        if delta.finish_reason is not None:
            events += self._responses.end_events(s.text, len(r.prompt_token_ids), len(s.token_ids),
                                                 self._finish(delta.finish_reason), s.error)
        return self._events(events)

    def chunk(self, r: Result, delta: StreamDelta, prompt_index: int = 0) -> bytes:
        """One record for one delta (already added to `r`)."""
        s = r.sample(delta.index)
        if self._responses is not None:
            return self._responses_chunk(r, s, delta)
        if (delta.finish_reason is None and type(delta.text) is str and not s.error and not self.req.continuous_usage
                and self.req.tools is None):
            rec = self._fast_chunk(r, s, delta, prompt_index)
            if rec is not None:
                return rec
        return self._chunk(r, s, delta, prompt_index)

    def _fast_chunk(self, r: Result, s: Sample, delta: StreamDelta, prompt_index: int) -> bytes | None:
        """The common mid-stream record (one per token per stream) as a string template: the same
        bytes `_chunk` writes through dicts and json.dumps, at a third of the cost. None: not a
        common record, `_chunk` writes it."""
        fmt = self.fmt
        if fmt in ("jsonlines", "sse", "tgi_sse"):
            if not delta.token_ids:
                return None
            tid = delta.token_ids[-1]
            special = self._special_json if tid in self.special_ids else ""
            return (f'{self._open}{{"token": {{"id": {_json_scalar(tid)}, "text": {_json_str(delta.text)}, '
                    f'{self._lp_json}{_json_scalar(s.logprobs[-1])}{special}}}}}{self._close}').encode()
        if self.req.top_logprobs is not None:
            return None
        if fmt in ("jsonlines_chat", "chat_sse"):
            if delta.index not in self._role_sent:
                return None
            if self._prefix is None:
                self._prefix = dumps(self._head("chat.completion.chunk"))[:-1] + ', "choices": [{"index": '
            return (f'{self._open}{self._prefix}{_json_scalar(delta.index)}, "delta": {{"content": '
                    f'{_json_str(delta.text)}}}, "logprobs": null, "finish_reason": null}}]}}{self._close}').encode()
        if fmt == "completion_sse":
            n_new = len(delta.token_ids)
            if self.req.echo and n_new and len(s.token_ids) == n_new:
                return None
            if self._prefix is None:
                self._prefix = dumps(self._head("text_completion"))[:-1] + ', "choices": [{"index": '
            return (f'data: {self._prefix}{_json_scalar(prompt_index * r.n + delta.index)}, "text": '
                    f'{_json_str(delta.text)}, "logprobs": null, "finish_reason": null, "stop_reason": null}}]}}\n\n'
                    ).encode()
        return None

    def _chunk(self, r: Result, s: Sample, delta: StreamDelta, prompt_index: int) -> bytes:
        n_new = len(delta.token_ids)
        end = len(s.token_ids)
        done = delta.finish_reason is not None
        fmt = self.fmt
        if fmt in ("jsonlines", "sse", "tgi_sse"):
            if n_new:
                tok = self._token(delta.token_ids[-1], delta.text, s.logprobs[-1])
            else:
                tok = {"id": -1, "text": delta.text, ("logprob" if fmt == "tgi_sse" else "log_prob"): -1,
                       ("special" if fmt == "tgi_sse" else "special_token"): True}
            rec: dict = {"token": tok}
            if done:
                rec["generated_text"] = self._generated_text(r, s)
                if self.req.details:
                    rec["details"] = self._details(r, s, tokens=False)
                elif s.finish_reason == "error":
                    rec["details"] = {"finish_reason": "error"}
                if s.error:
                    rec["error"] = s.error
            return (f"{dumps(rec)}\n" if fmt == "jsonlines" else self._sse(rec)).encode()
        if fmt in ("jsonlines_chat", "chat_sse"):
            d, finish = self._chat_delta(delta)
            if delta.index not in self._role_sent:
                self._role_sent.add(delta.index)
                d["role"] = "assistant"
            logprobs = self._chat_logprobs(s, end - n_new, end)
            if not d and not done and logprobs is None and not s.error:
                return b""  # text held back (it may be a tool call): nothing to send yet
            rec = {**self._head("chat.completion.chunk"), "choices": [
                {"index": delta.index, "delta": d, "logprobs": logprobs, "finish_reason": finish}]}
            if self.req.continuous_usage:
                rec["usage"] = self._sample_usage(r, s)
            if s.error:  # on /v1 OpenAI's error object: the openai client raises it with its message
                rec["error"] = s.error if fmt == "jsonlines_chat" else _error_object(s.error)
            return (f"{dumps(rec)}\n" if fmt == "jsonlines_chat" else self._sse(rec)).encode()
        if fmt == "completion_sse":
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
                rec["error"] = _error_object(s.error)
            return self._sse(rec).encode()
        if fmt == "generate_stream":  # vLLM's api_server: the whole texts so far, NUL-terminated
            rec = self._generate_object(r)
            if s.error:
                rec["error"] = _error_object(s.error)
            return (dumps(rec) + "\0").encode()
        raise AssertionError(f"{fmt} is not a streaming format")

    def _chat_delta(self, delta: StreamDelta) -> tuple[dict, str | None]:
        """The `delta` and finish_reason of a chat chunk: its text, or with tools the content and
        `tool_calls` pieces read so far (`tool_stream.ToolCallStream`); a sample that called a tool
        ends with finish_reason "tool_calls" (a named tool_choice: "stop", as OpenAI)."""
        finish = self._finish(delta.finish_reason)
        tools = self.req.tools
        if tools is None:
            return {"content": delta.text}, finish
        stream = self._tool_streams.get(delta.index)
        if stream is None:
            stream = self._tool_streams[delta.index] = ToolCallStream(tools)
        content, calls = stream.feed(delta.text)
        if delta.finish_reason is not None:
            rest, more = stream.finish()
            content, calls = content + rest, calls + more
            if finish == "stop" and stream.called and tools.choice != "named":
                finish = "tool_calls"
        d: dict = {}
        if content:
            d["content"] = content
        if calls:
            d["tool_calls"] = calls
        return d, finish

    def _generate_object(self, r: Result) -> dict:
        """vLLM `/generate`: `{"text": [prompt + completion, ...]}`, one per sample returned."""
        return {"text": [r.prompt + s.text for s in self._returned(r)]}

    def end(self, results: list[Result]) -> bytes:
        """Bytes after the last delta: the usage chunk and `[DONE]` on the /v1 SSE routes."""
        if self.fmt not in ("chat_sse", "completion_sse"):
            return b""
        out = ""
        if self.req.include_usage:
            out += self._sse({**self._head("chat.completion.chunk" if self.fmt == "chat_sse" else "text_completion"),
                              "choices": [], "usage": self._usage(results)})
        return (out + "data: [DONE]\n\n").encode()

    def error_body(self, status: int, message: str) -> bytes:
        """A whole failed answer as this route's API defines it: LMI's `{"error", "code"}` on
        /invocations, OpenAI's error object on /v1 and /generate (the body of an answer whose 200 was
        already sent by the opt-in plain heartbeat; the status itself says it otherwise)."""
        if self.req.route == "invocations":
            return dumps({"error": message, "code": status}).encode()
        return dumps(openai_error(status, message)).encode()

    def error_record(self, r: Result, message: str) -> bytes:
        """A final record for a stream that failed before the engine said so (finish_reason error)."""
        r.fail(message)
        delta = StreamDelta(request_id="", index=0, token_ids=(), text="", finish_reason="error", error=message)
        return self.chunk(r, delta)

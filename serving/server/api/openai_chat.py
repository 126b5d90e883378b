"""OpenAI's chat completions: `POST /v1/chat/completions`, and chat bodies on `/invocations`.

In: `messages` (text content, or text parts), OpenAI / vLLM sampling fields, `tools` and
`tool_choice`, `response_format`, `logprobs` / `top_logprobs`, `stream_options`. Out: a
`chat.completion` object or `chat.completion.chunk` events (`data: ...`, then `data: [DONE]`), with
OpenAI's finish reasons; on /invocations the same objects with LMI's finish reasons, streamed as
JSON lines. With tools, the calls are read from the text (`serving/server/structured.py`,
`tool_stream.py`).
"""

from __future__ import annotations

from typing import Any, ClassVar

from flask import Blueprint, Response

from serving.outputs import StreamDelta
from serving.server.api.openai import (
    OPENAI_COMMON,
    OpenAIFormat,
    continuous_usage,
    model_field,
    openai_params,
    stream_usage,
)
from serving.server.edge import current_edge
from serving.server.errors import stream_error
from serving.server.formatters import Result, Sample, dumps, json_scalar, json_str
from serving.server.protocol import LMI_DEFAULT_MAX_NEW_TOKENS, GenerateRequest, Route, get_bool, get_int, warn_unknown
from serving.server.structured import STRUCTURED_KEYS, TOOL_KEYS, parse_tool_calls, tools_from
from serving.server.tool_stream import ToolCallStream

blueprint = Blueprint("openai_chat", __name__)
_CHAT_KNOWN = OPENAI_COMMON | {"messages", "logprobs", "top_logprobs", "max_completion_tokens",
                               "add_generation_prompt", "parallel_tool_calls"}


@blueprint.post("/v1/chat/completions")
def chat_completions() -> Response:
    return current_edge().generate("/v1/chat/completions", parse_chat, model_field=True)


def _messages(body: dict) -> tuple[dict, ...]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {\"role\", \"content\"} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}] must be an object with a string role")
        content = m.get("content")
        if isinstance(content, list):  # OpenAI content parts: only text is supported
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ValueError(f"messages[{i}].content: only text parts are supported")
            content = "".join(p["text"] for p in content)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string or a list of text parts")
        out.append({"role": m["role"], "content": content})
    return tuple(out)


def parse_chat(body: dict, route: Route = "chat") -> GenerateRequest:
    """An OpenAI chat-completions body, on /v1/chat/completions or (route='invocations') /invocations."""
    tools = tools_from(body)
    messages = _messages(body)
    lmi_route = route == "invocations"
    stream = get_bool(body, "stream", False)
    max_tokens = get_int(body, "max_completion_tokens", 1) or get_int(body, "max_tokens", 1)
    want_logprobs = get_bool(body, "logprobs", False)
    top = get_int(body, "top_logprobs", 0, 20)
    top_logprobs = (top or 0) if want_logprobs else None
    # No max_tokens: LMI's 30 on /invocations; vLLM's "up to the context limit" (None) on /v1.
    default_max = LMI_DEFAULT_MAX_NEW_TOKENS if lmi_route else None
    params = openai_params(body, max_tokens or default_max, top_logprobs, lmi_route, tools, structured=True)
    if lmi_route:
        fmt = LmiChatJsonLines.name if stream else LmiChatJson.name
    else:
        fmt = ChatSse.name if stream else ChatCompletion.name
    model = model_field(body)
    ignored = STRUCTURED_KEYS | TOOL_KEYS | ({"adapters"} if lmi_route else set())  # LMI's adapters: read by the caller
    return GenerateRequest(
        route=route, params=params, fmt=fmt, messages=messages, details=True, top_logprobs=top_logprobs,
        include_usage=stream_usage(body), model=model, tools=tools,
        add_generation_prompt=get_bool(body, "add_generation_prompt", True),
        continuous_usage=continuous_usage(body),
        warnings=warn_unknown(body, _CHAT_KNOWN | ignored, "chat fields"))


class ChatFormat(OpenAIFormat):
    """What every chat format shares: the message (or its tool calls) and the logprobs of a choice."""

    def _chat_logprobs(self, s: Sample, start: int, end: int) -> dict | None:
        if self.req.top_logprobs is None:
            return None
        tops = s.top_logprobs + [{}] * (len(s.token_ids) - len(s.top_logprobs))
        return {"content": [self._lp_entry(s.token_texts[i], s.logprobs[i], tops[i]) for i in range(start, end)]}


class ChatCompletion(ChatFormat):
    """One `chat.completion` object."""

    name = "chat"
    content_type = "application/json"

    def body(self, results: list[Result]) -> bytes:
        r = results[0]
        choices = []
        for i in range(r.n):
            s = r.sample(i)
            message, finish = self._chat_message(s)
            choices.append({"index": i, "message": message,
                            "logprobs": self._chat_logprobs(s, 0, len(s.token_ids)), "finish_reason": finish})
        return dumps({**self._head("chat.completion"), "choices": choices, "usage": self._usage(results)}).encode()

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


class LmiChatJson(ChatCompletion):
    """A chat body's answer on /invocations (LMI's finish reasons)."""

    name = "json_chat"
    on_invocations = True


class ChatChunks(ChatFormat):
    """A stream of `chat.completion.chunk` records, framed by `_open` / `_close`: the first of each
    choice carries the role; with tools, text that may be a call is held back until it is known."""

    streams = True
    _open: ClassVar[str] = "data: "
    _close: ClassVar[str] = "\n\n"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._role_sent: set[int] = set()
        self._tool_streams: dict[int, ToolCallStream] = {}  # per choice, with tools: the calls read so far

    def _fast_chunk(self, r: Result, s: Sample, delta: StreamDelta, prompt_index: int) -> bytes | None:
        if self.req.top_logprobs is not None or delta.index not in self._role_sent:
            return None
        if self._prefix is None:
            self._prefix = dumps(self._head("chat.completion.chunk"))[:-1] + ', "choices": [{"index": '
        return (f'{self._open}{self._prefix}{json_scalar(delta.index)}, "delta": {{"content": '
                f'{json_str(delta.text)}}}, "logprobs": null, "finish_reason": null}}]}}{self._close}').encode()

    def _chunk(self, r: Result, s: Sample, delta: StreamDelta, prompt_index: int) -> bytes:
        n_new = len(delta.token_ids)
        end = len(s.token_ids)
        d, finish = self._chat_delta(delta)
        if delta.index not in self._role_sent:
            self._role_sent.add(delta.index)
            d["role"] = "assistant"
        logprobs = self._chat_logprobs(s, end - n_new, end)
        if not d and delta.finish_reason is None and logprobs is None and not s.error:
            return b""  # text held back (it may be a tool call): nothing to send yet
        rec = {**self._head("chat.completion.chunk"), "choices": [
            {"index": delta.index, "delta": d, "logprobs": logprobs, "finish_reason": finish}]}
        if self.req.continuous_usage:
            rec["usage"] = self._sample_usage(r, s)
        if s.error:  # on /v1 OpenAI's error object: the openai client raises it with its message
            rec["error"] = s.error if self.on_invocations else stream_error(s.error)
        return f"{self._open}{dumps(rec)}{self._close}".encode()

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


class ChatSse(ChatChunks):
    """`/v1/chat/completions` with `stream`: role chunks first, usage and `[DONE]` last."""

    name = "chat_sse"
    content_type = "text/event-stream"

    def start(self, results: list[Result]) -> bytes:
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

    def end(self, results: list[Result]) -> bytes:
        return self._usage_and_done("chat.completion.chunk", results)


class LmiChatJsonLines(ChatChunks):
    """A chat body streamed on /invocations: the chunks as JSON lines, LMI's finish reasons."""

    name = "jsonlines_chat"
    content_type = "application/jsonlines"
    on_invocations = True
    _open = ""
    _close = "\n"

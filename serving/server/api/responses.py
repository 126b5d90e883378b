"""OpenAI's Responses API (`POST /v1/responses`), its text subset, as vLLM serves it.

Why: newer OpenAI clients (the openai SDK's `client.responses`, agents frameworks) speak it
instead of chat completions. In: `input` (a string, or a list of messages whose content is a
string or `input_text` / `output_text` parts), `instructions` (a system message put first),
`max_output_tokens`, `temperature`, `top_p`, `stream`, `model`; it is run as the chat request it
amounts to. Out: a `response` object with one `message` output item holding one `output_text`
part, or with `stream: true` the event sequence the SDK reads (`response.created`, ...,
`response.output_text.delta` per piece, ..., `response.completed`, or `response.incomplete` when
`max_output_tokens` cut it, `response.failed` on an error). Not served (a 400 saying so): tools,
`previous_response_id` (nothing is stored), non-text inputs.
"""

from __future__ import annotations

import uuid
from dataclasses import replace
from typing import Any

from flask import Blueprint, Response

from serving.outputs import StreamDelta
from serving.server.api.openai import OpenAIFormat
from serving.server.api.openai_chat import parse_chat
from serving.server.edge import current_edge
from serving.server.formatters import Result, dumps
from serving.server.protocol import GenerateRequest

blueprint = Blueprint("responses", __name__)
_UNSUPPORTED = ("tools", "previous_response_id", "conversation", "reasoning", "prompt")
_KNOWN = {"input", "instructions", "max_output_tokens", "temperature", "top_p", "stream", "model", "store",
          "metadata", "user", "text", "truncation", "tool_choice", "parallel_tool_calls", "include", "seed",
          "stream_options", "background", "service_tier", *_UNSUPPORTED}


@blueprint.post("/v1/responses")
def responses() -> Response:
    return current_edge().generate("/v1/responses", parse_responses, model_field=True)


def _content(value: object, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") in ("input_text", "output_text", "text")
                                       and isinstance(p.get("text"), str) for p in value):
        return "".join(p["text"] for p in value)
    raise ValueError(f"{where} must be a string or a list of input_text parts (only text is supported)")


def _messages(body: dict) -> list[dict]:
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise ValueError("input must be a string or a non-empty list of messages")
    out = []
    for i, item in enumerate(items):
        if not isinstance(item, dict) or item.get("type", "message") != "message" or not isinstance(
                item.get("role"), str):
            raise ValueError(f"input[{i}] must be a message ({{\"role\", \"content\"}}); only text messages "
                             "are supported")
        role = "system" if item["role"] == "developer" else item["role"]
        out.append({"role": role, "content": _content(item.get("content"), f"input[{i}].content")})
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise ValueError("instructions must be a string")
        out.insert(0, {"role": "system", "content": instructions})
    return out


def parse_responses(body: dict) -> GenerateRequest:
    """A `/v1/responses` body -> the chat request it amounts to (fmt `responses` / `responses_sse`)."""
    for key in _UNSUPPORTED:
        if body.get(key) not in (None, [], ""):
            raise ValueError(f"{key} is not supported on /v1/responses by this server (text in, text out): use "
                             "/v1/chat/completions for tools")
    fmt = body.get("text", {}).get("format") if isinstance(body.get("text"), dict) else None
    if fmt not in (None, {"type": "text"}):
        raise ValueError("text.format: only {\"type\": \"text\"} is supported on /v1/responses; use "
                         "/v1/chat/completions for response_format")
    chat = {"messages": _messages(body), "model": body.get("model"), "stream": body.get("stream", False)}
    for ours, theirs in (("max_tokens", "max_output_tokens"), ("temperature", "temperature"), ("top_p", "top_p"),
                         ("seed", "seed")):
        if body.get(theirs) is not None:
            chat[ours] = body[theirs]
    try:
        req = parse_chat(chat)
    except ValueError as exc:  # name the Responses field, not the chat one it became
        raise ValueError(str(exc).replace("max_tokens", "max_output_tokens")) from None
    unknown = sorted(set(body) - _KNOWN)
    return replace(req, route="responses", fmt=ResponsesEvents.name if req.stream else ResponsesObject.name,
                   instructions=body.get("instructions"),
                   warnings=(f"dropped unsupported responses fields: {', '.join(unknown)}",) if unknown else ())


class ResponsesWriter:
    """Renders one Responses answer: the whole object, or its stream of events."""

    def __init__(self, req: GenerateRequest, model: str, request_id: str, created: int) -> None:
        self.req = req
        self.model = model
        self.id = f"resp_{request_id}"
        self.item_id = f"msg_{uuid.uuid4().hex}"
        self.created = created
        self.seq = 0

    def response(self, status: str, text: str | None, prompt_tokens: int, output_tokens: int,
                 finish: str | None = None, error: str | None = None) -> dict:
        """The `response` object (`text` None: no output item yet)."""
        p = self.req.params
        output = [] if text is None else [self.item(text, "completed")]
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status, "model": self.model,
            "output": output, "instructions": self.req.instructions, "max_output_tokens": p.max_tokens,
            "temperature": p.temperature, "top_p": p.top_p, "tools": [], "tool_choice": "auto",
            "parallel_tool_calls": False, "metadata": {}, "text": {"format": {"type": "text"}},
            "truncation": "disabled", "store": False,
            "error": None if error is None else {"code": "server_error", "message": error},
            "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
            "usage": None if status == "in_progress" else {
                "input_tokens": prompt_tokens, "output_tokens": output_tokens,
                "total_tokens": prompt_tokens + output_tokens, "input_tokens_details": {"cached_tokens": 0},
                "output_tokens_details": {"reasoning_tokens": 0}},
        }

    def item(self, text: str, status: str) -> dict:
        content = [self.part(text)] if status == "completed" else []
        return {"type": "message", "id": self.item_id, "status": status, "role": "assistant", "content": content}

    @staticmethod
    def part(text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    @staticmethod
    def status_of(finish: str | None, error: str | None) -> str:
        if error is not None or finish == "error":
            return "failed"
        return "incomplete" if finish == "length" else "completed"

    # ---- the stream ----------------------------------------------------------------------------
    def event(self, kind: str, **fields: object) -> dict:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def start_events(self, prompt_tokens: int) -> list[dict]:
        opening = self.response("in_progress", None, prompt_tokens, 0)
        at = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        return [self.event("response.created", response=opening),
                self.event("response.in_progress", response=opening),
                self.event("response.output_item.added", output_index=0, item=self.item("", "in_progress")),
                self.event("response.content_part.added", **at, part=self.part(""))]

    def delta_events(self, piece: str) -> list[dict]:
        if not piece:
            return []
        return [self.event("response.output_text.delta", item_id=self.item_id, output_index=0, content_index=0,
                           delta=piece, logprobs=[])]

    def end_events(self, text: str, prompt_tokens: int, output_tokens: int, finish: str | None,
                   error: str | None) -> list[dict]:
        status = self.status_of(finish, error)
        at = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        final = self.response(status, text, prompt_tokens, output_tokens, finish, error)
        return [self.event("response.output_text.done", **at, text=text, logprobs=[]),
                self.event("response.content_part.done", **at, part=self.part(text)),
                self.event("response.output_item.done", output_index=0, item=self.item(text, "completed")),
                self.event(f"response.{status}", response=final)]


class ResponsesFormat(OpenAIFormat):
    """What both Responses formats share: the writer of this answer's object and events."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._writer = ResponsesWriter(self.req, self.model, self.hex_id, self.created)


class ResponsesObject(ResponsesFormat):
    """One `response` object."""

    name = "responses"
    content_type = "application/json"

    def body(self, results: list[Result]) -> bytes:
        r = results[0]
        s = r.sample(0)
        return dumps(self._writer.response(ResponsesWriter.status_of(s.finish_reason, s.error), s.text,
                                           len(r.prompt_token_ids), len(s.token_ids),
                                           self._finish(s.finish_reason), s.error)).encode()


class ResponsesEvents(ResponsesFormat):
    """The Responses stream: server-sent events named by their type."""

    name = "responses_sse"
    content_type = "text/event-stream"
    streams = True

    def start(self, results: list[Result]) -> bytes:
        return self._events(self._writer.start_events(len(results[0].prompt_token_ids)))

    def chunk(self, r: Result, delta: StreamDelta, prompt_index: int = 0) -> bytes:
        s = r.sample(delta.index)
        events = self._writer.delta_events(delta.text)
        if delta.finish_reason is not None:
            events += self._writer.end_events(s.text, len(r.prompt_token_ids), len(s.token_ids),
                                              self._finish(delta.finish_reason), s.error)
        return self._events(events)

    @staticmethod
    def _events(events: list[dict]) -> bytes:
        return "".join(f"event: {e['type']}\ndata: {dumps(e)}\n\n" for e in events).encode()

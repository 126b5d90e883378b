"""Tool calls streamed as they are generated: the model's text so far -> OpenAI `delta.tool_calls`.

Why: a chat stream with `tools` must send each call as vLLM and OpenAI do, its name once, then
`function.arguments` in pieces as the model writes them, so that the openai SDK's
`chat.completions.stream(...)` helper, LangChain's `bind_tools(...).stream()` and others can
assemble the calls. The non-streamed answer parses the whole text at once
(`structured.parse_tool_calls`); this module reads the same shapes from a growing prefix:

- `named` tool_choice: the whole output is the function's arguments (generated under its schema);
- `required`: the output is a JSON array of `{"name", "arguments"}` (generated under its schema);
- `auto`: text, unless the model opens a call: `<tool_call>{...}</tool_call>` blocks (Hermes,
  Qwen, SmolLM), Mistral's `[TOOL_CALLS] [...]`, or an answer that is a JSON call or list of
  calls (`arguments` or `parameters`). While the text could still become a call it is held back;
  if it never does, it is sent as content when the sample ends.

Each call's `arguments` pieces are the model's own characters of that JSON value: concatenated,
they are the value (valid JSON once the call is complete).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from serving.server.structured import ToolSpec

_TAG = "<tool_call>"
_MISTRAL = "[TOOL_CALLS]"
_WS = " \t\r\n"


@dataclass
class _Call:
    """What one call of the text holds so far: its name (once whole) and its arguments' span."""

    name: str | None = None
    args_start: int | None = None
    args_end: int | None = None  # None: the value is not finished yet


@dataclass
class _Sent:
    """What was already sent of one call."""

    id: str
    args: int = 0  # characters of its arguments sent


def _skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WS:
        i += 1
    return i


def _value_end(s: str, i: int) -> int | None:
    """The end (exclusive) of the JSON value starting at `s[i]`, or None when `s` stops inside it
    (a bare scalar at the very end counts as unfinished: more digits or letters may follow)."""
    depth = 0
    in_str = False
    j = i
    while j < len(s):
        c = s[j]
        if in_str:
            if c == "\\":
                j += 1
            elif c == '"':
                in_str = False
                if depth == 0:
                    return j + 1
        elif c == '"':
            in_str = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth <= 0:
                return j + 1
        elif depth == 0 and c in _WS + ",":
            return j if j > i else None
        j += 1
    return None


def _scan_object(s: str, i: int, calls: list[_Call]) -> int | None:
    """Read a `{"name", "arguments"|"parameters"}` object at `s[i]` (appended to `calls` once it
    started); returns the index after it, or None when `s` ends inside it."""
    call = _Call()
    calls.append(call)
    i += 1
    while True:
        i = _skip_ws(s, i)
        if i >= len(s):
            return None
        if s[i] == "}":
            return i + 1
        if s[i] == ",":
            i += 1
            continue
        key_end = _value_end(s, i) if s[i] == '"' else None
        if key_end is None:
            return None
        try:
            key = json.loads(s[i:key_end])
        except ValueError:
            return None
        i = _skip_ws(s, key_end)
        if i >= len(s) or s[i] != ":":
            return None
        i = _skip_ws(s, i + 1)
        if i >= len(s):
            return None
        end = _value_end(s, i)
        if key == "name" and end is not None:
            try:
                name = json.loads(s[i:end])
            except ValueError:
                name = None
            call.name = name if isinstance(name, str) else None
        elif key in ("arguments", "parameters") and call.args_start is None:
            call.args_start, call.args_end = i, end
        if end is None:
            return None
        i = end


def _scan_calls(s: str, i: int) -> list[_Call]:
    """The calls of a JSON object or array of objects starting at `s[i]` (a prefix is fine)."""
    calls: list[_Call] = []
    if i >= len(s):
        return calls
    if s[i] == "{":
        _scan_object(s, i, calls)
        return calls
    if s[i] != "[":
        return calls
    i += 1
    while True:
        i = _skip_ws(s, i)
        if i >= len(s) or s[i] == "]":
            return calls
        if s[i] == ",":
            i += 1
            continue
        if s[i] != "{":
            return calls
        end = _scan_object(s, i, calls)
        if end is None:
            return calls
        i = end


@dataclass
class ToolCallStream:
    """The tool-call view of one sample's growing text (one per choice of a chat stream).

    `feed(text)` takes the next piece of generated text and returns (content to send, tool_call
    deltas to send); `finish()` returns what is left once the sample ended; `called` says whether
    any call was sent (finish_reason "tool_calls" instead of "stop", except for a named choice).
    """

    tools: ToolSpec
    text: str = ""
    content_sent: int = 0  # characters of `text` sent as content
    sent: list[_Sent] = field(default_factory=list)

    @property
    def called(self) -> bool:
        return bool(self.sent)

    def feed(self, piece: str) -> tuple[str, list[dict]]:
        self.text += piece
        return self._advance(final=False)

    def finish(self) -> tuple[str, list[dict]]:
        return self._advance(final=True)

    # ---- reading the text ----------------------------------------------------------------------
    def _calls(self, final: bool) -> tuple[int, list[_Call]]:
        """(where content ends, the calls so far) of the text, by the tool choice."""
        s, tools = self.text, self.tools
        if tools.choice == "named":
            return 0, [_Call(tools.name, _skip_ws(s, 0), len(s.rstrip(_WS)) if final else None)]
        if tools.choice == "required":
            return 0, _scan_calls(s, _skip_ws(s, 0))
        tag = s.find(_TAG)
        if tag >= 0:  # content, then <tool_call>{...}</tool_call> blocks
            calls: list[_Call] = []
            at = tag
            while at >= 0:
                body = _skip_ws(s, at + len(_TAG))
                if s[body:body + 1] == "{":
                    _scan_object(s, body, calls)
                at = s.find(_TAG, at + len(_TAG))
            return tag, calls
        start = _skip_ws(s, 0)
        head = s[start:]
        if head.startswith(_MISTRAL):
            return 0, _scan_calls(s, _skip_ws(s, start + len(_MISTRAL)))
        if head[:1] in ("{", "["):
            return 0, _scan_calls(s, start)
        if final:
            return len(s), []
        # Not a call (yet): send the text, holding back what may be the start of a marker.
        if not head:
            return 0, []  # only whitespace so far: a call may follow
        return min((k for k in range(len(s)) if _TAG.startswith(s[k:])), default=len(s)), []

    def _advance(self, final: bool) -> tuple[str, list[dict]]:
        content_end, calls = self._calls(final)
        names = {f["name"] for f in self.tools.functions}
        valid = [c for c in calls if c.name in names]
        if self.tools.choice == "auto" and final and not self.sent and not valid:
            content_end = len(self.text)  # it never became a call: all of it is content
        deltas = [d for i, c in enumerate(valid) if (d := self._call_delta(i, c)) is not None]
        content = self.text[self.content_sent:content_end] if content_end > self.content_sent else ""
        self.content_sent = max(self.content_sent, content_end)
        return content, deltas

    def _call_delta(self, index: int, call: _Call) -> dict | None:
        """The delta of call `index`: its header the first time, then arguments not yet sent."""
        fn: dict = {}
        out: dict = {"index": index}
        if index == len(self.sent):
            self.sent.append(_Sent(f"call_{uuid.uuid4().hex[:24]}"))
            out.update(id=self.sent[index].id, type="function")
            fn["name"] = call.name
            fn["arguments"] = ""
        sent = self.sent[index]
        if call.args_start is not None:
            end = call.args_end if call.args_end is not None else len(self.text)
            if self.tools.choice == "named" and call.args_end is None:
                end = len(self.text.rstrip(_WS))  # trailing whitespace is not part of the value
            piece = self.text[call.args_start + sent.args:end]
            if piece:
                fn["arguments"] = piece
                sent.args += len(piece)
        if not fn:
            return None
        out["function"] = fn
        return out

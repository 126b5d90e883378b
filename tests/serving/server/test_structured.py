"""The HTTP edge of structured output and tools: request fields -> constraint, text -> tool_calls."""

from __future__ import annotations

import json

import pytest

from serving.sampling_params import GuidedDecodingParams as G
from serving.server.api.lmi.request import parse_invocations
from serving.server.api.openai_chat import parse_chat
from serving.server.api.openai_completions import parse_completions
from serving.server.structured import ToolSpec, guided_from, parse_tool_calls, tool_schema, tools_from
from serving.server.tool_stream import ToolCallStream

MSG = [{"role": "user", "content": "x"}]
FN = {"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                  "properties": {"a": {"type": "integer"}}}}}
FN2 = {"type": "function", "function": {"name": "g"}}


def test_constraints_from_each_surface() -> None:
    rf = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object"}}}
    assert parse_chat({"messages": MSG, "response_format": rf}).params.guided_decoding == G(json={"type": "object"})
    assert parse_chat({"messages": MSG, "response_format": {"type": "json_object"}}).params.guided_decoding == \
        G(json_object=True)
    assert parse_chat({"messages": MSG, "response_format": {"type": "text"}}).params.guided_decoding is None
    c = parse_completions({"prompt": "p", "guided_choice": ["a", "b"]})
    assert c.params.guided_decoding == G(choice=("a", "b")) and not c.warnings
    assert parse_completions({"prompt": "p", "structured_outputs": {"regex": "a+"}}).params.guided_decoding == \
        G(regex="a+")
    inv = parse_invocations({"inputs": "p", "parameters": {"guided_json": {"type": "object"}}})
    assert inv.params.guided_decoding == G(json={"type": "object"}) and not inv.warnings
    for bad, needle in [({"response_format": {"type": "xml"}}, "response_format"),
                        ({"response_format": {"type": "json_schema"}}, "schema"),
                        ({"guided_regex": "a", "guided_choice": ["b"]}, "one output constraint"),
                        ({"guided_choice": "ab"}, "guided_choice")]:
        with pytest.raises(ValueError, match=needle):
            parse_chat({"messages": MSG, **bad})


def test_tools_and_tool_choice() -> None:
    assert tools_from({"tools": [FN], "tool_choice": "none"}) is None
    auto = parse_chat({"messages": MSG, "tools": [FN]})
    assert auto.tools.choice == "auto" and auto.params.guided_decoding is None
    req = parse_chat({"messages": MSG, "tools": [FN, FN2], "tool_choice": "required"})
    schema = json.loads(req.params.guided_decoding.json)
    assert schema["minItems"] == 1 and [c["properties"]["name"]["const"] for c in schema["items"]["anyOf"]] == ["f", "g"]
    named = parse_chat({"messages": MSG, "tools": [FN, FN2], "tool_choice": {"type": "function", "function": {"name": "f"}}})
    assert json.loads(named.params.guided_decoding.json) == FN["function"]["parameters"]
    for bad, needle in [({"tool_choice": "required"}, "needs tools"),
                        ({"tools": [FN], "tool_choice": {"type": "function", "function": {"name": "h"}}}, "not in tools"),
                        ({"tools": [FN], "tool_choice": "required", "guided_regex": "a"}, "one output constraint")]:
        with pytest.raises(ValueError, match=needle):
            parse_chat({"messages": MSG, **bad})


def test_parse_tool_calls() -> None:
    spec = tools_from({"tools": [FN, FN2], "tool_choice": "required"})
    calls, content = parse_tool_calls('[{"name": "f", "arguments": {"a": 1}}]', spec)
    assert content is None and calls[0]["function"] == {"name": "f", "arguments": '{"a": 1}'}
    named = ToolSpec(spec.functions, "named", "g")
    assert parse_tool_calls('{"x": 2}', named)[0][0]["function"] == {"name": "g", "arguments": '{"x": 2}'}
    assert tool_schema(named) == {"type": "object"}
    auto = ToolSpec(spec.functions, "auto")
    calls, content = parse_tool_calls('Sure. <tool_call>\n{"name": "f", "arguments": {"a": 3}}\n</tool_call>', auto)
    assert content == "Sure." and json.loads(calls[0]["function"]["arguments"]) == {"a": 3}
    calls, content = parse_tool_calls('{"name": "g", "parameters": {}}', auto)  # Llama 3.1 JSON
    assert content is None and calls[0]["function"]["name"] == "g"
    calls, _ = parse_tool_calls('[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}]', auto)  # Mistral
    assert calls[0]["function"]["name"] == "f"
    assert parse_tool_calls('{"name": "other"}', auto) == ([], '{"name": "other"}')
    assert parse_tool_calls("just text", auto) == ([], "just text")


def _streamed(spec: ToolSpec, text: str, step: int) -> tuple[str, list[tuple[str, str]], bool]:
    """(content, [(name, arguments)], called) as a client assembles them from ToolCallStream's pieces."""
    stream = ToolCallStream(spec)
    outs = [stream.feed(text[i:i + step]) for i in range(0, len(text), step)] + [stream.finish()]
    content, calls = "", {}
    for piece, deltas in outs:
        content += piece
        for d in deltas:
            name, args = calls.get(d["index"], (None, ""))
            calls[d["index"]] = (d["function"].get("name", name), args + d["function"].get("arguments", ""))
    return content, [calls[i] for i in sorted(calls)], stream.called


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
@pytest.mark.parametrize("choice, text", [
    ("named", ' {"a": 12, "b": "x}y"}\n'),
    ("required", '[{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {"s": "[\\"]"}}]'),
    ("auto", 'Checking.<tool_call>\n{"name": "f", "arguments": {"a": 3}}\n</tool_call>\n'
             '<tool_call>{"name": "g", "parameters": {}}</tool_call>'),
    ("auto", '[TOOL_CALLS] [{"name": "g", "arguments": {"x": [1, {"y": null}]}}]'),
    ("auto", '  {"name": "f", "arguments": {"a": -4}}'),
    ("auto", 'Plain text with a < sign, <tool and [brackets].'),
    ("auto", '{"name": "unknown", "arguments": {}}'),
])
def test_streamed_tool_calls_assemble_to_the_parsed_answer(choice: str, text: str, step: int) -> None:
    spec = tools_from({"tools": [FN, FN2], "tool_choice": choice if choice != "named" else
                       {"type": "function", "function": {"name": "f"}}})
    content, calls, called = _streamed(spec, text, step)
    want_calls, want_content = parse_tool_calls(text, spec)
    assert [(n, json.loads(a)) for n, a in calls] == [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in want_calls]
    assert called == bool(want_calls) and (content or None) == (want_content.strip() if want_content else None)

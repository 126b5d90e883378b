"""Structured output and tools at the HTTP edge: request fields -> `GuidedDecodingParams`, and the
model's text -> OpenAI `tool_calls`.

Accepted (each is one guided-decoding constraint; `serving/engine/structured_output.py` enforces it):
- OpenAI `response_format`: `{"type": "json_object"}`, `{"type": "json_schema", "json_schema":
  {"name", "schema", "strict"}}` (`text` = none);
- vLLM's extras `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` (on /v1 and in
  `parameters` on /invocations), and its newer `structured_outputs: {json|regex|choice|grammar}`;
- `tools` with `tool_choice`: `"required"` (the output is a JSON array of `{"name", "arguments"}`
  over the given functions, each `arguments` following its function's schema), a named function
  (`{"type": "function", "function": {"name"}}`: the output is that function's arguments object),
  `"auto"` (no constraint: tool calls are parsed from the model's text, see `parse_tool_calls`),
  `"none"` (plain text).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from serving.sampling_params import GuidedDecodingParams

GUIDED_KEYS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
STRUCTURED_KEYS = {"response_format", "structured_outputs", "guided_decoding_backend", "guided_whitespace_pattern",
                   *GUIDED_KEYS}
TOOL_KEYS = {"tools", "tool_choice", "parallel_tool_calls"}


@dataclass(frozen=True)
class ToolSpec:
    """The tools of a chat request and how the model must use them."""

    functions: tuple[dict, ...]  # OpenAI function objects: name, description, parameters
    choice: str  # "auto" | "required" | "named"
    name: str | None = None  # the function, when choice == "named"

    def schema_of(self, name: str) -> dict:
        for f in self.functions:
            if f["name"] == name:
                return f.get("parameters") or {"type": "object"}
        raise KeyError(name)


def guided_from(d: dict, tools: ToolSpec | None = None) -> GuidedDecodingParams | None:
    """The one output constraint a request body (or LMI `parameters`) asks for; ValueError -> 400."""
    found: list[tuple[str, GuidedDecodingParams]] = []
    rf = d.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
            raise ValueError("response_format must be an object with a type (text, json_object, json_schema)")
        kind = rf["type"]
        if kind == "json_object":
            found.append(("response_format", GuidedDecodingParams(json_object=True)))
        elif kind == "json_schema":
            js = rf.get("json_schema")
            schema = js.get("schema", js.get("json_schema")) if isinstance(js, dict) else None
            if not isinstance(schema, dict):
                raise ValueError("response_format.json_schema.schema must be a JSON schema object")
            found.append(("response_format", GuidedDecodingParams(json=schema)))
        elif kind != "text":
            raise ValueError(f"response_format.type must be text, json_object or json_schema, got {kind!r}")
    for key in GUIDED_KEYS:
        v = d.get(key)
        if v is None:
            continue
        name = key.removeprefix("guided_")
        if name == "json" and not isinstance(v, (dict, str)):
            raise ValueError("guided_json must be a JSON schema (an object or its text)")
        if name == "choice" and not isinstance(v, list):
            raise ValueError("guided_choice must be a list of strings")
        found.append((key, GuidedDecodingParams(**{name: v})))
    so = d.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise ValueError("structured_outputs must be an object (json, regex, choice or grammar)")
        known = {k: v for k, v in so.items() if k in ("json", "regex", "choice", "grammar", "json_object") and v}
        found.append(("structured_outputs", GuidedDecodingParams(**known)))
    if tools is not None and tools.choice in ("required", "named"):
        found.append(("tool_choice", GuidedDecodingParams(json=tool_schema(tools))))
    if len(found) > 1:
        raise ValueError(f"give one output constraint, got {', '.join(k for k, _ in found)}")
    return found[0][1] if found else None


def tools_from(body: dict) -> ToolSpec | None:
    """`tools` + `tool_choice` of a chat body; None when no tool may be called."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if body.get("functions") is not None:
        raise ValueError("functions (the deprecated form) is not supported: use tools")
    if tools in (None, []):
        if choice not in (None, "none", "auto"):
            raise ValueError("tool_choice needs tools")
        return None
    if not isinstance(tools, list):
        raise ValueError("tools must be a list of {\"type\": \"function\", \"function\": {...}} objects")
    functions = []
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) and t.get("type", "function") == "function" else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
            raise ValueError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\", ...}}}}")
        params = f.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
        functions.append({k: f[k] for k in ("name", "description", "parameters") if k in f})
    if choice is None or choice == "auto":
        return ToolSpec(tuple(functions), "auto")
    if choice == "none":
        return None
    if choice == "required":
        return ToolSpec(tuple(functions), "required")
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in {f["name"] for f in functions}:
            raise ValueError(f"tool_choice names function {name!r}, which is not in tools")
        return ToolSpec(tuple(functions), "named", name)
    raise ValueError("tool_choice must be none, auto, required or {\"type\": \"function\", \"function\": {\"name\"}}")


def tool_schema(tools: ToolSpec) -> dict:
    """What the model must write: a named function's arguments, or a non-empty array of calls."""
    if tools.choice == "named":
        return tools.schema_of(tools.name)  # type: ignore[arg-type]
    calls = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                               "arguments": f.get("parameters") or {"type": "object"}},
              "required": ["name", "arguments"], "additionalProperties": False} for f in tools.functions]
    item = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return {"type": "array", "items": item, "minItems": 1}


def _call(name: str, arguments: object) -> dict:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": args}}


_TAGGED = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)  # Hermes / Qwen / SmolLM3 style


def parse_tool_calls(text: str, tools: ToolSpec) -> tuple[list[dict], str | None]:
    """(OpenAI tool_calls, remaining content) from the model's text.

    `required` / `named` outputs were generated under the schema, so they parse. For `auto` the
    model chose: `<tool_call>{"name", "arguments"}</tool_call>` blocks (Hermes, Qwen 2/2.5/3,
    SmolLM2/3 templates), Mistral's `[TOOL_CALLS] [...]`, or the whole answer as a JSON call / list
    of calls with `arguments` or `parameters` (Llama 3.1+ JSON tool calling); anything else is text.
    """
    if tools.choice == "named":
        return [_call(tools.name, text.strip())], None  # type: ignore[arg-type]
    if tools.choice == "required":
        return [_call(c["name"], c["arguments"]) for c in json.loads(text)], None
    names = {f["name"] for f in tools.functions}
    calls: list[dict] = []
    content: str | None = text
    blocks = _TAGGED.findall(text)
    if blocks:
        for b in blocks:
            obj = _json_or_none(b)
            if isinstance(obj, dict) and obj.get("name") in names:
                calls.append(_call(obj["name"], obj.get("arguments", obj.get("parameters", {}))))
        content = text[: text.index("<tool_call>")].strip() or None
    else:
        body = text.strip()
        if body.startswith("[TOOL_CALLS]"):
            body = body.removeprefix("[TOOL_CALLS]").strip()
        obj = _json_or_none(body)
        objs = obj if isinstance(obj, list) else [obj]
        if objs and all(isinstance(o, dict) and o.get("name") in names for o in objs):
            calls = [_call(o["name"], o.get("arguments", o.get("parameters", {}))) for o in objs]
            content = None
    return calls, (content if calls else text)


def _json_or_none(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return None

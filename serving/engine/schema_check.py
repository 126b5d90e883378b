"""JSON-schema contradictions that xgrammar compiles anyway, found before any compile.

xgrammar refuses many unsatisfiable schemas itself (minimum > maximum, an empty enum, a `false`
required property, ...), but it builds a grammar for some that no value satisfies, and the model
then writes something that does not validate (`{}`, a number) with finish_reason "stop". This
finds those: a `type` list with no type, `enum` / `const` values none of which has the schema's
`type`, and a `required` property that `additionalProperties: false` (or a `false` property schema)
forbids; in the schema and every subschema a value must satisfy too (`allOf` members, the schemas
of required properties, `items` of an array with `minItems` >= 1); a contradiction in an optional
place (one `anyOf` branch, an optional property) only narrows what the model may write, so it
is left alone. A schema it finds nothing in may still be unsatisfiable in ways only a solver
would see.
"""

from __future__ import annotations

_PY_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
             "object": (dict,), "array": (list,), "null": (type(None),)}
_MAX_NODES = 100_000  # subschemas looked at, at most (a schema's text is bounded anyway)


def _has_type(value: object, types: list[str]) -> bool:
    for t in types:
        py = _PY_TYPES.get(t)
        if py is None:
            return True  # a type name we do not know: not ours to judge
        if isinstance(value, bool) and t not in ("boolean",):
            continue  # JSON booleans are not numbers
        if t == "integer" and isinstance(value, float) and value.is_integer():
            return True
        if isinstance(value, py):
            return True
    return False


def _contradiction(node: dict, path: str) -> str | None:
    types = node.get("type")
    if isinstance(types, str):
        types = [types]
    if isinstance(types, list):
        if not types:
            return f"{path}: `type` lists no type"
        if "enum" in node and isinstance(node["enum"], list) and node["enum"] \
                and not any(_has_type(v, types) for v in node["enum"]):
            return f"{path}: no `enum` value has the type {'/'.join(map(str, types))}"
        if "const" in node and not _has_type(node["const"], types):
            return f"{path}: `const` does not have the type {'/'.join(map(str, types))}"
    required = node.get("required")
    if isinstance(required, list):
        props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        closed = node.get("additionalProperties") is False and not node.get("patternProperties")
        for name in required:
            if not isinstance(name, str):
                continue  # xgrammar refuses it
            if props.get(name) is False or (closed and name not in props):
                return f"{path}: required property {name!r} is not allowed"
    return None


def schema_contradiction(schema: object) -> str | None:
    """Where and why the schema (parsed JSON) admits no value, if it says so plainly; else None."""
    stack: list[tuple[object, str]] = [(schema, "schema")]
    seen = 0
    while stack and seen < _MAX_NODES:
        node, path = stack.pop()
        seen += 1
        if not isinstance(node, dict):
            continue
        why = _contradiction(node, path)
        if why is not None:
            return why
        if isinstance(node.get("allOf"), list):
            stack.extend((sub, f"{path}.allOf[{i}]") for i, sub in enumerate(node["allOf"]))
        props = node.get("properties")
        if isinstance(props, dict) and isinstance(node.get("required"), list):
            stack.extend((props[name], f"{path}.properties.{name}") for name in node["required"]
                         if isinstance(name, str) and name in props)
        min_items = node.get("minItems")
        if isinstance(node.get("items"), dict) and isinstance(min_items, int) and min_items >= 1:
            stack.append((node["items"], f"{path}.items"))
    return None

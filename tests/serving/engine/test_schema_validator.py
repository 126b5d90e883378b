"""The safety net behind guided JSON (serving/engine/schema_validator.py), against jsonschema's own
verdicts: schemas that are not JSON Schema are named, outputs a keyword the grammar ignores rejects
are caught with the keyword's path, and odd schemas (a `$ref` cycle, a remote `$ref`, a
catastrophic-backtracking pattern) come back as messages within a bound, never as exceptions."""

from __future__ import annotations

import json
import time

import jsonschema
import pytest

from serving.engine.schema_validator import OUTPUT_INVALID, output_problem, schema_problem


@pytest.mark.parametrize("schema, where", [
    ({"type": "nope"}, "schema.type"),
    ({"properties": {"a": {"minimum": "x"}}}, "schema.properties.a.minimum"),
    ({"required": True}, "schema.required"),
    ({"$schema": "http://json-schema.org/draft-07/schema#", "exclusiveMinimum": True}, "schema.exclusiveMinimum"),
])
def test_invalid_schemas_are_named(schema, where) -> None:  # noqa: ANN001
    with pytest.raises(jsonschema.SchemaError):
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    assert f"`{where}`" in schema_problem(schema)


def test_valid_schemas_of_each_draft_pass() -> None:
    assert schema_problem({"type": "object", "properties": {"a": {"type": "integer"}}}) is None
    draft4 = {"$schema": "http://json-schema.org/draft-04/schema#", "minimum": 1, "exclusiveMinimum": True}
    assert schema_problem(draft4) is None  # a boolean exclusiveMinimum is draft 4's own


@pytest.mark.parametrize("schema, output, where", [
    ({"type": "boolean", "not": {"type": "boolean"}}, "true", "schema.not"),
    ({"allOf": [{"type": "integer", "minimum": 5}, {"type": "integer", "maximum": 1}]}, "3", "schema.allOf[0].minimum"),
    ({"type": "object", "properties": {"s": {"type": "string", "pattern": "^(?!x)x$"}}}, '{"s": "x"}',
     "schema.properties.s.pattern"),
    ({"type": "object", "patternProperties": {"^a": {"type": "integer"}}, "additionalProperties": False},
     '{"b": 1}', "schema.additionalProperties"),
    ({"type": "array", "uniqueItems": True}, "[1, 1]", "schema.uniqueItems"),
])
def test_outputs_a_keyword_rejects_are_caught_with_its_path(schema, output, where) -> None:  # noqa: ANN001
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(output), schema)
    problem = output_problem(json.dumps(schema), output)
    assert problem.startswith(OUTPUT_INVALID) and f"`{where}`" in problem, problem
    assert "could not enforce" in problem


@pytest.mark.parametrize("schema, output", [
    ({"type": "object", "properties": {"a": {"type": "string", "pattern": "^x"}}, "required": ["a"],
      "additionalProperties": False}, '{"a": "xy"}'),
    ({"type": "object", "patternProperties": {"^b": {"type": "integer"}}, "additionalProperties": False}, '{"b": 2}'),
    ({"$defs": {"n": {"type": "integer"}}, "type": "array", "items": {"$ref": "#/$defs/n"}}, "[1, 2]"),
])
def test_valid_outputs_pass(schema, output) -> None:  # noqa: ANN001
    jsonschema.validate(json.loads(output), schema)
    assert output_problem(json.dumps(schema), output) is None


@pytest.mark.parametrize("schema, output, needle", [
    ({"$ref": "#"}, "1", "nests too deeply"),
    ({"$ref": "http://127.0.0.1:9/remote.json"}, "1", "Unresolvable"),  # never fetched
    ({"type": "string", "pattern": "^(x+x+)+y$"}, json.dumps("x" * 5000), "too slow to match"),
    ({"type": "object"}, "{", "not JSON"),
])
def test_odd_schemas_are_a_bounded_message(schema, output, needle) -> None:  # noqa: ANN001
    t0 = time.monotonic()
    problem = output_problem(json.dumps(schema), output)
    assert problem.startswith(OUTPUT_INVALID) and needle in problem, problem
    assert time.monotonic() - t0 < 5


def test_many_slow_patterns_share_one_time_budget() -> None:
    props = {f"p{i}": {"type": "string", "pattern": "^(x+x+)+y$"} for i in range(40)}
    output = json.dumps({k: "x" * 3000 for k in props})
    t0 = time.monotonic()
    assert "too slow to match" in output_problem(json.dumps({"type": "object", "properties": props}), output)
    assert time.monotonic() - t0 < 2  # 40 patterns, each alone allowed 0.05 s: the whole check 0.25 s

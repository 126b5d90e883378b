"""JSON-schema guided outputs checked with `jsonschema`: the safety net behind the grammar.

xgrammar enforces most of JSON Schema but ignores some keywords (`not`, `if`/`then`/`else`,
`dependentSchemas`, `uniqueItems`, ...) and cannot see contradictions between `allOf` members or a
`pattern` that matches nothing, so a guided generation can finish ("stop") with text its schema
does not accept. This module (1) says up front whether a schema is a valid JSON Schema for the
draft it names (2020-12 when it names none: `schema_problem`), and (2) once a generation ended,
whether its text validates and, if not, the schema keyword path that failed (`output_problem`).

Cheap and bounded: a validator is built once per schema text and kept in a small LRU; `$ref`s
resolve inside the schema only (nothing is ever fetched: jsonschema's default registry would
download remote references); `pattern` / `patternProperties` / `additionalProperties` match with a
time bound (the `regex` module's timeout, so a catastrophic-backtracking pattern cannot hold a
thread); only the first errors are ranked; recursion (a `$ref` cycle, a deep output) and anything
else an odd schema makes the library raise come back as a message, never as an exception.
"""

from __future__ import annotations

import itertools
import json
import math
import threading
import time
from collections import OrderedDict

import regex
import referencing
from jsonschema import Draft202012Validator, validators
from jsonschema.exceptions import SchemaError, ValidationError, best_match

OUTPUT_INVALID = "the output does not validate against its JSON schema"  # how every such error starts
_CACHE_SIZE = 128  # validators kept (one per schema text; a schema's text is bounded by guided_decoding_max_bytes)
_PATTERN_TIMEOUT_S = 0.05  # the longest one regular expression may take on one string
_CHECK_BUDGET_S = 0.25  # the longest the regular expressions of one output may take together
_MAX_ERRORS = 16  # errors ranked for the message, at most
_NO_REMOTE = referencing.Registry()  # resolves nothing but the schema itself and the drafts' metaschemas


class _PatternTimeout(Exception):
    """A schema regex took longer than _PATTERN_TIMEOUT_S on an output string."""


_deadline = threading.local()  # .at: when the output being checked on this thread runs out of regex time


def _search(pattern: str, text: str) -> bool:
    left = getattr(_deadline, "at", math.inf) - time.monotonic()
    try:
        if left <= 0:
            raise TimeoutError
        return regex.search(pattern, text, timeout=min(_PATTERN_TIMEOUT_S, left)) is not None
    except TimeoutError:
        raise _PatternTimeout(pattern) from None


def _pattern(validator, pattern, instance, schema):  # noqa: ANN001, ANN202 - jsonschema's keyword signature
    if validator.is_type(instance, "string") and not _search(pattern, instance):
        yield ValidationError(f"{instance!r} does not match {pattern!r}")


def _pattern_properties(validator, patterns, instance, schema):  # noqa: ANN001, ANN202
    if not validator.is_type(instance, "object"):
        return
    for pattern, subschema in patterns.items():
        for k, v in instance.items():
            if _search(pattern, k):
                yield from validator.descend(v, subschema, path=k, schema_path=pattern)


def _additional_properties(validator, aP, instance, schema):  # noqa: ANN001, ANN202, N803
    if not validator.is_type(instance, "object"):
        return
    props = schema.get("properties", {})
    patterns = list(schema.get("patternProperties", {}))
    extras = [k for k in instance if k not in props and not any(_search(p, k) for p in patterns)]
    if validator.is_type(aP, "object"):
        for k in extras:
            yield from validator.descend(instance[k], aP, path=k)
    elif not aP and extras:
        yield ValidationError(f"additional properties are not allowed ({', '.join(map(repr, extras[:8]))})")


def _bounded(cls: type) -> type:
    """`cls` (a draft's validator class) with its regex keywords time-bounded."""
    return validators.extend(cls, {"pattern": _pattern, "patternProperties": _pattern_properties,
                                   "additionalProperties": _additional_properties})


_lock = threading.Lock()
_validators: OrderedDict[str, object] = OrderedDict()
_classes: dict[type, type] = {}


def _where(path: object) -> str:
    return "schema" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path)  # type: ignore[union-attr]


def _draft(schema: object) -> type:
    cls = validators.validator_for(schema, default=Draft202012Validator) if isinstance(schema, dict) \
        else Draft202012Validator
    return cls


def schema_problem(schema: object) -> str | None:
    """Why `schema` (parsed JSON) is not a valid JSON Schema of its draft, or None."""
    try:
        _draft(schema).check_schema(schema)
    except SchemaError as exc:
        return f"`{_where(exc.absolute_path)}`: {exc.message}"
    except RecursionError:
        return "it is nested too deeply to check"
    except Exception as exc:  # noqa: BLE001 - a schema the library cannot read: the client's input
        return f"it cannot be read as a JSON Schema ({type(exc).__name__}: {exc})"
    return None


def _validator(schema_text: str) -> object:
    with _lock:
        v = _validators.get(schema_text)
        if v is not None:
            _validators.move_to_end(schema_text)
            return v
    schema = json.loads(schema_text)
    cls = _draft(schema)
    with _lock:
        bounded = _classes.get(cls)
        if bounded is None:
            bounded = _classes[cls] = _bounded(cls)
    v = bounded(schema, registry=_NO_REMOTE)
    with _lock:
        _validators[schema_text] = v
        while len(_validators) > _CACHE_SIZE:
            _validators.popitem(last=False)
    return v


def output_problem(schema_text: str, text: str) -> str | None:
    """None when `text` is JSON that validates against the schema (its JSON text); else the error
    message (it starts with OUTPUT_INVALID and names the schema keyword path that failed)."""
    try:
        instance = json.loads(text)
    except ValueError as exc:
        return f"{OUTPUT_INVALID}: it is not JSON ({exc})"
    _deadline.at = time.monotonic() + _CHECK_BUDGET_S
    try:
        error = best_match(itertools.islice(_validator(schema_text).iter_errors(instance), _MAX_ERRORS))
    except _PatternTimeout as exc:
        return f"{OUTPUT_INVALID}: it could not be checked (the pattern {str(exc)[:200]!r} is too slow to match)"
    except RecursionError:
        return f"{OUTPUT_INVALID}: it could not be checked (the schema or the output nests too deeply)"
    except Exception as exc:  # noqa: BLE001 - e.g. a `$ref` that does not resolve inside the schema
        return f"{OUTPUT_INVALID}: it could not be checked ({type(exc).__name__}: {str(exc)[:300]})"
    finally:
        _deadline.at = math.inf
    if error is None:
        return None
    return (f"{OUTPUT_INVALID} at `{_where(error.absolute_schema_path)}` ({error.message[:300]}): the schema "
            "uses constraints guided decoding could not enforce")

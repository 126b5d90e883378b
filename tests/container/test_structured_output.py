"""Structured output and tools against the real server (SmolLM2, CPU) with the official `openai`
client: a concurrent batch mixing constrained and free rows (greedy and sampled) whose
constrained outputs parse and validate, a required and a named tool call whose arguments
validate, vLLM's guided_* extras on /v1/completions and in LMI `parameters` on /invocations."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
import requests
from lmi_server import running_server

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "London", "Tokyo"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                        "unit": {"enum": ["celsius", "fahrenheit"]}},
                       "required": ["city", "unit"], "additionalProperties": False},
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"]}}}
ASK = [{"role": "user", "content": "Give me a person as JSON."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):  # noqa: ANN001, ANN201
    with running_server(tmp_path_factory, {"OPTION_MAX_ROLLING_BATCH_SIZE": "16"}) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):  # noqa: ANN001, ANN201
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_mixed_batch_constrained_outputs_validate(client) -> None:  # noqa: ANN001
    schema_rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    jobs = {
        "schema-greedy": lambda: client.chat.completions.create(
            model="m", messages=ASK, max_tokens=48, temperature=0, response_format=schema_rf),
        "schema-sampled": lambda: client.chat.completions.create(
            model="m", messages=ASK, max_tokens=48, temperature=0.9, top_p=0.9, seed=5, response_format=schema_rf),
        "guided-json": lambda: client.chat.completions.create(
            model="m", messages=ASK, max_tokens=48, temperature=0.7, extra_body={"guided_json": PERSON}),
        "json-object": lambda: client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "Give me a JSON object with one key, a, set to 1."}],
            max_tokens=64, temperature=0, response_format={"type": "json_object"}),
        "regex": lambda: client.completions.create(
            model="m", prompt="A part number:", max_tokens=12, temperature=0.8,
            extra_body={"guided_regex": r"[A-Z]{2}-[0-9]{3}"}),
        "choice": lambda: client.completions.create(
            model="m", prompt="Is the sky blue? Answer:", max_tokens=8, temperature=0,
            extra_body={"guided_choice": ["yes", "no"]}),
        "free-greedy": lambda: client.chat.completions.create(model="m", messages=ASK, max_tokens=24, temperature=0),
        "free-sampled": lambda: client.chat.completions.create(model="m", messages=ASK, max_tokens=24, temperature=1),
    }
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = {k: pool.submit(f) for k, f in jobs.items()}
        got = {k: f.result() for k, f in futures.items()}
    for key in ("schema-greedy", "schema-sampled", "guided-json"):
        choice = got[key].choices[0]
        jsonschema.validate(json.loads(choice.message.content), PERSON)
        assert choice.finish_reason == "stop", key
    assert isinstance(json.loads(got["json-object"].choices[0].message.content), dict)
    assert got["json-object"].choices[0].finish_reason == "stop"
    assert re.fullmatch(r"[A-Z]{2}-[0-9]{3}", got["regex"].choices[0].text)
    assert got["choice"].choices[0].text in ("yes", "no")
    assert got["free-greedy"].choices[0].message.content and got["free-sampled"].choices[0].message.content


def test_required_and_named_tool_calls_validate(client) -> None:  # noqa: ANN001
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(model="m", messages=msgs, tools=[WEATHER, TIME], tool_choice="required",
                                       max_tokens=64, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    schemas = {"get_weather": WEATHER["function"]["parameters"], "get_time": TIME["function"]["parameters"]}
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    r = client.chat.completions.create(model="m", messages=msgs, tools=[WEATHER, TIME], max_tokens=48,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                       temperature=0.8, seed=1)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), schemas["get_weather"])


def test_lmi_parameters_and_bad_schema(server, client) -> None:  # noqa: ANN001
    r = requests.post(server.url + "/invocations", timeout=120, json={
        "inputs": "A person as JSON:", "parameters": {"max_new_tokens": 48, "guided_json": PERSON}})
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["generated_text"]), PERSON)
    with pytest.raises(openai.BadRequestError, match="guided"):
        client.chat.completions.create(model="m", messages=ASK, max_tokens=8,
                                       extra_body={"guided_json": {"type": "nope"}})

"""Parsing of LMI / SSE / TGI / OpenAI wire formats, and StreamingClient over HTTP and over SageMaker."""

from __future__ import annotations

import json

import pytest

from fake_lmi import lmi_lines
from sdk.client import StreamingClient, TokenStream, with_adapter
from sdk.parsing import collect, parse_line, parse_response
from sdk.results import ModelError, Token


def test_lmi_jsonlines() -> None:
    lines = lmi_lines(["Deep", " Learning", " is"], details=True)
    chunks = [parse_line(line) for line in lines]
    assert [c.token for c in chunks] == [Token("Deep", 100, -0.5), Token(" Learning", 101, -0.5), Token(" is", 102, -0.5)]
    assert not chunks[0].is_final and chunks[-1].is_final
    result = collect(chunks)
    assert result.generated_text == "Deep Learning is"
    assert result.finish_reason == "length" and result.generated_tokens == 3


def test_sse_lines_and_tgi_compat_keys() -> None:
    assert parse_line(b"") is None and parse_line(b"\r") is None and parse_line(b": keep-alive") is None
    assert parse_line(b"data: [DONE]") is None and parse_line(b"event: message") is None
    chunk = parse_line(b'data: {"token": {"id": 5, "text": "!", "logprob": -0.5, "special": true}}\r')
    assert chunk.token == Token("!", 5, -0.5, special=True)
    chunk = parse_line('data:{"token": {"id": 1, "text": "a", "log_prob": -1}, "generated_text": "a"}')
    assert chunk.generated_text == "a"


def test_openai_chat_chunks_and_completion() -> None:
    chunks = [
        {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hel"}, "finish_reason": None}]},
        {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "lo"}, "finish_reason": None}]},
        {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
    ]
    parsed = [parse_line(b"data: " + json.dumps(c).encode()) for c in chunks]
    assert [p.token.text if p.token else None for p in parsed] == ["Hel", "lo", None]
    result = collect(parsed)
    assert result.generated_text == "Hello" and result.finish_reason == "stop"
    body = {"object": "chat.completion", "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi"},
            "finish_reason": "length"}], "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}}
    result = parse_response(json.dumps(body))
    assert (result.generated_text, result.generated_tokens, result.prompt_tokens) == ("Hi", 3, 5)
    text_chunk = parse_line(json.dumps({"object": "text_completion", "choices": [{"text": " x", "finish_reason": None}]}))
    assert text_chunk.token.text == " x"


def test_openai_sse_with_role_usage_and_done() -> None:
    head = {"object": "chat.completion.chunk"}
    events = [
        {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
        {**head, "choices": [{"index": 0, "delta": {"content": "Yo"}, "finish_reason": "length"}]},
        {**head, "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 1, "total_tokens": 8}},
    ]
    raw = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
    result = TokenStream(raw.split(b"\n")).result
    assert (result.generated_text, result.generated_tokens, result.prompt_tokens) == ("Yo", 1, 7)


def test_lmi_placeholder_token_on_final_line_is_not_counted() -> None:
    lines = [b'{"token": {"id": 9, "text": "Hi", "log_prob": -1}}',
             b'{"token": {"id": -1, "text": "", "log_prob": -1, "special_token": true}, "generated_text": "Hi"}']
    stream = TokenStream(lines)
    assert [t.text for t in stream] == ["Hi"]
    assert stream.result.generated_text == "Hi" and len(stream.result.tokens) == 1


def test_non_streaming_shapes() -> None:
    body = {"generated_text": "!", "details": {"finish_reason": "eos_token", "generated_tokens": 1, "inputs": "Hi",
            "tokens": [{"id": 5, "text": "!", "log_prob": -0.5}]}}
    result = parse_response(json.dumps(body).encode())
    assert result.generated_text == "!" and result.finish_reason == "eos_token" and result.tokens == [Token("!", 5, -0.5)]
    assert parse_response([{"generated_text": "tgi"}]).generated_text == "tgi"  # TGI-compat array
    folded = parse_response(b"".join(lmi_lines(["a", "b"])))  # stream=true body read whole
    assert folded.generated_text == "ab"


def test_error_bodies() -> None:
    with pytest.raises(ModelError) as info:
        parse_response(b'{"code": 424, "error": "bad input"}')  # LMI 0.28: HTTP 200 with an error body
    assert info.value.status_code == 424 and info.value.message == "bad input"
    with pytest.raises(ModelError, match="nope"):
        parse_response({"error": {"message": "nope", "type": "invalid_request_error"}})
    partial = parse_response({"generated_text": "Deep", "details": {"finish_reason": "error"}})
    assert partial.finish_reason == "error"  # partial text is kept, as LMI does


def test_mid_stream_error_line_raises_with_partial_text() -> None:
    lines = [b'{"token": {"id": 1, "text": "Deep", "log_prob": -1}}',
             b'{"token": {"id": -1, "text": "", "log_prob": -1, "special_token": true}, "generated_text": "Deep", '
             b'"details": {"finish_reason": "error"}}']
    stream = TokenStream(lines)
    assert next(stream).text == "Deep"
    with pytest.raises(ModelError) as info:
        next(stream)
    assert info.value.body["partial_text"] == "Deep"


@pytest.fixture(params=["http", "sagemaker"])
def client(request, fake_lmi, smr) -> StreamingClient:
    if request.param == "http":
        return StreamingClient.from_url(fake_lmi.url)
    return StreamingClient.from_endpoint("ep", client=smr)


def test_generate_and_stream_agree(client: StreamingClient) -> None:
    whole = client.generate("one two three", max_new_tokens=8)
    stream = client.stream("one two three", {"max_new_tokens": 8})
    tokens = list(stream)
    assert [t.text for t in tokens] == ["one", " two", " three"]
    assert stream.result.generated_text == whole.generated_text == "one two three"


def test_stream_sse_from_container(fake_lmi) -> None:
    stream = StreamingClient.from_url(fake_lmi.url).stream("a b", sse=True)
    assert stream.text == "a b"


def test_client_errors(client: StreamingClient) -> None:
    with pytest.raises(ModelError) as info:
        client.generate("error400")
    assert info.value.status_code == 400 and info.value.message == "fake failure 400"
    with pytest.raises(ModelError) as info:
        client.stream("error503")
    assert info.value.status_code == 503


def test_custom_attributes_reach_container(client: StreamingClient, fake_lmi) -> None:
    client.generate("x", custom_attributes="adapter=a1")
    assert fake_lmi.requests[-1]["headers"]["X-Amzn-SageMaker-Custom-Attributes"] == "adapter=a1"


def test_adapter_keyword_sends_the_adapter_custom_attribute(client: StreamingClient, fake_lmi) -> None:
    client.generate("x", adapter="sql")
    assert fake_lmi.requests[-1]["headers"]["X-Amzn-SageMaker-Custom-Attributes"] == "adapter=sql"
    list(client.stream("x", custom_attributes="trace=1", adapter="sql"))
    assert fake_lmi.requests[-1]["headers"]["X-Amzn-SageMaker-Custom-Attributes"] == "trace=1;adapter=sql"
    assert with_adapter("trace=1", None) == "trace=1"
    with pytest.raises(ValueError, match="cannot be sent as a custom attribute"):
        with_adapter(None, "a;b")

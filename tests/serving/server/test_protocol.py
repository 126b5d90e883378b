"""Request parsing (LMI / OpenAI) and the exact response bytes of lmi-contract.md §4."""

import dataclasses
import json

import pytest

from serving.server.formatters import Formatter, Result
from serving.outputs import StreamDelta
from serving.server.adapters import header_adapter
from serving.server.api.lmi.request import parse_invocations
from serving.server.api.openai_chat import parse_chat
from serving.server.api.openai_completions import parse_completions
from serving.server.api.vllm_generate import parse_generate
from serving.server.protocol import loads_body

PROMPT = "What is Deep Learning?"
TOKENS = [(304, "Deep", -0.05), (11157, " Learning", -1.28), (338, " is", -0.007)]


def deltas(finish="length", tokens=TOKENS):
    out = []
    for i, (tid, text, lp) in enumerate(tokens):
        last = i == len(tokens) - 1
        out.append(StreamDelta(request_id="r", index=0, token_ids=(tid,), text=text, logprobs=(lp,),
                               token_texts=(text,), finish_reason=finish if last else None,
                               num_prompt_tokens=5, num_output_tokens=i + 1))
    return out


def run(req, stream, prompt=PROMPT, prompt_ids=(1, 2, 3, 4, 5), **kw):
    fmt = Formatter(req, created=1795316110, request_id="abc", model="m", **kw)
    r = Result(prompt=prompt, prompt_token_ids=list(prompt_ids), n=req.params.n)
    if not stream:
        for d in deltas():
            r.add(d)
        return fmt, fmt.body([r]).decode()
    out = fmt.start([r])
    for d in deltas():
        r.add(d)
        out += fmt.chunk(r, d)
    return fmt, (out + fmt.end([r])).decode()


# ---- parsing ---------------------------------------------------------------------------------

def test_lmi_defaults_are_30_tokens_greedy():
    req = parse_invocations({"inputs": "hi"})
    assert req.params.max_tokens == 30 and req.params.greedy and req.fmt == "json" and not req.stream


def test_do_sample_false_forces_greedy_even_with_temperature():
    assert parse_invocations({"inputs": "x", "parameters": {"temperature": 0.7}}).params.greedy
    p = parse_invocations({"inputs": "x", "parameters": {"do_sample": True}}).params
    assert p.temperature == 1.0
    p = parse_invocations({"inputs": "x", "parameters": {"do_sample": True, "temperature": 0.5, "top_p": 0.9,
                                                         "top_k": 5, "seed": "7", "stop_sequences": ["\n"],
                                                         "repetition_penalty": 1.05, "max_new_tokens": 5}}).params
    assert (p.temperature, p.top_p, p.top_k, p.seed, p.stop, p.repetition_penalty, p.max_tokens) == (
        0.5, 0.9, 5, 7, ("\n",), 1.05, 5)


def test_unknown_parameters_are_dropped_with_a_warning(caplog):
    req = parse_invocations({"inputs": "x", "parameters": {"watermark": True, "typical_p": 0.5, "bogus": 1}})
    assert req.warnings and "bogus" in req.warnings[0] and "watermark" in req.warnings[0]


@pytest.mark.parametrize("body, needle", [
    ({"inputs": 5}, "inputs"),
    ({"inputs": []}, "inputs"),
    ({"parameters": {}}, "inputs is required"),
    ({"inputs": "x", "parameters": {"max_new_tokens": "5"}}, "max_new_tokens must be an integer"),
    ({"inputs": "x", "parameters": {"max_new_tokens": 0}}, "max_new_tokens must be >= 1"),
    ({"inputs": "x", "parameters": {"do_sample": "yes"}}, "do_sample must be a boolean"),
    ({"inputs": "x", "parameters": {"temperature": -1}}, "temperature"),
    ({"inputs": "x", "parameters": {"top_p": 1.5, "do_sample": True}}, "top_p"),
    ({"inputs": "x", "parameters": {"top_k": -5}}, "top_k"),
    ({"inputs": "x", "parameters": {"stop_sequences": [1]}}, "stop_sequences"),
    ({"inputs": "x", "parameters": []}, "parameters must be a JSON object"),
    ({"inputs": "x", "stream": "true"}, "stream must be a boolean"),
    ({"inputs": ["a", "b"], "stream": True}, "streaming needs a single string"),
    ({"inputs": "x", "parameters": {"output_formatter": "xml"}}, "output_formatter"),
])
def test_invalid_invocations_raise_value_error(body, needle):
    with pytest.raises(ValueError, match=needle):
        parse_invocations(body)


def test_malformed_json():
    with pytest.raises(ValueError, match="malformed JSON"):
        loads_body(b'{"inputs": ')
    with pytest.raises(ValueError, match="JSON object"):
        loads_body(b"[1]")


def test_formatter_selection():
    assert parse_invocations({"inputs": "x", "stream": True}).fmt == "jsonlines"
    assert parse_invocations({"inputs": "x", "stream": True}, tgi_compat=True).fmt == "tgi_sse"
    assert parse_invocations({"inputs": "x"}, tgi_compat=True).fmt == "tgi_json"
    assert parse_invocations({"inputs": "x"}, output_formatter="jsonlines").fmt == "jsonlines"
    assert parse_invocations({"inputs": "x", "stream": True}, output_formatter="json").fmt == "json"
    assert parse_invocations({"inputs": "x", "parameters": {"output_formatter": "sse"}}).fmt == "sse"
    assert parse_invocations({"messages": [{"role": "user", "content": "hi"}]}).fmt == "json_chat"
    assert parse_invocations({"messages": [{"role": "user", "content": "hi"}], "stream": True}).fmt == "jsonlines_chat"


def test_list_inputs_are_a_batch():
    req = parse_invocations({"inputs": ["a", "b"], "parameters": {"max_new_tokens": 3}})
    assert req.batch and req.prompts == ("a", "b")


def test_openai_parsing():
    req = parse_completions({"model": "llama-2-13b-chat-hf", "prompt": "San Francisco is a", "max_tokens": 7,
                             "temperature": 0})
    assert req.params.greedy and req.params.max_tokens == 7 and req.prompts == ("San Francisco is a",)
    assert parse_completions({"prompt": "x"}).params.max_tokens == 16
    assert parse_completions({"prompt": [[1, 2], [3]]}).prompt_token_ids == ((1, 2), (3,))
    chat = parse_chat({"model": "m", "messages": [{"role": "system", "content": "s"},
                                                  {"role": "user", "content": [{"type": "text", "text": "q"}]}]})
    # no max_tokens: up to the context limit on /v1 (vLLM), LMI's 30 on /invocations
    assert chat.messages[1]["content"] == "q" and chat.params.temperature == 1.0 and chat.params.max_tokens is None
    assert parse_chat({"messages": [{"role": "user", "content": "x"}]}, route="invocations").params.max_tokens == 30
    assert parse_chat({"messages": [{"role": "user", "content": "x"}], "stream": True,
                       "stream_options": {"include_usage": True}}).include_usage
    for bad, needle in [({"messages": []}, "messages"), ({"messages": [{"content": "x"}]}, "role"),
                        ({"messages": [{"role": "user", "content": "x"}], "temperature": 3}, "temperature"),
                        ({"messages": [{"role": "user", "content": "x"}], "tools": [{}]}, "tools")]:
        with pytest.raises(ValueError, match=needle):
            parse_chat(bad)
    with pytest.raises(ValueError, match="prompt"):
        parse_completions({"prompt": 3})


def test_custom_attributes():
    # DJL's rules (split on ';', then on the first '=', both sides trimmed), on the one parser of the header
    assert header_adapter(" adapter = a1 ; x-max-items=3;flag") == "a1"
    assert header_adapter(" x-max-items=3;flag;ADAPTER=\"a=2\" ") == "a=2"
    assert header_adapter("flag; adapter; x=adapter=a1") is None


def test_each_wire_format_is_the_class_the_table_files_under_its_name():
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    reqs = [parse_invocations({"inputs": "x"}), parse_invocations({"inputs": "x", "stream": True}, tgi_compat=True),
            parse_invocations({"inputs": "x", "parameters": {"output_formatter": "none"}}), parse_invocations(chat),
            parse_invocations({**chat, "stream": True}), parse_chat({**chat, "stream": True}), parse_chat(chat),
            parse_completions({"prompt": "x"}), parse_generate({"prompt": "x", "stream": True})]
    for req in reqs:
        fmt = Formatter(req)
        assert type(fmt) is Formatter.FORMATS[req.fmt] and fmt.name == req.fmt and fmt.streams == req.stream
    assert len({req.fmt for req in reqs}) == len(reqs)
    with pytest.raises(AssertionError, match="no wire format 'bogus'"):
        Formatter(dataclasses.replace(reqs[0], fmt="bogus"))


# ---- exact bytes (lmi-contract.md §4, [ran] examples) ------------------------------------------

def test_json_default():
    _, body = run(parse_invocations({"inputs": PROMPT}), False)
    assert body == '{"generated_text": "Deep Learning is"}'


def test_json_details():
    fmt, body = run(parse_invocations({"inputs": PROMPT, "parameters": {"details": True}}), False)
    assert fmt.content_type == "application/json"
    assert body == ('{"generated_text": "Deep Learning is", "details": {"finish_reason": "length", '
                    '"generated_tokens": 3, "inputs": "What is Deep Learning?", "tokens": [{"id": 304, "text": '
                    '"Deep", "log_prob": -0.05}, {"id": 11157, "text": " Learning", "log_prob": -1.28}, {"id": 338, '
                    '"text": " is", "log_prob": -0.007}]}}')


def test_return_full_text_is_valid_json():  # the 0.28 bug wrote the prompt unescaped
    req = parse_invocations({"inputs": 'Say "hi"\n', "parameters": {"return_full_text": True}})
    _, body = run(req, False, prompt='Say "hi"\n')
    assert json.loads(body) == {"generated_text": 'Say "hi"\nDeep Learning is'}


def test_jsonlines():
    fmt, body = run(parse_invocations({"inputs": PROMPT, "stream": True}), True)
    assert fmt.content_type == "application/jsonlines"
    assert body == ('{"token": {"id": 304, "text": "Deep", "log_prob": -0.05}}\n'
                    '{"token": {"id": 11157, "text": " Learning", "log_prob": -1.28}}\n'
                    '{"token": {"id": 338, "text": " is", "log_prob": -0.007}, "generated_text": "Deep Learning is"}\n')


def test_jsonlines_details_last_line():
    _, body = run(parse_invocations({"inputs": PROMPT, "stream": True, "parameters": {"details": True}}), True)
    assert body.splitlines()[-1] == (
        '{"token": {"id": 338, "text": " is", "log_prob": -0.007}, "generated_text": "Deep Learning is", "details": '
        '{"finish_reason": "length", "generated_tokens": 3, "inputs": "What is Deep Learning?"}}')


def test_sse():
    fmt, body = run(parse_invocations({"inputs": PROMPT, "parameters": {"output_formatter": "sse"}}), True)
    assert fmt.content_type == "text/event-stream"
    assert body == ('data: {"token": {"id": 304, "text": "Deep", "log_prob": -0.05}}\n\n'
                    'data: {"token": {"id": 11157, "text": " Learning", "log_prob": -1.28}}\n\n'
                    'data: {"token": {"id": 338, "text": " is", "log_prob": -0.007}, '
                    '"generated_text": "Deep Learning is"}\n\n')


def test_tgi_compat_plain_and_stream():
    _, body = run(parse_invocations({"inputs": PROMPT}, tgi_compat=True), False)
    assert body == ('[{"generated_text": "Deep Learning is", "details": {"finish_reason": "length", '
                    '"generated_tokens": 3, "inputs": "What is Deep Learning?", "tokens": [{"id": 304, "text": '
                    '"Deep", "logprob": -0.05}, {"id": 11157, "text": " Learning", "logprob": -1.28}, {"id": 338, '
                    '"text": " is", "logprob": -0.007}]}}]')
    fmt, body = run(parse_invocations({"inputs": PROMPT, "stream": True}, tgi_compat=True), True)
    assert fmt.content_type == "text/event-stream"
    assert body.split("\n\n")[-2] == (
        'data: {"token": {"id": 338, "text": " is", "logprob": -0.007}, "generated_text": "Deep Learning is", '
        '"details": {"finish_reason": "length", "generated_tokens": 3, "inputs": "What is Deep Learning?"}}')


def test_decoder_input_details_prefill():
    req = parse_invocations({"inputs": "Hi", "parameters": {"details": True, "decoder_input_details": True}})
    fmt = Formatter(req, decode_token={1: "<s>", 2: "Hi"}.get)
    r = Result(prompt="Hi", prompt_token_ids=[1, 2])
    r.add(StreamDelta(request_id="r", index=0, token_ids=(5,), text="!", logprobs=(-0.5,), token_texts=("!",),
                      finish_reason="eos_token", prompt_logprobs=(None, -3.2)))
    assert fmt.body([r]).decode() == (
        '{"generated_text": "!", "details": {"finish_reason": "eos_token", "generated_tokens": 1, "inputs": "Hi", '
        '"tokens": [{"id": 5, "text": "!", "log_prob": -0.5}], "prefill": [{"id": 1, "text": "<s>", "log_prob": '
        'null}, {"id": 2, "text": "Hi", "log_prob": -3.2}]}}')


def test_chat_on_invocations_fixes_the_id_bug():
    req = parse_invocations({"messages": [{"role": "user", "content": PROMPT}]})
    _, body = run(req, False)
    assert body == ('{"id": "chatcmpl-abc", "object": "chat.completion", "created": 1795316110, "choices": '
                    '[{"index": 0, "message": {"role": "assistant", "content": "Deep Learning is"}, "logprobs": null, '
                    '"finish_reason": "length"}], "usage": {"prompt_tokens": 5, "completion_tokens": 3, '
                    '"total_tokens": 8}}')


def test_chat_stream_on_invocations_is_jsonlines_with_unwrapped_logprobs():
    req = parse_invocations({"messages": [{"role": "user", "content": PROMPT}], "stream": True,
                             "logprobs": True, "top_logprobs": 1})
    fmt, body = run(req, True)
    lines = body.splitlines()
    assert fmt.content_type == "application/jsonlines" and len(lines) == 3 and "[DONE]" not in body
    assert lines[0].startswith('{"id": "chatcmpl-abc", "object": "chat.completion.chunk", "created": 1795316110, '
                               '"choices": [{"index": 0, "delta": {"content": "Deep", "role": "assistant"}, '
                               '"logprobs": {"content": [{"token": "Deep", "logprob": -0.05, "bytes": '
                               '[68, 101, 101, 112], "top_logprobs": []}]}')
    assert json.loads(lines[-1])["choices"][0]["finish_reason"] == "length"


def test_v1_chat_stream_is_sse_with_done_and_openai_finish_reason():
    req = parse_chat({"messages": [{"role": "user", "content": "x"}], "stream": True,
                      "stream_options": {"include_usage": True}})
    fmt, body = run(req, True)
    events = body.split("\n\n")
    assert fmt.content_type == "text/event-stream" and events[-2] == "data: [DONE]" and events[-1] == ""
    objs = [json.loads(e[len("data: "):]) for e in events[:-2]]
    assert objs[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(o["choices"][0]["delta"].get("content", "") for o in objs if o["choices"]) == "Deep Learning is"
    assert objs[-2]["choices"][0]["finish_reason"] == "length" and objs[-1]["usage"]["total_tokens"] == 8
    assert all(o["model"] == "m" and o["object"] == "chat.completion.chunk" for o in objs)


def test_v1_completion_plain_and_stream():
    _, body = run(parse_completions({"prompt": "San Francisco is a", "max_tokens": 7}), False)
    obj = json.loads(body)
    assert obj["object"] == "text_completion" and obj["id"] == "cmpl-abc" and obj["model"] == "m"
    assert obj["choices"] == [{"index": 0, "text": "Deep Learning is", "logprobs": None, "finish_reason": "length",
                               "stop_reason": None}]
    assert obj["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    _, body = run(parse_completions({"prompt": "x", "stream": True}), True)
    assert body.endswith("data: [DONE]\n\n")


def test_eos_maps_to_stop_on_v1_only():
    req = parse_chat({"messages": [{"role": "user", "content": "x"}]})
    fmt = Formatter(req)
    r = Result(prompt="", prompt_token_ids=[1])
    for d in deltas(finish="eos_token"):
        r.add(d)
    assert json.loads(fmt.body([r]))["choices"][0]["finish_reason"] == "stop"


def test_error_record_ends_a_stream():
    req = parse_invocations({"inputs": PROMPT, "stream": True})
    fmt = Formatter(req)
    r = Result(prompt=PROMPT, prompt_token_ids=[1])
    d = deltas()[0]
    r.add(d)
    fmt.chunk(r, d)
    last = json.loads(fmt.error_record(r, "engine died"))
    assert last["details"] == {"finish_reason": "error"} and last["generated_text"] == "Deep"
    assert last["token"]["id"] == -1


def test_openai_logit_bias_user_echo_logprobs_and_continuous_usage():
    msg = [{"role": "user", "content": "x"}]
    chat = parse_chat({"messages": msg, "logit_bias": {"50": 200, "7": -1.5}, "user": "u-1"})
    assert chat.params.logit_bias == ((7, -1.5), (50, 100.0))  # clamped to [-100, 100] as vLLM
    assert parse_completions({"prompt": "x", "logit_bias": {"3": 1}}).params.logit_bias == ((3, 1.0),)
    assert parse_generate({"prompt": "x", "logit_bias": {"3": 1}}).params.logit_bias == ((3, 1.0),)
    for bad, needle in [({"logit_bias": [1]}, "logit_bias must be an object"),
                        ({"logit_bias": {"a": 1}}, "logit_bias keys must be token ids"),
                        ({"logit_bias": {"1": "x"}}, "logit_bias values must be finite"),
                        ({"user": 3}, "user must be a string")]:
        with pytest.raises(ValueError, match=needle):
            parse_chat({"messages": msg, **bad})
    echo = parse_completions({"prompt": "x", "echo": True, "logprobs": 2})
    assert echo.params.prompt_logprobs == 2 and echo.params.logprobs == 2
    assert parse_completions({"prompt": "x", "echo": True}).params.prompt_logprobs is None
    assert parse_completions({"prompt": "x", "logprobs": 1}).params.prompt_logprobs is None
    opts = {"include_usage": True, "continuous_usage_stats": True}
    assert parse_chat({"messages": msg, "stream": True, "stream_options": opts}).continuous_usage
    assert parse_completions({"prompt": "x", "stream": True, "stream_options": opts}).continuous_usage
    # as vLLM: continuous usage only together with include_usage
    assert not parse_chat({"messages": msg, "stream": True,
                           "stream_options": {"continuous_usage_stats": True}}).continuous_usage


def test_echo_logprobs_carry_the_prompt_tokens_and_continuous_usage_is_on_every_chunk():
    names = {1: "What", 2: " is", 3: " Deep", 4: " Learning", 5: "?"}
    first = StreamDelta(request_id="r", index=0, token_ids=(304,), text="Deep", logprobs=(-0.05,),
                        token_texts=("Deep",), prompt_logprobs=(None, -1.0, -2.0, -3.0, -4.0))
    for stream in (False, True):
        req = parse_completions({"prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 3, "stream": stream})
        fmt = Formatter(req, created=1, request_id="abc", model="m", decode_token=lambda t: names.get(t, "?"))
        r = Result(prompt=PROMPT, prompt_token_ids=[1, 2, 3, 4, 5])
        r.add(first)
        lp = (json.loads(fmt.body([r]))["choices"][0] if not stream else
              json.loads(fmt.chunk(r, first).decode()[6:])["choices"][0])["logprobs"]
        assert lp["tokens"] == ["What", " is", " Deep", " Learning", "?", "Deep"]
        assert lp["token_logprobs"] == [None, -1.0, -2.0, -3.0, -4.0, -0.05]
        assert lp["top_logprobs"][:3] == [None, {" is": -1.0}, {" Deep": -2.0}]
        assert lp["text_offset"] == [0, 4, 7, 12, 21, len(PROMPT)]
    opts = {"include_usage": True, "continuous_usage_stats": True}
    for body in ({"messages": [{"role": "user", "content": "x"}]}, {"prompt": "x"}):
        req = (parse_chat if "messages" in body else parse_completions)({**body, "stream": True, "stream_options": opts})
        _, raw = run(req, True)
        recs = [json.loads(e[6:]) for e in raw.split("\n\n") if e and e != "data: [DONE]"]
        usage = [rec["usage"]["completion_tokens"] for rec in recs]
        assert usage == ([0] if "messages" in body else []) + [1, 2, 3, 3], raw  # the last: the usage chunk
        assert all(rec["usage"]["prompt_tokens"] == 5 for rec in recs)

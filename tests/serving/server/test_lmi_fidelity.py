"""LMI fidelity at the formatter / protocol layers, byte for byte against what LMI writes.

The expected bytes are written out by hand from DJL Serving's `output_formatter.py` (every record is
`json.dumps(..., ensure_ascii=False)`, so non-ASCII text is raw UTF-8) and its documented response
schema (`lmi_input_output_schema.md`: `details.tokens`, `prefill`, `top_tokens`, `best_of_sequences`).
"""

from __future__ import annotations

import dataclasses

import pytest

from serving.outputs import StreamDelta
from serving.server.formatters import Formatter, Result
from serving.server.api.lmi.request import parse_invocations
from serving.server.api.openai_chat import parse_chat
from serving.server.api.openai_completions import parse_completions
from serving.server.protocol import GenerateRequest

VOCAB = {1: "<s>", 101: "长城", 102: "是", 103: "😀", 104: "！", 105: "的", 106: "历史"}
PROMPT = "长城"
PROMPT_IDS = [1, 101]


def _delta(tid: int, lp: float, index: int = 0, finish: str | None = None, top=None, **kw) -> StreamDelta:
    return StreamDelta("r", index, (tid,), VOCAB[tid], logprobs=(lp,), token_texts=(VOCAB[tid],),
                       top_logprobs=(top,) if top is not None else (), finish_reason=finish, **kw)


GREEDY = [_delta(102, -0.5), _delta(103, -1.25), _delta(104, -0.125, finish="length")]


def render(req: GenerateRequest, deltas: list[StreamDelta], prompt_logprobs=None) -> bytes:
    """The whole response body: plain, or every stream record concatenated."""
    fmt = Formatter(req, request_id="x", created=7, model="m", decode_token=VOCAB.__getitem__)
    r = Result(prompt=PROMPT, prompt_token_ids=list(PROMPT_IDS), n=req.params.n, decode_token=VOCAB.__getitem__)
    if prompt_logprobs is not None:
        deltas = [dataclasses.replace(deltas[0], prompt_logprobs=prompt_logprobs)] + deltas[1:]
    if not req.stream:
        for d in deltas:
            r.add(d)
        return fmt.body([r])
    out = fmt.start([r])
    for d in deltas:
        r.add(d)
        out += fmt.chunk(r, d)
    return out + fmt.end([r])


def lmi(**parameters) -> GenerateRequest:
    stream = parameters.pop("stream", False)
    return parse_invocations({"inputs": PROMPT, "parameters": parameters, "stream": stream})


# ---- (a) raw UTF-8 in every format ----------------------------------------------------------------

def test_json_non_ascii_is_raw_utf8():
    assert render(lmi(), GREEDY) == '{"generated_text": "是😀！"}'.encode()
    assert render(lmi(details=True), GREEDY) == (
        '{"generated_text": "是😀！", "details": {"finish_reason": "length", "generated_tokens": 3, '
        '"inputs": "长城", "tokens": [{"id": 102, "text": "是", "log_prob": -0.5}, '
        '{"id": 103, "text": "😀", "log_prob": -1.25}, {"id": 104, "text": "！", "log_prob": -0.125}]}}').encode()


def test_jsonlines_and_sse_non_ascii_are_raw_utf8():
    lines = ('{"token": {"id": 102, "text": "是", "log_prob": -0.5}}',
             '{"token": {"id": 103, "text": "😀", "log_prob": -1.25}}',
             '{"token": {"id": 104, "text": "！", "log_prob": -0.125}, "generated_text": "是😀！", '
             '"details": {"finish_reason": "length", "generated_tokens": 3, "inputs": "长城"}}')
    assert render(lmi(stream=True, details=True), GREEDY) == "".join(f"{x}\n" for x in lines).encode()
    assert render(lmi(stream=True, details=True, output_formatter="sse"), GREEDY) == \
        "".join(f"data: {x}\n\n" for x in lines).encode()


def test_tgi_compat_non_ascii_is_raw_utf8():
    req = parse_invocations({"inputs": PROMPT, "parameters": {"max_new_tokens": 3}}, tgi_compat=True)
    assert render(req, GREEDY[-1:]) == (
        '[{"generated_text": "！", "details": {"finish_reason": "length", "generated_tokens": 1, "inputs": "长城", '
        '"tokens": [{"id": 104, "text": "！", "logprob": -0.125}]}}]').encode()


def test_chat_and_v1_non_ascii_are_raw_utf8():
    body = {"messages": [{"role": "user", "content": "长城"}]}
    for req in (parse_invocations(body), parse_chat(body), parse_completions({"prompt": PROMPT}),
                parse_invocations({**body, "stream": True}), parse_chat({**body, "stream": True}),
                parse_completions({"prompt": PROMPT, "stream": True})):
        out = render(req, GREEDY)
        assert "是".encode() in out and "😀".encode() in out and b"\\u" not in out, req.fmt


# ---- (b) best_of_sequences, top_tokens, prefill, truncate, num_beams ------------------------------

def _two_samples(finish=("length", "eos_token")) -> list[StreamDelta]:
    # sample 0: cumulative logprob -1.5; sample 1: -0.375 (the best: generated_text)
    return [_delta(102, -0.5, 0), _delta(103, -0.25, 1),
            _delta(104, -1.0, 0, finish=finish[0]), _delta(104, -0.125, 1, finish=finish[1])]


def test_best_of_returns_best_of_sequences():
    req = lmi(best_of=2, do_sample=True)
    assert req.params.n == req.params.best_of == 2 and req.details  # details come with best_of, as in LMI
    assert render(req, _two_samples()) == (
        '{"generated_text": "😀！", "details": {"inputs": "长城", "finish_reason": "eos_token", '
        '"generated_tokens": 2, "tokens": [{"id": 103, "text": "😀", "log_prob": -0.25}, '
        '{"id": 104, "text": "！", "log_prob": -0.125}], "best_of_sequences": [{"finish_reason": "length", '
        '"generated_tokens": 2, "tokens": [{"id": 102, "text": "是", "log_prob": -0.5}, '
        '{"id": 104, "text": "！", "log_prob": -1.0}], "generated_text": "是！"}]}}').encode()


def test_n_alone_and_tgi_compat_best_of():
    assert lmi(n=3).params.n == 3 and lmi(n=2, best_of=4).params.n == 4  # LMI: n = best_of when given
    req = parse_invocations({"inputs": PROMPT, "parameters": {"best_of": 2, "return_full_text": True}},
                            tgi_compat=True)
    assert render(req, _two_samples()) == (
        '[{"generated_text": "长城😀！", "details": {"inputs": "长城", "finish_reason": "eos_token", '
        '"generated_tokens": 2, "tokens": [{"id": 103, "text": "😀", "logprob": -0.25}, '
        '{"id": 104, "text": "！", "logprob": -0.125}], "best_of_sequences": [{"finish_reason": "length", '
        '"generated_tokens": 2, "tokens": [{"id": 102, "text": "是", "logprob": -0.5}, '
        '{"id": 104, "text": "！", "logprob": -1.0}], "generated_text": "长城是！"}]}}]').encode()
    none = parse_invocations({"inputs": PROMPT, "parameters": {"n": 2, "output_formatter": "none"}})
    assert render(none, _two_samples()) == "😀！".encode()


@pytest.mark.parametrize("parameters, stream, needle", [
    ({"n": 3, "best_of": 2}, False, "best_of must be >= n"),
    ({"n": 17}, False, "n must be in [1, 16]"),
    ({"best_of": 2}, True, "needs a non-streaming request"),
    ({"num_beams": 4}, False, "num_beams > 1 (beam search) is not supported"),
    ({"use_beam_search": True}, False, "num_beams > 1 (beam search) is not supported"),
    ({"top_n_tokens": 21}, False, "top_n_tokens must be in [0, 20]"),
    ({"truncate": 0}, False, "truncate must be >= 1"),
])
def test_invalid_lmi_parameters_are_400s(parameters, stream, needle):
    with pytest.raises(ValueError) as err:
        parse_invocations({"inputs": "x", "parameters": parameters, "stream": stream})
    assert needle in str(err.value)


def test_num_beams_1_and_the_implemented_names_are_not_dropped():
    req = lmi(num_beams=1, use_beam_search=False, top_n_tokens=1, truncate=3, best_of=1, n=1)
    assert req.warnings == () and req.params.n == 1 and req.truncate == 3 and req.top_n_tokens == 1


def test_top_tokens_per_token():
    req = lmi(details=True, top_n_tokens=2)
    assert req.params.logprobs == 2
    deltas = [_delta(102, -0.5, top={102: -0.5, 105: -1.5}),  # the chosen token is among the top 2
              _delta(103, -1.25, top={105: -0.75, 106: -1.0}, finish="length")]  # it is not
    top = ('"top_tokens": [[{"id": 102, "text": "是", "log_prob": -0.5}, {"id": 105, "text": "的", "log_prob": -1.5}], '
           '[{"id": 103, "text": "😀", "log_prob": -1.25}, {"id": 105, "text": "的", "log_prob": -0.75}, '
           '{"id": 106, "text": "历史", "log_prob": -1.0}]]')
    assert render(req, deltas) == (
        '{"generated_text": "是😀", "details": {"finish_reason": "length", "generated_tokens": 2, "inputs": "长城", '
        '"tokens": [{"id": 102, "text": "是", "log_prob": -0.5}, {"id": 103, "text": "😀", "log_prob": -1.25}], '
        f'{top}}}}}').encode()
    last = render(lmi(details=True, top_n_tokens=2, stream=True), deltas).splitlines()[-1]
    assert last == ('{"token": {"id": 103, "text": "😀", "log_prob": -1.25}, "generated_text": "是😀", "details": '
                    f'{{"finish_reason": "length", "generated_tokens": 2, "inputs": "长城", {top}}}}}').encode()


PREFILL = '"prefill": [{"id": 1, "text": "<s>", "log_prob": null}, {"id": 101, "text": "长城", "log_prob": -3.5}]'


def test_decoder_input_details_prefill_plain_and_on_the_final_streamed_record():
    req = lmi(details=True, decoder_input_details=True)
    assert req.params.prompt_logprobs == 1  # LMI's value
    assert render(req, GREEDY[-1:], prompt_logprobs=(None, -3.5)) == (
        '{"generated_text": "！", "details": {"finish_reason": "length", "generated_tokens": 1, "inputs": "长城", '
        f'"tokens": [{{"id": 104, "text": "！", "log_prob": -0.125}}], {PREFILL}}}}}').encode()
    streamed = render(lmi(details=True, decoder_input_details=True, stream=True), GREEDY,
                      prompt_logprobs=(None, -3.5)).splitlines()
    assert streamed[-1] == (
        '{"token": {"id": 104, "text": "！", "log_prob": -0.125}, "generated_text": "是😀！", "details": '
        f'{{"finish_reason": "length", "generated_tokens": 3, "inputs": "长城", {PREFILL}}}}}').encode()
    assert b"prefill" not in b"".join(streamed[:-1])


# ---- through the app (fake engine: char tokenizer, id 0 = BOS, "abc..." at logprob -0.5) -----------

@pytest.fixture(scope="module")
def client():
    from fake_engine_loop import FakeEngineLoop

    from serving.server.settings.config import load_config
    from serving.server.app import create_app
    return create_app(FakeEngineLoop(), load_config({}, [])).test_client()


def test_truncate_keeps_the_last_prompt_tokens(client):
    body = {"inputs": "长城" + "x" * 100, "parameters": {"max_new_tokens": 1, "truncate": 2, "details": True,
                                                        "decoder_input_details": True}}
    r = client.post("/invocations", json=body)  # 103 tokens > max_model_len 64, unless truncated first
    assert r.status_code == 200 and r.data == (
        '{"generated_text": "a", "details": {"finish_reason": "length", "generated_tokens": 1, "inputs": '
        f'"长城{"x" * 100}", "tokens": [{{"id": 97, "text": "a", "log_prob": -0.5}}], "prefill": '
        '[{"id": 120, "text": "x", "log_prob": null}, {"id": 120, "text": "x", "log_prob": null}]}}').encode()
    r = client.post("/invocations", json={"inputs": "长城", "parameters": {"max_new_tokens": 1, "truncate": 9,
                                                                          "details": True, "decoder_input_details": True}})
    assert [t["id"] for t in r.json["details"]["prefill"]] == [0, ord("长"), ord("城")]  # shorter: whole


def test_n_through_the_app(client):
    r = client.post("/invocations", json={"inputs": "hi", "parameters": {"max_new_tokens": 2, "n": 3}})
    details = r.json["details"]
    assert r.status_code == 200 and r.json["generated_text"] == "ab" and details["generated_tokens"] == 2
    assert [s["generated_text"] for s in details["best_of_sequences"]] == ["ab", "ab"]


@pytest.mark.parametrize("how", ["header", "body", "list"])
def test_adapters_field_is_answered_as_the_adapter_header(client, how):
    body: dict = {"inputs": "hi"}
    headers = {}
    if how == "header":
        headers["X-Amzn-SageMaker-Custom-Attributes"] = "adapter=a1"
    else:
        body["adapters"] = "a1" if how == "body" else ["a1"]
    r = client.post("/invocations", json=body, headers=headers)
    assert r.status_code == 404 and r.json == {
        "error": "unknown adapter 'a1': LoRA adapters are not enabled on this server (set OPTION_ENABLE_LORA=true "
                 "/ option.enable_lora=true)", "code": 404}
    r = client.post("/invocations", json={"messages": [{"role": "user", "content": "hi"}], "adapters": "a1"})
    assert r.status_code == 404 and "unknown adapter 'a1'" in r.json["error"]

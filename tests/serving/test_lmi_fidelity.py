"""LMI fidelity at the formatter / protocol layers, byte for byte against what LMI writes.

The expected bytes are written out by hand from DJL Serving's `output_formatter.py` (every record is
`json.dumps(..., ensure_ascii=False)`, so non-ASCII text is raw UTF-8) and its documented response
schema (`lmi_input_output_schema.md`: `details.tokens`, `prefill`, `top_tokens`, `best_of_sequences`).
"""

from __future__ import annotations

import pytest

from serving.outputs import StreamDelta
from serving.server.formatters import Formatter, Result
from serving.server.protocol import GenerateRequest, parse_chat, parse_completions, parse_invocations

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
        deltas = [StreamDelta(**{**deltas[0].__dict__, "prompt_logprobs": prompt_logprobs})] + deltas[1:]
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

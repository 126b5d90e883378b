"""The per-token hot path of a stream: template records == the json.dumps records, byte for byte;
coalesced writes carry the same records, whole, one per line/event, in order."""

import json
import math
import queue
import random

import pytest
from fake_engine_loop import FakeEngineLoop, FakeStream

from serving.server.settings.serving_config import load_config
from serving.engine.request_stream import RequestStream
from serving.server.formatters import Formatter, Result
from serving.outputs import StreamDelta
from serving.server.api.lmi.request import parse_invocations
from serving.server.api.openai_chat import parse_chat
from serving.server.api.openai_completions import parse_completions
from serving.server.request_runner import RequestRunner

TEXTS = ["", " the", "caf\u00e9", '"q"', "back\\slash", "\n", "\t\x00\x1f", "\u2028", "\U0001f600",
         "</script>", "\u00fc" * 40, " "]
LOGPROBS = [-0.5, -0.0, 0.0, -1e-300, -123456.789, float("nan"), float("-inf"), -2.220446049250313e-16]

REQUESTS = {
    "jsonlines": lambda: parse_invocations({"inputs": "x", "stream": True, "parameters": {"max_new_tokens": 200}}),
    "jsonlines_full": lambda: parse_invocations(
        {"inputs": "x", "stream": True, "parameters": {"max_new_tokens": 200, "details": True,
                                                          "return_full_text": True}}),
    "sse": lambda: parse_invocations({"inputs": "x", "stream": True, "parameters": {"output_formatter": "sse"}}),
    "tgi_sse": lambda: parse_invocations({"inputs": "x", "stream": True}, tgi_compat=True),
    "chat_sse": lambda: parse_chat({"messages": [{"role": "user", "content": "x"}], "stream": True, "n": 2}),
    "chat_sse_logprobs": lambda: parse_chat({"messages": [{"role": "user", "content": "x"}], "stream": True,
                                             "logprobs": True, "top_logprobs": 2}),
    "jsonlines_chat": lambda: parse_invocations({"messages": [{"role": "user", "content": "x"}], "stream": True}),
    "completion_sse": lambda: parse_completions({"prompt": "x", "stream": True, "n": 2}),
    "completion_sse_echo": lambda: parse_completions({"prompt": "x", "stream": True, "echo": True, "logprobs": 1}),
}


def random_deltas(rng: random.Random, n: int, count: int) -> list[StreamDelta]:
    out = []
    for i in range(count):
        for index in range(n):
            k = rng.choice([0, 1, 1, 1, 2])
            ids = tuple(rng.choice([0, 5, 17, 50256, 2**40]) for _ in range(k))
            texts = tuple(rng.choice(TEXTS) for _ in ids)
            lps = tuple(rng.choice(LOGPROBS) for _ in ids) if rng.random() < 0.8 else ()
            top = tuple({5: lp, 17: -3.0} for lp in lps) if rng.random() < 0.5 else ()
            last = i == count - 1
            out.append(StreamDelta("r", index, ids, "".join(texts) if rng.random() < 0.9 else rng.choice(TEXTS),
                                   logprobs=lps, top_logprobs=top, token_texts=texts if rng.random() < 0.7 else (),
                                   finish_reason=rng.choice(["length", "eos_token", "error"]) if last else None,
                                   error="boom \u00e9" if last and rng.random() < 0.3 else None))
    return out


@pytest.mark.parametrize("name", sorted(REQUESTS))
def test_template_records_equal_json_dumps_records(name):
    """`chunk` (template fast path where it applies) writes exactly what `_chunk` (dicts + json.dumps) writes."""
    rng = random.Random(name)
    for trial in range(20):
        req = REQUESTS[name]()
        fast = Formatter(req, model="m \u00e9", request_id="abc", created=1795316110, special_ids=frozenset({0, 5}),
                         decode_token=lambda t: f"<{t}>")
        slow = Formatter(req, model="m \u00e9", request_id="abc", created=1795316110, special_ids=frozenset({0, 5}),
                         decode_token=lambda t: f"<{t}>")
        rf = Result(prompt="p\u00e9", prompt_token_ids=[1, 2], n=req.params.n, decode_token=lambda t: f"<{t}>")
        rs = Result(prompt="p\u00e9", prompt_token_ids=[1, 2], n=req.params.n, decode_token=lambda t: f"<{t}>")
        assert fast.start([rf]) == slow.start([rs])
        for p, d in enumerate(random_deltas(rng, req.params.n, 12)):
            rf.add(d)
            rs.add(d)
            got = fast.chunk(rf, d, p % 2)
            want = slow._chunk(rs, rs.sample(d.index), d, p % 2)
            assert got == want, (trial, d)
            if not any(isinstance(x, float) and not math.isfinite(x) for x in d.logprobs):
                json.loads(got.decode().removeprefix("data: "))
        assert rf.samples == rs.samples


@pytest.mark.parametrize("name", ["jsonlines", "sse", "tgi_sse", "chat_sse", "jsonlines_chat", "completion_sse"])
def test_mid_stream_records_take_the_template_path(name, monkeypatch):
    req = REQUESTS[name]()
    fmt = Formatter(req, model="m", request_id="abc", created=1, special_ids=frozenset({0}))
    r = Result(prompt="p", prompt_token_ids=[1], n=req.params.n)
    fmt.start([r])
    first = StreamDelta("r", 0, (5,), "a", logprobs=(-0.5,))
    r.add(first)
    fmt.chunk(r, first)  # may set up the chat role
    monkeypatch.setattr(type(fmt), "_chunk", lambda *a: pytest.fail("slow path on a mid-stream record"))
    for i in range(3):
        d = StreamDelta("r", 0, (6 + i,), "b", logprobs=(-0.25,))
        r.add(d)
        fmt.chunk(r, d)


def test_result_add_accumulates_like_before():
    r = Result(prompt="p", prompt_token_ids=[1], decode_token=lambda t: f"<{t}>")
    r.add(StreamDelta("r", 0, (1, 2), "ab", logprobs=(-1.0,), token_texts=()))
    r.add(StreamDelta("r", 0, (3,), "c", logprobs=(-0.5, -0.25)))
    r.add(StreamDelta("r", 0, (), "", finish_reason="length", top_logprobs=({1: -0.1},)))
    s = r.sample(0)
    assert s.token_ids == [1, 2, 3] and s.token_texts == ["<1>", "<2>", "c"] and s.logprobs == [-1.0, None, -0.5]
    assert s.text == "abc" and s.top_logprobs == [{1: -0.1}] and s.finish_reason == "length" and r.finished
    assert isinstance(s.token_ids, list) and isinstance(s.logprobs, list) and isinstance(s.token_texts, list)


def test_request_stream_get_nowait():
    stream = RequestStream(loop=None, request_id="r", n=1)  # type: ignore[arg-type]
    assert stream.get_nowait() is None
    with pytest.raises(queue.Empty):
        stream.get(timeout=0.01)
    deltas = [StreamDelta("r", 0, (i,), "x") for i in range(3)] + [StreamDelta("r", 0, (), "", finish_reason="length")]
    assert [stream._put(d) for d in deltas] == [False, False, False, True] and stream.finished
    assert stream.get(timeout=1) is deltas[0]
    assert [stream.get_nowait() for _ in range(4)] == deltas[1:] + [None]


class EagerLoop(FakeEngineLoop):
    """Every delta of a request is already queued when add_request returns (a stream that fell behind)."""

    def add_request(self, request_id, prompt_token_ids, params):
        stream = FakeStream(self, request_id)
        self.params.append(params)
        with self.lock:
            self.active.add(request_id)
        self._run(stream, "".join(chr(i) for i in prompt_token_ids if i), params)
        return stream


class OneAtATime:
    """A stream whose get_nowait never has anything: the runner takes one delta per write (the reference)."""

    def __init__(self, stream):
        self._s = stream

    def get(self, timeout=None):
        return self._s.get(timeout)

    def get_nowait(self):
        return None

    def close(self):
        self._s.close()


class OneAtATimeLoop(EagerLoop):
    def add_request(self, request_id, prompt_token_ids, params):
        return OneAtATime(super().add_request(request_id, prompt_token_ids, params))


def stream_writes(loop, body, route="invocations"):
    runner = RequestRunner(loop, load_config({}, []))
    parse = {"invocations": parse_invocations, "chat": parse_chat, "completions": parse_completions}[route]
    req = parse(body)
    writes = list(runner.run_stream(req, "abc"))
    assert runner.inflight == 0 and not loop.active
    return writes


@pytest.mark.parametrize("route, body, sep", [
    ("invocations", {"inputs": "hi", "stream": True, "parameters": {"max_new_tokens": 40}}, b"\n"),
    ("invocations", {"inputs": "FAIL", "stream": True, "parameters": {"max_new_tokens": 40}}, b"\n"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "stream": True, "n": 3, "max_tokens": 9,
              "stream_options": {"include_usage": True}}, b"\n\n"),
    ("completions", {"prompt": "x", "stream": True, "max_tokens": 30, "echo": True}, b"\n\n"),
])
def test_coalesced_writes_carry_the_same_records(route, body, sep):
    writes = stream_writes(EagerLoop(), body, route)
    ref = stream_writes(OneAtATimeLoop(), body, route)
    assert b"".join(writes) == b"".join(ref)  # the same bytes, record for record
    assert len(writes) < len(ref) and all(w for w in writes)
    # the reference writes one record per write; every coalesced write ends on a record boundary
    assert all(w.endswith(sep) for w in writes + ref)
    records = b"".join(writes).split(sep)
    assert records[-1] == b""
    parsed = [json.loads(rec.decode().removeprefix("data: ")) for rec in records[:-1] if rec != b"data: [DONE]"]
    assert len(records) - 1 == sum(w.count(sep) for w in ref)
    if route == "invocations":
        texts = [o["token"]["text"] for o in parsed]
        if body["inputs"] == "hi":
            assert texts == [chr(ord("a") + i % 26) for i in range(40)] and "error" not in parsed[-1]
        else:  # two tokens, then the engine's error
            assert texts == ["a", "b", ""] and parsed[-1]["error"] == "boom"
        assert parsed[-1]["generated_text"] == "".join(texts)


def test_coalescing_stops_at_a_stream_that_is_not_ahead():
    """With one delta available at a time, every record is its own write, at once."""
    loop = FakeEngineLoop(delay=0.01)
    writes = stream_writes(loop, {"inputs": "hi", "stream": True, "parameters": {"max_new_tokens": 5}})
    assert [json.loads(w)["token"]["text"] for w in writes] == list("abcde")

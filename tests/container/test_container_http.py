"""The container over HTTP: `container/serve` (gunicorn + the real engine, default model, fp32 CPU).

One server for the module. Covers the /ping lifecycle, every output format plain and streamed,
chat on both routes, the seeds' curl payloads verbatim, every 4xx while 16 streams keep going,
64 concurrent streams, disconnect cleanup (KV blocks from /metrics) and custom attributes.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from lmi_server import LMIServer, check_jsonlines, stream_lines

pytestmark = pytest.mark.slow
# The module server's context (lmi_server's default is 512): the requests without max_tokens below (the
# seeds' chat payload, the long story) decode until the context is full, one token per step on one
# thread, so half the context halves the module's longest tests; every check reads this constant.
MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("serve")
    srv = LMIServer({"OPTION_MAX_MODEL_LEN": str(MAX_MODEL_LEN)}, cwd, cwd / "serve.log")
    try:
        srv.wait(200)
        yield srv
    finally:
        srv.stop()


def post(server, path, body, **kw):
    return requests.post(server.url + path, json=body, timeout=120, **kw)


def test_ping_lifecycle_503_until_loaded_then_small_json(server):
    seen = server.ping_history
    assert 200 not in seen[:-1] and seen[-1] == 200
    assert any(s in (0, 503) for s in seen[:-1]), seen  # refused or 503 while loading, never 200 early
    r = requests.get(server.url + "/ping", timeout=2)
    assert r.status_code == 200 and r.headers["Content-Type"] == "application/json" and r.json() == {
        "status": "Healthy"}
    assert r.elapsed.total_seconds() < 2


def test_json_plain_details_and_list(server):
    r = post(server, "/invocations", {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 8}})
    assert r.status_code == 200 and r.headers["Content-Type"] == "application/json"
    assert list(r.json()) == ["generated_text"] and r.json()["generated_text"]
    r = post(server, "/invocations", {"inputs": "Hello, my name is",
                                      "parameters": {"max_new_tokens": 8, "details": True,
                                                     "decoder_input_details": True}})
    d = r.json()["details"]
    assert d["generated_tokens"] == len(d["tokens"]) <= 8 and d["finish_reason"] in ("length", "eos_token")
    assert d["inputs"] == "Hello, my name is" and d["prefill"][0]["log_prob"] is None
    assert r.json()["generated_text"] == "".join(t["text"] for t in d["tokens"] if not t.get("special_token"))
    r = post(server, "/invocations", {"inputs": ["a", "The future of AI is"], "parameters": {"max_new_tokens": 4}})
    assert isinstance(r.json(), list) and len(r.json()) == 2
    r = post(server, "/invocations", {"inputs": "Say \"hi\"\n", "parameters": {"max_new_tokens": 4,
                                                                              "return_full_text": True}})
    assert r.json()["generated_text"].startswith('Say "hi"\n')


def test_greedy_is_deterministic_and_matches_stream(server):
    body = {"inputs": "The president of the United States is", "parameters": {"max_new_tokens": 12}}
    a = post(server, "/invocations", body).json()["generated_text"]
    assert post(server, "/invocations", body).json()["generated_text"] == a
    r, lines = stream_lines(server.url + "/invocations", {**body, "stream": True})
    assert r.headers["Content-Type"] == "application/jsonlines" and r.headers.get("Transfer-Encoding") == "chunked"
    assert check_jsonlines(lines)["generated_text"] == a


def test_sse_and_none_formatters(server):
    r = requests.post(server.url + "/invocations", json={"inputs": "Hi", "parameters": {
        "max_new_tokens": 5, "output_formatter": "sse", "details": True}}, stream=True, timeout=60)
    raw = r.content.decode()
    assert r.headers["Content-Type"] == "text/event-stream" and raw.endswith("\n\n")
    events = [json.loads(e[len("data: "):]) for e in raw.split("\n\n") if e]
    assert events[-1]["details"]["generated_tokens"] == len(events)
    r = post(server, "/invocations", {"inputs": "Hi", "parameters": {"max_new_tokens": 3, "output_formatter": "none"}})
    assert r.headers["Content-Type"].startswith("text/plain")


def test_chat_on_invocations_plain_and_stream(server):
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    r = post(server, "/invocations", {"messages": msgs, "max_tokens": 8})
    obj = r.json()
    assert obj["object"] == "chat.completion" and obj["id"].startswith("chatcmpl-") and "built-in" not in obj["id"]
    assert obj["choices"][0]["message"]["role"] == "assistant" and obj["usage"]["completion_tokens"] <= 8
    assert "<|im_start|>" not in obj["choices"][0]["message"]["content"]  # generation prompt was added
    r, lines = stream_lines(server.url + "/invocations", {"messages": msgs, "max_tokens": 8, "stream": True,
                                                          "logprobs": True, "top_logprobs": 2})
    chunks = [json.loads(ln) for ln in lines]
    assert r.headers["Content-Type"] == "application/jsonlines" and all(
        c["object"] == "chat.completion.chunk" for c in chunks)
    assert isinstance(chunks[0]["choices"][0]["logprobs"], dict)  # not array-wrapped (0.28 bug)
    assert len(chunks[0]["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "eos_token")


def test_seed_curl_payloads_verbatim(server):
    # ../shared/docs/seed-code.md §3, byte for byte as the users send them
    r = requests.post(server.url + "/v1/completions", headers={"Content-Type": "application/json"}, data='''{
"model": "llama-2-13b-chat-hf",
"prompt": "San Francisco is a",
"max_tokens": 7,
"temperature": 0
}''', timeout=60)
    obj = r.json()
    assert r.status_code == 200 and obj["object"] == "text_completion" and obj["usage"]["completion_tokens"] <= 7
    assert obj["choices"][0]["finish_reason"] in ("length", "stop") and obj["choices"][0]["text"]
    r = requests.post(server.url + "/v1/chat/completions", headers={"Content-Type": "application/json"}, data='''{
"model": "llama-2-13b-chat-hf",
"messages": [
{"role": "system", "content": "You are a helpful assistant."},
{"role": "user", "content": "Who won the world series in 2020?"}
]
}''', timeout=120)
    obj = r.json()
    assert r.status_code == 200 and obj["object"] == "chat.completion" and obj["choices"][0]["message"]["content"]
    assert obj["usage"]["total_tokens"] == obj["usage"]["prompt_tokens"] + obj["usage"]["completion_tokens"]
    r = requests.get(server.url + "/v1/models", timeout=10)
    assert r.json()["object"] == "list" and r.json()["data"][0]["id"] == "SmolLM2-135M-Instruct"


def test_v1_streams_end_with_done(server):
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5,
                                                 "stream": True, "stream_options": {"include_usage": True},
                                                 "temperature": 0}),
                       ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 5, "stream": True})):
        r = requests.post(server.url + path, json=body, stream=True, timeout=60)
        raw = r.content.decode()
        assert r.headers["Content-Type"] == "text/event-stream" and raw.endswith("data: [DONE]\n\n"), raw
        objs = [json.loads(e[6:]) for e in raw.split("\n\n") if e and e != "data: [DONE]"]
        assert objs[-1]["usage"]["completion_tokens"] <= 5 if "usage" in objs[-1] else True


def _background_streams(server, n: int, max_new_tokens: int = 8):
    results: list = [None] * n

    def one(i: int) -> None:
        r, lines = stream_lines(server.url + "/invocations", {
            "inputs": f"Story number {i}: once upon a time", "stream": True,
            "parameters": {"max_new_tokens": max_new_tokens, "details": True}})
        results[i] = (r.status_code, lines)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    return threads, results


def test_every_error_while_16_streams_continue(server):
    threads, results = _background_streams(server, 16)
    big = b'{"inputs": "' + b"x" * (6 * 1024 * 1024) + b'"}'
    cases = [
        (b'{"inputs": "unterminated', "malformed JSON"),
        (b'{"inputs": 42}', "inputs"),
        (b'{"inputs": "x", "parameters": {"max_new_tokens": "ten"}}', "max_new_tokens must be an integer"),
        (b'{"inputs": "x", "parameters": {"temperature": -0.5, "do_sample": true}}', "temperature"),
        (b'{"inputs": "x", "parameters": {"top_p": 7, "do_sample": true}}', "top_p"),
        (json.dumps({"inputs": "word " * 600}).encode(), "maximum context length is"),
        (big, "limit"),
    ]
    for body, needle in cases:
        r = requests.post(server.url + "/invocations", data=body, headers={"Content-Type": "application/json"},
                          timeout=60)
        status = 413 if body is big else 400  # a body over max_request_size is too large, not malformed
        assert r.status_code == status, (needle, r.status_code, r.text[:200])
        assert r.headers["Content-Type"] == "application/json" and set(r.json()) == {"error", "code"}
        assert r.json()["code"] == status and needle in r.json()["error"]
    r = post(server, "/v1/chat/completions", {"messages": "nope"})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]  # OpenAI's error object on /v1
    for t in threads:
        t.join(120)
    for status, lines in results:
        assert status == 200
        last = check_jsonlines(lines)
        assert last["details"]["finish_reason"] in ("length", "eos_token")
        assert last["details"]["generated_tokens"] == len(lines)


def test_64_concurrent_streams_complete(server):
    def one(i: int) -> tuple[int, str, dict]:
        body = {"inputs": f"Question {i}: what is the color of the sky?", "stream": True,
                "parameters": {"max_new_tokens": 6, "details": True}}
        r, lines = stream_lines(server.url + "/invocations", body)
        return r.status_code, lines, check_jsonlines(lines)

    with ThreadPoolExecutor(64) as pool:
        futures = [pool.submit(one, i) for i in range(64)]
        pings = []
        while not all(f.done() for f in futures):  # /ping stays fast while 64 streams run
            r = requests.get(server.url + "/ping", timeout=2)
            pings.append((r.status_code, r.elapsed.total_seconds()))
            time.sleep(0.2)
        outs = [f.result() for f in futures]
    assert pings and all(status == 200 and secs < 2 for status, secs in pings), pings
    assert all(status == 200 for status, _, _ in outs)
    for _, lines, last in outs:
        assert last["details"]["generated_tokens"] == len(lines) and last["details"]["finish_reason"] in (
            "length", "eos_token")
        assert len(lines) == 6 or last["details"]["finish_reason"] == "eos_token"
    # the same prompt alone gives the same greedy text as in the batch of 64 (spot check)
    alone = post(server, "/invocations", {"inputs": "Question 3: what is the color of the sky?",
                                          "parameters": {"max_new_tokens": 6}}).json()["generated_text"]
    assert alone == outs[3][2]["generated_text"]
    server.wait_idle()


def test_client_disconnect_frees_kv_blocks(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/invocations", body=json.dumps({"inputs": "Write a long essay about the sea.",
                                                          "stream": True, "parameters": {"max_new_tokens": 200,
                                                                                         "ignore_eos_token": True}}),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    got = b""
    while got.count(b"\n") < 3:  # a few tokens have arrived
        got += resp.read1(4096)
    m = server.metrics()
    assert m["lmi_kv_blocks_used"] > 0 and m["lmi_requests_in_flight"] >= 1
    conn.sock.close()  # the client goes away mid-stream
    conn.close()
    m = server.wait_idle()
    assert m["lmi_kv_blocks_free"] == m["lmi_kv_blocks_total"]


def test_custom_attributes_header_accepted(server):
    r = post(server, "/invocations", {"inputs": "Hi", "parameters": {"max_new_tokens": 2}},
             headers={"X-Amzn-SageMaker-Custom-Attributes": "x-trace=abc; user=42"})
    assert r.status_code == 200
    r = post(server, "/invocations", {"inputs": "Hi"}, headers={"X-Amzn-SageMaker-Custom-Attributes": "adapter=a1"})
    assert r.status_code == 404 and "unknown adapter 'a1'" in r.json()["error"]  # LoRA off: never the base model


def test_lmi_fidelity_fields_raw_utf8(server):
    """The seeds' kind of prompt (Chinese) with every LMI details field the engine fills: raw UTF-8
    bytes as LMI writes them, best_of_sequences, top_tokens, prefill (truncated), and streamed prefill."""
    prompt = "请用中文简单介绍一下长城的历史。"
    params = {"max_new_tokens": 4, "details": True, "decoder_input_details": True, "top_n_tokens": 2,
              "truncate": 5, "best_of": 2, "do_sample": True, "seed": 3}
    r = post(server, "/invocations", {"inputs": prompt, "parameters": params})
    obj = r.json()
    assert r.status_code == 200 and r.content == json.dumps(obj, ensure_ascii=False).encode()
    assert prompt.encode() in r.content and b"\\u" not in r.content
    d = obj["details"]
    (other,) = d["best_of_sequences"]
    assert list(d) == ["inputs", "finish_reason", "generated_tokens", "tokens", "prefill", "top_tokens",
                       "best_of_sequences"] and d["inputs"] == prompt
    assert list(other) == ["finish_reason", "generated_tokens", "tokens", "prefill", "top_tokens", "generated_text"]
    assert sum(t["log_prob"] for t in d["tokens"]) >= sum(t["log_prob"] for t in other["tokens"])
    assert len(d["prefill"]) == 5 and d["prefill"][0]["log_prob"] is None  # the last 5 prompt tokens
    assert all(isinstance(t["log_prob"], float) for t in d["prefill"][1:])
    assert [row[0] for row in d["top_tokens"]] == d["tokens"] and all(2 <= len(row) <= 3 for row in d["top_tokens"])
    r = requests.post(server.url + "/invocations", json={"inputs": prompt, "stream": True, "parameters": {
        "max_new_tokens": 3, "details": True, "decoder_input_details": True}}, timeout=120)
    lines = r.content.splitlines()
    assert all(ln == json.dumps(json.loads(ln), ensure_ascii=False).encode() for ln in lines)
    last = json.loads(lines[-1])
    prefill = last["details"]["prefill"]  # the final streamed record carries prefill, untruncated here
    assert prefill[0]["log_prob"] is None and [t["id"] for t in prefill[-5:]] == [t["id"] for t in d["prefill"]]


def test_metrics_exposition(server):
    text = requests.get(server.url + "/metrics", timeout=5).text
    for name in ('lmi_requests_total{route="/invocations",status="200"}', 'status="400"', "lmi_queue_depth",
                 "lmi_running_sequences", "lmi_kv_blocks_used", "lmi_kv_blocks_free",
                 "lmi_time_to_first_token_seconds_bucket", "lmi_time_per_output_token_seconds_bucket"):
        assert name in text, name


@pytest.mark.parametrize("bad_id", [49152, 10**9, -1])
def test_out_of_vocabulary_token_ids_are_400_and_the_engine_lives_on(server, bad_id):
    """A stop id outside the vocabulary (with min_tokens, once an IndexError in the sampler that
    killed the engine for everyone) is a 400 on every route, while another stream runs on."""
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(stream_lines, server.url + "/invocations",
                              {"inputs": "Count to twenty:", "parameters": {"max_new_tokens": 24}, "stream": True})
        bodies = [
            ("/v1/completions", {"prompt": "Hi", "max_tokens": 4, "min_tokens": 1, "stop_token_ids": [bad_id]}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                                      "min_tokens": 1, "stop_token_ids": [bad_id]}),
            ("/invocations", {"inputs": "Hi", "parameters": {"max_new_tokens": 4, "min_tokens": 1,
                                                             "stop_token_ids": [bad_id]}}),
            ("/v1/completions", {"prompt": [1, 2, bad_id], "max_tokens": 2}),
        ]
        for path, body in bodies:
            r = post(server, path, body)
            assert r.status_code == 400, (path, r.status_code, r.text)
            assert "stop_token_ids" in r.text or "token" in r.text, r.text
        r, lines = running.result(timeout=120)
    assert r.status_code == 200 and check_jsonlines(lines)["generated_text"]
    assert requests.get(server.url + "/ping", timeout=2).status_code == 200
    assert post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 3, "min_tokens": 1,
                                            "stop_token_ids": [2]}).status_code == 200


def _openai_client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_openai_client_gets_openai_error_objects(server):
    import openai

    client = _openai_client(server)
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="llama-2-13b-chat-hf", messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=4, temperature=5)
    err = exc.value
    assert err.status_code == 400 and err.type == "invalid_request_error" and err.param == "temperature"
    assert str(err.code) == "400" and "temperature must be in [0.0, 2.0], got 5" in str(err)  # the client: a str
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model="m", prompt="word " * 600, max_tokens=4)
    assert exc.value.type == "invalid_request_error"
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in str(exc.value)
    assert exc.value.code == "context_length_exceeded"  # OpenAI's code: LangChain and LiteLLM read it
    with pytest.raises(openai.NotFoundError) as exc:
        client.models.retrieve("nope")
    assert exc.value.type == "invalid_request_error" and "no route" in str(exc.value)
    r = post(server, "/invocations", {"inputs": "x", "parameters": {"max_new_tokens": "ten"}})
    assert r.status_code == 400 and set(r.json()) == {"error", "code"}  # LMI's shape stays on /invocations


def test_openai_client_chat_without_max_tokens_goes_past_30_tokens(server):
    client = _openai_client(server)
    out = client.chat.completions.create(
        model="llama-2-13b-chat-hf", temperature=0,
        messages=[{"role": "system", "content": "You are a helpful assistant."},
                  {"role": "user", "content": "Write a long story about a dragon who learns to bake bread."}])
    usage, choice = out.usage, out.choices[0]
    assert usage.completion_tokens > 30, (usage, choice)
    # it ends on its own, or at the context limit (max_model_len), never at LMI's 30
    assert choice.finish_reason == "stop" or usage.total_tokens == MAX_MODEL_LEN, (usage, choice.finish_reason)
    r = post(server, "/invocations", {"messages": [{"role": "user", "content": "Write a long story."}]})
    assert r.json()["usage"]["completion_tokens"] <= 30  # LMI's default on /invocations


def test_vllm_generate_plain_and_streamed(server):
    # seed-code.md §3 verbatim: vLLM's api_server /generate (beam search is answered with n samples)
    r = requests.post(server.url + "/generate", data='''{
"prompt": "San Francisco is a",
"use_beam_search": true,
"n": 4,
"temperature": 0
}''', timeout=120)
    texts = r.json()["text"]
    assert r.status_code == 200 and len(texts) == 4 and len(set(texts)) == 1, r.text
    assert texts[0].startswith("San Francisco is a") and len(texts[0]) > len("San Francisco is a")
    plain = post(server, "/generate", {"prompt": "The sea is", "max_tokens": 8, "temperature": 0}).json()
    r = requests.post(server.url + "/generate", json={"prompt": "The sea is", "max_tokens": 8, "temperature": 0,
                                                      "stream": True}, stream=True, timeout=120)
    raw = r.content
    assert r.status_code == 200 and raw.endswith(b"\0")
    chunks = [json.loads(c) for c in raw.split(b"\0")[:-1]]
    assert 1 < len(chunks) <= 8 and all(c["text"][0].startswith("The sea is") for c in chunks)
    assert chunks[-1] == plain  # the last chunk is the whole text, as the plain answer
    r = post(server, "/generate", {"prompt": "Hi", "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_openai_client_echo_logprobs_logit_bias_user_and_continuous_usage(server):
    import openai

    client = _openai_client(server)
    prompt = "The capital of France is"
    out = client.completions.create(model="m", prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=1,
                                    user="user-1234")
    choice = out.choices[0]
    n_prompt = out.usage.prompt_tokens
    lp = choice.logprobs
    assert choice.text.startswith(prompt) and len(lp.tokens) == n_prompt + out.usage.completion_tokens
    assert "".join(lp.tokens[:n_prompt]) == prompt and lp.token_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:]), lp.token_logprobs
    # logit_bias: +100 on one token id makes greedy decoding pick it every step; -100 bans the argmax
    forced = client.completions.create(model="m", prompt=prompt, max_tokens=4, temperature=0,
                                       logit_bias={"28": 100}, extra_body={"ignore_eos": True})
    top = client.completions.create(model="m", prompt=prompt, max_tokens=1, temperature=0).choices[0].text
    banned = client.completions.create(model="m", prompt=prompt, max_tokens=1, temperature=0,
                                       logit_bias={str(_token_id(top)): -100})
    assert forced.choices[0].text == "," * 4 and banned.choices[0].text != top, (forced, banned, top)
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                       logit_bias={"49152": 5})
    assert exc.value.param == "logit_bias" and "vocabulary" in str(exc.value)
    # stream_options.continuous_usage_stats (vLLM): usage on every chunk
    chunks = list(client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in chunks]
    assert all(c.usage is not None and c.usage.prompt_tokens > 0 for c in chunks)
    assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == chunks[-1].usage.completion_tokens <= 5


def _token_id(text: str) -> int:
    """The id of a one-token text in the default model's vocabulary."""
    from transformers import AutoTokenizer

    from serving.checkpoint.default_model import default_model_path

    [tid] = AutoTokenizer.from_pretrained(default_model_path()).encode(text, add_special_tokens=False)
    return tid


def test_best_of_on_completions_and_generate_returns_the_most_likely_of_best_of_samples(server):
    """vLLM's best_of > n: best_of samples are drawn (seeded: the same ones as n = best_of), the n with the
    highest cumulative logprob come back, best first; streaming it is a 400 (the ranking needs them all)."""
    base = {"model": "m", "prompt": "Once upon a time", "max_tokens": 6, "temperature": 1.0, "seed": 11,
            "logprobs": 0}
    url = server.url + "/v1/completions"
    every = requests.post(url, json={**base, "n": 4}, timeout=120).json()["choices"]
    totals = sorted((sum(c["logprobs"]["token_logprobs"]), c["text"]) for c in every)[::-1]
    best = requests.post(url, json={**base, "n": 2, "best_of": 4}, timeout=120).json()
    assert [c["text"] for c in best["choices"]] == [t for _, t in totals[:2]], (totals, best)
    assert [c["index"] for c in best["choices"]] == [0, 1]
    assert best["usage"]["completion_tokens"] == sum(len(c["logprobs"]["tokens"]) for c in best["choices"])
    gen = requests.post(server.url + "/generate", json={"prompt": "Once upon a time", "max_tokens": 6,
                                                        "temperature": 1.0, "seed": 11, "best_of": 4}, timeout=120)
    assert gen.status_code == 200 and gen.json() == {"text": ["Once upon a time" + totals[0][1]]}
    r = requests.post(url, json={**base, "best_of": 3, "stream": True}, timeout=60)
    assert r.status_code == 400 and "non-streaming" in r.json()["error"]["message"]


def test_sdk_client_reports_the_finish_reason_without_asking_for_details(server):
    """sdk's StreamingClient against the real server: finish_reason and token count, whole and streamed."""
    from sdk.client import StreamingClient

    client = StreamingClient.from_url(server.url)
    whole = client.generate("The capital of France is", {"max_new_tokens": 5, "ignore_eos_token": True})
    assert whole.finish_reason == "length" and whole.generated_tokens == 5, whole
    streamed = client.stream("The capital of France is", {"max_new_tokens": 5, "ignore_eos_token": True}).result
    assert streamed.finish_reason == "length" and streamed.generated_text == whole.generated_text, streamed
    bare = client.generate("The capital of France is", {"max_new_tokens": 5, "details": False})
    assert bare.finish_reason is None and bare.generated_text  # asked for the bare body: LMI sends no reason


def test_sigterm_drains_in_flight_stream(server):
    # Last test of the module: SIGTERM while a stream is running; it completes, then the server exits.
    r = requests.post(server.url + "/invocations", json={"inputs": "The sea is", "stream": True,
                                                         "parameters": {"max_new_tokens": 8}},
                      stream=True, timeout=60)
    lines = r.iter_lines()
    first = next(lines)
    took = {}
    stopper = threading.Thread(target=lambda: took.setdefault("s", server.stop()))
    stopper.start()
    rest = [ln.decode() for ln in lines if ln]
    stopper.join(40)
    check_jsonlines([first.decode()] + rest)
    assert server.proc.returncode is not None and took["s"] < 30
    with pytest.raises(requests.ConnectionError):
        requests.get(server.url + "/ping", timeout=2)

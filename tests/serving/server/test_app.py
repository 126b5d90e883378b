"""create_app routes with Flask's test_client and a fake engine loop (no model)."""

import json

import pytest

from serving.server.app import create_app
from serving.server.settings.config import load_config
from fake_engine_loop import FakeEngineLoop


def make(state="ready", **env):
    loop = FakeEngineLoop(state=state)
    cfg = load_config({k.upper(): str(v) for k, v in env.items()}, [])
    return loop, create_app(loop, cfg).test_client()


def test_ping_lifecycle():
    loop, client = make(state="loading")
    r = client.get("/ping")
    assert r.status_code == 503 and r.json["status"] == "Loading"
    assert client.post("/invocations", json={"inputs": "x"}).status_code == 503
    loop.state = "ready"
    r = client.get("/ping")
    assert r.status_code == 200 and r.json == {"status": "Healthy"} and r.content_type == "application/json"
    loop.state, loop.error = "dead", RuntimeError("cuda oops")
    r = client.get("/ping")
    assert r.status_code == 500 and "cuda oops" in r.json["error"]


def test_health_is_vllm_and_tgis_on_flask_and_on_the_poller_fast_path():
    loop, client = make(state="loading")
    app = client.application
    admission = app.extensions["admission"]

    def fast(path: bytes) -> tuple[bytes, bytes]:  # what the poller thread answers, head and body
        head, _, body = admission.decide(b"GET " + path + b" HTTP/1.1\r\nHost: x\r\n\r\n").answer.partition(
            b"\r\n\r\n")
        return head.split(b"\r\n")[0], body
    assert client.get("/health").status_code == 503 and fast(b"/health")[0] == b"HTTP/1.1 503 Service Unavailable"
    loop.state = "ready"
    r = client.get("/health")
    assert (r.status_code, r.data) == (200, b"") and fast(b"/health") == (b"HTTP/1.1 200 OK", b"")
    assert fast(b"/ping") == (b"HTTP/1.1 200 OK", b'{"status": "Healthy"}')  # /ping keeps its body
    loop.state, loop.error = "dead", RuntimeError("cuda oops")
    assert client.get("/health").status_code == 500 and b"cuda oops" in fast(b"/health")[1]


def test_invocations_plain_and_list():
    _, client = make()
    r = client.post("/invocations", json={"inputs": "hi", "parameters": {"max_new_tokens": 3}})
    assert r.status_code == 200 and r.data == b'{"generated_text": "abc"}'
    assert r.headers["x-request-id"]
    r = client.post("/invocations", json={"inputs": ["a", "b"], "parameters": {"max_new_tokens": 2}})
    assert r.json == [{"generated_text": "ab"}, {"generated_text": "ab"}]


def test_invocations_stream_jsonlines():
    loop, client = make()
    r = client.post("/invocations", json={"inputs": "hi", "stream": True, "parameters": {"max_new_tokens": 3}})
    lines = r.data.decode().splitlines()
    assert r.content_type == "application/jsonlines" and len(lines) == 3
    assert json.loads(lines[-1])["generated_text"] == "abc"
    assert not loop.active


@pytest.mark.parametrize("body, needle", [
    (b'{"inputs": ', "malformed JSON"),
    (b'{"inputs": "x", "parameters": {"max_new_tokens": "a"}}', "max_new_tokens"),
    (b'{"inputs": "x", "parameters": {"top_p": 5, "do_sample": true}}', "top_p"),
    (b'{"inputs": "' + b"x" * 100 + b'"}', "maximum context length is"),
])
def test_400s(body, needle):
    _, client = make()
    r = client.post("/invocations", data=body, content_type="application/json")
    assert r.status_code == 400 and needle in r.json["error"] and r.json["code"] == 400


def test_body_over_6mb_is_413():
    _, client = make()
    r = client.post("/invocations", data=b"x" * (6 * 1024 * 1024 + 1), content_type="application/json")
    assert r.status_code == 413 and "limit" in r.json["error"]


def test_queue_full_is_503():
    loop, client = make(SERVING_JOB_QUEUE_SIZE=1)
    loop.delay = 0.05
    import threading
    t = threading.Thread(target=client.post, args=("/invocations",), kwargs={"json": {"inputs": "x"}})
    t.start()
    import time
    for _ in range(100):
        if loop.active:
            break
        time.sleep(0.01)
    r = make_client_again = client.post("/invocations", json={"inputs": "y"})
    assert make_client_again.status_code == 503 and "capacity" in r.json["error"]
    t.join()


def test_mid_stream_error_is_a_final_record():
    _, client = make()
    r = client.post("/invocations", json={"inputs": "FAIL", "stream": True, "parameters": {"max_new_tokens": 5}})
    last = json.loads(r.data.decode().splitlines()[-1])
    assert r.status_code == 200 and last["details"]["finish_reason"] == "error" and last["generated_text"] == "ab"


def test_plain_engine_error_is_500():
    _, client = make()
    r = client.post("/invocations", json={"inputs": "FAIL", "parameters": {"max_new_tokens": 5}})
    assert r.status_code == 500 and r.json == {"error": "boom", "code": 500}


def test_compat_200_errors():
    _, client = make(SERVING_COMPAT_200_ERRORS="true")
    r = client.post("/invocations", data=b"{", content_type="application/json")
    assert r.status_code == 200 and r.json["code"] == 424


def test_disconnect_closes_engine_stream():
    loop, client = make()
    r = client.post("/invocations", json={"inputs": "SLOW", "stream": True, "parameters": {"max_new_tokens": 20}},
                    buffered=False)
    it = r.response
    next(iter(it))
    r.close()  # what the WSGI server does when the client goes away
    assert not loop.active and loop.closed


def test_v1_routes():
    _, client = make(OPTION_SERVED_MODEL_NAME="llama-2-13b-chat-hf")
    r = client.get("/v1/models")
    assert r.json["data"][0]["id"] == "llama-2-13b-chat-hf"
    r = client.post("/v1/completions", json={"model": "llama-2-13b-chat-hf", "prompt": "San Francisco is a",
                                              "max_tokens": 7, "temperature": 0})
    assert r.json["choices"][0]["text"] == "abcdefg" and r.json["usage"]["completion_tokens"] == 7
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "q"}], "max_tokens": 2,
                                                  "stream": True})
    assert r.content_type.startswith("text/event-stream") and r.data.endswith(b"data: [DONE]\n\n")
    r = client.post("/invocations", json={"messages": [{"role": "user", "content": "q"}], "max_tokens": 2})
    assert r.json["object"] == "chat.completion" and r.json["choices"][0]["message"]["content"] == "ab"


def test_custom_attributes_accepted_and_metrics():
    _, client = make()
    r = client.post("/invocations", json={"inputs": "x", "parameters": {"max_new_tokens": 2}},
                    headers={"X-Amzn-SageMaker-Custom-Attributes": "trace=1; foo=bar"})
    assert r.status_code == 200
    text = client.get("/metrics").data.decode()
    assert 'lmi_requests_total{route="/invocations",status="200"} 1.0' in text
    for name in ("lmi_queue_depth", "lmi_running_sequences", "lmi_kv_blocks_used", "lmi_kv_blocks_free",
                 "lmi_time_to_first_token_seconds_bucket", "lmi_time_per_output_token_seconds_bucket"):
        assert name in text


def test_slow_plain_request_sends_heartbeat_whitespace_then_json():
    loop, client = make(SERVING_CHUNKED_READ_TIMEOUT="1", SERVING_PLAIN_HEARTBEAT="true")  # a space every 0.25 s
    loop.delay = 0.1
    r = client.post("/invocations", json={"inputs": "x", "parameters": {"max_new_tokens": 8}})
    assert r.status_code == 200 and r.data.startswith(b" ") and json.loads(r.data) == {"generated_text": "abcdefgh"}
    assert not loop.active


def test_slow_plain_request_without_the_heartbeat_commits_nothing_early():
    loop, client = make(SERVING_CHUNKED_READ_TIMEOUT="1")  # the heartbeat is off by default
    loop.delay = 0.1
    r = client.post("/invocations", json={"inputs": "x", "parameters": {"max_new_tokens": 8}})
    assert r.status_code == 200 and r.data == b'{"generated_text": "abcdefgh"}'


@pytest.mark.parametrize("path, body, error", [
    ("/invocations", {"inputs": "x", "parameters": {"max_new_tokens": 30}}, lambda j: j["error"]),
    ("/v1/completions", {"prompt": "x", "max_tokens": 30}, lambda j: j["error"]["message"]),
    ("/generate", {"prompt": "x", "max_tokens": 30}, lambda j: j["error"]["message"]),
])
def test_heartbeat_answer_that_times_out_is_the_routes_error_object(path, body, error):
    """With the opt-in heartbeat the 200 is sent; a failure after it is the route's error object, not text."""
    loop, client = make(SERVING_CHUNKED_READ_TIMEOUT="1", SERVING_PLAIN_HEARTBEAT="true", OPTION_PREDICT_TIMEOUT="1")
    loop.delay = 0.1  # 30 tokens: 3 s, past the 1 s predict_timeout
    r = client.post(path, json=body)
    assert r.status_code == 200 and r.data.startswith(b" ")
    assert "prediction timed out" in error(json.loads(r.data)) and "text" not in json.loads(r.data)


def test_text_plain_body_is_the_prompt():
    _, client = make()
    r = client.post("/invocations", data="hello", content_type="text/plain")
    assert r.status_code == 200 and r.json == {"generated_text": "abcdefghijklmnopqrstuvwxyzabcd"}  # 30 tokens


def test_openai_error_objects_on_v1_and_generate_lmi_shape_on_invocations():
    _, client = make()
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "q"}], "temperature": 9})
    assert r.status_code == 400 and r.json == {"error": {
        "message": "temperature must be in [0.0, 2.0], got 9", "type": "invalid_request_error",
        "param": "temperature", "code": 400}}
    r = client.post("/v1/completions", data=b"{", content_type="application/json")
    assert r.status_code == 400 and r.json["error"]["param"] is None and "malformed JSON" in r.json["error"]["message"]
    r = client.post("/generate", json={"prompt": 3})
    assert r.status_code == 400 and r.json["error"]["param"] == "prompt"
    r = client.get("/v1/models/nope")
    assert r.status_code == 404 and r.json["error"]["type"] == "invalid_request_error"
    r = client.post("/v1/completions", json={"prompt": "FAIL", "max_tokens": 5})
    assert r.status_code == 500 and r.json["error"] == {"message": "boom", "type": "server_error", "param": None,
                                                       "code": 500}
    r = client.post("/invocations", json={"inputs": "x", "parameters": {"top_p": 5, "do_sample": True}})
    assert r.status_code == 400 and set(r.json) == {"error", "code"} and "top_p" in r.json["error"]


def test_v1_stream_failing_mid_way_ends_with_an_openai_error_object():
    _, client = make()
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "FAIL"}]}),
                       ("/v1/completions", {"prompt": "FAIL"})):
        r = client.post(path, json={**body, "max_tokens": 5, "stream": True})
        events = [json.loads(e[6:]) for e in r.data.decode().split("\n\n") if e and e != "data: [DONE]"]
        assert r.data.endswith(b"data: [DONE]\n\n") and events[-1]["choices"][0]["finish_reason"] == "error"
        assert events[-1]["error"] == {"message": "boom", "type": "server_error", "param": None, "code": 500}
    r = client.post("/invocations", json={"messages": [{"role": "user", "content": "FAIL"}], "stream": True})
    assert json.loads(r.data.decode().splitlines()[-1])["error"] == "boom"  # LMI's string on /invocations


def test_vllm_generate_route_plain_and_stream():
    loop, client = make()
    r = client.post("/generate", json={"prompt": "hi", "n": 2, "max_tokens": 3, "temperature": 0,
                                       "use_beam_search": True})
    assert r.status_code == 200 and r.data == b'{"text":["hiabc","hiabc"]}'
    assert loop.params[-1].max_tokens == 3 and loop.params[-1].n == 2 and loop.params[-1].greedy
    client.post("/generate", json={"prompt": "hi"})
    assert loop.params[-1].max_tokens == 16 and loop.params[-1].temperature == 1.0  # vLLM SamplingParams defaults
    r = client.post("/generate", json={"prompt": "hi", "max_tokens": 3, "stream": True})
    assert r.status_code == 200 and r.data == b'{"text": ["hia"]}\0{"text": ["hiab"]}\0{"text": ["hiabc"]}\0'


def test_v1_chat_without_max_tokens_runs_to_the_context_limit():
    loop, client = make()
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "q"}]})
    assert loop.params[-1].max_tokens is None and r.json["usage"]["completion_tokens"] > 30
    client.post("/invocations", json={"messages": [{"role": "user", "content": "q"}]})
    assert loop.params[-1].max_tokens == 30  # LMI's default stays on /invocations

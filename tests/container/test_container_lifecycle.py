"""`serve` start-up failures and the limits server: bad config exits, a dead engine fails /ping,
a full queue answers 503, and a request past `predict_timeout` ends its stream with an error record."""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
from lmi_server import SERVE, LMIServer, check_jsonlines, stream_lines

pytestmark = pytest.mark.slow
QUEUE = 4  # job_queue_size of the limits server


def test_invalid_config_exits_with_a_message_naming_the_variable(tmp_path):
    env = {**os.environ, "OPTION_MAX_ROLLING_BATCH_SIZE": "lots",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    p = subprocess.run([str(SERVE), "serve"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    assert "OPTION_MAX_ROLLING_BATCH_SIZE='lots' is invalid: accepts a positive integer" in p.stderr


def test_serve_passes_other_commands_through(tmp_path):
    p = subprocess.run([str(SERVE), "echo", "hello"], cwd=tmp_path, capture_output=True, text=True, timeout=30)
    assert p.returncode == 0 and p.stdout.strip() == "hello"


def test_a_model_that_fails_to_load_stops_the_server_with_the_reason(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["BloomForCausalLM"], "model_type": "bloom"}))
    srv = LMIServer({"HF_MODEL_ID": str(model)}, tmp_path, tmp_path / "serve.log")
    t0 = time.monotonic()
    try:
        reason = srv.wait_failed_start()
    finally:
        srv.stop()
    assert time.monotonic() - t0 < 60
    assert 200 not in srv.ping_history
    assert "BloomForCausalLM" in reason and "not supported" in reason


def _broken_models(root: Path, good: Path) -> dict[str, tuple[Path, dict[str, str]]]:
    """Checkpoints (and one setting) that must each fail the start: name -> (model dir, extra env)."""
    import shutil

    out: dict[str, tuple[Path, dict[str, str]]] = {}
    for name in ("truncated", "empty", "vocab", "kv"):
        shutil.copytree(good, root / name)
        out[name] = (root / name, {})
    for shard in sorted((root / "truncated").glob("*.safetensors")):
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    for shard in sorted((root / "empty").glob("*.safetensors")):
        shard.write_bytes(b"")
    config = json.loads((root / "vocab" / "config.json").read_text())
    (root / "vocab" / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] * 2}))
    out["kv"] = (root / "kv", {"OPTION_KV_CACHE_MEMORY_GB": "100000"})  # 100 TB of KV cache
    return out


def test_each_broken_checkpoint_stops_the_server_within_seconds(tmp_path, tiny_models):
    """Truncated or empty safetensors, a vocab that does not match the weights, a KV budget of 100 TB:
    each start fails with its reason on one line and `serve` exits 3 (started together)."""
    servers = {name: LMIServer({"HF_MODEL_ID": str(path), **env}, tmp_path, tmp_path / f"{name}.log")
               for name, (path, env) in _broken_models(tmp_path, tiny_models("llama")).items()}
    t0 = time.monotonic()
    try:
        reasons = {name: srv.wait_failed_start(timeout=120) for name, srv in servers.items()}
    finally:
        for srv in servers.values():
            srv.stop()
    assert time.monotonic() - t0 < 120
    assert all(200 not in srv.ping_history for srv in servers.values())
    for name in ("truncated", "empty"):
        assert f"cannot read the checkpoint file {tmp_path / name}" in reasons[name], reasons
    assert "model.embed_tokens.weight" in reasons["vocab"] and "!= parameter shape" in reasons["vocab"], reasons
    assert "allocate" in reasons["kv"], reasons


@pytest.fixture(scope="module")
def limited(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("limited")
    # predict_timeout 5 s: the tests below wait it out three times, so it is short, yet far above the
    # 3-token requests (< 0.5 s) and the full queue's set-up (< 1 s) that must not meet it.
    (cwd / "serving.properties").write_text("# the file wins over the environment\noption.predict_timeout=5\n")
    # chunked_read_timeout 4: the opt-in plain heartbeat (off here) would commit 200 after 1 s, well
    # before the 5 s predict_timeout; a plain request past that deadline must still be a 5xx.
    srv = LMIServer({"OPTION_PREDICT_TIMEOUT": "100", "SERVING_JOB_QUEUE_SIZE": str(QUEUE),
                     "OPTION_TGI_COMPAT": "true", "SERVING_CHUNKED_READ_TIMEOUT": "4"}, cwd, cwd / "serve.log")
    try:
        srv.wait(200)
        yield srv
    finally:
        srv.stop()


def test_properties_file_in_working_dir_wins(limited):
    log = limited.log()
    assert "option.predict_timeout" in log and "serving.properties" in log


def test_startup_objects_are_frozen_out_of_the_collector_before_ready(limited):
    # Full collections walking the start-up heap stalled every stream (run 15): the worker
    # freezes it once the engine is ready and before /ping answers 200.
    import re

    found = re.search(r"start-up objects frozen out of the garbage collector's walks: (\d+)", limited.log())
    assert found and int(found.group(1)) > 10_000, limited.log()[-2000:]


def test_tgi_compat_plain_and_stream(limited):
    r = requests.post(limited.url + "/invocations", json={"inputs": "Hi", "parameters": {"max_new_tokens": 3}},
                      timeout=60)
    obj = r.json()
    assert isinstance(obj, list) and "logprob" in obj[0]["details"]["tokens"][0]
    r = requests.post(limited.url + "/invocations", json={"inputs": "Hi", "stream": True,
                                                          "parameters": {"max_new_tokens": 3}}, timeout=60)
    assert r.headers["Content-Type"] == "text/event-stream"
    events = [json.loads(e[6:]) for e in r.text.split("\n\n") if e]
    assert "logprob" in events[0]["token"] and "details" in events[-1]


def test_mid_stream_timeout_ends_with_an_error_record(limited):
    r, lines = stream_lines(limited.url + "/invocations", {
        "inputs": "Write a very long story.", "stream": True,
        "parameters": {"max_new_tokens": 480, "ignore_eos_token": True, "output_formatter": "jsonlines"}})
    assert r.status_code == 200
    last = json.loads(lines[-1])
    assert last["details"]["finish_reason"] == "error" and "timed out" in last["error"]
    assert last["generated_text"] == "".join(json.loads(ln)["token"]["text"] for ln in lines)
    limited.wait_idle()
    # a plain request past the deadline is a 5xx with the LMI error body
    r = requests.post(limited.url + "/invocations", json={"inputs": "x", "parameters": {
        "max_new_tokens": 480, "ignore_eos_token": True}}, timeout=60)
    assert r.status_code == 504 and set(r.json()) == {"error", "code"}
    _, ok = stream_lines(limited.url + "/invocations", {"inputs": "Hi", "stream": True,
                                                        "parameters": {"max_new_tokens": 3,
                                                                       "output_formatter": "jsonlines"}})
    check_jsonlines(ok)


def test_plain_requests_past_predict_timeout_fail_visibly_on_every_route_and_are_logged(limited):
    """No route answers a timed-out non-streamed request with 200 and partial text: each answers 504 in
    its API's error shape (the openai client raises), and the log names the request id."""
    import openai

    limited.wait_idle()
    long = {"max_tokens": 480, "ignore_eos": True}
    posts = {"/invocations": {"inputs": "Tell a long story.", "parameters": {"max_new_tokens": 480,
                                                                             "ignore_eos_token": True}},
             "/generate": {"prompt": "Tell a long story.", **long}}
    client = openai.OpenAI(base_url=limited.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    calls = {**{path: (lambda p=path, b=body: requests.post(limited.url + p, json=b, timeout=60))
                for path, body in posts.items()},
             "/v1/completions": lambda: client.completions.create(model="m", prompt="Tell a long story.",
                                                                  max_tokens=480, extra_body={"ignore_eos": True}),
             "/v1/chat/completions": lambda: client.chat.completions.create(
                 model="m", messages=[{"role": "user", "content": "Tell a long story."}], max_tokens=400,
                 extra_body={"ignore_eos": True})}
    from concurrent.futures import ThreadPoolExecutor

    def call(fn):
        try:
            return fn()
        except openai.APIStatusError as exc:
            return exc

    with ThreadPoolExecutor(len(calls)) as pool:  # all four at once: one deadline, not four
        answers = dict(zip(calls, pool.map(call, calls.values())))
    for path, answer in answers.items():
        if isinstance(answer, requests.Response):
            status, headers, body = answer.status_code, answer.headers, answer.json()
        else:
            assert isinstance(answer, openai.InternalServerError), (path, answer)
            status, headers, body = answer.status_code, answer.response.headers, answer.body
            body = {"error": body}  # the client hands over the error object itself
        assert status == 504, (path, status, body)
        message = body["error"] if path == "/invocations" else body["error"]["message"]
        assert "prediction timed out" in message, (path, body)
        if path != "/invocations":
            assert body["error"]["type"] == "server_error" and body["error"]["code"] == 504
        rid = headers["x-request-id"]
        assert limited.log_has(f"request {rid} {path} 504 tokens="), (path, limited.log()[-3000:])
    limited.wait_idle(timeout=30)


def test_full_queue_answers_503_ping_stays_fast_and_disconnects_clean_up(limited):
    conns = []
    try:
        for i in range(QUEUE):
            c = http.client.HTTPConnection("127.0.0.1", limited.port, timeout=60)
            c.request("POST", "/invocations", body=json.dumps({
                "inputs": f"Count to one hundred, attempt {i}:", "stream": True,
                "parameters": {"max_new_tokens": 200, "ignore_eos_token": True, "output_formatter": "jsonlines"}}),
                headers={"Content-Type": "application/json"})
            conns.append(c)
        for c in conns:
            resp = c.getresponse()
            assert resp.status == 200 and b'{"token"' in resp.read1(4096)
        r = requests.post(limited.url + "/invocations", json={"inputs": "one more"}, timeout=30)
        assert r.status_code == 503 and r.json()["code"] == 503 and "capacity" in r.json()["error"]
        ping = requests.get(limited.url + "/ping", timeout=2)
        assert ping.status_code == 200 and ping.elapsed.total_seconds() < 2
    finally:
        for c in conns:
            if c.sock:
                c.sock.close()
            c.close()
    m = limited.wait_idle(timeout=30)
    assert m["lmi_kv_blocks_free"] == m["lmi_kv_blocks_total"]
    assert 'lmi_requests_total{route="/invocations",status="503"}' in m


def test_an_idle_kept_alive_connection_does_not_hold_the_stop(limited):
    """Last test of the module: it stops the server. A client that keeps its connection open between
    requests (any connection pool) is closed a moment after SIGTERM, as gunicorn closes its own kept-alive
    connections, instead of holding the stop for the whole graceful_timeout (25 s here)."""
    conn = http.client.HTTPConnection("127.0.0.1", limited.port, timeout=30)
    conn.request("GET", "/ping")
    resp = conn.getresponse()
    assert resp.status == 200 and not resp.will_close  # kept alive
    resp.read()
    time.sleep(0.5)  # idle on the server, waiting for a next request
    try:
        took = limited.stop()
        assert limited.proc.returncode == 0 and took < 10, (took, limited.log()[-2000:])
        assert conn.sock.recv(1) == b""  # the server closed it
    finally:
        conn.close()

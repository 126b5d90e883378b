"""Issue 10: one request must never take the server down (nor its metrics, nor its memory).

One server for the module, started with a small job queue, a chat template file and
`OPTION_TRUST_REMOTE_CODE=true` on a model dir whose tokenizer_config.json `auto_map` points at a
local .py that writes a marker file when imported (it must never be). Covers the bounded `route` label of
`lmi_requests_total` (unknown paths and methods share one bucket), hostile JSON bodies (deep
nesting, lone surrogates, NaN / Infinity) answered 400 on every POST route, batches larger
than the whole job queue (413, never the retryable 503 of a momentarily full queue), and
`OPTION_CHAT_TEMPLATE` (a file is used only if it is a Jinja chat template; its text is never logged)
and repository code (never executed, whatever option.trust_remote_code says).
"""

from __future__ import annotations

import http.client
import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import requests
from lmi_server import SERVE, LMIServer, free_port

pytestmark = pytest.mark.slow
QUEUE = 8  # job_queue_size of the module's server
ROUTES = {"/invocations", "/v1/completions", "/v1/chat/completions"}
# The module server's chat template: the message texts only, so a chat prompt is exactly its text.
TEMPLATE_HEAD = "{#- open-lmi reliability template -#}"
TEMPLATE = TEMPLATE_HEAD + "{% for m in messages %}{{ m.content }}{% endfor %}"
REMOTE_CODE = """import pathlib
pathlib.Path({marker!r}).write_text("repository code was executed")
from transformers import PreTrainedTokenizerFast


class EvilTokenizer(PreTrainedTokenizerFast):
    pass
"""


def remote_code_model(root: Path, tokenizer_class: str) -> tuple[Path, Path]:
    """The default model (files linked) whose tokenizer_config.json auto_map names `evil.EvilTokenizer`,
    a local .py that writes a marker file when imported; returns (model dir, marker path)."""
    from serving.checkpoint.default_model import default_model_path

    src, model, marker = default_model_path(), root / "remote-code-model", root / "EXECUTED"
    model.mkdir()
    for f in src.iterdir():
        if f.name != "tokenizer_config.json":
            (model / f.name).symlink_to(f)
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    cfg.update(tokenizer_class=tokenizer_class, auto_map={"AutoTokenizer": [None, "evil.EvilTokenizer"]})
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    (model / "evil.py").write_text(REMOTE_CODE.format(marker=str(marker)))
    return model, marker


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("reliability")
    (cwd / "chat.jinja").write_text(TEMPLATE)
    model, marker = remote_code_model(cwd, "TokenizersBackend")  # a built-in class exists: the code is ignored
    env = {"SERVING_JOB_QUEUE_SIZE": str(QUEUE), "OPTION_CHAT_TEMPLATE": str(cwd / "chat.jinja"),
           "HF_MODEL_ID": str(model), "OPTION_TRUST_REMOTE_CODE": "true"}
    srv = LMIServer(env, cwd, cwd / "serve.log")
    srv.marker = marker
    try:
        srv.wait(200)
        yield srv
    finally:
        srv.stop()


def _metrics_text(server) -> str:
    return requests.get(server.url + "/metrics", timeout=10).text


def _route_labels(text: str) -> dict[tuple[str, str], float]:
    pairs = re.findall(r'^lmi_requests_total\{route="([^"]*)",status="(\d+)"\} (\S+)$', text, re.M)
    return {(route, status): float(value) for route, status, value in pairs}


def test_metrics_route_label_is_the_route_template_or_one_bucket(server):
    """300 distinct unknown paths and unknown methods add no time series to /metrics."""
    before_text = _metrics_text(server)
    before = _route_labels(before_text)
    tag = uuid.uuid4().hex[:8]
    with requests.Session() as s:
        for i in range(150):
            assert s.get(f"{server.url}/no/such/{tag}/{i}", timeout=10).status_code == 404
            assert s.post(f"{server.url}/v1/{tag}-{i}", json={}, timeout=10).status_code == 404
        assert s.request("BREW", server.url + "/invocations", timeout=10).status_code == 405
        assert s.get(server.url + "/v1/completions", timeout=10).status_code == 405
        assert s.post(server.url + "/invocations", data=b"{", timeout=10).status_code == 400
    text = _metrics_text(server)
    after = _route_labels(text)
    assert {route for route, _ in after} <= ROUTES | {"unmatched"}, sorted(after)
    assert tag not in text
    assert after[("unmatched", "404")] - before.get(("unmatched", "404"), 0) == 300
    assert after[("unmatched", "405")] - before.get(("unmatched", "405"), 0) == 2
    assert after[("/invocations", "400")] - before.get(("/invocations", "400"), 0) == 1
    assert len(text) < len(before_text) + 500  # at most the new buckets' lines, not one per path


# A minimal valid body per POST route, and the field that holds its prompt text.
BODIES = {
    "/invocations": ({"inputs": "Hi", "parameters": {"max_new_tokens": 1}}, "inputs"),
    "/v1/completions": ({"prompt": "Hi", "max_tokens": 1}, "prompt"),
    "/v1/chat/completions": ({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}, "messages[0].content"),
    "/generate": ({"prompt": "Hi", "max_tokens": 1}, "prompt"),
}


def _post_raw(server, path: str, raw: bytes) -> requests.Response:
    return requests.post(server.url + path, data=raw, headers={"Content-Type": "application/json"}, timeout=60)


def _with_token(path: str, body: dict, name: str, token: str) -> bytes:
    """`body` with sampling field `name` set to a raw JSON token (NaN is not writable by json.dumps)."""
    if path == "/invocations":
        body = {**body, "parameters": {**body["parameters"], "do_sample": True, name: "@@"}}
    else:
        body = {**body, name: "@@"}
    return json.dumps(body).replace('"@@"', token).encode()


@pytest.mark.parametrize("path", sorted(BODIES))
def test_hostile_json_is_a_400_naming_the_problem_on_every_post_route(server, path):
    body, prompt_field = BODIES[path]
    assert requests.post(server.url + path, json=body, timeout=60).status_code == 200
    cases = [
        (b'{"x": ' + b"[" * 5000 + b"]" * 5000 + b"}", "nest deeper than"),  # past Python's recursion limit
        (json.dumps({**body, "stop": [[[[["x"] * 1] * 1] * 1]]}).replace('"x"', "[" * 80 + "]" * 80).encode(),
         "stop[0][0][0][0]"),
    ]
    surrogate = json.dumps(body).replace('"Hi"', '"abc \\ud800 def"').encode()
    cases.append((surrogate, f"{prompt_field} holds an unpaired UTF-16 surrogate"))
    for name in ("temperature", "repetition_penalty", "top_p"):
        for literal in ("NaN", "Infinity", "-Infinity", "1e999"):
            cases.append((_with_token(path, body, name, literal), f"{name} must be a finite number"))
    for raw, needle in cases:
        r = _post_raw(server, path, raw)
        assert r.status_code == 400, (raw[:80], r.status_code, r.text[:300])
        err = r.json()["error"]  # OpenAI's error object on /v1/*, LMI's {"error", "code"} on /invocations
        err = {"message": err, "code": r.json()["code"]} if path == "/invocations" else err
        assert err["code"] == 400 and needle in err["message"], (raw[:80], r.json())
        assert len(r.content) < 500  # the value is not echoed back whole
    # a surrogate *pair* (what json.dumps writes for an emoji) is valid text
    emoji = json.dumps(body).replace('"Hi"', '"Hi \\ud83d\\ude00"').encode()
    assert _post_raw(server, path, emoji).status_code == 200
    assert requests.get(server.url + "/ping", timeout=2).status_code == 200


def _open_stream(server, i: int) -> http.client.HTTPConnection:
    """A long stream that holds one job-queue slot until its connection is closed."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/invocations", body=json.dumps({
        "inputs": f"Count to one hundred, attempt {i}:", "stream": True,
        "parameters": {"max_new_tokens": 400, "ignore_eos_token": True}}),
        headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and b'{"token"' in resp.read1(4096)
    return conn


def test_a_batch_larger_than_the_job_queue_is_a_413_a_full_queue_still_a_503(server):
    for n in (QUEUE + 1, 2000):
        t0 = time.monotonic()
        r = requests.post(server.url + "/invocations", json={"inputs": ["Hi"] * n}, timeout=60)
        assert r.status_code == 413 and r.json()["code"] == 413, r.text
        assert f"inputs holds {n} prompts" in r.json()["error"] and f"job_queue_size={QUEUE}" in r.json()["error"]
        assert time.monotonic() - t0 < 5
    r = requests.post(server.url + "/v1/completions", json={"prompt": ["Hi"] * (QUEUE + 1), "max_tokens": 1},
                      timeout=60)
    assert r.status_code == 413 and f"prompt holds {QUEUE + 1} prompts" in r.json()["error"]["message"]
    r = requests.post(server.url + "/invocations", json={"inputs": ["Hi"] * QUEUE, "parameters": {
        "max_new_tokens": 1}}, timeout=60)
    assert r.status_code == 200 and len(r.json()) == QUEUE  # exactly the queue size fits
    conns = []
    try:
        conns = [_open_stream(server, i) for i in range(QUEUE - 1)]
        r = requests.post(server.url + "/invocations", json={"inputs": ["Hi", "Ho"]}, timeout=60)
        assert r.status_code == 503 and "capacity" in r.json()["error"]  # fits, but not right now: retry
    finally:
        for c in conns:
            c.sock.close()
            c.close()
    server.wait_idle(timeout=30)


def test_chat_template_file_is_used_and_only_named_in_the_log(server):
    log = server.log()
    assert f"chat.jinja ({len(TEMPLATE)} chars)" in log
    assert "reliability template" not in log and "{% for m in messages" not in log
    chat = requests.post(server.url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 1}, timeout=60).json()
    plain = requests.post(server.url + "/v1/completions", json={"prompt": "Hi there", "max_tokens": 1},
                          timeout=60).json()
    assert chat["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]  # the template's text, nothing more


def test_a_chat_template_file_that_is_not_one_stops_the_start_without_echoing_it(tmp_path):
    secret = f"canary-{uuid.uuid4().hex}"
    files = {
        "notes.txt": (f"password = {secret}\n".encode(), "does not use `messages`: not a chat template"),
        "broken.jinja": (f"{{% for m in messages %}}\n{{{{ {secret} + }}}}\n{{% endfor %}}".encode(),
                         "not a valid Jinja template (syntax error at line 2)"),
        "blob.bin": (b"\x7fELF\x02\x01\x00\x00" + secret.encode(), "control characters: not a text file"),
        "latin1.jinja": ("{{ messages }} caf\u00e9 ".encode("latin-1") + secret.encode(), "is not UTF-8 text"),
        "huge.jinja": (b"{{ messages }}" + secret.encode() * (300 * 1024 // len(secret)), "larger than 256 KiB"),
    }
    cases = []
    for name, (data, needle) in files.items():
        (tmp_path / name).write_bytes(data)
        cases.append((str(tmp_path / name), needle))
    cases += [(str(tmp_path), "is not a regular file"),
              ("/proc/self/environ", "control characters"),  # the server's own environment (holds the secret)
              (str(tmp_path / "missing.jinja"), "neither an existing file nor a Jinja template")]
    env = {**os.environ, "LEAK_CANARY": secret, "SAGEMAKER_BIND_TO_PORT": str(free_port()),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    for value, needle in cases:
        p = subprocess.run([str(SERVE), "serve"], env={**env, "OPTION_CHAT_TEMPLATE": value}, cwd=tmp_path,
                           capture_output=True, text=True, timeout=30)
        out = p.stdout + p.stderr
        assert p.returncode == 2, (value, out[-2000:])
        assert f"OPTION_CHAT_TEMPLATE={value!r} is invalid" in out and needle in out, (value, out[-2000:])
        assert secret not in out, value


def test_trust_remote_code_true_never_runs_the_tokenizer_auto_map_code(server):
    assert not server.marker.exists()
    log = server.log()
    assert "evil.EvilTokenizer); it is NOT executed" in log and "the built-in TokenizersBackend is used" in log
    assert "option.trust_remote_code=true accepted, but this server never executes model repository code" in log
    r = requests.post(server.url + "/invocations", json={"inputs": "The capital of France is",
                                                          "parameters": {"max_new_tokens": 4}}, timeout=60)
    assert r.status_code == 200 and r.json()["generated_text"]
    assert not server.marker.exists()


def test_a_tokenizer_that_exists_only_as_repository_code_is_refused_by_default(tmp_path):
    model, marker = remote_code_model(tmp_path, "EvilTokenizer")  # no built-in class of that name
    srv = LMIServer({"HF_MODEL_ID": str(model)}, tmp_path, tmp_path / "serve.log")
    try:
        reason = srv.wait_failed_start()
    finally:
        srv.stop()
    assert 200 not in srv.ping_history and not marker.exists()
    assert "exists only as model repository code (evil.EvilTokenizer" in reason
    assert "never executes repository code, whatever option.trust_remote_code says" in reason

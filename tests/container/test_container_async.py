"""The container with async scheduling forced on (the CUDA default), on the CPU.

Async scheduling reads a step's tokens only after launching the next one, so results reach the
HTTP threads a step later and a sample that stops has computed one token more. This module
checks the HTTP contract holds in that mode: greedy streams equal greedy plain responses,
stop sequences cut exactly, concurrent streams complete, and a client that disconnects mid-stream
leaves no KV blocks behind.
"""

from __future__ import annotations

import http.client
import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from lmi_server import LMIServer, check_jsonlines, stream_lines

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory):  # noqa: ANN001, ANN201
    cwd = tmp_path_factory.mktemp("async")
    srv = LMIServer({"OPTION_ASYNC_SCHEDULING": "true"}, cwd, cwd / "serve.log")
    try:
        srv.wait()
        yield srv
    finally:
        srv.stop()


def _invoke(server, body: dict) -> requests.Response:  # noqa: ANN001
    return requests.post(server.url + "/invocations", json=body, timeout=120)


def test_log_says_async(server) -> None:  # noqa: ANN001
    assert "async_scheduling" in server.log()


def test_streams_equal_plain_and_stop_sequences_cut(server) -> None:  # noqa: ANN001
    params = {"max_new_tokens": 24, "ignore_eos_token": True}
    prompts = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,"]

    def one(prompt: str) -> tuple[str, str]:
        plain = _invoke(server, {"inputs": prompt, "parameters": params}).json()["generated_text"]
        r, lines = stream_lines(server.url + "/invocations", {"inputs": prompt, "parameters": params, "stream": True})
        assert r.status_code == 200
        return plain, check_jsonlines(lines)["generated_text"]

    with ThreadPoolExecutor(len(prompts)) as pool:
        for plain, streamed in pool.map(one, prompts):
            assert streamed == plain and plain
    full = _invoke(server, {"inputs": prompts[2], "parameters": params}).json()["generated_text"]
    stop = full.split()[2]
    cut = _invoke(server, {"inputs": prompts[2], "parameters": {**params, "stop": [stop]}}).json()
    assert cut["generated_text"] == full[: full.index(stop)]


def test_client_disconnect_frees_kv_blocks(server) -> None:  # noqa: ANN001
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    body = {"inputs": "Write a long essay about the sea.", "stream": True,
            "parameters": {"max_new_tokens": 300, "ignore_eos_token": True}}
    conn.request("POST", "/invocations", body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    got = b""
    while got.count(b"\n") < 3:
        got += resp.read1(4096)
    conn.sock.close()
    conn.close()
    m = server.wait_idle()
    assert m["lmi_kv_blocks_free"] == m["lmi_kv_blocks_total"]

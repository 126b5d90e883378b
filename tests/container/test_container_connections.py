"""Issue 10: slow, vanished and shutting-down clients against `container/serve` (one server).

The server runs with few threads (a thread held by a slow client would show at once) and a short
`graceful_timeout` (a quick SIGTERM drain). Covers gunicorn's own errors in the JSON error shape,
slow-header and slow-body connections (no thread held, /ping fast, 408 and closed in time), a plain
request aborted as soon as its client leaves (directly, and behind the SageMaker gateway when
boto3 times out), and SIGTERM: every open stream ends with a final error record and the chunked
terminator before the deadline while new connections are refused. The drain test stops the
server, so it comes last.
"""

from __future__ import annotations

import http.client
import json
import logging
import selectors
import signal
import socket
import threading
import time

import boto3
import pytest
import requests
from botocore.config import Config
from botocore.exceptions import ReadTimeoutError
from lmi_server import LMIServer, read_until_closed

from sdk.gateway import Gateway
from serving.server.request_reader import BODY_IDLE_TIMEOUT_S, HEAD_TIMEOUT_S
from serving.server.worker import drain_seconds

pytestmark = pytest.mark.slow
THREADS = 16  # gunicorn threads of the module's server
GRACE = 4.0  # its graceful_timeout (s)
LONG = {"max_new_tokens": 400, "ignore_eos_token": True}  # far longer than any test waits


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("connections")
    srv = LMIServer({"SERVING_THREADS": str(THREADS), "SERVING_GRACEFUL_TIMEOUT": f"{GRACE:g}"},
                    cwd, cwd / "serve.log")
    try:
        srv.wait(200)
        yield srv
    finally:
        srv.stop()


def _connect(server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=10)


def _json_error(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    assert b"content-type: application/json" in head.lower(), raw[:500]
    return status, json.loads(body)


def _post_bytes(path: str, body: dict) -> bytes:
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode() + data


def _wait_kv_used(server, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while server.metrics()["lmi_kv_blocks_used"] == 0:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.2)


def _seconds_until_idle(server, timeout: float) -> float:
    """Seconds until no request is in flight and no KV block is used (fails past `timeout`)."""
    t0 = time.monotonic()
    server.wait_idle(timeout=timeout)
    return time.monotonic() - t0


@pytest.mark.parametrize("raw, status", [
    (b"GET /ping HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n", 431),
    (b"GET /" + b"a" * 10000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414),
    (b"GARBAGE\r\n\r\n", 400),
    (b"POST /invocations HTTP/1.1\r\nHost: x\r\nContent-Length: 1x\r\n\r\n", 400),
])
def test_gunicorn_errors_have_the_json_error_shape(server, raw, status):
    with _connect(server) as sock:
        sock.sendall(raw)
        got_status, body = _json_error(read_until_closed(sock, 10))
    assert got_status == status and set(body) == {"error", "code"} and body["code"] == status, body
    assert body["error"] and len(body["error"]) < 400  # says what was wrong, does not echo it whole
    assert requests.get(server.url + "/ping", timeout=2).status_code == 200


def test_slow_clients_hold_no_thread_and_are_closed_in_time(server):
    """240 connections (15x the threads): half stop mid-head, half send 10 of 100 body bytes; and 8
    that neither read nor close after a `Connection: close` answer (gunicorn waited 2 s for each)."""
    slow, lingering = [], []
    try:
        for _ in range(8):
            lingering.append(_connect(server))
            lingering[-1].sendall(b"GET /ping HTTP/1.0\r\n\r\n")
        t0 = time.monotonic()
        for i in range(240):
            sock = _connect(server)
            if i % 2:
                sock.sendall(b"POST /invocations HTTP/1.1\r\nHost: x\r\nContent-Type: appl")
            else:
                sock.sendall(b"POST /invocations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Content-Length: 100\r\n\r\n{\"inputs\":")
            slow.append(sock)
        sent = time.monotonic()
        for _ in range(5):  # SageMaker's health check keeps answering, and so does a real request
            ping = requests.get(server.url + "/ping", timeout=2)
            assert ping.status_code == 200 and ping.elapsed.total_seconds() < 2
            time.sleep(0.5)
        r = requests.post(server.url + "/invocations", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}},
                          timeout=30)
        assert r.status_code == 200
        for sock in lingering:  # answered, then closed by the server
            assert read_until_closed(sock, 5).startswith(b"HTTP/1.0 200 OK")
        # Every slow connection is answered 408 and closed once its bound has passed.
        bound = max(HEAD_TIMEOUT_S, BODY_IDLE_TIMEOUT_S)
        sel = selectors.DefaultSelector()
        for sock in slow:
            sock.setblocking(False)
            sel.register(sock, selectors.EVENT_READ)
        closed: dict[socket.socket, float] = {}
        answers: dict[socket.socket, bytes] = {sock: b"" for sock in slow}
        while len(closed) < len(slow) and time.monotonic() < sent + bound + 5:
            for key, _ in sel.select(timeout=0.5):
                try:
                    data = key.fileobj.recv(65536)
                except ConnectionResetError:
                    data = b""
                if data:
                    answers[key.fileobj] += data
                else:
                    closed[key.fileobj] = time.monotonic()
                    sel.unregister(key.fileobj)
        assert len(closed) == len(slow), f"{len(slow) - len(closed)} slow connections still open"
        assert min(closed.values()) > t0 + min(HEAD_TIMEOUT_S, BODY_IDLE_TIMEOUT_S) - 1  # not before the bound
        for sock in slow:
            status, body = _json_error(answers[sock])
            assert status == 408 and body["code"] == 408 and "did not arrive" in body["error"], body
    finally:
        for sock in slow + lingering:
            sock.close()
    assert server.log_has("answered 408 and closed")
    assert requests.get(server.url + "/ping", timeout=2).status_code == 200


def test_plain_request_is_aborted_as_soon_as_its_client_leaves(server):
    before = server.metrics().get('lmi_requests_total{route="/invocations",status="499"}', 0)
    with _connect(server) as sock:
        sock.sendall(_post_bytes("/invocations", {"inputs": "Write a long essay about the sea.", "parameters": LONG}))
        _wait_kv_used(server)
    assert _seconds_until_idle(server, timeout=3) < 3  # KV blocks back to 0 within a couple of seconds
    after = server.metrics()['lmi_requests_total{route="/invocations",status="499"}']
    assert after == before + 1
    assert server.log_has("client went away; aborted request")


def test_gateway_client_read_timeouts_do_not_stack_generations(server, caplog, capfd):
    """boto3 gives up (read timeout) and retries, twice: each time the gateway closes its upstream
    request and the server aborts it; one log line per attempt, no traceback."""
    caplog.set_level(logging.INFO, logger="sdk.gateway")
    key = 'lmi_requests_total{route="/invocations",status="499"}'
    before = server.metrics().get(key, 0)
    with Gateway(server.url) as gw:
        client = boto3.client("sagemaker-runtime", endpoint_url=gw.url, region_name="us-east-1",
                              aws_access_key_id="testing", aws_secret_access_key="testing",
                              config=Config(read_timeout=2, retries={"total_max_attempts": 3}))
        with pytest.raises(ReadTimeoutError):
            client.invoke_endpoint(EndpointName="ep", ContentType="application/json",
                                   Body=json.dumps({"inputs": "Tell me a long story.", "parameters": LONG}))
        assert _seconds_until_idle(server, timeout=4) < 4
        time.sleep(0.5)  # the gateway's handler thread finishes
    assert server.metrics()[key] == before + 3  # every attempt was aborted, none left running
    gone = [r for r in caplog.records if r.name == "sdk.gateway" and "went away" in r.getMessage()]
    assert len(gone) == 3 and all(r.exc_info is None for r in gone), [r.getMessage() for r in caplog.records]
    assert "Traceback" not in capfd.readouterr().err


STREAMS = {  # path -> (body, how its records are framed)
    "/invocations": ({"inputs": "Count to a thousand:", "stream": True, "parameters": LONG}, "jsonlines"),
    "/invocations?sse": ({"inputs": "Count to a thousand:", "stream": True,
                          "parameters": {**LONG, "output_formatter": "sse"}}, "sse"),
    "/v1/completions": ({"prompt": "Count to a thousand:", "stream": True, "max_tokens": 400,
                         "ignore_eos": True}, "sse"),
    "/v1/chat/completions": ({"messages": [{"role": "user", "content": "Count to a thousand."}], "stream": True,
                              "max_tokens": 400, "ignore_eos": True}, "sse"),
}


def _records(raw: bytes, framing: str) -> list:
    if framing == "jsonlines":
        return [json.loads(line) for line in raw.splitlines() if line]
    return [e[6:] if e[6:] == "[DONE]" else json.loads(e[6:]) for e in raw.decode().split("\n\n") if e]


def test_sigterm_ends_open_streams_with_a_final_record_and_refuses_new_connections(server):
    # Last test of the module: it stops the server.
    conns = {}
    for path, (body, _) in STREAMS.items():
        c = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        c.request("POST", path.split("?")[0], body=json.dumps(body), headers={"Content-Type": "application/json"})
        conns[path] = c
    first = {}
    for path, c in conns.items():
        resp = c.getresponse()
        assert resp.status == 200, (path, resp.read())
        first[path] = (resp, resp.read1(65536))  # the stream has started
    t_term = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    refused = {}

    def connect_during_drain() -> None:
        time.sleep(1.0)
        t0 = time.monotonic()
        try:
            r = requests.get(server.url + "/ping", timeout=3)
            refused["how"] = r.status_code
        except requests.ConnectionError as exc:
            refused["how"] = type(exc).__name__
        refused["s"] = time.monotonic() - t0

    probe = threading.Thread(target=connect_during_drain)
    probe.start()
    ended = {}
    for path, (resp, head) in first.items():
        raw = head + resp.read()  # http.client raises IncompleteRead without the chunked terminator
        ended[path] = time.monotonic() - t_term
        conns[path].close()
        recs = _records(raw, STREAMS[path][1])
        if STREAMS[path][1] == "jsonlines":
            last = recs[-1]
            assert last["details"]["finish_reason"] == "error" and "shutting down" in last["error"], last
            assert last["generated_text"] == "".join(r["token"]["text"] for r in recs)
        elif path == "/invocations?sse":
            assert recs[-1]["details"]["finish_reason"] == "error" and "shutting down" in recs[-1]["error"]
        else:
            assert recs[-1] == "[DONE]", recs[-3:]
            last = recs[-2]["choices"][0]
            assert last["finish_reason"] == "error" and "shutting down" in recs[-2]["error"]["message"], recs[-2]
    probe.join(10)
    drain = drain_seconds(GRACE)
    assert all(drain - 1 < s < GRACE for s in ended.values()), (ended, drain)
    assert refused["how"] in ("ConnectionError", 503) and refused["s"] < 2, refused
    server.proc.wait(GRACE + 5)
    assert "stopping: new connections are refused" in server.log()

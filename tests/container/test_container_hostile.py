"""Issue 33: clients that try to hold a thread, a queue slot, memory or CPU forever (one server).

The server runs with few threads, a job queue of 4 and a 2 s write timeout, so anything a client
could still hold shows at once: chunked bodies gunicorn would wait on forever (a 16-hex-digit
chunk size, a chunk-size line with no end, oversized extensions and trailers) are answered by the
poller and hold no thread; a client that stops reading its stream is cut off after the write
timeout and its request aborted (KV freed); guided-decoding grammars are bounded in size, compile
time and cache bytes; a SIGSTOPped worker still gets /ping answered (unhealthy).
"""

from __future__ import annotations

import json
import socket
import time

import pytest
import requests
from lmi_server import read_until_closed, running_server

pytestmark = pytest.mark.slow
THREADS = 8
QUEUE = 4
WRITE_TIMEOUT = 2.0
HEAD = b"POST /invocations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    env = {"SERVING_THREADS": str(THREADS), "SERVING_JOB_QUEUE_SIZE": str(QUEUE),
           "SERVING_WRITE_TIMEOUT": f"{WRITE_TIMEOUT:g}", "SERVING_MAX_REQUEST_SIZE": "65536"}
    with running_server(tmp_path_factory, env, "hostile") as srv:
        yield srv


def _answer(server, raw: bytes, timeout: float = 10.0) -> tuple[int, dict]:
    """Send `raw`, read until the server closes; (status, JSON body)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=timeout) as sock:
        sock.sendall(raw)
        out = read_until_closed(sock, timeout)
    head, _, body = out.partition(b"\r\n\r\n")
    assert head, "the server closed without an answer"
    return int(head.split(b" ", 2)[1]), json.loads(body)


def _ping_fast(server) -> None:
    r = requests.get(server.url + "/ping", timeout=2)
    assert r.status_code == 200 and r.elapsed.total_seconds() < 2


def _small_request_ok(server) -> None:
    r = requests.post(server.url + "/invocations", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}},
                      timeout=30)
    assert r.status_code == 200, r.text


CHUNKED = HEAD + b"Transfer-Encoding: chunked\r\n\r\n"


@pytest.mark.parametrize("raw, status, needle", [
    (CHUNKED + b"ffffffffffffffff\r\n{", 400, "1 to 15 hex digits"),
    (CHUNKED + b"1" + b"0" * 5000, 400, "chunk-size line is over"),
    (CHUNKED + b"2;" + b"e" * 5000 + b"\r\n{}\r\n0\r\n\r\n", 400, "chunk-size line is over"),
    (CHUNKED + b"2\r\n{}\r\n0\r\nX-T: " + b"t" * 5000, 400, "trailer line is over"),
    (CHUNKED + (b"1;" + b"e" * 4000 + b"\r\n \r\n") * 20, 413, "over the limit of 65536"),
    (CHUNKED + b"2\r\n{}\r\n0\r\n" + (b"X-T: " + b"t" * 4000 + b"\r\n") * 20, 413, "over the limit of 65536"),
    (HEAD + b"Content-Length: 70000\r\n\r\n{", 413, "the limit is 65536"),
])
def test_unframeable_and_oversized_bodies_are_answered_at_once(server, raw, status, needle):
    t0 = time.monotonic()
    got, body = _answer(server, raw)
    assert got == status and body["code"] == status and needle in body["error"], body
    assert time.monotonic() - t0 < 5  # answered by the poller, no thread waited for more bytes


def test_many_hostile_chunked_sockets_hold_no_thread_and_log_no_traceback(server):
    """20x the threads of 16-hex-digit and endless chunk-size sockets, left open: /ping and a real
    request keep answering, and the log has no traceback."""
    socks = []
    try:
        for i in range(THREADS * 20):
            s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
            s.sendall(CHUNKED + (b"ffffffffffffffff\r\n" if i % 2 else b"1" + b"0" * 4200))
            socks.append(s)
        for _ in range(3):
            _ping_fast(server)
        _small_request_ok(server)
    finally:
        for s in socks:
            s.close()
    _ping_fast(server)
    assert "Traceback" not in server.log()


def test_a_stream_whose_client_stops_reading_is_cut_and_its_request_aborted(server):
    """Clients that start streams and never read (tiny receive buffers, so the server's writes
    block): each is cut within the write timeout of its stall, and its request and KV are freed;
    the queue serves others again."""
    body = json.dumps({"inputs": "Tell me a long story about the sea.", "stream": True,
                       "parameters": {"max_new_tokens": 400, "ignore_eos_token": True, "details": True,
                                      "decoder_input_details": False, "top_n_tokens": 5}}).encode()
    raw = HEAD + f"Content-Length: {len(body)}\r\n\r\n".encode() + body
    stalled = []
    try:
        for _ in range(QUEUE):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)  # before connect: a tiny window
            s.connect(("127.0.0.1", server.port))
            s.sendall(raw)
            stalled.append(s)
        deadline = time.monotonic() + 60
        while server.metrics().get("lmi_requests_in_flight") != QUEUE:
            assert time.monotonic() < deadline, "the streams never started"
            time.sleep(0.2)
        t0 = time.monotonic()
        server.wait_idle(timeout=120)  # every request aborted, every KV block freed: nobody read a byte
        freed = time.monotonic() - t0
        assert server.log_has("the client took no response byte for 2 s"), server.log()[-3000:]
        _small_request_ok(server)
    finally:
        for s in stalled:
            s.close()
    assert "Traceback" not in server.log()
    print(f"{QUEUE} stalled streams freed in {freed:.1f} s")

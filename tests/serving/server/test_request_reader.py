"""RequestReader: where a request ends (Content-Length, chunked, no body) and its read deadlines."""

from __future__ import annotations

import pytest

from serving.server.request_reader import BODY_IDLE_TIMEOUT_S, BODY_TIMEOUT_S, HEAD_TIMEOUT_S, RequestReader

HEAD = b"POST /invocations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"


def reader(max_body: int = 1000) -> RequestReader:
    return RequestReader(idle_deadline=75.0, max_head=4096, max_body=max_body)


def fed(*pieces: bytes, max_body: int = 1000) -> RequestReader:
    r = reader(max_body)
    for i, piece in enumerate(pieces):
        r.feed(piece, now=float(i))
    return r


def test_content_length_body_byte_by_byte_is_complete_only_at_its_end():
    request = HEAD + b"Content-Length: 5\r\n\r\nhello"
    r = reader()
    for i in range(len(request)):
        assert not r.complete, i
        r.feed(request[i:i + 1], now=0.0)
    assert r.complete and r.rejection is None and bytes(r.buf) == request


@pytest.mark.parametrize("request_bytes", [
    b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n",
    b"\r\nGET /ping HTTP/1.1\r\n\r\n",  # one empty line before the request line is allowed
    HEAD + b"Content-Length: 0\r\n\r\n",
    HEAD + b"Content-Length: 12x\r\n\r\n",  # malformed: gunicorn answers it
    HEAD + b"Content-Length: 3\r\nContent-Length: 4\r\n\r\n",
    HEAD + b"Transfer-Encoding: gzip\r\n\r\n",  # not chunked last: gunicorn answers it
])
def test_heads_that_need_no_more_bytes_are_complete_at_once(request_bytes):
    r = fed(request_bytes)
    assert r.complete and r.rejection is None


def test_chunked_body_ends_after_the_last_chunk_and_trailers():
    pieces = [HEAD + b"Transfer-Encoding: chunked\r\n\r\n", b"5;ext=1\r\nhel", b"lo\r\n", b"0\r\n",
              b"X-Trailer: 1\r\n", b"\r\n"]
    r = reader()
    for i, piece in enumerate(pieces):
        assert not r.complete, i
        r.feed(piece, now=0.0)
    assert r.complete and r.rejection is None


@pytest.mark.parametrize("pieces, status, why", [
    ([HEAD + b"Content-Length: 5000\r\n\r\n"], 413, "the request body is 5000 bytes; the limit is 1000"),
    ([HEAD + b"Transfer-Encoding: chunked\r\n\r\n", b"400\r\n" + b"a" * 10], 413, "over the limit of 1000"),
    ([HEAD + b"Transfer-Encoding: chunked\r\n\r\n", b"ffffffffffffffff\r\n"], 400, "1 to 15 hex digits"),
    ([HEAD + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n"], 400, "1 to 15 hex digits"),
    ([HEAD + b"Transfer-Encoding: chunked\r\n\r\n5", b"0" * 5000], 400, "chunk-size line is over 4096"),
    ([HEAD + b"Transfer-Encoding: chunked\r\n\r\n5;x=" + b"e" * 5000 + b"\r\n"], 400, "line is over 4096"),
    ([HEAD + b"Transfer-Encoding: chunked\r\n\r\n0\r\nX-T: " + b"t" * 5000], 400, "trailer line is over 4096"),
    # Many small extensions and trailers count towards the body limit.
    ([HEAD + b"Transfer-Encoding: chunked\r\n\r\n"] + [b"1;e=" + b"x" * 300 + b"\r\na\r\n"] * 4, 413, "over the limit"),
    ([HEAD + b"Transfer-Encoding: chunked\r\n\r\n0\r\n"] + [b"X-T: " + b"t" * 300 + b"\r\n"] * 4, 413, "over the limit"),
])
def test_bodies_over_the_limit_and_unframeable_chunks_are_rejected_here(pieces, status, why):
    r = fed(*pieces)
    assert r.rejection is not None and not r.complete, r.rejection
    assert r.rejection[0] == status and why in r.rejection[1], r.rejection


def test_head_without_end_past_the_limit_is_rejected():
    assert fed(b"GET /" + b"a" * 5000).rejection == (414, "the request line is over 4096 bytes")
    assert fed(HEAD + b"X-Big: " + b"a" * 5000).rejection == (431, "the request head is over 4096 bytes")


def test_deadlines_idle_then_head_then_body():
    r = reader()
    assert r.phase == "idle" and r.deadline == 75.0
    r.feed(HEAD, now=100.0)
    assert r.phase == "head" and r.deadline == 100.0 + HEAD_TIMEOUT_S
    assert "head" in r.timeout_message()
    r.feed(b"Content-Length: 100\r\n\r\n0123456789", now=101.0)
    assert r.phase == "body" and r.deadline == 101.0 + BODY_IDLE_TIMEOUT_S and not r.complete
    r.feed(b"x", now=105.0)  # every byte moves the idle deadline, never past the whole-body one
    assert r.deadline == 105.0 + BODY_IDLE_TIMEOUT_S
    r.feed(b"x", now=101.0 + BODY_TIMEOUT_S - 1)
    assert r.deadline == 101.0 + BODY_TIMEOUT_S
    assert "body" in r.timeout_message()


def test_expect_100_continue_is_noticed_on_http_1_1_only():
    assert fed(HEAD + b"Content-Length: 5\r\nExpect: 100-continue\r\n\r\n").expect_continue
    head_10 = HEAD.replace(b"HTTP/1.1", b"HTTP/1.0")
    assert not fed(head_10 + b"Content-Length: 5\r\nExpect: 100-continue\r\n\r\n").expect_continue

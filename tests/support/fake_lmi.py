"""A tiny stand-in for an LMI container (unit tests only): canned LMI bytes over HTTP/1.1 chunked.

Behaviour is chosen by the request's ``inputs``: "error400"/"error503" -> that status with an LMI
error body; "break" -> a stream cut off mid-way (no terminating chunk); "slow" -> nothing (but the
headers of a stream) for up to 10 s while watching for the client to hang up, which is recorded in
``hung_up``; anything else -> the words of
``inputs`` echoed back as tokens. ``"stream": true`` gives JSON lines (or SSE with
``parameters.sse``), otherwise one JSON object. The real-container tests use container/serve instead.
"""

from __future__ import annotations

import json
import select
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def lmi_lines(words: list[str], details: bool = False) -> list[bytes]:
    """The JSON lines LMI 0.28 writes for these tokens (lmi-contract.md §4.2)."""
    lines = []
    for i, word in enumerate(words):
        record: dict = {"token": {"id": 100 + i, "text": word, "log_prob": -0.5}}
        if i == len(words) - 1:
            record["generated_text"] = "".join(words)
            if details:
                record["details"] = {"finish_reason": "length", "generated_tokens": len(words), "inputs": "x"}
        lines.append(json.dumps(record).encode() + b"\n")
    return lines


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:
        pass

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%X\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def do_GET(self) -> None:
        body = b'{"fake": {"status": "Healthy"}}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append({"path": self.path, "headers": dict(self.headers), "body": body})
        if "messages" in body:
            self._chat(body)
            return
        inputs = body.get("inputs", "")
        if body.get("parameters", {}).get("max_new_tokens", 1) < 0:
            inputs = "error400"
        if inputs.startswith("error"):
            status = int(inputs[5:8])
            payload = json.dumps({"error": f"fake failure {status}", "code": status}).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
            return
        words = [w if i == 0 else " " + w for i, w in enumerate(inputs.split())] or ["ok"]
        params = body.get("parameters", {})
        stream = body.get("stream", False)
        if inputs == "slow" and self._slow(stream):
            return
        self.send_response(200)
        ctype = "text/event-stream" if params.get("sse") else "application/jsonlines" if stream else "application/json"
        self.send_header("Content-Type", ctype)
        self.send_header("X-Amzn-SageMaker-Custom-Attributes", self.headers.get("X-Amzn-SageMaker-Custom-Attributes", "none"))
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        if inputs == "break":
            self._chunk(b'{"token": {"id": 1, "text": "par')
            self.wfile.flush()
            self.close_connection = True
            return  # no terminating 0-chunk: the reader sees an incomplete body
        if not stream:
            self._chunk(json.dumps({"generated_text": "".join(words)}).encode())
        else:
            for line in lmi_lines(words, params.get("details", False)):
                self._chunk(b"data: " + line + b"\n" if params.get("sse") else line)
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


    def _slow(self, stream: bool) -> bool:
        """Wait (at most 10 s) for the client to hang up, recorded in ``hung_up``. True when that
        dealt with the request (the client left, or its stream was ended here); False: answer it."""
        if stream:
            self.send_response(200)
            self.send_header("Content-Type", "application/jsonlines")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            self.wfile.flush()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            readable, _, _ = select.select([self.connection], [], [], 0.1)
            if readable and self.connection.recv(1, socket.MSG_PEEK) == b"":
                self.server.hung_up.append(time.monotonic())
                self.close_connection = True
                return True
        if stream:  # the client stayed: end the stream it has the headers of
            self._chunk(lmi_lines(["slow"])[0])
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        return stream

    def _chat(self, body: dict) -> None:
        words = body["messages"][-1]["content"].split()[: body.get("max_tokens", 8)] or ["ok"]
        words = [w if i == 0 else " " + w for i, w in enumerate(words)]
        self.send_response(200)
        self.send_header("Content-Type", "application/jsonlines" if body.get("stream") else "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        if body.get("stream"):
            for i, word in enumerate(words):
                finish = "length" if i == len(words) - 1 else None
                chunk = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": word}, "finish_reason": finish}]}
                self._chunk(json.dumps(chunk).encode() + b"\n")
        else:
            answer = {"object": "chat.completion", "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(words)},
                      "finish_reason": "length"}], "usage": {"prompt_tokens": 5, "completion_tokens": len(words), "total_tokens": 5 + len(words)}}
            self._chunk(json.dumps(answer).encode())
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


class FakeLMI:
    """``with FakeLMI() as fake: fake.url``: a threaded fake container on a free port."""

    def __init__(self, port: int = 0) -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", port), _Handler)
        self.server.daemon_threads = True
        self.server.requests = []  # type: ignore[attr-defined]
        self.server.hung_up = []  # type: ignore[attr-defined]  # when clients of "slow" requests left
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    @property
    def requests(self) -> list[dict]:
        return self.server.requests  # type: ignore[attr-defined]

    @property
    def hung_up(self) -> list[float]:
        return self.server.hung_up  # type: ignore[attr-defined]

    def __enter__(self) -> FakeLMI:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def runtime_client(url: str, read_timeout: float = 60):
    """A real boto3 sagemaker-runtime client aimed at ``url`` (dummy credentials, no retries)."""
    import boto3
    from botocore.config import Config

    return boto3.client(
        "sagemaker-runtime", endpoint_url=url, region_name="us-east-1",
        aws_access_key_id="testing", aws_secret_access_key="testing",
        config=Config(retries={"total_max_attempts": 1}, read_timeout=read_timeout),
    )


if __name__ == "__main__":  # a stand-in `serve` for trying notebooks without the real container
    import os

    with FakeLMI(int(os.environ.get("SAGEMAKER_BIND_TO_PORT", "8080"))) as fake:
        fake.thread.join()

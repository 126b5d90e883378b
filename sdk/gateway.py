"""A local SageMaker runtime: the data plane of ``sagemaker-runtime`` in front of a local container.

``python -m sdk.gateway --upstream http://127.0.0.1:8080 [--port N] [--endpoint NAME=URL ...]``

In: ``POST /endpoints/<name>/invocations`` (InvokeEndpoint) and ``.../invocations-response-stream``
(InvokeEndpointWithResponseStream), as boto3 or the sagemaker SDK send them with ``endpoint_url``.
Out: the container's ``POST /invocations`` answer; 4xx/5xx become SageMaker's ``ModelError`` (424 with
``OriginalStatusCode``/``OriginalMessage``); streams become event-stream frames (``PayloadPart`` per
upstream chunk, ``ModelStreamError`` if the upstream breaks). A client that hangs up while its request
runs (a boto3 read timeout) has its upstream request closed, so the container aborts it; the gateway
logs one line. No auth: signatures are not checked.
"""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import re
import socket
import sys
import threading
import uuid
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

from sdk import eventstream

logger = logging.getLogger(__name__)

ACCOUNT = "123456789012"
REGION = "us-east-1"
VARIANT = "AllTraffic"
# Request headers that InvokeEndpoint carries through to the container (lmi-contract.md §1.5).
_FORWARDED = (
    "Content-Type", "X-Amzn-SageMaker-Custom-Attributes", "X-Amzn-SageMaker-Target-Model",
    "X-Amzn-SageMaker-Inference-Id", "X-Amzn-SageMaker-Session-Id",
)
_ROUTE = re.compile(r"^/endpoints/([^/]+)/(invocations|invocations-response-stream)$")
_WATCH_S = 0.25  # how often a waiting handler checks that its client is still connected


class Upstreams:
    """Endpoint name -> container base URL, with an optional default for any other name."""

    def __init__(self, default: str | None = None, endpoints: dict[str, str] | None = None,
                 on_unknown: Callable[[str], str | None] | None = None) -> None:
        self.default = default.rstrip("/") if default else None
        self.endpoints = {k: v.rstrip("/") for k, v in (endpoints or {}).items()}
        # A name not routed yet: asked for its URL (sdk.local starts the endpoint's container there).
        self.on_unknown = on_unknown

    def resolve(self, name: str) -> str | None:
        if name not in self.endpoints and self.on_unknown is not None:
            url = self.on_unknown(name)
            if url is not None:
                return url.rstrip("/")
        return self.endpoints.get(name, self.default)

    def add(self, name: str, url: str) -> None:
        self.endpoints[name] = url.rstrip("/")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _GatewayServer

    def log_message(self, fmt: str, *args: object) -> None:  # route through logging, not stderr
        logger.info("%s " + fmt, self.address_string(), *args)

    # -- helpers ---------------------------------------------------------------------------------
    def _send(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("x-amzn-RequestId", str(uuid.uuid4()))
        self.end_headers()
        self.wfile.write(body)

    def _aws_error(self, status: int, code: str, message: str, **fields: object) -> None:
        body = json.dumps({"Message": message, "message": message, **fields}).encode()
        self._send(status, body, {"Content-Type": "application/json", "x-amzn-ErrorType": code})

    def _model_error(self, name: str, status: int, original: str) -> None:
        kind = "client" if 400 <= status < 500 else "server"
        log_group = f"/aws/sagemaker/Endpoints/{name}"
        message = (
            f'Received {kind} error ({status}) from primary with message "{original}". See '
            f"https://{REGION}.console.aws.amazon.com/cloudwatch/home?region={REGION}#logEventViewer:"
            f"group={log_group} in account {ACCOUNT} for more information."
        )
        self._aws_error(
            424, "ModelError", message, OriginalStatusCode=status, OriginalMessage=original,
            LogStreamArn=f"arn:aws:logs:{REGION}:{ACCOUNT}:log-group:{log_group}",
        )

    def _read_body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _open_upstream(self, base: str, body: bytes, accept: str | None) -> http.client.HTTPConnection:
        """Connect to the container and send the request (the answer is read by the caller)."""
        parts = urlsplit(base)
        conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=self.server.timeout_s)
        headers = {h: v for h in _FORWARDED if (v := self.headers.get(h)) is not None}
        headers.setdefault("Content-Type", "application/json")
        if accept:
            headers["Accept"] = accept
        try:
            conn.request("POST", (parts.path or "") + "/invocations", body=body, headers=headers)
        except BaseException:
            conn.close()
            raise
        return conn

    def _upstream_failed(self, name: str, exc: Exception) -> None:
        if isinstance(exc, TimeoutError):
            self._model_error(name, 0, "Your invocation timed out while waiting for a response from container primary.")
        else:
            self._model_error(name, 0, f"Could not reach the container: {exc}")

    # -- routes ----------------------------------------------------------------------------------
    def do_GET(self) -> None:
        if self.path == "/ping":
            self._send(200, b"{}", {"Content-Type": "application/json"})
        else:
            self._aws_error(404, "UnknownOperationException", f"no route for GET {self.path}")

    def do_POST(self) -> None:
        match = _ROUTE.match(urlsplit(self.path).path)
        body = self._read_body()
        if match is None:
            self._aws_error(404, "UnknownOperationException", f"no route for POST {self.path}")
            return
        name, operation = unquote(match.group(1)), match.group(2)
        upstream = self.server.upstreams.resolve(name)
        if upstream is None:
            self._aws_error(400, "ValidationError", f"Endpoint {name} of account {ACCOUNT} not found.")
            return
        stream = operation != "invocations"
        try:
            conn = self._open_upstream(upstream, body, self.headers.get("X-Amzn-SageMaker-Accept" if stream else "Accept"))
        except (OSError, http.client.HTTPException) as exc:
            self._upstream_failed(name, exc)
            return
        watch = _ClientWatch(self.connection, conn, f"{self.address_string()} ({name})")
        try:
            with watch:
                (self._invoke_stream if stream else self._invoke)(name, conn, watch)
        except (BrokenPipeError, ConnectionResetError):  # a write to the client failed
            watch.hang_up()
        finally:
            conn.close()
        if watch.gone:
            self.close_connection = True

    def _invoke(self, name: str, conn: http.client.HTTPConnection, watch: _ClientWatch) -> None:
        try:
            resp = conn.getresponse()
            data = resp.read()
        except (OSError, http.client.HTTPException) as exc:
            if not watch.gone:  # else: we closed it, and nobody is left to answer
                self._upstream_failed(name, exc)
            return
        if watch.gone:
            return
        if resp.status >= 400:
            self._model_error(name, resp.status, data.decode("utf-8", "replace"))
            return
        headers = {"Content-Type": resp.getheader("Content-Type", "application/octet-stream"),
                   "x-Amzn-Invoked-Production-Variant": VARIANT}
        if (attrs := resp.getheader("X-Amzn-SageMaker-Custom-Attributes")) is not None:
            headers["X-Amzn-SageMaker-Custom-Attributes"] = attrs
        self._send(resp.status, data, headers)

    def _invoke_stream(self, name: str, conn: http.client.HTTPConnection, watch: _ClientWatch) -> None:
        try:
            resp = conn.getresponse()
            error = resp.read() if resp.status >= 400 else None
        except (OSError, http.client.HTTPException) as exc:
            if not watch.gone:
                self._upstream_failed(name, exc)
            return
        if error is not None:
            self._model_error(name, resp.status, error.decode("utf-8", "replace"))
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/vnd.amazon.eventstream")
        self.send_header("X-Amzn-SageMaker-Content-Type", resp.getheader("Content-Type", "application/octet-stream"))
        self.send_header("x-Amzn-Invoked-Production-Variant", VARIANT)
        if (attrs := resp.getheader("X-Amzn-SageMaker-Custom-Attributes")) is not None:
            self.send_header("X-Amzn-SageMaker-Custom-Attributes", attrs)
        self.send_header("x-amzn-RequestId", str(uuid.uuid4()))
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self._pump(resp, watch)

    def _pump(self, resp: http.client.HTTPResponse, watch: _ClientWatch) -> None:
        """Copy upstream chunks out as PayloadPart frames; a broken upstream ends with ModelStreamError."""
        while True:
            try:
                data, failure = resp.read1(65536), None
            except (http.client.HTTPException, OSError) as exc:
                data, failure = b"", exc
            if watch.gone:  # we closed the upstream ourselves: the client is not there to tell
                return
            if isinstance(failure, TimeoutError):
                self._chunk(eventstream.model_stream_error(
                    "The model failed to finish sending the response within the timeout period.",
                    "ModelInvocationTimeExceeded"))
            elif failure is not None:
                self._chunk(eventstream.model_stream_error(f"Upstream stream broken: {failure!r}", "StreamBroken"))
            if not data:
                break
            self._chunk(eventstream.payload_part(data))
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def _chunk(self, frame: bytes) -> None:
        self.wfile.write(b"%X\r\n%s\r\n" % (len(frame), frame))
        self.wfile.flush()


class _ClientWatch:
    """While a handler waits on the container, notice its client hanging up and close the upstream
    request then, so the container aborts the work (a boto3 read timeout and its retries must not
    stack generations there). Logs one line per client that went away."""

    def __init__(self, client: socket.socket, upstream: http.client.HTTPConnection, who: str) -> None:
        self.gone = False
        self._client = client
        self._upstream = upstream
        self._who = who
        self._lock = threading.Lock()
        self._done = threading.Event()

    def __enter__(self) -> _ClientWatch:
        threading.Thread(target=self._watch, name="sm-gateway-watch", daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()

    def _watch(self) -> None:
        while not self._done.wait(_WATCH_S):
            try:  # peek: b"" is the client's EOF; no byte waiting means it is still there
                eof = self._client.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
            except (BlockingIOError, InterruptedError, TimeoutError):
                eof = False
            except OSError:  # reset
                eof = True
            if eof:
                self.hang_up()
                return

    def hang_up(self) -> None:
        """The client is gone: shut the upstream connection (the container sees it close) and say so."""
        with self._lock:
            if self.gone:
                return
            self.gone = True
        logger.info("client %s went away; closed its request to the container", self._who)
        sock = self._upstream.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes the handler's blocked read; close() is the handler's
            except OSError:
                pass


class _GatewayServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], upstreams: Upstreams, timeout_s: float) -> None:
        super().__init__(address, _Handler)
        self.upstreams = upstreams
        self.timeout_s = timeout_s


class Gateway:
    """In-process gateway on a background thread (tests, notebooks): ``with Gateway(up) as gw: gw.url``."""

    def __init__(
        self, upstream: str | None = None, endpoints: dict[str, str] | None = None, *,
        host: str = "127.0.0.1", port: int = 0, timeout_s: float = 60.0,
    ) -> None:
        self.upstreams = Upstreams(upstream, endpoints)
        self._server = _GatewayServer((host, port), self.upstreams, timeout_s)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """Base URL to pass as boto3's ``endpoint_url``."""
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> Gateway:
        self._thread = threading.Thread(target=self._server.serve_forever, name="sm-gateway", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> Gateway:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sdk.gateway", description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", help="container base URL for any endpoint name, e.g. http://127.0.0.1:8080")
    parser.add_argument("--endpoint", action="append", default=[], metavar="NAME=URL",
                        help="route one endpoint name to its own container (repeatable)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8081, help="0 picks a free port")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for upstream bytes")
    args = parser.parse_args(argv)
    endpoints = dict(item.split("=", 1) for item in args.endpoint)
    if not args.upstream and not endpoints:
        parser.error("give --upstream or at least one --endpoint NAME=URL")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    gateway = Gateway(args.upstream, endpoints, host=args.host, port=args.port, timeout_s=args.timeout)
    print(f"sagemaker-runtime gateway listening on {gateway.url}", flush=True)
    try:
        gateway._server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        gateway._server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

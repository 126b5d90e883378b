"""A local SageMaker runtime: the data plane of ``sagemaker-runtime`` in front of a local container.

``python -m sdk.gateway --upstream http://127.0.0.1:8080 [--port N] [--endpoint NAME=URL ...]``

In: ``POST /endpoints/<name>/invocations`` (InvokeEndpoint) and ``.../invocations-response-stream``
(InvokeEndpointWithResponseStream), as boto3 or the sagemaker SDK send them with ``endpoint_url``.
Out: the container's ``POST /invocations`` answer; 4xx/5xx become SageMaker's ``ModelError`` (424 with
``OriginalStatusCode``/``OriginalMessage``); streams become event-stream frames (``PayloadPart`` per
upstream chunk, ``ModelStreamError`` if the upstream breaks). No auth: signatures are not checked.
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


class Upstreams:
    """Endpoint name -> container base URL, with an optional default for any other name."""

    def __init__(self, default: str | None = None, endpoints: dict[str, str] | None = None) -> None:
        self.default = default.rstrip("/") if default else None
        self.endpoints = {k: v.rstrip("/") for k, v in (endpoints or {}).items()}

    def resolve(self, name: str) -> str | None:
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

    def _open_upstream(self, base: str, body: bytes, accept: str | None):
        parts = urlsplit(base)
        conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=self.server.timeout_s)
        headers = {h: v for h in _FORWARDED if (v := self.headers.get(h)) is not None}
        headers.setdefault("Content-Type", "application/json")
        if accept:
            headers["Accept"] = accept
        conn.request("POST", (parts.path or "") + "/invocations", body=body, headers=headers)
        return conn, conn.getresponse()

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
        if operation == "invocations":
            self._invoke(name, upstream, body)
        else:
            self._invoke_stream(name, upstream, body)

    def _invoke(self, name: str, upstream: str, body: bytes) -> None:
        try:
            conn, resp = self._open_upstream(upstream, body, self.headers.get("Accept"))
            try:
                data = resp.read()
            finally:
                conn.close()
        except (TimeoutError, socket.timeout):
            self._model_error(name, 0, "Your invocation timed out while waiting for a response from container primary.")
            return
        except OSError as exc:
            self._model_error(name, 0, f"Could not reach the container: {exc}")
            return
        if resp.status >= 400:
            self._model_error(name, resp.status, data.decode("utf-8", "replace"))
            return
        headers = {"Content-Type": resp.getheader("Content-Type", "application/octet-stream"),
                   "x-Amzn-Invoked-Production-Variant": VARIANT}
        if (attrs := resp.getheader("X-Amzn-SageMaker-Custom-Attributes")) is not None:
            headers["X-Amzn-SageMaker-Custom-Attributes"] = attrs
        self._send(resp.status, data, headers)

    def _invoke_stream(self, name: str, upstream: str, body: bytes) -> None:
        try:
            conn, resp = self._open_upstream(upstream, body, self.headers.get("X-Amzn-SageMaker-Accept"))
        except (TimeoutError, socket.timeout):
            self._model_error(name, 0, "Your invocation timed out while waiting for a response from container primary.")
            return
        except OSError as exc:
            self._model_error(name, 0, f"Could not reach the container: {exc}")
            return
        try:
            if resp.status >= 400:
                self._model_error(name, resp.status, resp.read().decode("utf-8", "replace"))
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
            self._pump(resp)
        finally:
            conn.close()

    def _pump(self, resp: http.client.HTTPResponse) -> None:
        """Copy upstream chunks out as PayloadPart frames; a broken upstream ends with ModelStreamError."""
        try:
            while True:
                try:
                    data = resp.read1(65536)
                except (TimeoutError, socket.timeout):
                    self._chunk(eventstream.model_stream_error(
                        "The model failed to finish sending the response within the timeout period.",
                        "ModelInvocationTimeExceeded"))
                    break
                except (http.client.HTTPException, OSError) as exc:
                    self._chunk(eventstream.model_stream_error(f"Upstream stream broken: {exc!r}", "StreamBroken"))
                    break
                if not data:
                    break
                self._chunk(eventstream.payload_part(data))
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            logger.info("client went away during a stream")
            self.close_connection = True

    def _chunk(self, frame: bytes) -> None:
        self.wfile.write(b"%X\r\n%s\r\n" % (len(frame), frame))
        self.wfile.flush()


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

"""The HTTP surface: `create_app(engine_loop, config)` -> Flask app (thin; no engine state here).

Routes: `GET /ping`, `POST /invocations` (LMI, TGI-compat and chat bodies), `GET /v1/models`,
`POST /v1/completions`, `POST /v1/chat/completions`, `POST /generate` (vLLM's legacy api_server),
`GET /metrics`. Parsing is in
`serving/server/protocol.py`, output bytes in `serving/server/formatters.py`, engine interaction in
`serving/server/request_runner.py`. Errors are `{"error", "code"}` JSON with a 4xx/5xx status (LMI's) on
`/invocations`, OpenAI's `{"error": {"message", "type", "param", "code"}}` on `/v1/*` and `/generate`.
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from collections.abc import Callable, Iterator

from flask import Flask, Response, request
from werkzeug.exceptions import HTTPException

from serving.config import ServingConfig
from serving.server.disconnect import probe_from_environ
from serving.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from serving.server.metrics import Metrics
from serving.server.protocol import (
    GenerateRequest,
    loads_body,
    parse_chat,
    parse_completions,
    parse_custom_attributes,
    parse_generate,
    parse_invocations,
    unsupported_adapter,
)
from serving.engine.client import EngineClient
from serving.engine.engine_loop import EngineState
from serving.server.request_runner import HTTPError, RequestRunner

logger = logging.getLogger("serving.server.app")
UNMATCHED_ROUTE = "unmatched"  # the metrics route label of requests no route/method matched
_NO_CACHE = {"Cache-Control": "no-cache, no-store, must-revalidate, private", "Pragma": "no-cache"}


def _engine_state(engine_loop: EngineClient) -> str:
    return EngineState(engine_loop.state).value


def _stats(engine_loop: EngineClient) -> dict:
    try:
        return engine_loop.stats()
    except Exception:  # noqa: BLE001 - never fail a scrape
        return {}


def create_app(engine_loop: EngineClient, config: ServingConfig) -> Flask:
    """Build the Flask app around a running (or loading) engine: one EngineLoop, or a ReplicaSet
    of model copies (`serving/engine/client.py` says what the app may use of it).

    Args:
        engine_loop: the engine client (its streams: `get(timeout)` -> StreamDelta,
            `get_nowait()`, `close()` aborts).
        config: the resolved container configuration.
    """
    app = Flask("serving")
    app.config["MAX_CONTENT_LENGTH"] = None  # we answer 400 ourselves (LMI error schema)
    runner: RequestRunner | None = None
    metrics = Metrics(lambda: _stats(engine_loop), lambda: runner.inflight if runner else 0)
    runner = RequestRunner(engine_loop, config, metrics)
    app.extensions["runner"] = runner

    def error(status: int, message: str, route: str) -> Response:
        metrics.observe_request(route, status)
        if config.compat_200_errors and status in (400, 424, 500):
            # LMI 0.28 default for rolling batch: HTTP 200 with {"code": 424, "error": ...}
            return Response(json.dumps({"code": 424, "error": message}), 200, mimetype="application/json")
        headers = {"Connection": "close"} if status >= 400 else {}
        body = openai_error(status, message) if _openai_path(request.path) else {"error": message, "code": status}
        return Response(json.dumps(body), status, mimetype="application/json", headers=headers)

    def not_ready(route: str) -> Response | None:
        state = _engine_state(engine_loop)
        if state == "ready":
            return None
        if state == "dead":
            return error(500, f"the engine is dead: {engine_loop.error}", route)
        return error(503, "the model is loading", route)

    def read_body(route: str) -> dict | Response:
        length = request.content_length
        limit = config.max_request_size
        if length is not None and length > limit:
            return error(400, f"the request body is {length} bytes; the limit is {limit}", route)
        raw = request.stream.read(limit + 1)
        if len(raw) > limit:
            return error(400, f"the request body is over the limit of {limit} bytes", route)
        try:
            if request.mimetype == "text/plain":  # LMI: a text body is the prompt
                return {"inputs": raw.decode("utf-8")}
            return loads_body(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            return error(400, str(exc), route)

    def generate(route: str, parse: Callable[[dict], GenerateRequest]) -> Response:
        busy = not_ready(route)
        if busy is not None:
            return busy
        body = read_body(route)
        if isinstance(body, Response):
            return body
        attrs = parse_custom_attributes(request.headers.get("X-Amzn-SageMaker-Custom-Attributes"))
        if attrs.get("adapter"):
            return error(400, unsupported_adapter(attrs["adapter"]), route)  # as the `adapters` body field
        request_id = uuid.uuid4().hex
        headers = {"x-request-id": request_id, **_NO_CACHE}
        gone = probe_from_environ(request.environ)  # a client that leaves aborts its request at once
        try:
            req = parse(body)
            if req.stream:
                records = runner.run_stream(req, request_id, gone)
                metrics.observe_request(route, 200)
                fmt_type = runner.formatter(req, request_id).content_type
                return Response(_flushing(records), 200, content_type=fmt_type,
                                headers={**headers, "X-Accel-Buffering": "no"}, direct_passthrough=True)
            out = runner.run_plain(req, request_id, gone)
            content_type = runner.formatter(req, request_id).content_type
            if isinstance(out, tuple):
                metrics.observe_request(route, out[0])
                return Response(out[1], out[0], content_type=content_type, headers=headers)
            metrics.observe_request(route, 200)  # slow: 200 committed, heartbeats, then the body
            return Response(_flushing(out), 200, content_type=content_type, headers=headers,
                            direct_passthrough=True)
        except ValueError as exc:
            return error(400, str(exc), route)
        except HTTPError as exc:
            return error(exc.status, exc.message, route)

    @app.get("/ping")
    def ping() -> Response:
        state = _engine_state(engine_loop)
        status = {"ready": 200, "loading": 503}.get(state, 500)
        body: dict = {"status": {"ready": "Healthy", "loading": "Loading"}.get(state, "Unhealthy")}
        if state == "dead":
            body["error"] = str(engine_loop.error or "")
        return Response(json.dumps(body), status, mimetype="application/json")

    @app.post("/invocations")
    def invocations() -> Response:
        return generate("/invocations", lambda b: parse_invocations(
            b, tgi_compat=config.tgi_compat, output_formatter=config.output_formatter))

    @app.post("/v1/completions")
    def completions() -> Response:
        return generate("/v1/completions", parse_completions)

    @app.post("/v1/chat/completions")
    def chat_completions() -> Response:
        return generate("/v1/chat/completions", parse_chat)

    @app.post("/generate")
    def vllm_generate() -> Response:
        return generate("/generate", parse_generate)

    @app.get("/v1/models")
    def models() -> Response:
        card = {"id": config.served_model_name, "object": "model", "created": int(time.time()),
                "owned_by": "open-lmi", "root": config.engine.model or config.served_model_name, "parent": None,
                "max_model_len": engine_loop.max_model_len, "permission": []}
        return Response(json.dumps({"object": "list", "data": [card]}), 200, mimetype="application/json")

    @app.get("/metrics")
    def prometheus() -> Response:
        return Response(metrics.render(), 200, content_type=METRICS_CONTENT_TYPE)

    @app.errorhandler(404)
    def not_found(_exc: Exception) -> Response:
        return error(404, f"no route {request.path}", _route_label())

    @app.errorhandler(405)
    def bad_method(_exc: Exception) -> Response:
        return error(405, f"{request.method} is not allowed on {request.path}", _route_label())

    @app.errorhandler(Exception)
    def internal(exc: Exception) -> Response:
        if isinstance(exc, HTTPException):
            return error(exc.code or 500, exc.description or exc.name, _route_label())
        logger.exception("unhandled error on %s", request.path)
        return error(500, f"internal error: {exc}", _route_label())

    return app


def _openai_path(path: str) -> bool:
    """Routes answered with OpenAI's error object: /v1/* and vLLM's legacy /generate."""
    return path.startswith("/v1/") or path == "/generate"


# "max_tokens must be ...", "messages[0].content: only text ...": the field a message starts with.
_PARAM = re.compile(r"^([a-z_]+(?:\[\d+\])*(?:\.[a-z_]+(?:\[\d+\])*)*)(?::| must | is | holds )")


def openai_error(status: int, message: str) -> dict:
    """OpenAI's error object (`{"error": {"message", "type", "param", "code"}}`), as vLLM answers:
    `type` is `invalid_request_error` for 4xx and `server_error` for 5xx, `param` the request field
    the message names (else null), `code` the HTTP status."""
    match = _PARAM.match(message)
    param = match.group(1) if match else None
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def _route_label() -> str:
    """The `route` label of a request: its route template, or one bucket for everything else.

    Never the raw path: every distinct unknown path (or method) would become a new time series.
    """
    rule = request.url_rule
    return rule.rule if rule is not None else UNMATCHED_ROUTE


def _flushing(records: Iterator[bytes]) -> Iterator[bytes]:
    """Yield each record as its own chunk; closing this closes `records` (aborts on disconnect)."""
    try:
        for rec in records:
            if rec:
                yield rec
    finally:
        close = getattr(records, "close", None)
        if close is not None:
            close()

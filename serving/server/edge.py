"""What every route of the edge shares, written once: `Edge`, the app's state and the steps of a request.

Why: the routes live in their APIs' modules (`serving/server/api/`), as Flask blueprints; each
asks `current_edge()` for the rest: the engine's readiness, the body (size limit, JSON), errors
in the route's dialect (LMI's or OpenAI's, or LMI 0.28's HTTP 200 with code 424 when
`compat_200_errors`), the adapter a request names, and one generation request run on the
`RequestRunner` and answered (plain, streamed, or plain with the opt-in heartbeat), logged once as
it ends (`access_log.RequestRecord`). `serving/server/app.py` builds it and registers the routes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from flask import Response, current_app, request

from serving.server.settings.serving_config import ServingConfig
from serving.engine.client import EngineClient
from serving.engine.request_stream import EngineState
from serving.engine.grammar_compiler import COMPILE_CANCELLED
from serving.server.access_log import RequestRecord
from serving.server.adapters import AdapterNotFound, AdapterRegistry, select_adapters
from serving.server.admission import Health
from serving.server.disconnect import probe_from_environ
from serving.server.errors import error_for_path
from serving.server.formatters import Formatter
from serving.server.metrics import Metrics
from serving.server.protocol import GenerateRequest, loads_body
from serving.server.request_runner import HTTPError, RequestRunner
from serving.server.write_stall import WriteStall, stall_from_environ

logger = logging.getLogger("serving.server.app")
NO_CACHE = {"Cache-Control": "no-cache, no-store, must-revalidate, private", "Pragma": "no-cache"}
CUSTOM_ATTRIBUTES = "X-Amzn-SageMaker-Custom-Attributes"


def engine_state(engine: EngineClient) -> str:
    return EngineState(engine.state).value


def engine_health(engine: EngineClient) -> Health:
    """`/ping`'s answer: 200 Healthy, 503 while loading, 500 Unhealthy with the error once dead."""
    state = engine_state(engine)
    body: dict = {"status": {"ready": "Healthy", "loading": "Loading"}.get(state, "Unhealthy")}
    if state == "dead":
        body["error"] = str(engine.error or "")
    return Health({"ready": 200, "loading": 503}.get(state, 500), body)


def current_edge() -> Edge:
    """The `Edge` of the app serving this request."""
    return current_app.extensions["edge"]


@dataclass
class Edge:
    """The app's state (engine client, configuration, runner, metrics, adapters) and the steps
    every route takes with it."""

    engine: EngineClient
    config: ServingConfig
    runner: RequestRunner
    metrics: Metrics
    adapters: AdapterRegistry

    def error(self, status: int, message: str, route: str) -> Response:
        """The error answer of `route` (the metrics count it)."""
        self.metrics.observe_request(route, status)
        if self.config.compat_200_errors and status in (400, 424, 500):
            # LMI 0.28 default for rolling batch: HTTP 200 with {"code": 424, "error": ...}
            return Response(json.dumps({"code": 424, "error": message}), 200, mimetype="application/json")
        headers = {"Connection": "close"} if status >= 400 else {}
        body = error_for_path(request.path, status, message)
        return Response(json.dumps(body), status, mimetype="application/json", headers=headers)

    def not_ready(self, route: str) -> Response | None:
        """The error to answer while the engine is not ready (503 loading, 500 dead), else None."""
        state = engine_state(self.engine)
        if state == "ready":
            return None
        if state == "dead":
            return self.error(500, f"the engine is dead: {self.engine.error}", route)
        return self.error(503, "the model is loading", route)

    def read_body(self, route: str) -> dict | Response:
        """The request's JSON object (a text/plain body is LMI's prompt), else the error to answer."""
        length = request.content_length
        limit = self.config.max_request_size
        if length is not None and length > limit:
            return self.error(413, f"the request body is {length} bytes; the limit is {limit}", route)
        raw = request.stream.read(limit + 1)
        if len(raw) > limit:
            return self.error(413, f"the request body is over the limit of {limit} bytes", route)
        try:
            if request.mimetype == "text/plain":  # LMI: a text body is the prompt
                return {"inputs": raw.decode("utf-8")}
            return loads_body(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            return self.error(400, str(exc), route)

    def ready_body(self, route: str) -> dict | Response:
        """The request's JSON body once the engine is ready, else the error Response to answer."""
        busy = self.not_ready(route)
        return busy if busy is not None else self.read_body(route)

    def generate(self, route: str, parse: Callable[[dict], GenerateRequest], model_field: bool = False) -> Response:
        """One generation request, logged once as it ends (`access_log.RequestRecord`).

        `parse`: the route's body parser; `model_field`: the body's `model` may name an adapter (vLLM).
        """
        record = RequestRecord(uuid.uuid4().hex, route)
        response = self._run_generate(route, parse, model_field, record)
        response.headers.setdefault("x-request-id", record.request_id)  # errors too: the id the log names
        if not response.is_streamed:
            record.done(response.status_code)
        return response

    def _run_generate(self, route: str, parse: Callable[[dict], GenerateRequest], model_field: bool,
                      record: RequestRecord) -> Response:
        body = self.ready_body(route)
        if isinstance(body, Response):
            return body
        runner, metrics = self.runner, self.metrics
        request_id = record.request_id
        headers = {"x-request-id": request_id, **NO_CACHE}
        gone = probe_from_environ(request.environ)  # a client that leaves aborts its request at once
        stall = stall_from_environ(request.environ, self.config.write_timeout)  # one that stops reading, too
        try:
            req = select_adapters(parse(body), request.headers.get(CUSTOM_ATTRIBUTES), self.adapters,
                                  model_field=model_field)
            if req.adapters:
                logger.info("request %s on adapter(s) %s", request_id,
                            ", ".join(dict.fromkeys(a or "(base)" for a in req.adapters)))
            content_type = Formatter.of(req.fmt).content_type
            with _compiles_cancelled_by(gone):  # a grammar compile ends when its client leaves
                out = (runner.run_stream if req.stream else runner.run_plain)(req, request_id, gone, record)
            if req.stream:
                metrics.observe_request(route, 200)
                return Response(_flushing(out, lambda: record.done(200), stall), 200, content_type=content_type,
                                headers={**headers, "X-Accel-Buffering": "no"}, direct_passthrough=True)
            if isinstance(out, tuple):
                metrics.observe_request(route, out[0])
                return Response(out[1], out[0], content_type=content_type, headers=headers)
            metrics.observe_request(route, 200)  # plain_heartbeat: 200 committed, spaces, then the body
            return Response(_flushing(out, lambda: record.done(200), stall), 200, content_type=content_type,
                            headers=headers, direct_passthrough=True)
        except AdapterNotFound as exc:
            return self.error(404, str(exc), route)
        except ValueError as exc:
            return self.error(400, str(exc), route)
        except HTTPError as exc:
            record.count(record.tokens, exc.message)
            return self.error(exc.status, exc.message, route)


@contextlib.contextmanager
def _compiles_cancelled_by(gone: Callable[[], bool] | None) -> Iterator[None]:
    """Grammar compiles started in this block (on this thread) are cancelled once `gone()`."""
    token = COMPILE_CANCELLED.set(gone)
    try:
        yield
    finally:
        COMPILE_CANCELLED.reset(token)


def _flushing(records: Iterator[bytes], on_close: Callable[[], None],
              stall: WriteStall | None = None) -> Iterator[bytes]:
    """Yield each record as its own chunk; closing this closes `records` (aborts on disconnect), then
    calls `on_close` (the access line, now that the outcome is known). `stall` raises
    ClientNotReading (the response is cut, the request aborted) when the client stopped taking bytes."""
    try:
        for rec in records:
            if rec:
                if stall is not None:
                    stall.check(len(rec))
                yield rec
    finally:
        close = getattr(records, "close", None)
        if close is not None:
            close()
        on_close()

"""The HTTP surface: `create_app(engine_loop, config)` -> Flask app (thin; no engine state here).

Routes live with their APIs, as Flask blueprints registered below (`serving/server/api/`): LMI's
`POST /invocations` (LMI, TGI-compat and chat bodies) and TGI's `POST /`, `POST /generate_stream`
(`api/lmi/`), `POST /v1/chat/completions` (`api/openai_chat.py`), `POST /v1/completions`
(`api/openai_completions.py`), `POST /v1/responses` (`api/responses.py`), `POST /generate` (vLLM's
legacy api_server body, or TGI's by body shape; `api/vllm_generate.py`), vLLM's `GET /version`,
`POST /tokenize`, `POST /detokenize` (`api/tokenize.py`), `GET /ping`, `GET /health` (vLLM /
TGI), `GET /models`, `GET /v1/models`, `GET /metrics` and the chat page at `GET /`
(`api/service.py`), and DJL's management API for LoRA adapters (`api/management.py`), which
answers 403 unless the operator sets option.runtime_adapter_sources. What every route shares
(readiness, the body, errors, running one generation request) is `serving/server/edge.py`. Errors
are `{"error", "code"}` JSON with a 4xx/5xx status (LMI's) on `/invocations`, OpenAI's
`{"error": {"message", "type", "param", "code"}}` on `/v1/*` and `/generate`.

A new route is a blueprint in its API's module and one line in `BLUEPRINTS`.
"""

from __future__ import annotations

import logging

from flask import Flask, Response, request
from werkzeug.exceptions import HTTPException

from serving.server.settings.config import ServingConfig
from serving.engine.client import EngineClient
from serving.server.adapter_journal import AdapterJournal
from serving.server.adapters import AdapterRegistry
from serving.server.admission import Admission
from serving.server.api import management, openai_chat, openai_completions, responses, service, tokenize, vllm_generate
from serving.server.api.lmi import routes as lmi_routes
from serving.server.edge import Edge, engine_health
from serving.server.errors import error_for_path
from serving.server.metrics import Metrics
from serving.server.request_runner import RequestRunner

logger = logging.getLogger("serving.server.app")
UNMATCHED_ROUTE = "unmatched"  # the metrics route label of requests no route/method matched
BLUEPRINTS = (
    lmi_routes.blueprint,  # /invocations; TGI's / and /generate_stream
    openai_chat.blueprint,  # /v1/chat/completions
    openai_completions.blueprint,  # /v1/completions
    responses.blueprint,  # /v1/responses
    vllm_generate.blueprint,  # /generate (vLLM's body, or TGI's)
    tokenize.blueprint,  # /tokenize, /detokenize, /version
    service.blueprint,  # /ping, /health, /models, /v1/models, /metrics, the chat page
    management.blueprint,  # DJL's LoRA adapter management API
)


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
    adapters = AdapterRegistry(engine_loop, config, AdapterJournal(config.download_dir))
    edge = Edge(engine_loop, config, runner, metrics, adapters)
    app.extensions.update(edge=edge, runner=runner, adapters=adapters, metrics=metrics)  # (metrics: wsgi shares it)
    for blueprint in BLUEPRINTS:
        app.register_blueprint(blueprint)

    def route_of(method: str, path: str) -> str:
        try:
            return app.url_map.bind("localhost").match(path, method=method, return_rule=True)[0].rule
        except HTTPException:
            return UNMATCHED_ROUTE

    app.extensions["admission"] = Admission(
        config.job_queue_size, lambda: engine_health(engine_loop),
        reject_body=lambda path, message: error_for_path(path, 503, message),
        on_reject=lambda method, path: metrics.observe_request(route_of(method, path), 503))

    @app.errorhandler(404)
    def not_found(_exc: Exception) -> Response:
        return edge.error(404, f"no route {request.path}", _route_label())

    @app.errorhandler(405)
    def bad_method(_exc: Exception) -> Response:
        return edge.error(405, f"{request.method} is not allowed on {request.path}", _route_label())

    @app.errorhandler(Exception)
    def internal(exc: Exception) -> Response:
        if isinstance(exc, HTTPException):
            return edge.error(exc.code or 500, exc.description or exc.name, _route_label())
        logger.exception("unhandled error on %s", request.path)
        return edge.error(500, f"internal error: {exc}", _route_label())

    return app


def _route_label() -> str:
    """The `route` label of a request: its route template, or one bucket for everything else.

    Never the raw path: every distinct unknown path (or method) would become a new time series.
    """
    rule = request.url_rule
    return rule.rule if rule is not None else UNMATCHED_ROUTE

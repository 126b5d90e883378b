"""The HTTP surface: `create_app(engine_loop, config)` -> Flask app (thin; no engine state here).

Routes: `GET /ping`, `GET /health` (vLLM / TGI), `POST /invocations` (LMI, TGI-compat and chat
bodies), `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions`, `POST /v1/responses`,
`POST /generate` (vLLM's legacy api_server body, or TGI's by body shape), TGI's `POST /` and
`POST /generate_stream`, vLLM's `GET /version`, `POST /tokenize`, `POST /detokenize`, the chat
page at `GET /` (`serving/server/chat.html`),
`GET /metrics`, `GET /models`, and DJL's management API for LoRA adapters (`GET|POST
/models/{model}/adapters`, `GET|DELETE /models/{model}/adapters/{name}`; `/adapters[/{name}]` for
the one model), which answers 403 unless the operator sets option.runtime_adapter_sources. Parsing is in `serving/server/protocol.py`, output bytes in
`serving/server/formatters.py`, engine interaction in `serving/server/request_runner.py`, adapters
in `serving/server/adapters.py`. Errors are `{"error", "code"}` JSON with a 4xx/5xx status (LMI's) on
`/invocations`, OpenAI's `{"error": {"message", "type", "param", "code"}}` on `/v1/*` and `/generate`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

from flask import Flask, Response, request
from werkzeug.exceptions import HTTPException

from serving.server.settings.adapter_allowlist import SourceNotAllowed, management_on
from serving.server.settings.config import ServingConfig
from serving.engine.grammar_compiler import COMPILE_CANCELLED
from serving.server.access_log import RequestRecord
from serving.server.admission import Admission, Health, health_answer
from serving.server.disconnect import probe_from_environ
from serving.server.formatters import openai_error
from serving.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from serving.server.metrics import Metrics
from serving.server.adapter_journal import AdapterJournal
from serving.server.adapters import (
    AdapterConflict,
    AdapterNotFound,
    AdapterRegistry,
    describe,
    list_page,
    select_adapters,
)
from serving.server.protocol import (
    GenerateRequest,
    loads_body,
    parse_chat,
    parse_completions,
    is_tgi_body,
    parse_generate,
    parse_invocations,
    parse_tgi,
)
from serving.server.responses import parse_responses
from serving.server.tokenize_api import detokenize, tokenize, version
from serving.engine.client import EngineClient
from serving.engine.engine_loop import EngineState
from serving.server.request_runner import HTTPError, RequestRunner
from serving.server.write_stall import WriteStall, stall_from_environ

logger = logging.getLogger("serving.server.app")
UNMATCHED_ROUTE = "unmatched"  # the metrics route label of requests no route/method matched
_NO_CACHE = {"Cache-Control": "no-cache, no-store, must-revalidate, private", "Pragma": "no-cache"}
CUSTOM_ATTRIBUTES = "X-Amzn-SageMaker-Custom-Attributes"
CHAT_PAGE = Path(__file__).with_name("chat.html")  # the playground at GET / (one file, no dependencies)
# where `model` may name an adapter (vLLM)
_MODEL_FIELD_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses")


def _engine_state(engine_loop: EngineClient) -> str:
    return EngineState(engine_loop.state).value


def engine_health(engine_loop: EngineClient) -> Health:
    """`/ping`'s answer: 200 Healthy, 503 while loading, 500 Unhealthy with the error once dead."""
    state = _engine_state(engine_loop)
    body: dict = {"status": {"ready": "Healthy", "loading": "Loading"}.get(state, "Unhealthy")}
    if state == "dead":
        body["error"] = str(engine_loop.error or "")
    return Health({"ready": 200, "loading": 503}.get(state, 500), body)


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
    adapters = AdapterRegistry(engine_loop, config, AdapterJournal(config.download_dir))
    app.extensions["adapters"] = adapters

    def route_of(method: str, path: str) -> str:
        try:
            return app.url_map.bind("localhost").match(path, method=method, return_rule=True)[0].rule
        except HTTPException:
            return UNMATCHED_ROUTE

    app.extensions["admission"] = Admission(
        config.job_queue_size, lambda: engine_health(engine_loop),
        reject_body=lambda path, message: (openai_error(503, message) if _openai_path(path)
                                           else {"error": message, "code": 503}),
        on_reject=lambda method, path: metrics.observe_request(route_of(method, path), 503))

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
            return error(413, f"the request body is {length} bytes; the limit is {limit}", route)
        raw = request.stream.read(limit + 1)
        if len(raw) > limit:
            return error(413, f"the request body is over the limit of {limit} bytes", route)
        try:
            if request.mimetype == "text/plain":  # LMI: a text body is the prompt
                return {"inputs": raw.decode("utf-8")}
            return loads_body(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            return error(400, str(exc), route)

    def generate(route: str, parse: Callable[[dict], GenerateRequest]) -> Response:
        """One generation request, logged once as it ends (`access_log.RequestRecord`)."""
        record = RequestRecord(uuid.uuid4().hex, route)
        response = run_generate(route, parse, record)
        response.headers.setdefault("x-request-id", record.request_id)  # errors too: the id the log names
        if not response.is_streamed:
            record.done(response.status_code)
        return response

    def ready_body(route: str) -> dict | Response:
        """The request's JSON body once the engine is ready, else the error Response to answer."""
        busy = not_ready(route)
        return busy if busy is not None else read_body(route)

    def run_generate(route: str, parse: Callable[[dict], GenerateRequest], record: RequestRecord) -> Response:
        body = ready_body(route)
        if isinstance(body, Response):
            return body
        request_id = record.request_id
        headers = {"x-request-id": request_id, **_NO_CACHE}
        gone = probe_from_environ(request.environ)  # a client that leaves aborts its request at once
        stall = stall_from_environ(request.environ, config.write_timeout)  # one that stops reading, too
        try:
            req = select_adapters(parse(body), request.headers.get(CUSTOM_ATTRIBUTES), adapters,
                                  model_field=route in _MODEL_FIELD_ROUTES)
            if req.adapters:
                logger.info("request %s on adapter(s) %s", request_id,
                            ", ".join(dict.fromkeys(a or "(base)" for a in req.adapters)))
            with _compiles_cancelled_by(gone):  # a grammar compile ends when its client leaves
                out = (runner.run_stream if req.stream else runner.run_plain)(req, request_id, gone, record)
            if req.stream:
                metrics.observe_request(route, 200)
                fmt_type = runner.formatter(req, request_id).content_type
                return Response(_flushing(out, lambda: record.done(200), stall), 200, content_type=fmt_type,
                                headers={**headers, "X-Accel-Buffering": "no"}, direct_passthrough=True)
            content_type = runner.formatter(req, request_id).content_type
            if isinstance(out, tuple):
                metrics.observe_request(route, out[0])
                return Response(out[1], out[0], content_type=content_type, headers=headers)
            metrics.observe_request(route, 200)  # plain_heartbeat: 200 committed, spaces, then the body
            return Response(_flushing(out, lambda: record.done(200), stall), 200, content_type=content_type,
                            headers=headers, direct_passthrough=True)
        except AdapterNotFound as exc:
            return error(404, str(exc), route)
        except ValueError as exc:
            return error(400, str(exc), route)
        except HTTPError as exc:
            record.count(record.tokens, exc.message)
            return error(exc.status, exc.message, route)

    def management(route: str, model: str | None, call: Callable[[], tuple[int, dict]],
                   needs_engine: bool = False) -> Response:
        """One management-API call: 403 unless the operator set option.runtime_adapter_sources (or
        for a `src` outside it), then DJL's statuses (404 unknown model or adapter, 409 a name taken,
        400 bad parameters or LoRA off) in this server's error shape."""
        try:
            management_on(config.runtime_adapter_sources)  # off unless the operator allows sources: 403
        except SourceNotAllowed as exc:
            return error(403, str(exc), route)
        busy = not_ready(route) if needs_engine else None
        if busy is not None:
            return busy
        try:
            if model is not None and model not in adapters.base_names():
                raise AdapterNotFound(f"The model {model} was not found; this server serves "
                                      f"{config.served_model_name!r}")
            status, body = call()
        except AdapterNotFound as exc:
            return error(404, str(exc), route)
        except AdapterConflict as exc:
            return error(409, str(exc), route)
        except SourceNotAllowed as exc:
            return error(403, str(exc), route)
        except ValueError as exc:
            return error(400, str(exc), route)
        metrics.observe_request(route, status)
        return Response(json.dumps(body), status, mimetype="application/json")

    def lora_on() -> None:
        if not adapters.enabled:
            raise ValueError("LoRA is not enabled: start the server with OPTION_ENABLE_LORA=true")

    def register_params(route: str) -> tuple[str, str]:
        """DJL's query parameters `name` and `src` (a JSON body {"name", "src"} also works)."""
        params = dict(request.args)
        if not ("name" in params and "src" in params) and request.content_length:
            body = read_body(route)
            if isinstance(body, dict):
                params = {**{k: v for k, v in body.items() if isinstance(v, str)}, **params}
        for key in ("name", "src"):
            if not params.get(key):
                raise ValueError(f"Parameter {key} is required: POST /models/{{model}}/adapters?name=<adapter "
                                 "name>&src=<adapter directory or s3://bucket/prefix>")
        ignored = sorted(set(params) - {"name", "src"})
        if ignored:
            logger.info("adapter %s: options %s accepted and not used (every adapter is loaded when registered "
                        "and may be moved out of the device when others are needed)", params["name"], ignored)
        return params["name"], params["src"]

    @app.route("/adapters", methods=["GET", "POST"])
    @app.route("/models/<path:model>/adapters", methods=["GET", "POST"])
    def adapter_collection(model: str | None = None) -> Response:
        route = _route_label()

        def call() -> tuple[int, dict]:
            lora_on()
            if request.method == "GET":
                return 200, list_page(adapters, request.args.get("limit"), request.args.get("next_page_token"))
            name, src = register_params(route)
            adapters.register_from_client(name, src)
            return 200, {"status": f"Adapter {name} registered"}
        return management(route, model, call, needs_engine=request.method == "POST")

    @app.route("/adapters/<name>", methods=["GET", "DELETE"])
    @app.route("/models/<path:model>/adapters/<name>", methods=["GET", "DELETE"])
    def adapter_item(name: str, model: str | None = None) -> Response:
        def call() -> tuple[int, dict]:
            lora_on()
            if request.method == "DELETE":
                adapters.unregister(name)
                metrics.forget_adapter(name)  # its series goes too: names never pile up as labels
                return 200, {"status": f"Adapter {name} unregistered"}
            adapter = adapters.get(name)
            if adapter is None:
                raise AdapterNotFound(f"The adapter {name} was not found")
            return 200, describe(adapter)
        return management(_route_label(), model, call, needs_engine=request.method == "DELETE")

    @app.get("/models")
    def list_models() -> Response:
        status = {"ready": "READY", "loading": "PENDING"}.get(_engine_state(engine_loop), "FAILED")
        card = {"modelName": config.served_model_name, "modelUrl": config.model_id or "", "status": status}
        metrics.observe_request("/models", 200)
        return Response(json.dumps({"models": [card]}), 200, mimetype="application/json")

    @app.get("/ping")
    def ping() -> Response:  # the poller thread answers it first (serving/server/admission.py); TLS comes here
        health = engine_health(engine_loop)
        return Response(json.dumps(health.body), health.status, mimetype="application/json")

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

    @app.post("/v1/responses")
    def responses() -> Response:
        return generate("/v1/responses", parse_responses)

    @app.post("/generate")
    def vllm_generate() -> Response:  # vLLM's body ({"prompt"}) or TGI's ({"inputs", "parameters"})
        return generate("/generate", lambda b: parse_tgi(b, "/generate") if is_tgi_body(b) else parse_generate(b))

    @app.post("/")
    def tgi_root() -> Response:  # TGI's compat route: huggingface_hub's InferenceClient(base_url) posts here
        return generate("/", lambda b: parse_tgi(b, "/"))

    @app.post("/generate_stream")
    def tgi_generate_stream() -> Response:
        return generate("/generate_stream", lambda b: parse_tgi(b, "/generate_stream"))

    @app.get("/")
    def chat_page() -> Response:
        metrics.observe_request("/", 200)
        return Response(CHAT_PAGE.read_bytes(), 200, mimetype="text/html", headers=_NO_CACHE)

    @app.get("/health")
    def health() -> Response:  # the poller thread answers it first (serving/server/admission.py); TLS comes here
        status, body = health_answer(engine_health(engine_loop))
        return Response(body, status, mimetype="application/json")

    @app.get("/version")
    def server_version() -> Response:
        metrics.observe_request("/version", 200)
        return Response(json.dumps(version()), 200, mimetype="application/json")

    @app.post("/tokenize")
    def tokenize_route() -> Response:
        return tokenizer_call("/tokenize", lambda b: tokenize(runner, b, engine_loop.max_model_len))

    @app.post("/detokenize")
    def detokenize_route() -> Response:
        return tokenizer_call("/detokenize", lambda b: detokenize(runner, b))

    def tokenizer_call(route: str, call: Callable[[dict], dict]) -> Response:
        body = ready_body(route)
        if isinstance(body, Response):
            return body
        try:
            out = call(body)
        except ValueError as exc:
            return error(400, str(exc), route)
        except HTTPError as exc:
            return error(exc.status, exc.message, route)
        metrics.observe_request(route, 200)
        return Response(json.dumps(out), 200, mimetype="application/json")

    @app.get("/v1/models")
    def models() -> Response:
        created = int(time.time())
        card = {"id": config.served_model_name, "object": "model", "created": created,
                "owned_by": "open-lmi", "root": config.engine.model or config.served_model_name, "parent": None,
                "max_model_len": engine_loop.max_model_len, "permission": []}
        cards = [card] + [{**card, "id": a.name, "root": a.src, "parent": config.served_model_name}
                          for a in adapters.adapters()]  # vLLM lists each LoRA adapter as a model
        return Response(json.dumps({"object": "list", "data": cards}), 200, mimetype="application/json")

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
    """Routes answered with OpenAI's error object: /v1/*, vLLM's legacy /generate and its tokenizer routes."""
    return path.startswith("/v1/") or path in ("/generate", "/tokenize", "/detokenize")


def _route_label() -> str:
    """The `route` label of a request: its route template, or one bucket for everything else.

    Never the raw path: every distinct unknown path (or method) would become a new time series.
    """
    rule = request.url_rule
    return rule.rule if rule is not None else UNMATCHED_ROUTE


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

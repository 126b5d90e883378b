"""What the server says about itself: `GET /ping` and `/health` (the engine's state), `GET /models`
(DJL's model card) and `/v1/models` (vLLM's list, LoRA adapters included), `GET /metrics`
(Prometheus) and the chat page at `GET /` (`serving/server/chat.html`)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from flask import Blueprint, Response

from serving.server.admission import health_answer
from serving.server.edge import NO_CACHE, current_edge, engine_health, engine_state
from serving.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE

CHAT_PAGE = Path(__file__).parents[1] / "chat.html"  # the playground at GET / (one file, no dependencies)
blueprint = Blueprint("service", __name__)


@blueprint.get("/ping")
def ping() -> Response:  # the poller thread answers it first (serving/server/admission.py); TLS comes here
    health = engine_health(current_edge().engine)
    return Response(json.dumps(health.body), health.status, mimetype="application/json")


@blueprint.get("/health")
def health() -> Response:  # the poller thread answers it first (serving/server/admission.py); TLS comes here
    status, body = health_answer(engine_health(current_edge().engine))
    return Response(body, status, mimetype="application/json")


@blueprint.get("/models")
def list_models() -> Response:
    edge = current_edge()
    status = {"ready": "READY", "loading": "PENDING"}.get(engine_state(edge.engine), "FAILED")
    card = {"modelName": edge.config.served_model_name, "modelUrl": edge.config.model_id or "", "status": status}
    edge.metrics.observe_request("/models", 200)
    return Response(json.dumps({"models": [card]}), 200, mimetype="application/json")


@blueprint.get("/v1/models")
def models() -> Response:
    edge = current_edge()
    config = edge.config
    created = int(time.time())
    card = {"id": config.served_model_name, "object": "model", "created": created,
            "owned_by": "open-lmi", "root": config.engine.model or config.served_model_name, "parent": None,
            "max_model_len": edge.engine.max_model_len, "permission": []}
    cards = [card] + [{**card, "id": a.name, "root": a.src, "parent": config.served_model_name}
                      for a in edge.adapters.adapters()]  # vLLM lists each LoRA adapter as a model
    return Response(json.dumps({"object": "list", "data": cards}), 200, mimetype="application/json")


@blueprint.get("/metrics")
def prometheus() -> Response:
    return Response(current_edge().metrics.render(), 200, content_type=METRICS_CONTENT_TYPE)


@blueprint.get("/")
def chat_page() -> Response:
    current_edge().metrics.observe_request("/", 200)
    return Response(CHAT_PAGE.read_bytes(), 200, mimetype="text/html", headers=NO_CACHE)

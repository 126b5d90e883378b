"""DJL's management API for LoRA adapters: `GET|POST /models/{model}/adapters`,
`GET|DELETE /models/{model}/adapters/{name}` (and `/adapters[/{name}]` for the one model).

Off (403) unless the operator sets option.runtime_adapter_sources (`serving/server/settings/adapter_allowlist.py`);
then DJL's statuses (404 unknown model or adapter, 409 a name taken, 400 bad parameters or LoRA
off) in this server's error shape. The registry itself is `serving/server/adapters.py`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

from flask import Blueprint, Response, request

from serving.server.settings.adapter_allowlist import SourceNotAllowed, management_on
from serving.server.adapters import AdapterConflict, AdapterNotFound, describe, list_page
from serving.server.edge import Edge, current_edge

logger = logging.getLogger("serving.server.app")
blueprint = Blueprint("management", __name__)


@blueprint.route("/adapters", methods=["GET", "POST"])
@blueprint.route("/models/<path:model>/adapters", methods=["GET", "POST"])
def adapter_collection(model: str | None = None) -> Response:
    edge = current_edge()
    route = request.url_rule.rule

    def call() -> tuple[int, dict]:
        _lora_on(edge)
        if request.method == "GET":
            return 200, list_page(edge.adapters, request.args.get("limit"), request.args.get("next_page_token"))
        name, src = _register_params(edge, route)
        edge.adapters.register_from_client(name, src)
        return 200, {"status": f"Adapter {name} registered"}
    return _management(edge, route, model, call, needs_engine=request.method == "POST")


@blueprint.route("/adapters/<name>", methods=["GET", "DELETE"])
@blueprint.route("/models/<path:model>/adapters/<name>", methods=["GET", "DELETE"])
def adapter_item(name: str, model: str | None = None) -> Response:
    edge = current_edge()

    def call() -> tuple[int, dict]:
        _lora_on(edge)
        if request.method == "DELETE":
            edge.adapters.unregister(name)
            edge.metrics.forget_adapter(name)  # its series goes too: names never pile up as labels
            return 200, {"status": f"Adapter {name} unregistered"}
        adapter = edge.adapters.get(name)
        if adapter is None:
            raise AdapterNotFound(f"The adapter {name} was not found")
        return 200, describe(adapter)
    return _management(edge, request.url_rule.rule, model, call, needs_engine=request.method == "DELETE")


def _management(edge: Edge, route: str, model: str | None, call: Callable[[], tuple[int, dict]],
                needs_engine: bool = False) -> Response:
    """One management-API call: 403 unless the operator set option.runtime_adapter_sources (or
    for a `src` outside it), then DJL's statuses in this server's error shape."""
    try:
        management_on(edge.config.runtime_adapter_sources)  # off unless the operator allows sources: 403
    except SourceNotAllowed as exc:
        return edge.error(403, str(exc), route)
    busy = edge.not_ready(route) if needs_engine else None
    if busy is not None:
        return busy
    try:
        if model is not None and model not in edge.adapters.base_names():
            raise AdapterNotFound(f"The model {model} was not found; this server serves "
                                  f"{edge.config.served_model_name!r}")
        status, body = call()
    except AdapterNotFound as exc:
        return edge.error(404, str(exc), route)
    except AdapterConflict as exc:
        return edge.error(409, str(exc), route)
    except SourceNotAllowed as exc:
        return edge.error(403, str(exc), route)
    except ValueError as exc:
        return edge.error(400, str(exc), route)
    edge.metrics.observe_request(route, status)
    return Response(json.dumps(body), status, mimetype="application/json")


def _lora_on(edge: Edge) -> None:
    if not edge.adapters.enabled:
        raise ValueError("LoRA is not enabled: start the server with OPTION_ENABLE_LORA=true")


def _register_params(edge: Edge, route: str) -> tuple[str, str]:
    """DJL's query parameters `name` and `src` (a JSON body {"name", "src"} also works)."""
    params = dict(request.args)
    if not ("name" in params and "src" in params) and request.content_length:
        body = edge.read_body(route)
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

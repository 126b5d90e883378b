"""vLLM's `/tokenize`, `/detokenize` and `/version` bodies, on this server's tokenizer.

Why: tools written for vLLM (benchmarks, prompt-length checks, LangChain's token counting
through a vLLM endpoint) call these next to the OpenAI routes. `/tokenize` takes a completion
body (`prompt`, `add_special_tokens`, default true) or a chat body (`messages`, rendered with the
chat template as `/v1/chat/completions` renders it) and answers `{"count", "max_model_len",
"tokens", "token_strs"}`; `/detokenize` takes `{"tokens"}` and answers `{"prompt"}`. Bad input
raises ValueError (a 400).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from importlib import metadata

from flask import Blueprint, Response

from serving.server.api.openai_chat import parse_chat
from serving.server.edge import current_edge
from serving.server.request_runner import HTTPError, RequestRunner

_DIST = "open-lmi"
blueprint = Blueprint("tokenize", __name__)


@blueprint.get("/version")
def server_version() -> Response:
    edge = current_edge()
    edge.metrics.observe_request("/version", 200)
    return Response(json.dumps(version()), 200, mimetype="application/json")


@blueprint.post("/tokenize")
def tokenize_route() -> Response:
    edge = current_edge()
    return _tokenizer_call("/tokenize", lambda b: tokenize(edge.runner, b, edge.engine.max_model_len))


@blueprint.post("/detokenize")
def detokenize_route() -> Response:
    return _tokenizer_call("/detokenize", lambda b: detokenize(current_edge().runner, b))


def _tokenizer_call(route: str, call: Callable[[dict], dict]) -> Response:
    edge = current_edge()
    body = edge.ready_body(route)
    if isinstance(body, Response):
        return body
    try:
        out = call(body)
    except ValueError as exc:
        return edge.error(400, str(exc), route)
    except HTTPError as exc:
        return edge.error(exc.status, exc.message, route)
    edge.metrics.observe_request(route, 200)
    return Response(json.dumps(out), 200, mimetype="application/json")


def version() -> dict:
    """`/version`: this server's package version (vLLM answers its own the same way)."""
    try:
        return {"version": metadata.version(_DIST)}
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return {"version": "unknown"}


def tokenize(runner: RequestRunner, body: dict, max_model_len: int) -> dict:
    """`/tokenize` of a completion (`prompt`) or chat (`messages`) body."""
    if "messages" in body:
        ((_, ids),) = runner.prompts(parse_chat({k: body[k] for k in ("messages", "add_generation_prompt",
                                                                        "tools") if k in body}))
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise ValueError("prompt must be a string (or send messages, a chat)")
        special = body.get("add_special_tokens", True)
        if not isinstance(special, bool):
            raise ValueError(f"add_special_tokens must be a boolean, got {special!r}")
        ids = list(runner.tokenizer.encode(prompt, add_special_tokens=special))
    strs = None
    if body.get("return_token_strs"):
        strs = runner.tokenizer.convert_ids_to_tokens(ids)
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}


def detokenize(runner: RequestRunner, body: dict) -> dict:
    """`/detokenize`: token ids -> text (special tokens kept, as vLLM)."""
    tokens = body.get("tokens")
    vocab = len(runner.tokenizer)
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                                               for t in tokens):
        raise ValueError(f"tokens must be a list of token ids in [0, {vocab})")
    return {"prompt": runner.tokenizer.decode(tokens)}

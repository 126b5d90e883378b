"""LMI's route (`POST /invocations`, SageMaker's) and TGI's own (`POST /`, `POST /generate_stream`;
TGI's `/generate` shares vLLM's route, `serving/server/api/vllm_generate.py`)."""

from __future__ import annotations

from flask import Blueprint, Response

from serving.server.api.lmi.request import parse_invocations, parse_tgi
from serving.server.edge import current_edge

blueprint = Blueprint("lmi", __name__)


@blueprint.post("/invocations")
def invocations() -> Response:
    edge = current_edge()
    return edge.generate("/invocations", lambda b: parse_invocations(
        b, tgi_compat=edge.config.tgi_compat, output_formatter=edge.config.output_formatter))


@blueprint.post("/")
def tgi_root() -> Response:  # TGI's compat route: huggingface_hub's InferenceClient(base_url) posts here
    return current_edge().generate("/", lambda b: parse_tgi(b, "/"))


@blueprint.post("/generate_stream")
def tgi_generate_stream() -> Response:
    return current_edge().generate("/generate_stream", lambda b: parse_tgi(b, "/generate_stream"))

"""vLLM's legacy `api_server` API: `POST /generate` with `{"prompt", "stream", ...}`.

In: `prompt` (a string), `stream` and vLLM `SamplingParams` fields at the top level. Out:
`{"text": [prompt + completion, ...]}`, one per returned sample; streamed, the whole texts so far
after every step, each record NUL-terminated. A TGI body on the same route (`inputs`, no
`prompt`) is TGI's `/generate` (`serving/server/api/lmi/`).
"""

from __future__ import annotations

import logging

from flask import Blueprint, Response

from serving.outputs import StreamDelta
from serving.server.api.lmi.request import is_tgi_body, parse_tgi
from serving.server.api.openai import OPENAI_COMPLETIONS_DEFAULT_MAX_TOKENS, OpenAIFormat, keep_best, openai_params
from serving.server.edge import current_edge
from serving.server.errors import stream_error
from serving.server.formatters import Result, Sample, dumps
from serving.server.protocol import GenerateRequest, get_bool, get_int, show, warn_unknown

logger = logging.getLogger("serving.server.protocol")  # the parsers' warnings, under one name (`warn_unknown`)
blueprint = Blueprint("vllm_generate", __name__)


@blueprint.post("/generate")
def generate() -> Response:  # vLLM's body ({"prompt"}) or TGI's ({"inputs", "parameters"})
    return current_edge().generate("/generate", lambda b: parse_tgi(b, "/generate") if is_tgi_body(b)
                                   else parse_generate(b))


_GENERATE_KNOWN = {"prompt", "stream", "n", "best_of", "temperature", "max_tokens", "stop", "top_p", "top_k",
                   "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "seed", "stop_token_ids",
                   "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens",
                   "spaces_between_special_tokens", "logit_bias"}
_NO_BEAM_SEARCH = ("use_beam_search", "length_penalty", "early_stopping")


def parse_generate(body: dict) -> GenerateRequest:
    """vLLM's `api_server` `/generate` body: `prompt` (a string), `stream`, and `SamplingParams` fields at
    the top level with vLLM's defaults (16 tokens, temperature 1). Beam search is not supported: its
    fields are accepted with a warning and the n samples are drawn as without it."""
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise ValueError(f"prompt must be a non-empty string, got {show(prompt)}")
    stream = get_bool(body, "stream", False)
    max_tokens = get_int(body, "max_tokens", 1)
    params = openai_params(body, max_tokens or OPENAI_COMPLETIONS_DEFAULT_MAX_TOKENS, None, False, best_of_ok=True)
    warnings: tuple[str, ...] = ()
    beam = [k for k in _NO_BEAM_SEARCH if body.get(k) not in (None, False)]
    if beam:
        warnings += (f"{', '.join(beam)}: beam search is not supported; the {params.n} sample(s) are drawn "
                     "as without it (greedy when temperature is 0)",)
        logger.warning(warnings[-1])
    warnings += warn_unknown(body, _GENERATE_KNOWN | set(_NO_BEAM_SEARCH), "generate fields")
    return GenerateRequest(route="generate", params=params, fmt=GenerateStream.name if stream else GenerateJson.name,
                           prompts=(prompt,), keep_best=keep_best(body, params, stream), warnings=warnings)


class GenerateFormat(OpenAIFormat):
    """vLLM's `{"text": [...]}` records (OpenAI's error objects, vLLM's best_of)."""

    def _generate_object(self, r: Result) -> dict:
        """vLLM `/generate`: `{"text": [prompt + completion, ...]}`, one per sample returned."""
        return {"text": [r.prompt + s.text for s in self._returned(r)]}


class GenerateJson(GenerateFormat):
    """The whole answer, as vLLM's api_server writes it (Starlette's JSONResponse: compact, UTF-8)."""

    name = "generate"
    content_type = "application/json"

    def body(self, results: list[Result]) -> bytes:
        return dumps(self._generate_object(results[0]), separators=(",", ":")).encode()


class GenerateStream(GenerateFormat):
    """vLLM's api_server stream: the whole texts so far, NUL-terminated."""

    name = "generate_stream"
    content_type = "application/octet-stream"
    streams = True

    def _chunk(self, r: Result, s: Sample, delta: StreamDelta, prompt_index: int) -> bytes:
        rec = self._generate_object(r)
        if s.error:
            rec["error"] = stream_error(s.error)
        return (dumps(rec) + "\0").encode()

"""LMI's and TGI's request bodies -> `GenerateRequest`.

`POST /invocations` takes `{"inputs", "parameters", "stream"}` (LMI 0.28's schema and defaults:
30 new tokens, greedy unless `do_sample`), a chat body (`messages`: OpenAI chat's parser, LMI's
defaults and records) or a completion body (`prompt`). TGI's `/`, `/generate` and
`/generate_stream` take LMI's body (TGI's parameters are LMI's) with TGI's formats.
"""

from __future__ import annotations

from dataclasses import replace

from serving.sampling_params import SamplingParams
from serving.server.api.lmi.formats import LmiJson, LmiJsonLines, TgiGenerate, TgiJson, TgiSse
from serving.server.api.openai_chat import parse_chat
from serving.server.api.openai_completions import parse_completions
from serving.server.formatters import Formatter
from serving.server.protocol import (
    LMI_DEFAULT_MAX_NEW_TOKENS,
    GenerateRequest,
    common_sampling,
    get_bool,
    get_int,
    get_num,
    get_stop,
    show,
    to_sampling_params,
    warn_unknown,
)
from serving.server.structured import GUIDED_KEYS, guided_from

LMI_FORMATTERS = ("json", "jsonlines", "sse", "json_chat", "jsonlines_chat", "none")  # option.output_formatter
_LMI_KNOWN = {"max_new_tokens", "max_tokens", "do_sample", "temperature", "top_p", "top_k", "repetition_penalty",
              "presence_penalty", "frequency_penalty", "min_p", "seed", "stop_sequences", "stop", "stop_token_ids",
              "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
              "ignore_eos_token", "ignore_eos", "details", "return_full_text", "decoder_input_details",
              "logprobs", "n", "best_of", "min_tokens", "output_formatter", "top_n_tokens", "truncate",
              "num_beams", "use_beam_search", *GUIDED_KEYS}
MAX_LMI_SEQUENCES = 16  # n / best_of on /invocations (as on /v1)


def _body_adapters(body: dict, count: int, batch: bool) -> tuple[str, ...]:
    """LMI's top-level `adapters`: one name for every input, or a list with one per input ("" or
    null = the base model for that input). A list whose length differs from the inputs' is a 400."""
    adapters = body.get("adapters")
    if adapters is None or adapters == []:  # LMI reads an empty list as no adapters
        return ()
    if isinstance(adapters, str):
        return (adapters.strip(),)
    if not isinstance(adapters, list) or not all(a is None or isinstance(a, str) for a in adapters):
        raise ValueError(f"adapters must be an adapter name or a list of them (one per input), got {show(adapters)}")
    if len(adapters) != count:
        what = f"{count} inputs" if batch else "a single input"
        raise ValueError(f"adapters holds {len(adapters)} names for {what}: send one name per input "
                         "(\"\" for the base model), or a single string for all")
    return tuple((a or "").strip() for a in adapters)


def _lmi_sequences(parameters: dict) -> int:
    """How many sequences an /invocations request generates: `best_of` when given (LMI sets n =
    best_of), else `n`. The best one is `generated_text`, the others `details.best_of_sequences`."""
    n = get_int(parameters, "n", 1, MAX_LMI_SEQUENCES) or 1
    best_of = get_int(parameters, "best_of", 1, MAX_LMI_SEQUENCES)
    if best_of is not None and best_of < n:
        raise ValueError(f"best_of must be >= n, got best_of={best_of} n={n}")
    if get_int(parameters, "num_beams", 1) not in (None, 1) or get_bool(parameters, "use_beam_search", False):
        raise ValueError("num_beams > 1 (beam search) is not supported by this server; for several candidates "
                         "use best_of (with do_sample: true), which returns details.best_of_sequences")
    return best_of or n


def lmi_sampling_params(parameters: dict) -> tuple[SamplingParams, tuple[str, ...]]:
    """LMI `parameters` -> SamplingParams with LMI semantics (30 tokens, greedy unless do_sample)."""
    if not isinstance(parameters, dict):
        raise ValueError(f"parameters must be a JSON object, got {show(parameters)}")
    warnings = warn_unknown(parameters, _LMI_KNOWN, "parameters")
    kw = common_sampling(parameters)
    kw["n"] = kw["best_of"] = _lmi_sequences(parameters)
    max_new = get_int(parameters, "max_new_tokens", 1)
    if max_new is None:
        max_new = get_int(parameters, "max_tokens", 1)
    kw["max_tokens"] = LMI_DEFAULT_MAX_NEW_TOKENS if max_new is None else max_new
    do_sample = get_bool(parameters, "do_sample", False)
    temperature = get_num(parameters, "temperature", 0.0)
    # NOTE: LMI forces greedy when do_sample is false, even if a temperature is given.
    kw["temperature"] = (1.0 if temperature is None else temperature) if do_sample else 0.0
    kw["stop"] = get_stop(parameters, "stop_sequences", "stop")
    if "ignore_eos_token" in parameters:
        kw["ignore_eos"] = get_bool(parameters, "ignore_eos_token", False)
    logprobs = get_int(parameters, "logprobs", 0, 20)
    top_n = get_int(parameters, "top_n_tokens", 0, 20)
    kw["logprobs"] = max(logprobs or 0, top_n or 0)  # LMI always fills token.log_prob; logprobs = top_n_tokens
    if get_bool(parameters, "decoder_input_details", False):
        kw["prompt_logprobs"] = 1  # LMI's value: each prompt token's own logprob (for details.prefill)
    # LMI 0.28 has no guided decoding of its own (it drops TGI's `grammar`); vLLM's guided_* keys work here.
    kw["guided_decoding"] = guided_from({k: parameters[k] for k in GUIDED_KEYS if k in parameters})
    return to_sampling_params(**kw), warnings


def _lmi_format(stream: bool, tgi_compat: bool, configured: str | None, override: object) -> str:
    """LMI 0.28 `get_output_formatter`: request override > config > json / jsonlines / sse."""
    name = configured
    if override is not None:
        if override not in LMI_FORMATTERS:
            raise ValueError(f"output_formatter must be one of {'|'.join(LMI_FORMATTERS)}, got {show(override)}")
        name = override  # type: ignore[assignment]
    if name is None:
        if tgi_compat:
            return TgiSse.name if stream else TgiJson.name
        return LmiJsonLines.name if stream else LmiJson.name
    # An explicit formatter is used as named (tgi_compat only changes the default choice).
    return {"json_chat": "json", "jsonlines_chat": "jsonlines"}.get(name, name)


def parse_invocations(body: dict, *, tgi_compat: bool = False, output_formatter: str | None = None
                      ) -> GenerateRequest:
    """Parse a `POST /invocations` body (LMI schema, or chat when it has `messages`)."""
    stream = get_bool(body, "stream", False)
    if "messages" in body:
        chat = parse_chat(body, route="invocations")
        return replace(chat, adapters=_body_adapters(body, 1, False))
    inputs = body.get("inputs", None)
    if inputs is None:
        if "prompt" in body:  # TGI's SageMaker route also takes completion requests
            return parse_completions(body)
        raise ValueError("inputs is required: {\"inputs\": \"...\", \"parameters\": {...}}")
    if isinstance(inputs, str):
        prompts, batch = (inputs,), False
    elif isinstance(inputs, list) and inputs and all(isinstance(p, str) for p in inputs):
        prompts, batch = tuple(inputs), True
    else:
        raise ValueError("inputs must be a string or a non-empty list of strings")
    parameters = body.get("parameters")
    parameters = {} if parameters is None else parameters
    params, warnings = lmi_sampling_params(parameters)
    fmt = _lmi_format(stream, tgi_compat, output_formatter, parameters.get("output_formatter"))
    streams = Formatter.of(fmt).streams
    if batch and streams:
        raise ValueError("streaming needs a single string in inputs, not a list")
    if params.n > 1 and streams:  # LMI documents best_of / n > 1 as non-streaming only
        raise ValueError(f"n / best_of > 1 ({params.n} sequences) needs a non-streaming request: "
                         "send \"stream\": false (the others come back in details.best_of_sequences)")
    warnings += warn_unknown(body, {"inputs", "parameters", "stream", "adapters", "cached_prompt"}, "fields")
    return GenerateRequest(adapters=_body_adapters(body, len(prompts), batch),
        route="invocations", params=params, fmt=fmt, prompts=prompts, batch=batch,
        # LMI answers n / best_of > 1 with details (best_of_sequences) whether or not they were asked for
        details=tgi_compat or params.n > 1 or get_bool(parameters, "details", False),
        decoder_input_details=get_bool(parameters, "decoder_input_details", False),
        top_n_tokens=get_int(parameters, "top_n_tokens", 0, 20) or 0,
        truncate=get_int(parameters, "truncate", 1),
        return_full_text=get_bool(parameters, "return_full_text", False), warnings=warnings)


# ---- TGI's own routes (`/`, `/generate`, `/generate_stream`) ------------------------------------

TGI_ROUTES = {"/": None, "/generate": TgiGenerate.name, "/generate_stream": TgiSse.name}  # None: by `stream`


def is_tgi_body(body: dict) -> bool:
    """TGI's body (`{"inputs", "parameters"}`), as opposed to vLLM's `/generate` one (`{"prompt"}`)."""
    return "inputs" in body and "prompt" not in body


def parse_tgi(body: dict, path: str) -> GenerateRequest:
    """A body of TGI's API (LMI's parameters are TGI's): `POST /` streams (SSE) when `stream` is
    true, else answers a list with one object; `/generate` answers one object; `/generate_stream`
    always streams. `details` only when asked, as TGI."""
    if path not in TGI_ROUTES:
        raise AssertionError(f"not a TGI route: {path}")
    if not isinstance(body.get("inputs"), str):
        raise ValueError(f"inputs must be a string, got {show(body.get('inputs'))}")
    req = parse_invocations({k: v for k, v in body.items() if k != "stream"}, tgi_compat=True)
    parameters = body.get("parameters") or {}
    fmt = TGI_ROUTES[path] or (TgiSse.name if get_bool(body, "stream", False) else TgiJson.name)
    if req.params.n > 1 and fmt == TgiSse.name:
        raise ValueError("best_of > 1 needs a non-streaming request")
    return replace(req, fmt=fmt, details=get_bool(parameters, "details", False) or req.params.n > 1)

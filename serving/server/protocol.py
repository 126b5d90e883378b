"""Wire requests -> engine requests: the one place LMI / TGI / OpenAI request names are translated.

In: the JSON body of `POST /invocations` (`{"inputs","parameters","stream"}` or a chat body with
`messages`), `/v1/completions`, `/v1/chat/completions`, vLLM's `/generate`, or TGI's `/`,
`/generate` and `/generate_stream` (`/v1/responses` is `serving/server/responses.py`, on `parse_chat`). Out: a frozen `GenerateRequest` holding
vLLM-named `SamplingParams`, the prompts, and how to answer (wire format, details, ...). Every
problem raises `ValueError` naming the field, which the app answers with 400. The response side
(the same names in the other direction) is `serving/server/formatters.py`.
"""

from __future__ import annotations

import array
import itertools
import json
import logging
import math
import re
import reprlib
from dataclasses import dataclass, field, replace
from typing import Literal

from serving.sampling_params import SamplingParams
from serving.server.structured import GUIDED_KEYS, STRUCTURED_KEYS, TOOL_KEYS, ToolSpec, guided_from, tools_from

logger = logging.getLogger("serving.server.protocol")

Route = Literal["invocations", "completions", "chat", "generate", "responses"]
LMI_DEFAULT_MAX_NEW_TOKENS = 30  # LMI 0.28: a missing max_new_tokens becomes 30
OPENAI_COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI / vLLM /v1/completions default
STREAMING_FORMATS = frozenset({"jsonlines", "sse", "tgi_sse", "jsonlines_chat", "chat_sse", "completion_sse",
                               "generate_stream", "responses_sse"})
LMI_FORMATTERS = ("json", "jsonlines", "sse", "json_chat", "jsonlines_chat", "none")
MAX_JSON_DEPTH = 64  # arrays/objects nested deeper than this are a 400 (real requests nest < 10)
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # a \uD800-\uDFFF escape in the raw body
_SURROGATE = re.compile("[\ud800-\udfff]")  # left in a decoded str only when it had no partner
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_BRACKET_STEPS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")  # as signed bytes: +1 / -1
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[{]}")))
_SHOW = reprlib.Repr()  # values echoed in error messages: short, and never deeply recursive
_SHOW.maxstring = _SHOW.maxother = 60
_SHOW.maxlevel = 3


@dataclass(frozen=True)
class GenerateRequest:
    """One parsed HTTP request (http -> engine), ready once prompts are tokenized.

    Exactly one of `prompts` (text per input), `prompt_token_ids` (OpenAI token prompts) or
    `messages` (chat, rendered with the tokenizer's template) is set. `batch` means the client
    sent a list and gets a list back. `fmt` is the wire format (see `serving/server/formatters.py`).
    """

    route: Route
    params: SamplingParams
    fmt: str
    prompts: tuple[str, ...] = ()
    prompt_token_ids: tuple[tuple[int, ...], ...] = ()
    messages: tuple[dict, ...] = ()
    batch: bool = False
    details: bool = False
    decoder_input_details: bool = False
    top_n_tokens: int = 0  # LMI / TGI: > 0 adds details.top_tokens (that many alternatives per token)
    truncate: int | None = None  # LMI / TGI: keep only the last `truncate` prompt tokens
    return_full_text: bool = False
    echo: bool = False
    top_logprobs: int | None = None  # OpenAI logprobs: None = not asked
    include_usage: bool = False
    continuous_usage: bool = False  # vLLM's stream_options.continuous_usage_stats: usage on every chunk
    add_generation_prompt: bool = True
    model: str | None = None
    tools: ToolSpec | None = None  # chat: functions the model may call (tool_calls in the answer)
    # LoRA adapter per prompt ("" = the base model); () = the base model for all, one name = for all.
    adapters: tuple[str, ...] = ()
    # vLLM's best_of > n on /v1/completions and /generate: params.n = best_of samples are generated and
    # only the `keep_best` most likely (highest cumulative logprob) are returned. 0: all of them.
    keep_best: int = 0
    instructions: str | None = None  # /v1/responses: echoed in the response object
    warnings: tuple[str, ...] = field(default=())

    @property
    def stream(self) -> bool:
        return self.fmt in STREAMING_FORMATS

    @property
    def num_prompts(self) -> int:
        return len(self.prompts) + len(self.prompt_token_ids) + (1 if self.messages else 0)

    def adapter(self, i: int) -> str | None:
        """The adapter prompt `i` runs on (None: the base model)."""
        if not self.adapters:
            return None
        return (self.adapters[i] if len(self.adapters) > 1 else self.adapters[0]) or None


def loads_body(raw: bytes) -> dict:
    """Decode a JSON object body, or raise ValueError ('malformed JSON ...').

    Also a ValueError: arrays/objects nested deeper than `MAX_JSON_DEPTH`, and a string (or key)
    holding an unpaired UTF-16 surrogate escape such as `"\\ud800"` (not valid Unicode text).
    """
    try:
        body = json.loads(raw.decode("utf-8")) if raw.strip() else None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, too many digits in an integer
        raise ValueError(f"malformed JSON body: {exc}") from None
    except RecursionError:
        raise ValueError(f"malformed JSON body: arrays and objects nest deeper than {MAX_JSON_DEPTH} "
                         "levels") from None
    if not isinstance(body, dict):
        raise ValueError("the request body must be a JSON object")
    # Cheap checks first (C speed); the walk that names the field runs only for a bad body.
    too_deep = raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH and _json_depth(raw) > MAX_JSON_DEPTH
    if too_deep or (_SURROGATE_ESCAPE.search(raw) and not _valid_unicode(body)):
        _check_tree(body)
    return body


def _json_depth(raw: bytes) -> int:
    """How deeply arrays/objects nest in a valid JSON text (brackets inside strings do not count)."""
    steps = _JSON_STRING.sub(b"", raw).translate(_BRACKET_STEPS, _NOT_BRACKETS)
    return max(itertools.accumulate(array.array("b", steps)), default=0)


def _valid_unicode(body: dict) -> bool:
    """False when a decoded string holds a lone surrogate (JSON escapes can make one)."""
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_tree(body: dict) -> None:
    """Walk the decoded body without recursion: too deep, or a lone surrogate -> ValueError."""
    stack: list[tuple[object, int, tuple | None]] = [(body, 1, None)]  # (value, depth, (key, parent))
    while stack:
        value, depth, where = stack.pop()
        if isinstance(value, str):
            lone = _SURROGATE.search(value)
            if lone:
                raise ValueError(f"{_field(where)} holds an unpaired UTF-16 surrogate escape "
                                 f"(\\u{ord(lone.group()):04x}): strings must be valid Unicode")
            continue
        if depth > MAX_JSON_DEPTH:
            raise ValueError(f"{_field(where)}: arrays and objects nest deeper than {MAX_JSON_DEPTH} levels")
        for key, item in value.items() if isinstance(value, dict) else enumerate(value):
            if isinstance(key, str) and _SURROGATE.search(key):
                raise ValueError(f"a key of {_field(where)} holds an unpaired UTF-16 surrogate escape: "
                                 "strings must be valid Unicode")
            if isinstance(item, (str, dict, list)):
                stack.append((item, depth + 1, (key, where)))


def _field(where: tuple | None, most: int = 6) -> str:
    """`(key, parent)` links -> 'messages[0].content' ('the request body' at the top; at most
    `most` parts, then '...')."""
    parts: list[str] = []
    while where is not None:
        key, where = where
        parts.append(f"[{key}]" if isinstance(key, int) else f".{_show(key)[1:-1]}")
    parts.reverse()
    return ("".join(parts[:most]) + ("..." if len(parts) > most else "")).lstrip(".") or "the request body"


def _show(value: object) -> str:
    """A user value for an error message: its repr, cut short."""
    return _SHOW.repr(value)


# ---- small typed getters: wrong types -> ValueError naming the field -------------------------

def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _get_bool(d: dict, key: str, default: bool) -> bool:
    v = d.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ValueError(f"{key} must be a boolean, got {_show(v)}")
    return v


def _get_int(d: dict, key: str, lo: int | None = None, hi: int | None = None) -> int | None:
    v = d.get(key)
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not _is_int(v):
        raise ValueError(f"{key} must be an integer, got {_show(v)}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        bounds = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{key} must be {bounds}, got {v}")
    return v


def _get_num(d: dict, key: str, lo: float | None = None, hi: float | None = None) -> float | None:
    v = d.get(key)
    if v is None:
        return None
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
        raise ValueError(f"{key} must be a finite number, got {_show(v)}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise ValueError(f"{key} must be in [{lo}, {hi}], got {v}")
    return float(v)


def _get_stop(d: dict, *keys: str) -> tuple[str, ...]:
    for key in keys:
        v = d.get(key)
        if v is None:
            continue
        if isinstance(v, str):
            return (v,) if v else ()
        if isinstance(v, list) and all(isinstance(s, str) for s in v):
            return tuple(s for s in v if s)
        raise ValueError(f"{key} must be a string or a list of strings, got {_show(v)}")
    return ()


def _get_ids(d: dict, key: str) -> tuple[int, ...]:
    v = d.get(key)
    if v is None:
        return ()
    if not isinstance(v, list) or not all(_is_int(t) and t >= 0 for t in v):
        raise ValueError(f"{key} must be a list of non-negative integers, got {_show(v)}")
    return tuple(v)


def _common_sampling(d: dict) -> dict:
    """vLLM-named options shared by every route (penalties, top-k/p, seed, stop ids ...)."""
    out: dict = {}
    for key, lo, hi in (("top_p", None, None), ("repetition_penalty", None, None), ("min_p", None, None),
                        ("presence_penalty", -2.0, 2.0), ("frequency_penalty", -2.0, 2.0)):
        v = _get_num(d, key, lo, hi)
        if v is not None:
            out[key] = v
    for key, lo in (("top_k", -1), ("min_tokens", 0)):
        v = _get_int(d, key, lo)
        if v is not None:
            out[key] = v
    seed = d.get("seed")
    if isinstance(seed, str) and seed.strip().lstrip("-").isdigit():
        seed = int(seed)  # LMI converts the seed with int()
    if seed is not None:
        out["seed"] = _get_int({"seed": seed}, "seed", 0)
    ids = _get_ids(d, "stop_token_ids")
    if ids:
        out["stop_token_ids"] = ids
    for key in ("include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
                "ignore_eos"):
        if key in d and d[key] is not None:
            out[key] = _get_bool(d, key, False)
    return out


def _warn_unknown(d: dict, known: set[str], where: str) -> tuple[str, ...]:
    unknown = sorted(k for k in d if k not in known)
    if unknown:
        msg = f"dropped unsupported {where}: {', '.join(unknown)}"
        logger.warning(msg)
        return (msg,)
    return ()


def _sampling(**kwargs: object) -> SamplingParams:
    try:
        return SamplingParams(**kwargs)  # type: ignore[arg-type]
    except TypeError as exc:  # a wrong type reached a comparison
        raise ValueError(str(exc)) from None


# ---- LMI /invocations --------------------------------------------------------------------------

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
        raise ValueError(f"adapters must be an adapter name or a list of them (one per input), got {_show(adapters)}")
    if len(adapters) != count:
        what = f"{count} inputs" if batch else "a single input"
        raise ValueError(f"adapters holds {len(adapters)} names for {what}: send one name per input "
                         "(\"\" for the base model), or a single string for all")
    return tuple((a or "").strip() for a in adapters)


def _lmi_sequences(parameters: dict) -> int:
    """How many sequences an /invocations request generates: `best_of` when given (LMI sets n =
    best_of), else `n`. The best one is `generated_text`, the others `details.best_of_sequences`."""
    n = _get_int(parameters, "n", 1, MAX_LMI_SEQUENCES) or 1
    best_of = _get_int(parameters, "best_of", 1, MAX_LMI_SEQUENCES)
    if best_of is not None and best_of < n:
        raise ValueError(f"best_of must be >= n, got best_of={best_of} n={n}")
    if _get_int(parameters, "num_beams", 1) not in (None, 1) or _get_bool(parameters, "use_beam_search", False):
        raise ValueError("num_beams > 1 (beam search) is not supported by this server; for several candidates "
                         "use best_of (with do_sample: true), which returns details.best_of_sequences")
    return best_of or n


def lmi_sampling_params(parameters: dict) -> tuple[SamplingParams, tuple[str, ...]]:
    """LMI `parameters` -> SamplingParams with LMI semantics (30 tokens, greedy unless do_sample)."""
    if not isinstance(parameters, dict):
        raise ValueError(f"parameters must be a JSON object, got {_show(parameters)}")
    warnings = _warn_unknown(parameters, _LMI_KNOWN, "parameters")
    kw = _common_sampling(parameters)
    kw["n"] = kw["best_of"] = _lmi_sequences(parameters)
    max_new = _get_int(parameters, "max_new_tokens", 1)
    if max_new is None:
        max_new = _get_int(parameters, "max_tokens", 1)
    kw["max_tokens"] = LMI_DEFAULT_MAX_NEW_TOKENS if max_new is None else max_new
    do_sample = _get_bool(parameters, "do_sample", False)
    temperature = _get_num(parameters, "temperature", 0.0)
    # NOTE: LMI forces greedy when do_sample is false, even if a temperature is given.
    kw["temperature"] = (1.0 if temperature is None else temperature) if do_sample else 0.0
    kw["stop"] = _get_stop(parameters, "stop_sequences", "stop")
    if "ignore_eos_token" in parameters:
        kw["ignore_eos"] = _get_bool(parameters, "ignore_eos_token", False)
    logprobs = _get_int(parameters, "logprobs", 0, 20)
    top_n = _get_int(parameters, "top_n_tokens", 0, 20)
    kw["logprobs"] = max(logprobs or 0, top_n or 0)  # LMI always fills token.log_prob; logprobs = top_n_tokens
    if _get_bool(parameters, "decoder_input_details", False):
        kw["prompt_logprobs"] = 1  # LMI's value: each prompt token's own logprob (for details.prefill)
    # LMI 0.28 has no guided decoding of its own (it drops TGI's `grammar`); vLLM's guided_* keys work here.
    kw["guided_decoding"] = guided_from({k: parameters[k] for k in GUIDED_KEYS if k in parameters})
    return _sampling(**kw), warnings


def _lmi_format(stream: bool, chat: bool, tgi_compat: bool, configured: str | None, override: object) -> str:
    """LMI 0.28 `get_output_formatter`: request override > config > json / jsonlines / sse."""
    if chat:
        return "jsonlines_chat" if stream else "json_chat"
    name = configured
    if override is not None:
        if override not in LMI_FORMATTERS:
            raise ValueError(f"output_formatter must be one of {'|'.join(LMI_FORMATTERS)}, got {_show(override)}")
        name = override  # type: ignore[assignment]
    if name is None:
        if tgi_compat:
            return "tgi_sse" if stream else "tgi_json"
        return "jsonlines" if stream else "json"
    # An explicit formatter is used as named (tgi_compat only changes the default choice).
    return {"json_chat": "json", "jsonlines_chat": "jsonlines"}.get(name, name)


def parse_invocations(body: dict, *, tgi_compat: bool = False, output_formatter: str | None = None
                      ) -> GenerateRequest:
    """Parse a `POST /invocations` body (LMI schema, or chat when it has `messages`)."""
    stream = _get_bool(body, "stream", False)
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
    fmt = _lmi_format(stream, False, tgi_compat, output_formatter, parameters.get("output_formatter"))
    if batch and fmt in STREAMING_FORMATS:
        raise ValueError("streaming needs a single string in inputs, not a list")
    if params.n > 1 and fmt in STREAMING_FORMATS:  # LMI documents best_of / n > 1 as non-streaming only
        raise ValueError(f"n / best_of > 1 ({params.n} sequences) needs a non-streaming request: "
                         "send \"stream\": false (the others come back in details.best_of_sequences)")
    warnings += _warn_unknown(body, {"inputs", "parameters", "stream", "adapters", "cached_prompt"}, "fields")
    return GenerateRequest(adapters=_body_adapters(body, len(prompts), batch),
        route="invocations", params=params, fmt=fmt, prompts=prompts, batch=batch,
        # LMI answers n / best_of > 1 with details (best_of_sequences) whether or not they were asked for
        details=tgi_compat or params.n > 1 or _get_bool(parameters, "details", False),
        decoder_input_details=_get_bool(parameters, "decoder_input_details", False),
        top_n_tokens=_get_int(parameters, "top_n_tokens", 0, 20) or 0,
        truncate=_get_int(parameters, "truncate", 1),
        return_full_text=_get_bool(parameters, "return_full_text", False), warnings=warnings)


# ---- TGI's own routes (`/`, `/generate`, `/generate_stream`) ------------------------------------

TGI_ROUTES = {"/": None, "/generate": "tgi_generate", "/generate_stream": "tgi_sse"}


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
        raise ValueError(f"inputs must be a string, got {_show(body.get('inputs'))}")
    req = parse_invocations({k: v for k, v in body.items() if k != "stream"}, tgi_compat=True)
    parameters = body.get("parameters") or {}
    fmt = TGI_ROUTES[path] or ("tgi_sse" if _get_bool(body, "stream", False) else "tgi_json")
    if req.params.n > 1 and fmt == "tgi_sse":
        raise ValueError("best_of > 1 needs a non-streaming request")
    return replace(req, fmt=fmt, details=_get_bool(parameters, "details", False) or req.params.n > 1)


# ---- OpenAI chat / completions -----------------------------------------------------------------

_OPENAI_COMMON = {"model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed",
                  "presence_penalty", "frequency_penalty", "user", "logit_bias", "top_k", "min_p",
                  "repetition_penalty", "ignore_eos", "stop_token_ids", "min_tokens", "skip_special_tokens",
                  "include_stop_str_in_output", "spaces_between_special_tokens", "best_of"}
_CHAT_KNOWN = _OPENAI_COMMON | {"messages", "logprobs", "top_logprobs", "max_completion_tokens",
                                "add_generation_prompt", "parallel_tool_calls"}
_COMPLETIONS_KNOWN = _OPENAI_COMMON | {"prompt", "echo", "logprobs", "suffix"} | STRUCTURED_KEYS


def _openai_params(body: dict, max_tokens: int | None, top_logprobs: int | None,
                   lmi_route: bool, tools: ToolSpec | None = None, structured: bool = False,
                   best_of_ok: bool = False) -> SamplingParams:
    """vLLM / OpenAI sampling fields -> SamplingParams. With `best_of_ok` (completions, /generate) a
    best_of above n generates best_of samples (`n` = best_of): the caller keeps the n best (`_keep_best`)."""
    kw = _common_sampling(body)
    if structured:  # chat and completions: response_format, guided_*, tool_choice required / named
        kw["guided_decoding"] = guided_from(body, tools)
    kw["max_tokens"] = max_tokens
    temperature = _get_num(body, "temperature", 0.0, 2.0)
    kw["temperature"] = 1.0 if temperature is None else temperature
    kw["stop"] = _get_stop(body, "stop")
    if not lmi_route:
        n = _get_int(body, "n", 1, 16) or 1
        best_of = _get_int(body, "best_of", 1, 16)
        kw["n"] = n
        if best_of is not None:
            if best_of < n:
                raise ValueError(f"best_of must be >= n, got best_of={best_of} n={n}")
            if best_of != n:
                if not best_of_ok:
                    raise ValueError("best_of != n is not supported on this route (it is on /v1/completions "
                                     "and /generate)")
                kw["logprobs"] = 0  # the ranking reads each sampled token's logprob (`logprobs` may ask more)
            kw["n"] = kw["best_of"] = best_of
    if top_logprobs is not None:
        kw["logprobs"] = top_logprobs
    bias = _logit_bias(body)
    if bias:
        kw["logit_bias"] = bias
    user = body.get("user")  # OpenAI's end-user id: accepted, not used (no per-user policy here)
    if user is not None and not isinstance(user, str):
        raise ValueError(f"user must be a string, got {_show(user)}")
    return _sampling(**kw)


def _logit_bias(body: dict) -> dict | None:
    """OpenAI `logit_bias` ({"token id": bias}) with biases clamped to [-100, 100] as vLLM does; the
    ids are checked by SamplingParams (integers) and the engine (in the vocabulary)."""
    bias = body.get("logit_bias")
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be an object mapping token ids to biases, got {_show(bias)}")
    out = {}
    for key, value in bias.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise ValueError(f"logit_bias values must be finite numbers, got {_show(value)} for {_show(key)}")
        out[key] = max(-100.0, min(100.0, float(value)))
    return out


def _keep_best(body: dict, params: SamplingParams, stream: bool) -> int:
    """How many of the generated samples a best_of > n request returns (n), else 0 (all); as vLLM, a
    stream cannot rank its samples before they end, so best_of > n is refused there."""
    n = _get_int(body, "n", 1, 16) or 1
    if params.n == n:
        return 0
    if stream:
        raise ValueError(f"best_of ({params.n}) > n ({n}) needs a non-streaming request: the best samples "
                         "are known only once all have ended")
    return n


def _stream_usage(body: dict) -> bool:
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not isinstance(opts, dict):
        raise ValueError("stream_options must be an object")
    return _get_bool(opts, "include_usage", False)


def _continuous_usage(body: dict) -> bool:
    """vLLM's `stream_options.continuous_usage_stats` (with `include_usage`): usage on every chunk."""
    return _stream_usage(body) and _get_bool(body["stream_options"], "continuous_usage_stats", False)


def _messages(body: dict) -> tuple[dict, ...]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {\"role\", \"content\"} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}] must be an object with a string role")
        content = m.get("content")
        if isinstance(content, list):  # OpenAI content parts: only text is supported
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ValueError(f"messages[{i}].content: only text parts are supported")
            content = "".join(p["text"] for p in content)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string or a list of text parts")
        out.append({"role": m["role"], "content": content})
    return tuple(out)


def parse_chat(body: dict, route: Route = "chat") -> GenerateRequest:
    """An OpenAI chat-completions body, on /v1/chat/completions or (route='invocations') /invocations."""
    tools = tools_from(body)
    messages = _messages(body)
    lmi_route = route == "invocations"
    stream = _get_bool(body, "stream", False)
    max_tokens = _get_int(body, "max_completion_tokens", 1) or _get_int(body, "max_tokens", 1)
    want_logprobs = _get_bool(body, "logprobs", False)
    top = _get_int(body, "top_logprobs", 0, 20)
    top_logprobs = (top or 0) if want_logprobs else None
    # No max_tokens: LMI's 30 on /invocations; vLLM's "up to the context limit" (None) on /v1.
    default_max = LMI_DEFAULT_MAX_NEW_TOKENS if lmi_route else None
    params = _openai_params(body, max_tokens or default_max, top_logprobs, lmi_route, tools, structured=True)
    if lmi_route:
        fmt = "jsonlines_chat" if stream else "json_chat"
    else:
        fmt = "chat_sse" if stream else "chat"
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ValueError(f"model must be a string, got {_show(model)}")
    ignored = STRUCTURED_KEYS | TOOL_KEYS | ({"adapters"} if lmi_route else set())  # LMI's adapters: read by the caller
    return GenerateRequest(
        route=route, params=params, fmt=fmt, messages=messages, details=True, top_logprobs=top_logprobs,
        include_usage=_stream_usage(body), model=model, tools=tools,
        add_generation_prompt=_get_bool(body, "add_generation_prompt", True),
        continuous_usage=_continuous_usage(body),
        warnings=_warn_unknown(body, _CHAT_KNOWN | ignored, "chat fields"))


def parse_completions(body: dict) -> GenerateRequest:
    """An OpenAI `/v1/completions` body (prompt: str | [str] | [int] | [[int]])."""
    prompt = body.get("prompt")
    prompts: tuple[str, ...] = ()
    ids: tuple[tuple[int, ...], ...] = ()
    if isinstance(prompt, str):
        prompts = (prompt,)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = tuple(prompt)
    elif isinstance(prompt, list) and prompt and all(_is_int(t) and t >= 0 for t in prompt):
        ids = (tuple(prompt),)
    elif (isinstance(prompt, list) and prompt and all(isinstance(p, list) and p for p in prompt)
          and all(_is_int(t) and t >= 0 for p in prompt for t in p)):
        ids = tuple(tuple(p) for p in prompt)
    else:
        raise ValueError("prompt must be a string, a list of strings, or token ids")
    logprobs = _get_int(body, "logprobs", 0, 20)
    stream = _get_bool(body, "stream", False)
    max_tokens = _get_int(body, "max_tokens", 1)
    params = _openai_params(body, max_tokens or OPENAI_COMPLETIONS_DEFAULT_MAX_TOKENS, logprobs, False,
                            structured=True, best_of_ok=True)
    if logprobs is not None and _get_bool(body, "echo", False):
        params = params.replace(prompt_logprobs=logprobs)  # echo: the prompt tokens' logprobs come first
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ValueError(f"model must be a string, got {_show(model)}")
    return GenerateRequest(
        route="completions", params=params, fmt="completion_sse" if stream else "completion",
        prompts=prompts, prompt_token_ids=ids, batch=len(prompts) + len(ids) > 1, details=True,
        echo=_get_bool(body, "echo", False), top_logprobs=logprobs, include_usage=_stream_usage(body),
        continuous_usage=_continuous_usage(body), model=model, keep_best=_keep_best(body, params, stream),
        warnings=_warn_unknown(body, _COMPLETIONS_KNOWN, "completion fields"))


# ---- vLLM's legacy api_server /generate ----------------------------------------------------------

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
        raise ValueError(f"prompt must be a non-empty string, got {_show(prompt)}")
    stream = _get_bool(body, "stream", False)
    max_tokens = _get_int(body, "max_tokens", 1)
    params = _openai_params(body, max_tokens or OPENAI_COMPLETIONS_DEFAULT_MAX_TOKENS, None, False, best_of_ok=True)
    warnings: tuple[str, ...] = ()
    beam = [k for k in _NO_BEAM_SEARCH if body.get(k) not in (None, False)]
    if beam:
        warnings += (f"{', '.join(beam)}: beam search is not supported; the {params.n} sample(s) are drawn "
                     "as without it (greedy when temperature is 0)",)
        logger.warning(warnings[-1])
    warnings += _warn_unknown(body, _GENERATE_KNOWN | set(_NO_BEAM_SEARCH), "generate fields")
    return GenerateRequest(route="generate", params=params, fmt="generate_stream" if stream else "generate",
                           prompts=(prompt,), keep_best=_keep_best(body, params, stream), warnings=warnings)


def parse_custom_attributes(header: str | None) -> dict[str, str]:
    """`X-Amzn-SageMaker-Custom-Attributes: k=v; k2=v2` -> dict (DJL's RequestParser rules)."""
    out: dict[str, str] = {}
    for item in (header or "").split(";"):
        key, sep, value = item.partition("=")
        if key.strip():
            out[key.strip()] = value.strip() if sep else ""
    return out

"""Wire requests -> engine requests: what every API's parser shares.

Each HTTP API (`serving/server/api/`: LMI and TGI, OpenAI chat, OpenAI completions, vLLM's
`/generate`, the Responses API) parses its own body into the one hand-off type here, a frozen
`GenerateRequest` holding vLLM-named `SamplingParams`, the prompts, and how to answer (wire
format, details, ...). Here too: the body decoder (`loads_body`) and the small typed getters every
parser uses. Every problem raises `ValueError` naming the field, which the app answers with 400.
The response side (the same names in the other direction) is each format's class, on
`serving/server/formatters.py`.
"""

from __future__ import annotations

import array
import itertools
import json
import logging
import math
import re
import reprlib
from dataclasses import dataclass, field
from typing import Literal

from serving.sampling_params import SamplingParams
from serving.server import wire_formats
from serving.server.structured import ToolSpec

logger = logging.getLogger("serving.server.protocol")

Route = Literal["invocations", "completions", "chat", "generate", "responses"]
LMI_DEFAULT_MAX_NEW_TOKENS = 30  # LMI 0.28: a missing max_new_tokens becomes 30 (also chat on /invocations)
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
    sent a list and gets a list back. `fmt` names the wire format (`Formatter.FORMATS`, `wire_formats`).
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
        return wire_formats.streams(self.fmt)

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
        parts.append(f"[{key}]" if isinstance(key, int) else f".{show(key)[1:-1]}")
    parts.reverse()
    return ("".join(parts[:most]) + ("..." if len(parts) > most else "")).lstrip(".") or "the request body"


def show(value: object) -> str:
    """A user value for an error message: its repr, cut short."""
    return _SHOW.repr(value)


# ---- small typed getters: wrong types -> ValueError naming the field -------------------------

def is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def get_bool(d: dict, key: str, default: bool) -> bool:
    v = d.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ValueError(f"{key} must be a boolean, got {show(v)}")
    return v


def get_int(d: dict, key: str, lo: int | None = None, hi: int | None = None) -> int | None:
    v = d.get(key)
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not is_int(v):
        raise ValueError(f"{key} must be an integer, got {show(v)}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        bounds = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{key} must be {bounds}, got {v}")
    return v


def get_num(d: dict, key: str, lo: float | None = None, hi: float | None = None) -> float | None:
    v = d.get(key)
    if v is None:
        return None
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
        raise ValueError(f"{key} must be a finite number, got {show(v)}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise ValueError(f"{key} must be in [{lo}, {hi}], got {v}")
    return float(v)


def get_stop(d: dict, *keys: str) -> tuple[str, ...]:
    for key in keys:
        v = d.get(key)
        if v is None:
            continue
        if isinstance(v, str):
            return (v,) if v else ()
        if isinstance(v, list) and all(isinstance(s, str) for s in v):
            return tuple(s for s in v if s)
        raise ValueError(f"{key} must be a string or a list of strings, got {show(v)}")
    return ()


def get_ids(d: dict, key: str) -> tuple[int, ...]:
    v = d.get(key)
    if v is None:
        return ()
    if not isinstance(v, list) or not all(is_int(t) and t >= 0 for t in v):
        raise ValueError(f"{key} must be a list of non-negative integers, got {show(v)}")
    return tuple(v)


def common_sampling(d: dict) -> dict:
    """vLLM-named options shared by every route (penalties, top-k/p, seed, stop ids ...)."""
    out: dict = {}
    for key, lo, hi in (("top_p", None, None), ("repetition_penalty", None, None), ("min_p", None, None),
                        ("presence_penalty", -2.0, 2.0), ("frequency_penalty", -2.0, 2.0)):
        v = get_num(d, key, lo, hi)
        if v is not None:
            out[key] = v
    for key, lo in (("top_k", -1), ("min_tokens", 0)):
        v = get_int(d, key, lo)
        if v is not None:
            out[key] = v
    seed = d.get("seed")
    if isinstance(seed, str) and seed.strip().lstrip("-").isdigit():
        seed = int(seed)  # LMI converts the seed with int()
    if seed is not None:
        out["seed"] = get_int({"seed": seed}, "seed", 0)
    ids = get_ids(d, "stop_token_ids")
    if ids:
        out["stop_token_ids"] = ids
    for key in ("include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
                "ignore_eos"):
        if key in d and d[key] is not None:
            out[key] = get_bool(d, key, False)
    return out


def warn_unknown(d: dict, known: set[str], where: str) -> tuple[str, ...]:
    unknown = sorted(k for k in d if k not in known)
    if unknown:
        msg = f"dropped unsupported {where}: {', '.join(unknown)}"
        logger.warning(msg)
        return (msg,)
    return ()


def to_sampling_params(**kwargs: object) -> SamplingParams:
    try:
        return SamplingParams(**kwargs)  # type: ignore[arg-type]
    except TypeError as exc:  # a wrong type reached a comparison
        raise ValueError(str(exc)) from None

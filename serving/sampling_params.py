"""Per-request generation parameters, with vLLM's names and semantics.

`SamplingParams` is what `LLM.generate` takes and what the engine runs on. LMI/TGI names
(`max_new_tokens`, `stop_sequences`, `do_sample`) are translated into it once, at the HTTP
edge (`serving/server/protocol.py`), never here. Every check raises `ValueError` with a message that
names the field, so the server can answer 400 without disturbing other requests.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from typing import Any

_GREEDY_EPS = 1e-5


@dataclass(frozen=True)
class GuidedDecodingParams:
    """One output constraint (vLLM's `GuidedDecodingParams`): exactly one of the fields is set.

    `json`: a JSON schema (dict or its text; kept as text so the object stays hashable);
    `json_object`: any JSON object; `regex`; `choice`: one of these strings; `grammar`: an EBNF
    (GBNF) grammar. The engine compiles it (xgrammar) and masks every sampled token to it; a
    sample whose output completes the constraint finishes with finish_reason "stop".
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):
            object.__setattr__(self, "json", json.dumps(self.json))
        elif self.json is not None and not isinstance(self.json, str):
            raise ValueError("guided json must be a JSON schema (an object or its text)")
        if self.choice is not None:
            choice = (self.choice,) if isinstance(self.choice, str) else tuple(self.choice)
            if not choice or not all(isinstance(c, str) and c for c in choice):
                raise ValueError("guided choice must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", choice)
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"guided {name} must be a non-empty string")
        kinds = [n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None]
        kinds += ["json_object"] if self.json_object else []
        if len(kinds) != 1:
            raise ValueError(f"give exactly one guided decoding constraint (json, regex, choice, grammar, "
                             f"json_object), got {kinds or 'none'}")

    @property
    def kind(self) -> str:
        return next(n for n in ("json", "regex", "choice", "grammar", "json_object") if getattr(self, n))


@dataclass(frozen=True)
class SamplingParams:
    """Sampling and stopping options for one request (vLLM field names).

    Greedy decoding happens when `temperature` is below 1e-5 (vLLM's rule). `top_k` of 0 or
    -1 disables top-k. `logprobs=k` returns the chosen token's logprob plus the top k.
    `logit_bias` ({token id: bias}, added to that token's logit before penalties and sampling) is
    kept as sorted `(id, bias)` pairs so the object stays hashable; ids must be in the vocabulary
    (the engine checks them at admission).
    """

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    logit_bias: dict[int, float] | tuple[tuple[int, float], ...] | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    guided_decoding: GuidedDecodingParams | None = None

    def __post_init__(self) -> None:
        # Normalise list-ish inputs so the object stays hashable and immutable.
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        else:
            stop = tuple(stop)
        if not all(isinstance(s, str) for s in stop):
            raise ValueError("stop must be a string or a list of strings")
        if any(s == "" for s in stop):
            raise ValueError("stop strings must be non-empty")
        object.__setattr__(self, "stop", stop)
        ids = () if self.stop_token_ids is None else tuple(self.stop_token_ids)
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise ValueError("stop_token_ids must be a list of non-negative integers")
        object.__setattr__(self, "stop_token_ids", ids)
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        if self.best_of is None:
            object.__setattr__(self, "best_of", self.n)
        if isinstance(self.guided_decoding, dict):
            object.__setattr__(self, "guided_decoding", GuidedDecodingParams(**self.guided_decoding))
        elif self.guided_decoding is not None and not isinstance(self.guided_decoding, GuidedDecodingParams):
            raise ValueError("guided_decoding must be a GuidedDecodingParams")
        self._validate()

    def _validate(self) -> None:
        def _int(name: str, lo: int | None = None) -> None:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"{name} must be an integer, got {v!r}")
            if lo is not None and v < lo:
                raise ValueError(f"{name} must be >= {lo}, got {v}")

        def _num(name: str) -> float:
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v != v:
                raise ValueError(f"{name} must be a number, got {v!r}")
            return float(v)

        _int("n", 1)
        _int("best_of", 1)
        if self.best_of < self.n:
            raise ValueError(f"best_of must be >= n, got best_of={self.best_of} n={self.n}")
        if not -2.0 <= _num("presence_penalty") <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= _num("frequency_penalty") <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not _num("repetition_penalty") > 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if _num("temperature") < 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < _num("top_p") <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _int("top_k")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 0, got {self.top_k}")
        if not 0.0 <= _num("min_p") <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            _int("seed")
        if self.max_tokens is not None:
            _int("max_tokens", 1)
        _int("min_tokens", 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError("min_tokens must be <= max_tokens")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _int(name, 0)
                if getattr(self, name) > 20:
                    raise ValueError(f"{name} must be <= 20, got {getattr(self, name)}")

    @property
    def needs_token_history(self) -> bool:
        """True when sampling reads the ids generated so far (repetition/frequency/presence penalties)."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def greedy(self) -> bool:
        """True when decoding is argmax (temperature ~ 0)."""
        return self.temperature < _GREEDY_EPS

    def replace(self, **changes: Any) -> SamplingParams:
        """A copy with some fields changed (validated again)."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        if "n" in changes and "best_of" not in changes:
            values["best_of"] = None
        values.update(changes)
        return SamplingParams(**values)


def _logit_bias(bias: object) -> tuple[tuple[int, float], ...] | None:
    """{token id: bias} (or (id, bias) pairs; ids may be digit strings, as JSON keys are) -> sorted
    pairs, validated: ids non-negative integers, biases finite numbers. None / empty -> None."""
    if not bias:
        return None
    items = bias.items() if isinstance(bias, dict) else bias
    out: dict[int, float] = {}
    try:
        for tid, value in items:  # type: ignore[union-attr]
            if isinstance(tid, str) and tid.strip().isdigit():
                tid = int(tid)
            if not isinstance(tid, int) or isinstance(tid, bool) or tid < 0:
                raise ValueError(f"logit_bias keys must be token ids (non-negative integers), got {tid!r:.40}")
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise ValueError(f"logit_bias values must be finite numbers, got {value!r:.40}")
            out[tid] = float(value)
    except TypeError:
        raise ValueError("logit_bias must map token ids to numbers") from None
    return tuple(sorted(out.items())) or None

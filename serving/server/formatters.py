"""Engine deltas -> wire bytes: the one interface of every wire format, and what they share.

`Result` accumulates the `StreamDelta`s of one prompt (all its samples). A `Formatter` turns them
into the body of one response: `body()` for a plain answer, `start()` / `chunk()` / `end()` for a
stream (every record ends in a newline). Each wire format (`GenerateRequest.fmt`) is one small
subclass, defined beside the parser that chooses it (`serving/server/api/`), and filed by its
`name` in `Formatter.FORMATS` as it is defined; `Formatter(req, ...)` builds the class the table
holds for `req.fmt`. JSON is written as LMI writes it: `json.dumps` with its default separators
and `ensure_ascii=False`, so non-ASCII text is raw UTF-8 (`"你好"`, not `"\\u4f60\\u597d"`), on
/invocations and on /v1 alike (vLLM's OpenAI server writes raw UTF-8 too); the common mid-stream
record (one per token per stream, on the HTTP thread, holding the GIL) is filled into a string
template instead (`_fast_chunk`), the same bytes as `_chunk` writes at a fraction of the cost.
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from json.encoder import encode_basestring
from typing import TYPE_CHECKING, ClassVar

from serving.outputs import StreamDelta
from serving.server import wire_formats

if TYPE_CHECKING:
    from serving.server.protocol import GenerateRequest

# Template records write strings with the function json.dumps itself uses for them.
json_str: Callable[[str], str] = encode_basestring


def dumps(obj: object, **kw: object) -> str:
    """Every record as LMI writes it: json.dumps with ', ' / ': ' and raw UTF-8 (ensure_ascii=False);
    never NaN or Infinity, which are not JSON (see `_finite`)."""
    try:
        return json.dumps(obj, ensure_ascii=False, allow_nan=False, **kw)
    except ValueError:  # a non-finite float somewhere (rare): write it as JSON can
        return json.dumps(_finite_tree(obj), ensure_ascii=False, **kw)


LOGPROB_FLOOR = -9999.0  # what a -inf log-probability (a masked or impossible token) is written as (vLLM's)


def _finite(x: float) -> float | None:
    """A float JSON can carry: -inf -> LOGPROB_FLOOR, NaN and +inf (no meaning left) -> null."""
    if math.isfinite(x):
        return x
    return LOGPROB_FLOOR if x < 0 else None


def _finite_tree(obj: object) -> object:
    if isinstance(obj, float):
        return _finite(obj)
    if isinstance(obj, dict):
        return {k: _finite_tree(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite_tree(v) for v in obj]
    return obj


def json_scalar(x: object) -> str:
    """json.dumps(x), byte for byte, for a token record's scalars (None, int, float), minus its overhead."""
    t = type(x)
    if t is float:
        return float.__repr__(x) if math.isfinite(x) else dumps(x)  # never NaN / Infinity
    if t is int:
        return int.__repr__(x)
    if x is None:
        return "null"
    return dumps(x)


@dataclass
class Sample:
    """What one sample (of n) produced so far."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    token_texts: list[str] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None


@dataclass
class Result:
    """All deltas of one prompt, accumulated (the HTTP thread's only view of a request)."""

    prompt: str
    prompt_token_ids: list[int]
    n: int = 1
    samples: dict[int, Sample] = field(default_factory=dict)
    prompt_logprobs: tuple[float | None, ...] | None = None
    decode_token: Callable[[int], str] | None = None

    def add(self, delta: StreamDelta) -> Sample:
        # Once per token per stream on the HTTP thread: no throwaway Sample, no list copies.
        s = self.samples.get(delta.index)
        if s is None:
            s = self.samples[delta.index] = Sample(delta.index)
        ids = delta.token_ids
        n = len(ids)
        if n:
            s.token_ids += ids
            if len(delta.token_texts) == n:
                s.token_texts += delta.token_texts
            elif n == 1:
                s.token_texts.append(delta.text)
            else:
                s.token_texts += [self.decode_token(t) if self.decode_token else "" for t in ids]
            lps = delta.logprobs
            if len(lps) >= n:
                s.logprobs += lps[:n] if len(lps) > n else lps
            else:
                s.logprobs += list(lps) + [None] * (n - len(lps))
        if delta.top_logprobs:
            s.top_logprobs += delta.top_logprobs
        s.text += delta.text
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.finish_reason is not None:
            s.finish_reason = delta.finish_reason
            s.error = delta.error
        return s

    def fail(self, message: str) -> None:
        """Mark every unfinished sample as failed (engine died, timeout, ...)."""
        for i in range(self.n):
            s = self.samples.setdefault(i, Sample(i))
            if s.finish_reason is None:
                s.finish_reason, s.error = "error", message

    @property
    def finished(self) -> bool:
        if len(self.samples) < self.n:
            return False
        for s in self.samples.values():
            if not s.finish_reason:
                return False
        return True

    @property
    def num_output_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.samples.values())

    def sample(self, i: int = 0) -> Sample:
        s = self.samples.get(i)
        if s is None:
            s = self.samples[i] = Sample(i)
        return s

    def ranked(self) -> list[Sample]:
        """The samples, most likely first (highest cumulative logprob; ties keep their index order):
        the first is LMI's best sequence, the rest its best_of_sequences."""
        samples = [self.sample(i) for i in range(self.n)]
        if self.n == 1:
            return samples
        return sorted(samples, key=lambda s: -sum(lp for lp in s.logprobs if lp is not None))


class Formatter:
    """Renders one response in one wire format; the base of every format class.

    A subclass that sets `name` is the format of that name (`GenerateRequest.fmt`) and is filed in
    `FORMATS` as it is defined: a request's format is always filed, since the parser that names it
    lives in the format's module. `Formatter(req, ...)` builds `FORMATS[req.fmt]`.
    """

    FORMATS: ClassVar[dict[str, type[Formatter]]] = {}
    name: ClassVar[str] = ""  # the `GenerateRequest.fmt` this class writes ("" for a shared base)
    content_type: ClassVar[str] = ""
    streams: ClassVar[bool] = False  # start / chunk / end (a stream), else body

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        name = cls.__dict__.get("name")
        if name:
            assert name not in Formatter.FORMATS, f"two wire formats named {name!r}"
            assert cls.content_type, f"the wire format {name!r} has no content type"
            Formatter.FORMATS[name] = cls
            wire_formats.register(name, cls.streams)

    @staticmethod
    def of(fmt: str) -> type[Formatter]:
        """The class of the wire format `fmt`."""
        cls = Formatter.FORMATS.get(fmt)
        if cls is None:
            raise AssertionError(f"no wire format {fmt!r} (known: {', '.join(sorted(Formatter.FORMATS))})")
        return cls

    def __new__(cls, req: GenerateRequest, **_kw: object) -> Formatter:
        return super().__new__(Formatter.of(req.fmt) if cls is Formatter else cls)

    def __init__(self, req: GenerateRequest, *, model: str = "", request_id: str | None = None,
                 created: int = 0, special_ids: frozenset[int] = frozenset(),
                 decode_token: Callable[[int], str] | None = None) -> None:
        self.req = req
        self.fmt = req.fmt
        self.model = model  # the served name (vLLM answers with it, whatever the client sent)
        self.hex_id = request_id or uuid.uuid4().hex
        self.created = created
        self.special_ids = special_ids
        self.decode_token = decode_token or (lambda t: "")

    # ---- the interface ---------------------------------------------------------------------------
    def body(self, results: list[Result]) -> bytes:
        """The whole non-streaming response body."""
        raise AssertionError(f"{self.fmt} is a streaming format")

    def start(self, results: list[Result]) -> bytes:
        """Bytes sent before the first delta of a stream."""
        return b""

    def chunk(self, r: Result, delta: StreamDelta, prompt_index: int = 0) -> bytes:
        """One record for one delta (already added to `r`)."""
        s = r.sample(delta.index)
        if (delta.finish_reason is None and type(delta.text) is str and not s.error and not self.req.continuous_usage
                and self.req.tools is None):
            rec = self._fast_chunk(r, s, delta, prompt_index)
            if rec is not None:
                return rec
        return self._chunk(r, s, delta, prompt_index)

    def end(self, results: list[Result]) -> bytes:
        """Bytes after the last delta of a stream."""
        return b""

    def error_body(self, status: int, message: str) -> bytes:
        """A whole failed answer in this format's API (the body of an answer whose 200 was already
        sent by the opt-in plain heartbeat; the status itself says it otherwise)."""
        raise NotImplementedError

    def error_record(self, r: Result, message: str) -> bytes:
        """A final record for a stream that failed before the engine said so (finish_reason error)."""
        r.fail(message)
        delta = StreamDelta(request_id="", index=0, token_ids=(), text="", finish_reason="error", error=message)
        return self.chunk(r, delta)

    # ---- what a stream format writes ----------------------------------------------------------------
    def _fast_chunk(self, r: Result, s: Sample, delta: StreamDelta, prompt_index: int) -> bytes | None:
        """The common mid-stream record as a string template: the same bytes `_chunk` writes through
        dicts and json.dumps, at a third of the cost. None: not a common record, `_chunk` writes it."""
        return None

    def _chunk(self, r: Result, s: Sample, delta: StreamDelta, prompt_index: int) -> bytes:
        """The record of one delta, written through dicts and `dumps`."""
        raise AssertionError(f"{self.fmt} is not a streaming format")

    @staticmethod
    def _sse(obj: object) -> str:
        return f"data: {dumps(obj)}\n\n"

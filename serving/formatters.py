"""Engine deltas -> wire bytes, byte-compatible with LMI 0.28 (minus its bugs), TGI and OpenAI.

`Result` accumulates the `StreamDelta`s of one prompt (all its samples). A `Formatter` turns them
into the body of one response: `body()` for a plain answer, `start()` / `chunk()` / `end()` for a
stream (every record ends in a newline). JSON is written with `json.dumps` defaults, as LMI does.
Finish reasons stay LMI's (`length|eos_token|stop_sequence|error`) on /invocations and become
OpenAI's (`length|stop`) on /v1.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from serving.outputs import StreamDelta
from serving.protocol import GenerateRequest

CONTENT_TYPES = {
    "json": "application/json", "tgi_json": "application/json", "json_chat": "application/json",
    "chat": "application/json", "completion": "application/json", "none": "text/plain",
    "jsonlines": "application/jsonlines", "jsonlines_chat": "application/jsonlines",
    "sse": "text/event-stream", "tgi_sse": "text/event-stream", "chat_sse": "text/event-stream",
    "completion_sse": "text/event-stream",
}
_OPENAI_FINISH = {"eos_token": "stop", "stop_sequence": "stop", "length": "length", "abort": "abort",
                  "error": "error"}


def dumps(obj: object) -> str:
    """LMI writes every record with Python's json.dumps defaults (', ' / ': ', ASCII escapes)."""
    return json.dumps(obj)


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
        s = self.samples.setdefault(delta.index, Sample(delta.index))
        ids = list(delta.token_ids)
        s.token_ids += ids
        if len(delta.token_texts) == len(ids):
            s.token_texts += list(delta.token_texts)
        elif len(ids) == 1:
            s.token_texts.append(delta.text)
        else:
            s.token_texts += [self.decode_token(t) if self.decode_token else "" for t in ids]
        lps = list(delta.logprobs) + [None] * (len(ids) - len(delta.logprobs))
        s.logprobs += lps[: len(ids)]
        s.top_logprobs += list(delta.top_logprobs)
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
        return len(self.samples) >= self.n and all(s.finish_reason for s in self.samples.values())

    @property
    def num_output_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.samples.values())

    def sample(self, i: int = 0) -> Sample:
        return self.samples.setdefault(i, Sample(i))


class Formatter:
    """Renders one response in one wire format (`GenerateRequest.fmt`)."""

    def __init__(self, req: GenerateRequest, *, model: str = "", request_id: str | None = None,
                 created: int = 0, special_ids: frozenset[int] = frozenset(),
                 decode_token: Callable[[int], str] | None = None) -> None:
        self.req = req
        self.fmt = req.fmt
        self.model = model  # the served name (vLLM answers with it, whatever the client sent)
        hex_id = request_id or uuid.uuid4().hex
        self.id = ("cmpl-" if req.route == "completions" else "chatcmpl-") + hex_id
        self.created = created
        self.special_ids = special_ids
        self.decode_token = decode_token or (lambda t: "")
        self.content_type = CONTENT_TYPES[self.fmt]
        self._role_sent: set[int] = set()

    # ---- LMI / TGI token records --------------------------------------------------------------
    def _token(self, tid: int, text: str, lp: float | None) -> dict:
        tgi = self.fmt.startswith("tgi")
        rec = {"id": tid, "text": text, ("logprob" if tgi else "log_prob"): lp}
        if tid in self.special_ids:
            rec["special" if tgi else "special_token"] = True
        return rec

    def _details(self, r: Result, s: Sample, tokens: bool) -> dict:
        d: dict = {"finish_reason": s.finish_reason, "generated_tokens": len(s.token_ids), "inputs": r.prompt}
        if tokens:
            d["tokens"] = [self._token(t, x, lp) for t, x, lp in zip(s.token_ids, s.token_texts, s.logprobs)]
            if self.req.decoder_input_details:
                lps = list(r.prompt_logprobs or ()) + [None] * len(r.prompt_token_ids)
                d["prefill"] = [{"id": t, "text": self.decode_token(t), ("logprob" if self.fmt.startswith("tgi")
                                 else "log_prob"): (lps[i] if i else None)}
                                for i, t in enumerate(r.prompt_token_ids)]
        return d

    def _generated_text(self, r: Result, s: Sample) -> str:
        return (r.prompt + s.text) if self.req.return_full_text else s.text

    def _lmi_object(self, r: Result) -> dict:
        s = r.sample(0)
        obj: dict = {"generated_text": self._generated_text(r, s)}
        if self.req.details or s.finish_reason == "error":
            obj["details"] = self._details(r, s, tokens=self.req.details) if self.req.details else \
                {"finish_reason": "error"}
        if s.error:
            obj["error"] = s.error
        return obj

    # ---- OpenAI records ------------------------------------------------------------------------
    def _finish(self, reason: str | None) -> str | None:
        if reason is None or self.req.route == "invocations":
            return reason
        return _OPENAI_FINISH.get(reason, reason)

    def _usage(self, results: list[Result]) -> dict:
        p = sum(len(r.prompt_token_ids) for r in results)
        c = sum(r.num_output_tokens for r in results)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def _lp_entry(self, text: str, lp: float | None, top: dict[int, float] | None) -> dict:
        entry = {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}
        tops = []
        for tid, v in sorted((top or {}).items(), key=lambda kv: -kv[1])[: self.req.top_logprobs or 0]:
            t = self.decode_token(tid)
            tops.append({"token": t, "logprob": v, "bytes": list(t.encode("utf-8"))})
        entry["top_logprobs"] = tops
        return entry

    def _chat_logprobs(self, s: Sample, start: int, end: int) -> dict | None:
        if self.req.top_logprobs is None:
            return None
        tops = s.top_logprobs + [{}] * (len(s.token_ids) - len(s.top_logprobs))
        return {"content": [self._lp_entry(s.token_texts[i], s.logprobs[i], tops[i]) for i in range(start, end)]}

    def _completion_logprobs(self, s: Sample, start: int, end: int, offset: int) -> dict | None:
        if self.req.top_logprobs is None:
            return None
        tops = s.top_logprobs + [{}] * (len(s.token_ids) - len(s.top_logprobs))
        out: dict = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
        for i in range(start, end):
            out["text_offset"].append(offset)
            offset += len(s.token_texts[i])
            out["token_logprobs"].append(s.logprobs[i])
            out["tokens"].append(s.token_texts[i])
            out["top_logprobs"].append({self.decode_token(t): v for t, v in tops[i].items()})
        return out

    def _head(self, obj: str) -> dict:
        head = {"id": self.id, "object": obj, "created": self.created}
        if self.req.route != "invocations":
            head["model"] = self.model
        return head

    # ---- plain responses -------------------------------------------------------------------------
    def body(self, results: list[Result]) -> bytes:
        """The whole non-streaming response body."""
        fmt = self.fmt
        if fmt in ("json", "tgi_json"):
            objs = [self._lmi_object(r) for r in results]
            if fmt == "tgi_json" or self.req.batch:
                return dumps(objs).encode()
            return dumps(objs[0]).encode()
        if fmt == "none":
            return "".join(self._generated_text(r, r.sample(0)) for r in results).encode()
        if fmt in ("json_chat", "chat"):
            r = results[0]
            choices = []
            for i in range(r.n):
                s = r.sample(i)
                choices.append({"index": i, "message": {"role": "assistant", "content": s.text},
                                "logprobs": self._chat_logprobs(s, 0, len(s.token_ids)),
                                "finish_reason": self._finish(s.finish_reason)})
            return dumps({**self._head("chat.completion"), "choices": choices, "usage": self._usage(results)}).encode()
        if fmt == "completion":
            choices = []
            for p, r in enumerate(results):
                for i in range(r.n):
                    s = r.sample(i)
                    prefix = r.prompt if self.req.echo else ""
                    choices.append({"index": p * r.n + i, "text": prefix + s.text,
                                    "logprobs": self._completion_logprobs(s, 0, len(s.token_ids), len(prefix)),
                                    "finish_reason": self._finish(s.finish_reason), "stop_reason": None})
            return dumps({**self._head("text_completion"), "choices": choices, "usage": self._usage(results)}).encode()
        raise AssertionError(f"{fmt} is a streaming format")

    # ---- streams ---------------------------------------------------------------------------------
    def start(self, results: list[Result]) -> bytes:
        """Bytes sent before the first delta (the role chunks of an OpenAI chat stream)."""
        if self.fmt != "chat_sse":
            return b""
        out = []
        for i in range(results[0].n):
            self._role_sent.add(i)
            out.append(self._sse({**self._head("chat.completion.chunk"), "choices": [
                {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None}]}))
        return "".join(out).encode()

    @staticmethod
    def _sse(obj: object) -> str:
        return f"data: {dumps(obj)}\n\n"

    def chunk(self, r: Result, delta: StreamDelta, prompt_index: int = 0) -> bytes:
        """One record for one delta (already added to `r`)."""
        s = r.sample(delta.index)
        n_new = len(delta.token_ids)
        end = len(s.token_ids)
        done = delta.finish_reason is not None
        fmt = self.fmt
        if fmt in ("jsonlines", "sse", "tgi_sse"):
            if n_new:
                tok = self._token(delta.token_ids[-1], delta.text, s.logprobs[-1])
            else:
                tok = {"id": -1, "text": delta.text, ("logprob" if fmt == "tgi_sse" else "log_prob"): -1,
                       ("special" if fmt == "tgi_sse" else "special_token"): True}
            rec: dict = {"token": tok}
            if done:
                rec["generated_text"] = self._generated_text(r, s)
                if self.req.details:
                    rec["details"] = self._details(r, s, tokens=False)
                elif s.finish_reason == "error":
                    rec["details"] = {"finish_reason": "error"}
                if s.error:
                    rec["error"] = s.error
            return (f"{dumps(rec)}\n" if fmt == "jsonlines" else self._sse(rec)).encode()
        if fmt in ("jsonlines_chat", "chat_sse"):
            d: dict = {"content": delta.text}
            if delta.index not in self._role_sent:
                self._role_sent.add(delta.index)
                d["role"] = "assistant"
            rec = {**self._head("chat.completion.chunk"), "choices": [
                {"index": delta.index, "delta": d, "logprobs": self._chat_logprobs(s, end - n_new, end),
                 "finish_reason": self._finish(delta.finish_reason)}]}
            if s.error:
                rec["error"] = s.error
            return (f"{dumps(rec)}\n" if fmt == "jsonlines_chat" else self._sse(rec)).encode()
        if fmt == "completion_sse":
            text = delta.text
            offset = len(s.text) - len(delta.text)
            if self.req.echo and end == n_new and n_new:
                text, offset = r.prompt + text, 0
            rec = {**self._head("text_completion"), "choices": [
                {"index": prompt_index * r.n + delta.index, "text": text,
                 "logprobs": self._completion_logprobs(s, end - n_new, end, offset),
                 "finish_reason": self._finish(delta.finish_reason), "stop_reason": None}]}
            if s.error:
                rec["error"] = s.error
            return self._sse(rec).encode()
        raise AssertionError(f"{fmt} is not a streaming format")

    def end(self, results: list[Result]) -> bytes:
        """Bytes after the last delta: the usage chunk and `[DONE]` on the /v1 SSE routes."""
        if self.fmt not in ("chat_sse", "completion_sse"):
            return b""
        out = ""
        if self.req.include_usage:
            out += self._sse({**self._head("chat.completion.chunk" if self.fmt == "chat_sse" else "text_completion"),
                              "choices": [], "usage": self._usage(results)})
        return (out + "data: [DONE]\n\n").encode()

    def error_record(self, r: Result, message: str) -> bytes:
        """A final record for a stream that failed before the engine said so (finish_reason error)."""
        r.fail(message)
        delta = StreamDelta(request_id="", index=0, token_ids=(), text="", finish_reason="error", error=message)
        return self.chunk(r, delta)

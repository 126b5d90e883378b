"""LMI's and TGI's wire formats: `generated_text` objects, and token records streamed as JSON
lines or server-sent events, byte-compatible with LMI 0.28 (minus its bugs) and TGI.

Finish reasons stay LMI's (`length|eos_token|stop_sequence|error`); errors are LMI's
`{"error", "code"}`. TGI's formats are LMI's with TGI's names (`logprob`, `special`) and shapes.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

from serving.outputs import StreamDelta
from serving.server.errors import lmi_error
from serving.server.formatters import Formatter, Result, Sample, dumps, json_scalar, json_str


class LmiFormat(Formatter):
    """What LMI's and TGI's formats share: token records, `details`, `best_of_sequences`."""

    tgi: ClassVar[bool] = False  # TGI's names: `logprob` / `special` (LMI: `log_prob` / `special_token`)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._lp_key = "logprob" if self.tgi else "log_prob"
        self._special_key = "special" if self.tgi else "special_token"

    def _token(self, tid: int, text: str, lp: float | None) -> dict:
        rec = {"id": tid, "text": text, self._lp_key: lp}
        if tid in self.special_ids:
            rec[self._special_key] = True
        return rec

    def _details(self, r: Result, s: Sample, tokens: bool, inputs: bool = True) -> dict:
        """LMI's `details`: finish_reason, generated_tokens, inputs, tokens (non-streaming only), then
        prefill (decoder_input_details) and top_tokens (top_n_tokens > 0), streamed or not."""
        d: dict = {"finish_reason": s.finish_reason, "generated_tokens": len(s.token_ids)}
        if inputs:
            d["inputs"] = r.prompt
        if tokens:
            d["tokens"] = [self._token(t, x, lp) for t, x, lp in zip(s.token_ids, s.token_texts, s.logprobs)]
        if self.req.decoder_input_details:
            lps = list(r.prompt_logprobs or ()) + [None] * len(r.prompt_token_ids)
            d["prefill"] = [{"id": t, "text": self.decode_token(t), self._lp_key: (lps[i] if i else None)}
                            for i, t in enumerate(r.prompt_token_ids)]
        if self.req.top_n_tokens > 0:
            d["top_tokens"] = self._top_tokens(s)
        return d

    def _top_tokens(self, s: Sample) -> list[list[dict]]:
        """Per generated token, as vLLM's logprobs dict orders them (LMI writes it as is): the chosen
        token first, then the `top_n_tokens` most likely ones, the chosen one not repeated."""
        k = self.req.top_n_tokens
        tops = s.top_logprobs + [{}] * (len(s.token_ids) - len(s.top_logprobs))
        out = []
        for tid, text, lp, top in zip(s.token_ids, s.token_texts, s.logprobs, tops):
            row = [self._token(tid, text, lp)]
            row += [self._token(t, self.decode_token(t), v)
                    for t, v in sorted(top.items(), key=lambda kv: -kv[1])[:k] if t != tid]
            out.append(row)
        return out

    def _generated_text(self, r: Result, s: Sample) -> str:
        return (r.prompt + s.text) if self.req.return_full_text else s.text

    def _best_of_object(self, r: Result) -> dict:
        """n / best_of > 1 (LMI `_json_output_formatter_best_of`): the best sequence, and the others
        in details.best_of_sequences, each with its own generated_text."""
        best, *others = r.ranked()
        details = {"inputs": r.prompt, **self._details(r, best, tokens=True, inputs=False)}
        details["best_of_sequences"] = [{**self._details(r, s, tokens=True, inputs=False),
                                         "generated_text": self._generated_text(r, s)} for s in others]
        obj: dict = {"generated_text": self._generated_text(r, best), "details": details}
        error = next((s.error for s in (best, *others) if s.error), None)
        if error:
            obj["error"] = error
        return obj

    def _lmi_object(self, r: Result) -> dict:
        if r.n > 1:
            return self._best_of_object(r)
        s = r.sample(0)
        obj: dict = {"generated_text": self._generated_text(r, s)}
        if self.req.details or s.finish_reason == "error":
            obj["details"] = self._details(r, s, tokens=self.req.details) if self.req.details else \
                {"finish_reason": "error"}
        if s.error:
            obj["error"] = s.error
        return obj

    def error_body(self, status: int, message: str) -> bytes:
        return dumps(lmi_error(status, message)).encode()


class LmiJson(LmiFormat):
    """LMI's `json`: one `{"generated_text"[, "details"]}`, a list of them for list `inputs`."""

    name = "json"
    content_type = "application/json"
    always_list: ClassVar[bool] = False  # TGI's `/` answers a list even for one input

    def body(self, results: list[Result]) -> bytes:
        objs = [self._lmi_object(r) for r in results]
        if self.always_list or self.req.batch:
            return dumps(objs).encode()
        return dumps(objs[0]).encode()


class LmiText(LmiFormat):
    """LMI's `none`: the generated text alone (the best sample's), as plain text."""

    name = "none"
    content_type = "text/plain"

    def body(self, results: list[Result]) -> bytes:
        return "".join(self._generated_text(r, r.ranked()[0]) for r in results).encode()


class LmiTokenStream(LmiFormat):
    """A stream of token records, `{"token": {"id", "text", "log_prob"}}`; the last adds
    `generated_text` (+ `details`, `error`). Framed by `_open` / `_close`."""

    streams = True
    _open: ClassVar[str] = ""
    _close: ClassVar[str] = "\n"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._lp_json = f"{json.dumps(self._lp_key)}: "  # the constant parts of a token record
        self._special_json = f", {json.dumps(self._special_key)}: true"

    def _fast_chunk(self, r: Result, s: Sample, delta: StreamDelta, prompt_index: int) -> bytes | None:
        if not delta.token_ids:
            return None
        tid = delta.token_ids[-1]
        special = self._special_json if tid in self.special_ids else ""
        return (f'{self._open}{{"token": {{"id": {json_scalar(tid)}, "text": {json_str(delta.text)}, '
                f'{self._lp_json}{json_scalar(s.logprobs[-1])}{special}}}}}{self._close}').encode()

    def _chunk(self, r: Result, s: Sample, delta: StreamDelta, prompt_index: int) -> bytes:
        if delta.token_ids:
            tok = self._token(delta.token_ids[-1], delta.text, s.logprobs[-1])
        else:
            tok = {"id": -1, "text": delta.text, self._lp_key: -1, self._special_key: True}
        rec: dict = {"token": tok}
        if delta.finish_reason is not None:
            rec["generated_text"] = self._generated_text(r, s)
            if self.req.details:
                rec["details"] = self._details(r, s, tokens=False)
            elif s.finish_reason == "error":
                rec["details"] = {"finish_reason": "error"}
            if s.error:
                rec["error"] = s.error
        return f"{self._open}{dumps(rec)}{self._close}".encode()


class LmiJsonLines(LmiTokenStream):
    """LMI's `jsonlines`: one record per line."""

    name = "jsonlines"
    content_type = "application/jsonlines"


class LmiSse(LmiTokenStream):
    """LMI's `sse`: the same records as `data: ...` events."""

    name = "sse"
    content_type = "text/event-stream"
    _open = "data: "
    _close = "\n\n"


class TgiJson(LmiJson):
    """TGI's `POST /` answer (and `option.tgi_compat`): a list of TGI objects."""

    name = "tgi_json"
    tgi = True
    always_list = True


class TgiGenerate(LmiJson):
    """TGI's `POST /generate` answer: one TGI object."""

    name = "tgi_generate"
    tgi = True


class TgiSse(LmiSse):
    """TGI's stream (`/generate_stream`, `POST /` with `stream`, `option.tgi_compat`)."""

    name = "tgi_sse"
    tgi = True

"""Wire formats -> typed objects: LMI JSON / JSON lines, SSE ``data:`` lines, TGI-compat, OpenAI.

``parse_line`` turns one stream line into a ``StreamChunk`` (or None for blank lines, SSE comments,
``[DONE]``); ``parse_response`` turns a whole non-streaming body into a ``GenerationResult``;
``collect`` folds a chunk stream into a ``GenerationResult``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from sdk.results import GenerationResult, ModelError, StreamChunk, Token


def _token(obj: dict[str, Any]) -> Token:
    """LMI uses ``log_prob``/``special_token``; TGI uses ``logprob``/``special``."""
    log_prob = obj.get("log_prob", obj.get("logprob"))
    return Token(
        text=str(obj.get("text") or ""),
        id=obj.get("id") if isinstance(obj.get("id"), int) else None,
        log_prob=float(log_prob) if isinstance(log_prob, (int, float)) else None,
        special=bool(obj.get("special_token", obj.get("special", False))),
    )


def _error_text(obj: dict[str, Any]) -> str | None:
    """The ``error`` of an LMI/TGI/OpenAI error body, if this object is one."""
    error = obj.get("error")
    if isinstance(error, dict):  # OpenAI: {"error": {"message": ..., "type": ...}}
        return str(error.get("message") or error)
    if error is not None:
        return str(error)
    return None


def parse_record(obj: Any) -> StreamChunk | None:
    """Parse one decoded JSON stream record of any supported format."""
    if not isinstance(obj, dict):
        return None
    if "choices" in obj:  # OpenAI chat.completion.chunk / text_completion chunk
        choices = obj.get("choices") or [{}]
        choice = choices[0] or {}
        delta = choice.get("delta")
        text = (delta or {}).get("content") if delta is not None else choice.get("text")
        token = Token(text=text) if text else None
        error = _error_text(obj)
        finish = choice.get("finish_reason") or ("error" if error else None)
        return StreamChunk(token=token, finish_reason=finish, error=error, raw=obj)
    if "outputs" in obj and isinstance(obj["outputs"], list):  # legacy enable_streaming lines
        return StreamChunk(token=Token(text="".join(map(str, obj["outputs"]))), raw=obj)
    details = obj.get("details") if isinstance(obj.get("details"), dict) else None
    error = _error_text(obj)
    finish = (details or {}).get("finish_reason")
    token = _token(obj["token"]) if isinstance(obj.get("token"), dict) else None
    if token is not None and token.id == -1 and not token.text and finish == "error":
        token = None  # LMI's placeholder token on a mid-stream error line
    generated = obj.get("generated_text")
    return StreamChunk(
        token=token,
        generated_text=str(generated) if generated is not None else None,
        finish_reason=finish if finish is not None else ("error" if error else None),
        details=details,
        error=error or ("generation failed" if finish == "error" else None),
        raw=obj,
    )


def parse_line(line: bytes | str) -> StreamChunk | None:
    """Parse one JSON-lines or SSE line; None for blank lines, SSE comments/fields and ``[DONE]``."""
    text = line.decode("utf-8") if isinstance(line, (bytes, bytearray)) else line
    text = text.strip()
    if not text or text.startswith(":"):
        return None
    if text.startswith("data:"):
        text = text[len("data:") :].strip()
        if text == "[DONE]" or not text:
            return None
    elif not text.startswith("{"):
        # Other SSE fields (event:, id:, retry:) and anything before a JSON record.
        start = text.find("{")
        if start < 0:
            return None
        text = text[start:]
    return parse_record(json.loads(text))


def parse_response(body: bytes | str | dict | list) -> GenerationResult:
    """Parse a non-streaming body: LMI/TGI JSON (object or one-element array) or OpenAI.

    Raises:
        ModelError: the body is an error (LMI 0.28's 200 ``{"code": 424, "error": ...}`` included).
    """
    obj: Any = body
    if isinstance(body, (bytes, bytearray, str)):
        text = body.decode("utf-8") if isinstance(body, (bytes, bytearray)) else body
        try:
            obj = json.loads(text)
        except json.JSONDecodeError:
            # A JSON-lines body (stream=true answered by invoke_endpoint): fold its records.
            return collect(filter(None, map(parse_line, text.splitlines())))
    if isinstance(obj, list):
        if not obj:
            raise ModelError("empty response array", body=obj)
        obj = obj[0]
    if not isinstance(obj, dict):
        raise ModelError(f"unexpected response {obj!r}", body=obj)
    error = _error_text(obj)
    if error is not None and obj.get("generated_text") is None:
        code = obj.get("code")
        raise ModelError(error, int(code) if isinstance(code, int) else None, body=obj)
    if "choices" in obj:
        choice = (obj.get("choices") or [{}])[0]
        message = choice.get("message")
        text = (message or {}).get("content") if message is not None else choice.get("text")
        usage = obj.get("usage") or {}
        return GenerationResult(
            generated_text=text or "",
            finish_reason=choice.get("finish_reason"),
            generated_tokens=usage.get("completion_tokens"),
            prompt_tokens=usage.get("prompt_tokens"),
            raw=obj,
        )
    details = obj.get("details") if isinstance(obj.get("details"), dict) else {}
    tokens = [_token(t) for t in details.get("tokens") or [] if isinstance(t, dict)]
    return GenerationResult(
        generated_text=str(obj.get("generated_text") or ""),
        finish_reason=details.get("finish_reason"),
        generated_tokens=details.get("generated_tokens"),
        tokens=tokens,
        details=details or None,
        raw=obj,
    )


def collect(chunks: Iterable[StreamChunk]) -> GenerationResult:
    """Fold stream chunks into one result; the server's final ``generated_text`` wins if present."""
    tokens: list[Token] = []
    final: StreamChunk | None = None
    finish: str | None = None
    usage: dict[str, Any] = {}
    for chunk in chunks:
        if chunk.token is not None and (chunk.token.text or not chunk.token.special):
            tokens.append(chunk.token)  # (LMI's id -1 placeholder on a text-less final line is not a token)
        if chunk.raw is not None and isinstance(chunk.raw.get("usage"), dict):
            usage = chunk.raw["usage"]  # OpenAI stream_options.include_usage chunk
        if chunk.finish_reason is not None:
            finish = chunk.finish_reason
        if chunk.generated_text is not None or chunk.details is not None:
            final = chunk
        if chunk.error is not None and chunk.generated_text is None and not tokens:
            raise ModelError(chunk.error, body=chunk.raw)
    streamed = "".join(t.text for t in tokens)
    details = final.details if final is not None else None
    return GenerationResult(
        generated_text=final.generated_text if final and final.generated_text is not None else streamed,
        finish_reason=finish,
        generated_tokens=(details or {}).get("generated_tokens", usage.get("completion_tokens", len(tokens) or None)),
        tokens=tokens,
        prompt_tokens=usage.get("prompt_tokens"),
        details=details,
    )

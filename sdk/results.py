"""Typed results of the SDK: what parsing an LMI / TGI / OpenAI response produces.

``Token`` is one streamed piece of text, ``StreamChunk`` one parsed stream record (a token and/or the
final text and finish reason), ``GenerationResult`` a whole answer. ``ModelError`` is a container
error, whether it arrived as an HTTP status, a SageMaker ``ModelError``, or a 200 with an error body.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Token:
    """One generated token (or several, when the server merged them) as the wire reports it."""

    text: str
    id: int | None = None
    log_prob: float | None = None
    special: bool = False


@dataclass(frozen=True, slots=True)
class StreamChunk:
    """One parsed stream record. The last record of an LMI stream carries ``generated_text``."""

    token: Token | None = None
    generated_text: str | None = None
    finish_reason: str | None = None
    details: dict[str, Any] | None = None
    error: str | None = None
    raw: dict[str, Any] | None = None

    @property
    def is_final(self) -> bool:
        """True for the record that ends an answer (LMI final line, or an OpenAI finish_reason)."""
        return self.generated_text is not None or self.finish_reason is not None


@dataclass(slots=True)
class GenerationResult:
    """A whole answer: the text plus whatever the server reported about it."""

    generated_text: str
    finish_reason: str | None = None
    generated_tokens: int | None = None
    tokens: list[Token] = field(default_factory=list)
    prompt_tokens: int | None = None
    details: dict[str, Any] | None = None
    raw: Any = None

    @property
    def num_tokens(self) -> int | None:
        """Generated token count: the server's figure, else the number of streamed tokens."""
        if self.generated_tokens is not None:
            return self.generated_tokens
        return len(self.tokens) or None


class ModelError(Exception):
    """The container answered with an error (HTTP 4xx/5xx, SageMaker ModelError, or an error body)."""

    def __init__(self, message: str, status_code: int | None = None, body: Any = None) -> None:
        super().__init__(f"{status_code}: {message}" if status_code is not None else message)
        self.message = message
        self.status_code = status_code
        self.body = body

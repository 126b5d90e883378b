"""A small client for LMI-compatible containers, over SageMaker or over plain HTTP.

``StreamingClient.generate()`` returns a ``GenerationResult``; ``stream()`` returns a ``TokenStream``
that yields ``Token`` objects as they arrive and keeps the final result. Two transports carry the
bytes: ``SageMakerTransport`` (boto3 ``sagemaker-runtime``: ``invoke_endpoint`` and
``invoke_endpoint_with_response_stream``) and ``HTTPTransport`` (``requests`` to a local container).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any, Literal, Protocol

from sdk.iterators import LineIterator
from sdk.parsing import collect, parse_line, parse_response
from sdk.results import GenerationResult, ModelError, StreamChunk, Token

Route = Literal["invocations", "chat"]

__all__ = [
    "GenerationResult", "HTTPTransport", "ModelError", "SageMakerTransport", "StreamingClient",
    "Token", "TokenStream",
]


class Transport(Protocol):
    """Moves one request body to the model and the answer back."""

    def invoke(self, body: bytes, route: Route, custom_attributes: str | None) -> tuple[bytes, str]:
        """Return (response body, content type); raise ModelError for container errors."""

    def invoke_stream(self, body: bytes, route: Route, custom_attributes: str | None) -> Iterable[Any]:
        """Return an iterable of byte chunks or event-stream events (LineIterator accepts both)."""


class HTTPTransport:
    """Plain HTTP to a container: ``/invocations`` and ``/v1/chat/completions``."""

    PATHS: dict[str, str] = {"invocations": "/invocations", "chat": "/v1/chat/completions"}

    def __init__(self, base_url: str, timeout: float = 300.0) -> None:
        import requests  # deferred: keeps `import sdk` light

        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self._session = requests.Session()

    def _post(self, body: bytes, route: Route, custom_attributes: str | None, stream: bool):
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if custom_attributes:
            headers["X-Amzn-SageMaker-Custom-Attributes"] = custom_attributes
        resp = self._session.post(
            self.base_url + self.PATHS[route], data=body, headers=headers, stream=stream, timeout=self.timeout
        )
        if resp.status_code >= 400:
            text = resp.text
            resp.close()
            raise ModelError(_error_message(text), resp.status_code, body=text)
        return resp

    def invoke(self, body: bytes, route: Route = "invocations", custom_attributes: str | None = None):
        resp = self._post(body, route, custom_attributes, stream=False)
        return resp.content, resp.headers.get("Content-Type", "")

    def invoke_stream(self, body: bytes, route: Route = "invocations", custom_attributes: str | None = None):
        resp = self._post(body, route, custom_attributes, stream=True)

        def chunks() -> Iterator[bytes]:
            try:
                yield from resp.iter_content(chunk_size=None)
            finally:
                resp.close()

        return chunks()

    def close(self) -> None:
        """Close pooled connections."""
        self._session.close()


class SageMakerTransport:
    """boto3 ``sagemaker-runtime``; the chat route also goes to ``/invocations`` (LMI accepts messages)."""

    def __init__(self, endpoint_name: str, client: Any = None, **client_kwargs: Any) -> None:
        if client is None:
            import boto3

            client = boto3.client("sagemaker-runtime", **client_kwargs)
        self.endpoint_name = endpoint_name
        self.client = client

    def _kwargs(self, body: bytes, custom_attributes: str | None) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "EndpointName": self.endpoint_name, "Body": body, "ContentType": "application/json",
        }
        if custom_attributes:
            kwargs["CustomAttributes"] = custom_attributes
        return kwargs

    def invoke(self, body: bytes, route: Route = "invocations", custom_attributes: str | None = None):
        try:
            resp = self.client.invoke_endpoint(Accept="application/json", **self._kwargs(body, custom_attributes))
        except Exception as exc:
            raise _model_error(exc) from exc
        return resp["Body"].read(), resp.get("ContentType", "")

    def invoke_stream(self, body: bytes, route: Route = "invocations", custom_attributes: str | None = None):
        try:
            resp = self.client.invoke_endpoint_with_response_stream(**self._kwargs(body, custom_attributes))
        except Exception as exc:
            raise _model_error(exc) from exc
        return resp["Body"]


def _error_message(text: str) -> str:
    try:
        obj = json.loads(text)
    except (json.JSONDecodeError, TypeError):
        return text
    if isinstance(obj, dict):
        for key in ("error", "message", "Message"):
            if obj.get(key):
                return str(obj[key])
    return text


def _model_error(exc: Exception) -> Exception:
    """botocore ``ModelError`` -> our ModelError (original status and message); others unchanged."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict) or response.get("Error", {}).get("Code") != "ModelError":
        return exc
    original = response.get("OriginalMessage") or response["Error"].get("Message", "")
    status = response.get("OriginalStatusCode")
    return ModelError(_error_message(original), int(status) if status is not None else None, body=original)


class TokenStream:
    """Iterator of ``Token`` over one streamed answer; ``.result`` holds the folded answer afterwards."""

    def __init__(self, lines: Iterable[bytes]) -> None:
        self._lines = iter(lines)
        self.chunks: list[StreamChunk] = []
        self._done = False

    def __iter__(self) -> TokenStream:
        return self

    def __next__(self) -> Token:
        for line in self._lines:
            chunk = parse_line(line)
            if chunk is None:
                continue
            self.chunks.append(chunk)
            if chunk.error is not None:
                self._done = True
                partial = "".join(c.token.text for c in self.chunks if c.token)
                raise ModelError(chunk.error, body={"partial_text": partial, "record": chunk.raw})
            if chunk.token is not None and (chunk.token.text or not chunk.token.special):
                return chunk.token
        self._done = True
        raise StopIteration

    @property
    def result(self) -> GenerationResult:
        """The whole answer; drains the stream first if the caller stopped early."""
        if not self._done:
            for _ in self:
                pass
        return collect(self.chunks)

    @property
    def text(self) -> str:
        """Shortcut for ``result.generated_text``."""
        return self.result.generated_text


class StreamingClient:
    """Generate text from an LMI-compatible model, whole or token by token."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport

    @classmethod
    def from_url(cls, base_url: str, timeout: float = 300.0) -> StreamingClient:
        """Client for a container reachable over HTTP, e.g. ``http://127.0.0.1:8080``."""
        return cls(HTTPTransport(base_url, timeout))

    @classmethod
    def from_endpoint(cls, endpoint_name: str, client: Any = None, **client_kwargs: Any) -> StreamingClient:
        """Client for a SageMaker endpoint (``client_kwargs`` go to ``boto3.client``, e.g. endpoint_url)."""
        return cls(SageMakerTransport(endpoint_name, client, **client_kwargs))

    @staticmethod
    def _body(inputs: str, parameters: dict[str, Any] | None, stream: bool, extra: dict[str, Any]) -> bytes:
        """The /invocations body. ``details`` defaults to true: LMI says the finish reason (and token
        count) only in ``details``, so without it ``result.finish_reason`` would be None; pass
        ``details=False`` for the bare ``generated_text`` body."""
        payload: dict[str, Any] = {"inputs": inputs, "parameters": {"details": True, **(parameters or {}), **extra}}
        if stream:
            payload["stream"] = True
        return json.dumps(payload).encode()

    def generate(
        self, inputs: str, parameters: dict[str, Any] | None = None, *,
        custom_attributes: str | None = None, adapter: str | None = None, **extra: Any,
    ) -> GenerationResult:
        """One request, whole answer. ``extra`` keyword arguments are merged into ``parameters``;
        ``adapter`` runs it on that LoRA adapter (the ``adapter=<name>`` custom attribute)."""
        body, _ = self.transport.invoke(self._body(inputs, parameters, False, extra), "invocations",
                                        with_adapter(custom_attributes, adapter))
        return parse_response(body)

    def stream(
        self, inputs: str, parameters: dict[str, Any] | None = None, *,
        custom_attributes: str | None = None, adapter: str | None = None, **extra: Any,
    ) -> TokenStream:
        """One request with ``"stream": true``; iterate the returned TokenStream for tokens."""
        events = self.transport.invoke_stream(
            self._body(inputs, parameters, True, extra), "invocations", with_adapter(custom_attributes, adapter)
        )
        return TokenStream(LineIterator(events))

    def chat(self, messages: list[dict[str, str]], *, adapter: str | None = None, **params: Any) -> GenerationResult:
        """OpenAI-style chat completion (``/v1/chat/completions`` over HTTP), on ``adapter`` if given."""
        body = json.dumps({"messages": messages, **params}).encode()
        payload, _ = self.transport.invoke(body, "chat", with_adapter(None, adapter))
        return parse_response(payload)

    def stream_chat(self, messages: list[dict[str, str]], *, adapter: str | None = None, **params: Any) -> TokenStream:
        """Streamed chat completion: chunks as JSON lines or SSE, both parsed."""
        body = json.dumps({"messages": messages, "stream": True, **params}).encode()
        return TokenStream(LineIterator(self.transport.invoke_stream(body, "chat", with_adapter(None, adapter))))


def with_adapter(custom_attributes: str | None, adapter: str | None) -> str | None:
    """``custom_attributes`` plus ``adapter=<name>``: how SageMaker requests pick a LoRA adapter
    (``InvokeEndpoint``'s ``CustomAttributes``; the only way that reaches the container there)."""
    if not adapter:
        return custom_attributes
    if any(c in adapter for c in ";=\"") or adapter != adapter.strip():
        raise ValueError(f"adapter name {adapter!r} cannot be sent as a custom attribute (no ; = \" or spaces)")
    return f"{custom_attributes};adapter={adapter}" if custom_attributes else f"adapter={adapter}"

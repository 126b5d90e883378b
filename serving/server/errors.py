"""The error bodies of the edge, in each API's dialect, written once for every route.

Why: an error leaves the server from several places (a route's 4xx, the poller thread's 503 for a
full queue, a plain answer whose 200 was already sent, a stream that fails half way) and must look
the same from each. LMI answers `{"error", "code"}`; OpenAI (and vLLM, on `/v1/*`, `/generate`
and its tokenizer routes) `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import re

from serving.engine.scheduler import CONTEXT_OVERFLOW

OVERFLOW_CODE = "context_length_exceeded"
# "max_tokens must be ...", "messages[0].content: only text ...": the field a message starts with.
_PARAM = re.compile(r"^([a-z_]+(?:\[\d+\])*(?:\.[a-z_]+(?:\[\d+\])*)*)(?::| must | is | holds )")


def lmi_error(status: int, message: str) -> dict:
    """LMI's error object: `{"error": message, "code": status}`."""
    return {"error": message, "code": status}


def openai_error(status: int, message: str) -> dict:
    """OpenAI's error object (`{"error": {"message", "type", "param", "code"}}`), as vLLM answers:
    `type` is `invalid_request_error` for 4xx and `server_error` for 5xx, `param` the request field
    the message names (else null), `code` the HTTP status, or OpenAI's `context_length_exceeded`
    for a request longer than the context (LangChain's ContextOverflowError and LiteLLM's
    ContextWindowExceededError are picked by that code and the message's wording)."""
    match = _PARAM.match(message)
    param = match.group(1) if match else None
    kind = "invalid_request_error" if status < 500 else "server_error"
    if status == 400 and message.startswith(CONTEXT_OVERFLOW):  # OpenAI's code for it: clients map it
        # openai>=3 puts only the message in str(error), which is what LangChain searches for the code
        return {"error": {"message": f"{message} ({OVERFLOW_CODE})", "type": kind, "param": "messages",
                          "code": OVERFLOW_CODE}}
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def stream_error(message: str) -> dict:
    """OpenAI's error object for a stream that fails after it started (its status is long sent)."""
    return {"message": message, "type": "server_error", "param": None, "code": 500}


def is_openai_path(path: str) -> bool:
    """Routes answered with OpenAI's error object: /v1/*, vLLM's legacy /generate and its tokenizer routes."""
    return path.startswith("/v1/") or path in ("/generate", "/tokenize", "/detokenize")


def error_for_path(path: str, status: int, message: str) -> dict:
    """The error object of a request to `path`, in its API's dialect."""
    return openai_error(status, message) if is_openai_path(path) else lmi_error(status, message)

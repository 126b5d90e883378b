"""One access-log line per generation request: id, route, status, tokens, duration (and the error).

gunicorn's own access log (`SERVING_ACCESS_LOG=true`) knows neither the request id nor the tokens,
and it writes a streamed or failed request's line before its outcome is known. `RequestRecord` is
created by the route as the request arrives, given its token count (and error) by the request runner
when the engine work ends, and written once when the response is finished (for a stream: when its
last byte is sent or its client left). Failed requests are logged at WARNING, so a request that
timed out is in the log with its id even at LOG_LEVEL=WARNING.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

logger = logging.getLogger("serving.server.access")


@dataclass
class RequestRecord:
    """What the access line of one request says; filled while it runs, written by `done`."""

    request_id: str
    route: str
    start: float = field(default_factory=time.monotonic)
    tokens: int = 0
    error: str | None = None
    written: bool = False

    def count(self, tokens: int, error: str | None) -> None:
        """The runner's part: tokens generated (all prompts and samples) and the first error, if any."""
        self.tokens = tokens
        self.error = self.error or error

    def done(self, status: int) -> None:
        """Write the line (once): `request <id> <route> <status> tokens=<n> <s>s[ error=<message>]`."""
        if self.written:
            return
        self.written = True
        failed = status >= 500 or (status < 400 and self.error is not None)  # a 200 stream that failed
        line = (f"request {self.request_id} {self.route} {status} tokens={self.tokens} "
                f"{time.monotonic() - self.start:.3f}s")
        if self.error is not None:
            line += f" error={self.error!r}"
        logger.log(logging.WARNING if failed else logging.INFO, "%s", line)

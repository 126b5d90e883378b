"""Which wire formats stream: the one fact about a format that a parsed request needs.

Why a module of its own: `GenerateRequest.stream` (protocol.py) asks whether its format streams, and
the formatters (formatters.py, which read a `GenerateRequest`) file each format as its class is
defined; with the answer kept here, the request and its formatters point one way.
"""

from __future__ import annotations

_STREAMS: dict[str, bool] = {}  # format name -> streams (start / chunk / end) or answers one body


def register(name: str, streams: bool) -> None:
    """File a wire format (called as each formatter class is defined)."""
    assert name not in _STREAMS, f"two wire formats named {name!r}"
    _STREAMS[name] = streams


def streams(name: str) -> bool:
    """Whether the wire format `name` streams its answer."""
    found = _STREAMS.get(name)
    if found is None:
        raise AssertionError(f"no wire format {name!r} (known: {', '.join(sorted(_STREAMS))})")
    return found

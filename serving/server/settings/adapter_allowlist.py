"""Which places a client may make the server load adapter weights from: the operator's allow-list.

The management API (`POST|GET /models/{m}/adapters`, `GET|DELETE .../adapters/{name}`) is off
unless the operator sets `option.runtime_adapter_sources` (env `OPTION_RUNTIME_ADAPTER_SOURCES`):
a comma-separated list of absolute local directories and/or `s3://bucket[/prefix]`. Off, every
management route answers 403 naming the option; on, a `src` is loaded only when it lies under one
of them (`check_allowed`), else 403 naming the option too. A local `src` is compared after
resolving symlinks and `..`; an S3 `src` segment by segment (`s3://b/loras` allows
`s3://b/loras/x`, not `s3://b/loras-x`), and one with an empty, `.` or `..` segment is refused
outright. Adapters found at start under `<model dir>/adapters/` are the operator's own and are
not checked here.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from serving.server.settings.download_paths import S3_BUCKET

OPTION = "option.runtime_adapter_sources"
OPTION_ENV = "OPTION_RUNTIME_ADAPTER_SOURCES"


class SourceNotAllowed(PermissionError):
    """The management API is off, or a `src` is outside the operator's allow-list (HTTP 403)."""


def _s3_parts(uri: str) -> list[str]:
    """['bucket', 'seg', ...] of `s3://bucket/seg/...`; ValueError when a segment is empty, '.' or '..'."""
    rest = uri[len("s3://"):].rstrip("/")
    parts = rest.split("/")
    if not S3_BUCKET.fullmatch(parts[0]):
        raise ValueError(f"{uri!r}: {parts[0]!r} is not an S3 bucket name")
    bad = [p for p in parts[1:] if p in ("", ".", "..")]
    if bad:
        raise ValueError(f"{uri!r} has an empty, '.' or '..' segment")
    return parts


def parse_allowlist(text: str) -> tuple[str, ...]:
    """The option's value -> its entries (absolute directories, `s3://bucket[/prefix]`); ValueError
    on anything else. Empty: the management API stays off."""
    entries: list[str] = []
    for raw in text.split(","):
        entry = raw.strip()
        if not entry:
            continue
        if entry.startswith("s3://"):
            entries.append("s3://" + "/".join(_s3_parts(entry)))
        elif "://" in entry or not os.path.isabs(entry):
            raise ValueError(f"{entry!r} is neither an absolute directory nor an s3://bucket/prefix")
        elif ".." in entry.split("/"):
            raise ValueError(f"{entry!r} has a '..' segment")
        else:
            entries.append(os.path.normpath(entry))
    return tuple(entries)


def management_on(allowlist: Sequence[str]) -> None:
    """SourceNotAllowed unless the operator turned the management API on."""
    if not allowlist:
        raise SourceNotAllowed(f"the adapter management API is off: the operator enables it by setting {OPTION_ENV} "
                               f"({OPTION}) to the local directories and/or s3://bucket/prefix it may load "
                               "adapters from")


def check_allowed(src: str, allowlist: Sequence[str]) -> None:
    """SourceNotAllowed (naming the option) unless `src` lies under an entry of `allowlist`."""
    management_on(allowlist)
    refused = SourceNotAllowed(f"adapter source {src!r} is not under any of the places {OPTION_ENV} ({OPTION}) "
                               "allows")
    if src.startswith("s3://"):
        try:
            parts = _s3_parts(src)
        except ValueError as exc:
            raise SourceNotAllowed(f"adapter source {exc}: refused ({OPTION_ENV} allows only plain prefixes)"
                                   ) from None
        for entry in allowlist:
            if entry.startswith("s3://"):
                allowed = entry[len("s3://"):].split("/")
                if parts[:len(allowed)] == allowed:
                    return
        raise refused
    if "://" in src or not src.strip():
        raise refused
    real = os.path.realpath(os.path.expanduser(src))
    for entry in allowlist:
        if entry.startswith("s3://"):
            continue
        root = os.path.realpath(entry)
        if real == root or real.startswith(root.rstrip(os.sep) + os.sep):
            return
    raise refused

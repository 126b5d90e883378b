"""Where a downloaded file may land: inside its target directory, and nowhere else.

Every downloader turns a remote name (an S3 bucket and prefix, an S3 key below the prefix, a
file of a hub snapshot) into a local path here, before anything is written. A name is refused,
with an `UnsafePathError` naming it, when it is empty or absolute, holds an empty, `.` or `..`
segment or a NUL, or resolves (through a symlink already in the tree) outside the target
directory. With those rules two distinct keys never normalise to one file; a key that is both a
file and the directory of another key (`a/b` and `a/b/c`) is refused too (`check_names`).
`check_tree` checks a finished download: no entry under it resolves outside its boundary.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path, PurePosixPath

S3_BUCKET = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")  # S3's rules, loosened for legacy names; never '..'


class UnsafePathError(ValueError):
    """A remote name would be written outside its target directory; the message names it."""


def relative_name(name: str, what: str) -> PurePosixPath:
    """`name` ('/'-separated) as a relative path that stays below its root, else UnsafePathError.

    `what` says what the name is ("S3 key", "S3 prefix", ...) for the message."""
    if not isinstance(name, str) or not name:
        raise UnsafePathError(f"{what} {name!r} is empty")
    if "\0" in name:
        raise UnsafePathError(f"{what} {name!r} holds a NUL character")
    parts = name.split("/")
    bad = [p for p in parts if p in ("", ".", "..")]
    if name.startswith("/") or bad:
        raise UnsafePathError(f"{what} {name!r} is not a plain relative path (absolute, or with an empty, '.' or "
                              "'..' segment): refused, it could be written outside the download directory")
    return PurePosixPath(*parts)


def _inside(path: Path, root: Path) -> bool:
    real, real_root = os.path.realpath(path), os.path.realpath(root)
    return real == real_root or real.startswith(real_root.rstrip(os.sep) + os.sep)


def destination(root: Path, name: str, what: str) -> Path:
    """`root / name`, checked: a plain relative name whose resolved path (symlinks followed) is
    below `root`. UnsafePathError otherwise, naming `name` and where it would have gone."""
    target = Path(root) / relative_name(name, what)
    if not _inside(target, root):
        raise UnsafePathError(f"{what} {name!r} resolves to {os.path.realpath(target)}, outside {root} "
                              "(a symlink in the tree): refused")
    return target


def check_names(names: Iterable[str], what: str) -> None:
    """Refuse a set of relative names where one is a file and also the directory of another."""
    files = set(names)
    for name in sorted(files):
        parts = name.split("/")
        for i in range(1, len(parts)):
            parent = "/".join(parts[:i])
            if parent in files:
                raise UnsafePathError(f"{what} {parent!r} is a file and also the directory of {name!r}: "
                                      "refused (they cannot both be written)")


def check_tree(root: Path, boundary: Path, what: str) -> None:
    """Every file, directory and symlink under `root` resolves inside `boundary`, else UnsafePathError."""
    if not _inside(root, boundary):
        raise UnsafePathError(f"{what} {root} resolves to {os.path.realpath(root)}, outside {boundary}: refused")
    for dirpath, dirnames, filenames in os.walk(root):
        for entry in (*dirnames, *filenames):
            path = Path(dirpath) / entry
            if not _inside(path, boundary):
                raise UnsafePathError(f"{what} {path.relative_to(root)} resolves to {os.path.realpath(path)}, "
                                      f"outside {boundary}: refused")

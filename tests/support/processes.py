"""Process checks for tests that kill or stop processes: is a pid still running (a zombie is not)."""

from __future__ import annotations


def alive(pid: int) -> bool:
    """The process exists and is not a zombie (an orphan would be re-parented, still alive)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False

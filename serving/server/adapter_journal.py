"""The adapters registered through the management API, kept on disk so that a worker replacing a
dead one registers them again.

gunicorn replaces a worker whose engine died (`serving/server/wsgi.py`, `_watch`). The new worker
loads the model and registers the start-up adapters, but adapters registered over HTTP lived only
in the old worker's memory: /ping said 200 while requests on them got 404. So the registry records
each API registration (name, src) here and drops it on DELETE; `AdapterRegistry.register_startup`
registers them again behind the same 503, and one that fails is a failed start (/ping 500 naming
it), never a healthy server missing an adapter.

The record belongs to one server run: its file name holds the gunicorn master's pid and start time
(the worker's parent), so a new container or a restarted server starts with none, as LMI does.
It lives under `download_dir`, written whole and renamed into place.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path

logger = logging.getLogger("serving.server.adapter_journal")
JOURNAL_DIR = ".open-lmi-adapters"


def _server_run_id() -> str:
    """The gunicorn master (this worker's parent) as `pid-starttime`: the same for every worker of
    one server run, different for the next run even if a pid comes back."""
    pid = os.getppid()
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        start = stat.rsplit(")", 1)[1].split()[19]  # field 22, after the command name in parentheses
    except (OSError, IndexError):
        start = "0"
    return f"{pid}-{start}"


class AdapterJournal:
    """(name, src) of every adapter registered through the API and not deleted, in order."""

    def __init__(self, download_dir: str | Path) -> None:
        self.root = Path(download_dir) / JOURNAL_DIR
        self._lock = threading.Lock()

    @property
    def path(self) -> Path:
        return self.root / f"{_server_run_id()}.json"  # read when used: the worker's parent, after fork

    def entries(self) -> list[tuple[str, str]]:
        """The recorded registrations; an unreadable record is logged and treated as none."""
        path = self.path
        if not path.is_file():
            return []
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            return [(str(e["name"]), str(e["src"])) for e in data]
        except (OSError, ValueError, TypeError, KeyError) as exc:
            logger.error("cannot read the API-registered adapters from %s (%s): none restored", path, exc)
            return []

    def record(self, name: str, src: str) -> None:
        self._write([e for e in self.entries() if e[0] != name] + [(name, src)])

    def forget(self, name: str) -> None:
        self._write([e for e in self.entries() if e[0] != name])

    def _write(self, entries: list[tuple[str, str]]) -> None:
        with self._lock:
            path = self.path
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
                tmp.write_text(json.dumps([{"name": n, "src": s} for n, s in entries]), encoding="utf-8")
                os.replace(tmp, path)
            except OSError as exc:  # the adapter still serves; only a replaced worker would miss it
                logger.error("cannot record the API-registered adapters in %s (%s): a replaced worker will not "
                             "register them again", path, exc)

"""Guided-decoding grammars compiled off the serving paths, within a time, size and memory bound.

It exists because a constraint is client input whose compile cost has no useful bound of its own
(a 28 KB JSON schema can compile for minutes, a 2 MB enum for a quarter of an hour) and whose
compiled form stays in memory: so
- a constraint's text over `max_bytes` is refused before anything is compiled (ValueError -> 400),
  and so is a JSON schema that is not a valid JSON Schema of its draft (serving/engine/schema_validator.py)
  or that plainly admits no value (serving/engine/schema_check.py);
- compiles run in child processes (`python -m serving.engine.grammar_compiler`, niced, at most
  `workers` at once, no cache of their own): the GIL, the engine thread and the other requests'
  threads never wait on one; one that runs past `timeout` seconds is killed (ValueError -> 400,
  its memory goes with it), and so is one whose request is cancelled while it waits (`cancelled`,
  or the probe the caller set in `COMPILE_CANCELLED`: the HTTP edge sets "the client left");
- compiled grammars come back serialized (xgrammar's JSON form) and are kept in one LRU cache
  bounded in bytes (`cache_bytes`, by xgrammar's own size of each); a grammar bigger than a
  quarter of the cache is refused.
`CompiledGrammarCache.compile` is thread-safe.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from contextvars import ContextVar

from serving.engine.schema_check import schema_contradiction
from serving.engine.schema_validator import schema_problem
from serving.sampling_params import GuidedDecodingParams

logger = logging.getLogger("serving.engine.grammar_compiler")
# Set by a caller (serving/server/app.py) around requests it submits: "cancel my compile now?".
COMPILE_CANCELLED: ContextVar[Callable[[], bool] | None] = ContextVar("compile_cancelled", default=None)
_START_TIMEOUT_S = 120.0  # a child's start (it imports xgrammar and torch): not counted in `timeout`
_POLL_S = 0.25  # how often a waiting compile asks whether its request was cancelled


class CompileBusy(RuntimeError):
    """Every compile worker stayed busy for the whole timeout (a 503: try again)."""


def constraint_text(g: GuidedDecodingParams) -> tuple[str, str]:
    """(kind, text) of a constraint as the child compiles it; json_object has no text."""
    if g.json is not None:
        return "json", g.json  # type: ignore[return-value]
    if g.regex is not None:
        return "regex", g.regex
    if g.choice is not None:
        return "grammar", "root ::= " + " | ".join(json.dumps(s) for s in g.choice)  # EBNF string literals
    if g.grammar is not None:
        return "grammar", g.grammar
    return "json_object", ""


class _Child:
    """One compile process and its pipes (length-prefixed JSON messages both ways)."""

    def __init__(self, tokenizer_info_json: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "serving.engine.grammar_compiler"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True)
        self.ready = False
        self.send({"tokenizer_info": tokenizer_info_json})

    def send(self, message: dict) -> None:
        data = json.dumps(message).encode()
        self.proc.stdin.write(struct.pack("<Q", len(data)) + data)  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]

    def receive(self, deadline: float, cancelled: Callable[[], bool] | None) -> dict | None:
        """The child's next message; None past `deadline` or once `cancelled()` (the child is then killed)."""
        fd = self.proc.stdout.fileno()  # type: ignore[union-attr]
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        buf = b""
        need = 8
        while len(buf) < need:
            left = deadline - time.monotonic()
            if left <= 0 or (cancelled is not None and cancelled()):
                self.kill()
                return None
            if not poller.poll(min(left, _POLL_S) * 1000):
                continue
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                raise RuntimeError(f"the grammar compile process exited ({self.proc.wait()})")
            buf += chunk
            if need == 8 and len(buf) >= 8:
                need = 8 + struct.unpack("<Q", buf[:8])[0]
        return json.loads(buf[8:need])

    def kill(self) -> None:
        try:
            self.proc.kill()
        except OSError:
            pass
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            pipe.close()  # type: ignore[union-attr]


class CompiledGrammarCache:
    """Compiles constraints (see the module doc) for one tokenizer; LRU cache bounded in bytes."""

    def __init__(self, tokenizer_info: object, *, timeout: float, max_bytes: int, cache_bytes: int,
                 workers: int = 2, check: Callable[[GuidedDecodingParams, object], None] | None = None) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self._info = tokenizer_info
        self._info_json = tokenizer_info.serialize_json()  # type: ignore[attr-defined]
        self._local = xgr.GrammarCompiler(tokenizer_info, max_threads=1, cache_enabled=False)
        self.timeout = timeout
        self.max_bytes = max_bytes
        self.cache_bytes = cache_bytes
        self._check = check  # raises ValueError for a grammar that must not be used (never cached)
        self._cache: OrderedDict[GuidedDecodingParams, object] = OrderedDict()
        self._cached_bytes = 0
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(workers)
        self._idle: list[_Child] = [_Child(self._info_json)]  # starting now: the first compile waits less

    @property
    def cached_bytes(self) -> int:
        return self._cached_bytes

    def __len__(self) -> int:
        return len(self._cache)

    def compile(self, g: GuidedDecodingParams, cancelled: Callable[[], bool] | None = None) -> object:
        """The compiled grammar of `g` (xgrammar's CompiledGrammar). ValueError: invalid, too big,
        or not compiled within the timeout; CompileBusy: no worker was free in time."""
        with self._lock:
            hit = self._cache.get(g)
            if hit is not None:
                self._cache.move_to_end(g)
                return hit
        kind, text = constraint_text(g)
        size = len(text.encode())
        if size > self.max_bytes:
            raise ValueError(f"the guided decoding {g.kind} is {size} bytes; the limit is {self.max_bytes} "
                             "(option.guided_decoding_max_bytes)")
        if kind == "json":
            try:
                schema = json.loads(text)
            except ValueError as exc:
                raise ValueError(f"invalid guided decoding json: {exc}") from None
            problem = schema_problem(schema)
            if problem is not None:
                raise ValueError(f"the guided decoding json is not a valid JSON Schema: {problem}")
            why = schema_contradiction(schema)
            if why is not None:
                raise ValueError(f"the guided decoding json admits no value ({why})")
        if kind == "json_object":
            compiled = self._local.compile_builtin_json_grammar()
        else:
            compiled = self._compile_in_child(g.kind, kind, text, cancelled or COMPILE_CANCELLED.get())
        if self._check is not None:
            self._check(g, compiled)
        self._keep(g, compiled)
        return compiled

    def _compile_in_child(self, label: str, kind: str, text: str, cancelled: Callable[[], bool] | None) -> object:
        if not self._slots.acquire(timeout=self.timeout):
            raise CompileBusy(f"every grammar compile worker stayed busy for {self.timeout:g} s; send it again")
        child = None
        try:
            child = self._take_child()
            if not child.ready:  # its start (imports) is not the grammar's time
                if child.receive(time.monotonic() + _START_TIMEOUT_S, cancelled) is None:
                    child = None
                    raise self._stopped(label, cancelled, starting=True)
                child.ready = True
            child.send({"kind": kind, "text": text, "max_size": self.cache_bytes // 4})
            reply = child.receive(time.monotonic() + self.timeout, cancelled)
            if reply is None:
                child = None  # killed, and its memory with it
                raise self._stopped(label, cancelled, starting=False)
            if "error" in reply:
                raise ValueError(f"invalid guided decoding {label}: {reply['error']}")
            if "too_big" in reply:  # never brought into this process
                raise self._too_big(label, reply["too_big"])
            return self._xgr.CompiledGrammar.deserialize_json(reply["grammar"], self._info)
        finally:
            if child is not None:
                with self._lock:
                    self._idle.append(child)
            self._slots.release()

    def _stopped(self, label: str, cancelled: Callable[[], bool] | None, starting: bool) -> Exception:
        """The error for a compile whose process was killed: cancelled, not started, or too slow."""
        if cancelled is not None and cancelled():
            logger.info("a guided decoding %s compile was cancelled (its client left)", label)
            return ValueError("the request was cancelled while its grammar compiled")
        if starting:
            return CompileBusy("the grammar compile process did not start in time")
        return ValueError(f"the guided decoding {label} did not compile within {self.timeout:g} s "
                          "(option.guided_decoding_compile_timeout): simplify it")

    def _too_big(self, label: str, size: int) -> ValueError:
        return ValueError(f"the guided decoding {label} compiles to {size} bytes, over the limit of "
                          f"{self.cache_bytes // 4}: simplify it")

    def _take_child(self) -> _Child:
        with self._lock:
            while self._idle:
                child = self._idle.pop()
                if child.proc.poll() is None:
                    return child
                child.kill()
        return _Child(self._info_json)

    def _keep(self, g: GuidedDecodingParams, compiled: object) -> None:
        size = int(compiled.memory_size_bytes)  # type: ignore[attr-defined]
        if size > self.cache_bytes // 4:
            raise self._too_big(g.kind, size)
        with self._lock:
            if g in self._cache:
                return
            self._cache[g] = compiled
            self._cached_bytes += size
            while self._cached_bytes > self.cache_bytes:
                _, old = self._cache.popitem(last=False)
                self._cached_bytes -= int(old.memory_size_bytes)  # type: ignore[attr-defined]

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for child in idle:
            child.kill()


def _child_main() -> None:
    """The compile process: reads the tokenizer info, then compiles one constraint per message."""
    os.nice(10)  # behind the engine and the HTTP threads for the CPU
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when this ends
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer

    def receive() -> dict | None:
        head = stdin.read(8)
        if len(head) < 8:
            return None
        return json.loads(stdin.read(struct.unpack("<Q", head)[0]))

    def send(message: dict) -> None:
        data = json.dumps(message).encode()
        stdout.write(struct.pack("<Q", len(data)) + data)
        stdout.flush()

    import xgrammar as xgr

    first = receive()
    if first is None:
        return
    info = xgr.TokenizerInfo.deserialize_json(first["tokenizer_info"])
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    send({"ready": True})
    while (message := receive()) is not None:
        try:
            kind, text = message["kind"], message["text"]
            if kind == "json":
                json.loads(text)
                compiled = compiler.compile_json_schema(text, any_whitespace=False)
            elif kind == "regex":
                compiled = compiler.compile_regex(text)
            else:
                compiled = compiler.compile_grammar(text)
            size = int(compiled.memory_size_bytes)
            send({"too_big": size} if size > message["max_size"] else {"grammar": compiled.serialize_json()})
        except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError variants
            send({"error": str(exc)})


if __name__ == "__main__":
    _child_main()

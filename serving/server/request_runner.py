"""Runs one parsed HTTP request on the engine loop: tokenize, admit, collect deltas, format.

In: a `GenerateRequest` (serving/server/protocol.py; each API in serving/server/api/ parses its own).
Out: either whole response bytes, or an iterator of byte records for a stream. It owns admission
(the job queue bound -> 503), the per-request deadline (`predict_timeout`), the SIGTERM drain
deadline (`begin_drain`: new work 503, what still runs then ends with an error record), aborting
on client disconnect (a failed write closes the generator; while waiting, the `gone` probe is
polled; either way the engine stream is closed, which frees its KV blocks), and the latency metrics.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from serving.server.settings.serving_config import ServingConfig
from serving.engine.client import EngineClient
from serving.engine.request_stream import EngineState, RequestStream
from serving.engine.schema_validator import OUTPUT_INVALID, output_problem
from serving.lora_request import UnknownAdapterError
from serving.server.access_log import RequestRecord
from serving.server.errors import lmi_error
from serving.server.formatters import Formatter, Result
from serving.server.metrics import Metrics
from serving.outputs import StreamDelta
from serving.server.protocol import GenerateRequest

logger = logging.getLogger("serving.server.request_runner")
_POLL_S = 0.5  # how often a waiting handler re-checks engine health, the drain and its client
DRAINING = "the server is shutting down"  # the error of requests refused or cut by the SIGTERM drain
CLIENT_CLOSED = 499  # status recorded for a request whose client left before its answer (nginx's code)
_COMPLETE = ("eos_token", "stop_sequence")  # a guided sample that ended so has a whole output to validate


class HTTPError(Exception):
    """An error answered before any response byte: status + message (LMI body {"error","code"})."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message

    def body(self) -> bytes:
        return json.dumps(lmi_error(self.status, self.message)).encode()


class ServerDraining(RuntimeError):
    """The SIGTERM drain deadline passed while this request still ran (503: retry elsewhere)."""


class ClientGone(Exception):
    """The client closed its connection while its request was waiting for the engine."""


def _status_of(error: str) -> int:
    """The HTTP status of a request that failed with `error` before its answer started."""
    if error.startswith("prediction timed out"):
        return 504
    if error.startswith(OUTPUT_INVALID):  # the schema asked for what guided decoding could not enforce
        return 400
    return 503 if error.startswith(DRAINING) else 500


@dataclass
class _Job:
    """One prompt submitted to the engine and what came back so far."""

    request_id: str
    stream: RequestStream
    result: Result
    first_token_at: float | None = None
    probe_at: float = 0.0  # when to next ask whether the client is still there
    schema: str | None = None  # the JSON schema (text) its outputs were guided by: validated as each ends


class RequestRunner:
    """Executes GenerateRequests against the engine client (`serving/engine/client.py`)."""

    def __init__(self, engine: EngineClient, config: ServingConfig, metrics: Metrics | None = None) -> None:
        self.engine = engine
        self.config = config
        self.metrics = metrics
        self._lock = threading.Lock()
        self._inflight = 0
        self._drain_deadline: float | None = None

    @property
    def inflight(self) -> int:
        return self._inflight

    def begin_drain(self, deadline: float) -> None:
        """SIGTERM: answer new work 503 and end whatever still runs at `deadline` (time.monotonic())
        with an error record, so no stream is cut mid-token when the process exits.

        Safe from a signal handler: it only stores the deadline, which waiting handlers poll.
        """
        self._drain_deadline = deadline

    # ---- tokenization ----------------------------------------------------------------------------
    @property
    def tokenizer(self):  # noqa: ANN201 - HF tokenizer
        return self.engine.tokenizer

    def decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def special_ids(self) -> frozenset[int]:
        return frozenset(getattr(self.tokenizer, "all_special_ids", ()) or ())

    def prompts(self, req: GenerateRequest) -> list[tuple[str, list[int]]]:
        """(prompt text, prompt ids) per input; chat is rendered with the template. ValueError -> 400.

        A batch larger than the whole job queue is refused first, before any tokenizing: it could
        never be admitted, so it is a 413 rather than the retryable 503 of a momentarily full queue.
        """
        count = len(req.prompts) + len(req.prompt_token_ids) + (1 if req.messages else 0)
        if count > self.config.job_queue_size:
            field = "inputs" if req.route == "invocations" else "prompt"
            raise HTTPError(413, f"{field} holds {count} prompts, more than this server ever admits at once "
                                 f"(job_queue_size={self.config.job_queue_size}): send at most "
                                 f"{self.config.job_queue_size} per request")
        tok = self.tokenizer
        out: list[tuple[str, list[int]]] = []
        if req.messages:
            try:
                extra = {"tools": [{"type": "function", "function": f} for f in req.tools.functions]} if req.tools else {}
                text = tok.apply_chat_template(list(req.messages), tokenize=False,
                                               add_generation_prompt=req.add_generation_prompt,
                                               chat_template=self.config.chat_template, **extra)
            except Exception as exc:  # noqa: BLE001 - no template / template error
                raise ValueError(f"cannot apply the chat template: {exc}") from None
            out.append((text, list(tok.encode(text, add_special_tokens=False))))
        for p in req.prompts:
            out.append((p, list(tok.encode(p))))
        for ids in req.prompt_token_ids:
            if max(ids, default=0) >= 1 << 32:  # past any tokenizer's ids (u32 in `tokenizers`: it fails)
                raise ValueError(f"prompt token ids must be in the vocabulary, got {max(ids)}")
            out.append((tok.decode(list(ids)), list(ids)))
        if req.truncate is not None:  # LMI / TGI `truncate`: keep the last N prompt tokens (the text stays whole)
            out = [(text, ids[-req.truncate:]) for text, ids in out]
        # Whether each prompt fits (length, vocabulary, KV capacity) is the engine's one check, made
        # as it is submitted (`LLMEngine.validate`): a ValueError there is a 400 for the request.
        return out

    # ---- engine access ---------------------------------------------------------------------------
    def _submit(self, req: GenerateRequest, prompts: list[tuple[str, list[int]]]) -> list[_Job]:
        n = len(prompts)
        if self._drain_deadline is not None:
            raise HTTPError(503, f"{DRAINING}; send the request again (to another instance)")
        with self._lock:
            if self._inflight + n > self.config.job_queue_size:
                raise HTTPError(503, f"Worker queue capacity exceeded ({self.config.job_queue_size} requests)")
            self._inflight += n
        jobs: list[_Job] = []
        try:
            for i, (text, ids) in enumerate(prompts):
                rid = uuid.uuid4().hex
                adapter = req.adapter(i)
                if adapter is None:  # the base model: the call every EngineClient (and test fake) takes
                    stream = self.engine.add_request(rid, ids, req.params)
                else:
                    stream = self.engine.add_request(rid, ids, req.params, lora_name=adapter)
                if adapter is not None and self.metrics is not None:
                    self.metrics.adapter_requests.labels(adapter=adapter).inc()
                result = Result(prompt=text, prompt_token_ids=ids, n=req.params.n, decode_token=self.decode_token)
                guided = req.params.guided_decoding
                jobs.append(_Job(rid, stream, result, schema=guided.json if guided is not None else None))
        except UnknownAdapterError as exc:  # removed since the request was checked: never the base model
            self._release(jobs, n)
            raise HTTPError(404, str(exc)) from None
        except ValueError as exc:
            self._release(jobs, n)
            raise HTTPError(400, str(exc)) from None
        except Exception as exc:  # noqa: BLE001 - engine dead / stopping
            self._release(jobs, n)
            raise HTTPError(503, f"the engine cannot take requests: {exc}") from None
        return jobs

    def _release(self, jobs: list[_Job], n: int) -> None:
        for job in jobs:
            try:
                job.stream.close()
            except Exception:  # noqa: BLE001
                logger.exception("closing stream %s", job.request_id)
        with self._lock:
            self._inflight -= n

    @staticmethod
    def _accept(job: _Job, delta: StreamDelta) -> StreamDelta:
        """Fold a delta into the job's result (and note when its first token came); returns the delta
        to format: the same one, or, for a schema-guided sample whose whole output does not validate
        against its schema (a keyword the grammar does not enforce), that delta ending in an error."""
        if job.first_token_at is None and delta.token_ids:
            job.first_token_at = time.monotonic()
        s = job.result.add(delta)
        if (job.schema is not None and delta.finish_reason in _COMPLETE
                and not isinstance(delta.extra.get("stop_reason"), str)):  # a client's stop string cut it
            problem = output_problem(job.schema, s.text)
            if problem is not None:
                s.finish_reason, s.error = "error", problem
                return replace(delta, finish_reason="error", error=problem)
        return delta

    def _next(self, job: _Job, deadline: float, gone: Callable[[], bool] | None = None) -> StreamDelta:
        """The next delta of a job; raises TimeoutError, ServerDraining, RuntimeError (engine dead)
        or ClientGone (`gone()` said so; it is asked at most every _POLL_S)."""
        while True:
            now = time.monotonic()
            drain = self._drain_deadline
            if drain is not None and now >= drain:
                raise ServerDraining(f"{DRAINING}: the request was ended at the drain deadline")
            if gone is not None and now >= job.probe_at:
                job.probe_at = now + _POLL_S
                if gone():
                    raise ClientGone()
            remaining = deadline - now
            if remaining <= 0:
                raise TimeoutError(f"prediction timed out after {self.config.predict_timeout:g} s")
            if drain is not None:
                remaining = min(remaining, drain - now)
            try:
                delta = job.stream.get(timeout=min(_POLL_S, remaining))
            except queue.Empty:
                if self.engine.state == EngineState.DEAD:
                    raise RuntimeError(f"the engine died: {self.engine.error}") from None
                continue
            if delta is None:
                raise RuntimeError("the engine closed the request stream")
            return self._accept(job, delta)

    def _observe(self, jobs: list[_Job], start: float, record: RequestRecord | None = None) -> None:
        if record is not None:
            record.count(sum(j.result.num_output_tokens for j in jobs), self._failure(jobs))
        if self.metrics is None:
            return
        now = time.monotonic()
        for job in jobs:
            n = job.result.num_output_tokens
            self.metrics.generated.inc(n)
            if job.first_token_at is not None:
                self.metrics.ttft.observe(job.first_token_at - start)
                if n > 1:
                    self.metrics.tpot.observe((now - job.first_token_at) / (n - 1))

    def formatter(self, req: GenerateRequest, request_id: str) -> Formatter:
        return Formatter(req, model=self.config.served_model_name, request_id=request_id,
                         created=int(time.time()), special_ids=self.special_ids(), decode_token=self.decode_token)

    # ---- plain -------------------------------------------------------------------------------------
    def run_plain(self, req: GenerateRequest, request_id: str, gone: Callable[[], bool] | None = None,
                  record: RequestRecord | None = None) -> tuple[int, bytes] | Iterator[bytes]:
        """Run to completion: (status, body); errors (a timeout: 504) -> HTTPError.

        The status is not committed before the result is known, so a request that fails (past
        `predict_timeout`, engine dead, drain) is a 5xx on every route, never a 200 with partial text.
        Only with `plain_heartbeat` on (off by default) does a request not done after `heartbeat_s`
        return a byte iterator instead: status 200 is committed, a space (valid leading JSON
        whitespace) is sent every `heartbeat_s` for clients and proxies that drop idle connections,
        then the body, or the route's error object if it failed after that point. `gone()` (polled
        while waiting) says the client left: the request is aborted at once.
        """
        start = time.monotonic()
        prompts = self.prompts(req)
        jobs = self._submit(req, prompts)
        deadline = start + self.config.predict_timeout
        until = start + self.heartbeat_s if self.heartbeat_s else deadline
        try:
            done = self._collect(jobs, deadline, until, gone)
        except ClientGone:
            raise self._abandon(jobs, start, record) from None
        if done:
            return self._finish_plain(req, request_id, jobs, start, record)
        return self._plain_with_heartbeat(req, request_id, jobs, start, deadline, gone, record)

    def _abandon(self, jobs: list[_Job], start: float, record: RequestRecord | None = None) -> HTTPError:
        """The client left before its answer started: abort its engine requests (their KV blocks are
        freed); returns the HTTPError(499) to raise, which the app records and cannot deliver."""
        _log_gone(jobs)
        self._release(jobs, len(jobs))
        self._observe(jobs, start, record)
        return HTTPError(CLIENT_CLOSED, "the client closed the connection")

    @property
    def heartbeat_s(self) -> float:
        """Seconds between the spaces of a slow non-streamed answer; 0 = none (`plain_heartbeat` off)."""
        return min(15.0, self.config.chunked_read_timeout / 4) if self.config.plain_heartbeat else 0.0

    def _collect(self, jobs: list[_Job], deadline: float, until: float,
                 gone: Callable[[], bool] | None = None) -> bool:
        """Drain deltas until every job finished (True) or `until` passed (False); failures end jobs;
        ClientGone propagates."""
        try:
            for job in jobs:
                while not job.result.finished:
                    if time.monotonic() >= until < deadline:
                        return False
                    try:
                        self._next(job, min(deadline, until), gone)
                    except TimeoutError:
                        if time.monotonic() < deadline:
                            return False
                        raise
        except (TimeoutError, RuntimeError) as exc:
            for job in jobs:
                job.result.fail(str(exc))
        return True

    @staticmethod
    def _failure(jobs: list[_Job]) -> str | None:
        """The first error of any sample, or None when every sample ended normally."""
        return next((s.error or "generation failed" for j in jobs for s in j.result.samples.values()
                     if s.finish_reason == "error"), None)

    def _finish_plain(self, req: GenerateRequest, request_id: str, jobs: list[_Job], start: float,
                      record: RequestRecord | None = None) -> tuple[int, bytes]:
        self._release(jobs, len(jobs))
        self._observe(jobs, start, record)
        error = self._failure(jobs)
        if error is not None:
            raise HTTPError(_status_of(error), error)
        return 200, self.formatter(req, request_id).body([j.result for j in jobs])

    def _plain_with_heartbeat(self, req: GenerateRequest, request_id: str, jobs: list[_Job], start: float,
                              deadline: float, gone: Callable[[], bool] | None,
                              record: RequestRecord | None) -> Iterator[bytes]:
        fmt = self.formatter(req, request_id)
        try:
            while not self._collect(jobs, deadline, time.monotonic() + self.heartbeat_s, gone):
                yield b" "
            error = self._failure(jobs)  # 200 is sent: the body is the route's error object instead
            yield fmt.body([j.result for j in jobs]) if error is None else fmt.error_body(_status_of(error), error)
        except ClientGone:
            _log_gone(jobs)
        finally:
            self._release(jobs, len(jobs))
            self._observe(jobs, start, record)

    # ---- streams -----------------------------------------------------------------------------------
    def run_stream(self, req: GenerateRequest, request_id: str, gone: Callable[[], bool] | None = None,
                   record: RequestRecord | None = None) -> Iterator[bytes]:
        """Start generating; wait for the first delta (so early errors get a status), then stream.

        The returned generator must be closed by the server (client gone -> GeneratorExit), which
        aborts the engine requests in its `finally`; `gone()` is polled while it waits for deltas.
        """
        start = time.monotonic()
        prompts = self.prompts(req)
        jobs = self._submit(req, prompts)
        deadline = start + self.config.predict_timeout
        fmt = self.formatter(req, request_id)
        try:
            first = self._next(jobs[0], deadline, gone)
        except ClientGone:
            raise self._abandon(jobs, start, record) from None
        except (TimeoutError, RuntimeError) as exc:
            self._release(jobs, len(jobs))
            raise HTTPError(_status_of(str(exc)), str(exc)) from None
        if first.finish_reason == "error" and not first.token_ids:
            self._release(jobs, len(jobs))
            error = first.error or "generation failed"
            raise HTTPError(_status_of(error), error)
        return self._stream(req, fmt, jobs, first, start, deadline, gone, record)

    @staticmethod
    def _catch_up(job: _Job, fmt: Formatter, p: int, rec: bytes, delta: StreamDelta | None,
                  ready: Callable[[], StreamDelta | None]) -> bytes:
        """`rec` plus the records of `delta` and of every delta behind it already in the queue."""
        out = [rec]
        result = job.result
        while delta is not None:
            out.append(fmt.chunk(result, RequestRunner._accept(job, delta), p))
            delta = None if result.finished else ready()
        return b"".join(out)

    def _stream(self, req: GenerateRequest, fmt: Formatter, jobs: list[_Job], first: StreamDelta,
                start: float, deadline: float, gone: Callable[[], bool] | None = None,
                record: RequestRecord | None = None) -> Iterator[bytes]:
        """The records of a stream, each flushed as soon as its delta is there.

        Coalescing: after the delta it waited for, a thread also takes the deltas already queued
        behind it (never waiting for more) and writes all their records at once. Every record is
        still its own line / event, whole and in order; a stream that fell behind just catches up
        with one write (one generator step, one socket send, one GIL hand-off) instead of one each.
        """
        results = [j.result for j in jobs]
        try:
            for p, job in enumerate(jobs):
                result = job.result
                ready = job.stream.get_nowait
                if p == 0:
                    rec = fmt.start(results) + fmt.chunk(result, first, 0)
                    yield self._catch_up(job, fmt, 0, rec, None if result.finished else ready(), ready)
                while not result.finished:
                    try:
                        delta = self._next(job, deadline, gone)
                    except (TimeoutError, RuntimeError) as exc:
                        logger.warning("request %s failed mid-stream: %s", job.request_id, exc)
                        yield fmt.error_record(result, str(exc))
                        break
                    rec = fmt.chunk(result, delta, p)
                    behind = None if result.finished else ready()
                    yield rec if behind is None else self._catch_up(job, fmt, p, rec, behind, ready)
            end = fmt.end(results)
            if end:
                yield end
        except ClientGone:  # noticed while waiting for a delta: nobody to write the rest to
            _log_gone(jobs)
        finally:
            # Runs on normal end, on error, and when the client disconnects (GeneratorExit).
            self._release(jobs, len(jobs))
            self._observe(jobs, start, record)


def _log_gone(jobs: list[_Job]) -> None:
    logger.info("client went away; aborted request(s) %s", ", ".join(j.request_id for j in jobs))

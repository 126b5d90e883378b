"""`MultiprocExecutor`: one spawned process per rank, driven over pipes, watched for death.

Each rank's process (`serving/executor/rank_process.py`) joins one torch.distributed group
(NCCL on GPUs, gloo on CPU), loads only its shard, sizes its KV cache (the minimum over ranks)
and captures its CUDA graphs in step with the others. Per step the executor pickles the plan
once and writes it to every rank's pipe; rank 0 answers the sampled tokens when they are
asked for, so the next plan is on its way while a step runs.

Faults: a watchdog thread checks every rank's process and heartbeat every 0.25 s; a rank that
exits, or whose heartbeat is older than `hang_timeout_s`, fails the executor within about a
second and calls the failure callback (the engine loop marks itself dead and fails every open
stream). Workers die with their parent (PR_SET_PDEATHSIG) and are terminated on shutdown, so
no process outlives the server; the heartbeat array's shared memory is anonymous (unlinked at
creation), so nothing is left in /dev/shm either.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import pickle
import socket
import sys
import threading
import time
from collections.abc import Callable

from serving.engine_config import EngineConfig
from serving.executor.executor import Executor, WorkerFailedError
from serving.executor.plan import ExecutorInfo, SampledToken, StepOutput, StepPlan

logger = logging.getLogger(__name__)

HANG_TIMEOUT_S = 3.0  # a heartbeat older than this is a hung rank
MAIN_GUARD_EXIT = 78  # a rank's exit code: the script that spawned it has no `if __name__ == "__main__":`
UNGUARDED = ('tensor parallelism runs one spawned process per rank, and each re-imports your script: '
             'put the code that creates the LLM under `if __name__ == "__main__":`')


def _start_failure(rank: int, exitcode: int | None, note: str = "") -> WorkerFailedError:
    """The error of a rank that exited while starting; one that exited with MAIN_GUARD_EXIT says why in
    one line (not one bootstrap traceback per rank)."""
    if exitcode == MAIN_GUARD_EXIT:
        return WorkerFailedError(UNGUARDED)
    return WorkerFailedError(f"rank {rank} exited with code {exitcode} while starting{note}")
_WATCH_PERIOD_S = 0.25


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MultiprocExecutor(Executor):
    """Ranks 0..N-1 in spawned processes; rank 0 returns the sampled tokens."""

    def __init__(self, config: EngineConfig, model_dir: str | None, devices: tuple[str, ...],
                 hang_timeout_s: float = HANG_TIMEOUT_S, start_timeout_s: float = 3600.0) -> None:
        from serving.executor.rank_process import rank_main

        self.world_size = len(devices)
        self.devices = tuple(devices)
        self.hang_timeout_s = hang_timeout_s
        self._failure: BaseException | None = None
        self._callback: Callable[[BaseException], None] | None = None
        self._closed = False
        self._lock = threading.Lock()
        # `_terminate` runs on the watchdog (a rank died) and on the caller's thread (shutdown), maybe at
        # once: unserialised, both closed the same pipe and the second os.close hit EBADF (CI, 2026-11-27),
        # or, worse, a descriptor number reused meanwhile by something else.
        self._stop_lock = threading.Lock()
        self._watchdog: threading.Thread | None = None
        if getattr(mp.current_process(), "_inheriting", False):
            # We are a rank being spawned, re-running the user's script as `__mp_main__`: its top level
            # builds an LLM again. Exit quietly with a code the parent turns into one clear error.
            sys.exit(MAIN_GUARD_EXIT)
        ctx = mp.get_context("spawn")  # never fork: CUDA and the engine's threads do not survive it
        self._heartbeats = ctx.Array("d", self.world_size, lock=False)
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        self._conns = []
        self._procs = []
        now = time.monotonic()
        for rank, device in enumerate(devices):
            self._heartbeats[rank] = now
            ours, theirs = ctx.Pipe(duplex=True)
            proc = ctx.Process(
                target=rank_main, name=f"open-lmi-rank{rank}", daemon=True,
                args=(config, model_dir, rank, self.world_size, device, init_method, theirs, self._heartbeats),
            )
            proc.start()
            theirs.close()
            self._conns.append(ours)
            self._procs.append(proc)
        try:
            self.info = self._wait_ready(start_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        self._watchdog = threading.Thread(target=self._watch, name="executor-watchdog", daemon=True)
        self._watchdog.start()
        logger.info("executor: %d ranks on %s, worker pids %s", self.world_size, ", ".join(devices),
                    [p.pid for p in self._procs])

    # ---- start ---------------------------------------------------------------------------

    def _wait_ready(self, timeout_s: float) -> ExecutorInfo:
        """Every rank's ("ready", info) or the first start error, naming the rank."""
        deadline = time.monotonic() + timeout_s
        info: ExecutorInfo | None = None
        pending = set(range(self.world_size))
        while pending:
            for rank in list(pending):
                conn, proc = self._conns[rank], self._procs[rank]
                if conn.poll(0.05):
                    try:
                        kind, payload = conn.recv()
                    except (EOFError, OSError):
                        proc.join(1.0)
                        raise _start_failure(rank, proc.exitcode, " (its log is above)") from None
                    if kind == "init_error":
                        raise WorkerFailedError(f"rank {rank} failed to start: {payload}")
                    assert kind == "ready", kind
                    if rank == 0:
                        info = dataclasses.replace(payload, devices=self.devices)
                    pending.discard(rank)
                elif not proc.is_alive():
                    raise _start_failure(rank, proc.exitcode)
            if time.monotonic() > deadline:
                raise WorkerFailedError(f"ranks {sorted(pending)} did not start within {timeout_s:.0f} s")
        assert info is not None
        return info

    # ---- per step ------------------------------------------------------------------------

    def execute(self, plan: StepPlan) -> StepOutput:
        self._send(("step", plan))
        if not any(plan.sample):
            return StepOutput([])
        step_id = plan.step_id
        return StepOutput(resolve=lambda: self._fetch(step_id))

    @property
    def supports_deferred_masks(self) -> bool:  # type: ignore[override]
        """One rank samples alone, so its guided masks may follow the step (a "masks" message)."""
        return len(self._conns) == 1

    def sample_deferred(self, masks: object) -> None:
        assert self.supports_deferred_masks, "deferred guided-decoding masks need a single rank"
        self._send(("masks", masks))

    def reset(self) -> None:
        self._send(("reset", None))

    def _send(self, message: tuple, ranks: int | None = None) -> None:
        """Pickle `message` once and write it to the first `ranks` ranks (default: all)."""
        self._check()
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for conn in self._conns[:ranks]:
                conn.send_bytes(data)
        except (BrokenPipeError, ConnectionResetError, EOFError, OSError) as exc:
            raise self._fail(WorkerFailedError(f"a worker went away: {exc}")) from None

    def _fetch(self, step_id: int) -> list[SampledToken]:
        """Ask rank 0 for a step's tokens and wait for them, watching for worker failure."""
        self._send(("get", step_id), ranks=1)
        conn = self._conns[0]
        try:
            while not conn.poll(0.1):
                self._check()
            kind, got_id, payload = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError) as exc:
            raise self._fail(WorkerFailedError(f"rank 0 went away: {exc}")) from None
        assert got_id == step_id, f"asked for step {step_id}, rank 0 answered step {got_id}"
        if kind == "error":
            raise RuntimeError(payload)  # a failure inside the step: the engine fails its request
        return payload

    # ---- faults --------------------------------------------------------------------------

    def set_failure_callback(self, callback: Callable[[BaseException], None]) -> None:
        self._callback = callback

    def _check(self) -> None:
        if self._failure is not None:
            raise self._failure
        if self._closed:
            raise WorkerFailedError("the executor is shut down")

    def _fail(self, error: BaseException) -> BaseException:
        """Record the first failure, stop every worker, tell the callback once."""
        with self._lock:
            first = self._failure is None and not self._closed
            if self._failure is None:
                self._failure = error
        if first:
            logger.error("executor failed: %s", error)
            if self._callback is not None:  # first: the engine turns unhealthy at once
                try:
                    self._callback(error)
                except Exception:  # noqa: BLE001 - the watchdog must not die of a callback
                    logger.exception("executor failure callback raised")
            self._terminate()  # then the workers go (a stopped one only yields to SIGKILL, ~2 s)
        return self._failure  # type: ignore[return-value]

    def _watch(self) -> None:
        while not self._closed and self._failure is None:
            now = time.monotonic()
            for rank, proc in enumerate(self._procs):
                if not proc.is_alive():
                    self._fail(WorkerFailedError(f"rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}"))
                    return
                stale = now - self._heartbeats[rank]
                if stale > self.hang_timeout_s:
                    self._fail(WorkerFailedError(f"rank {rank} (pid {proc.pid}) stopped responding "
                                                 f"(no heartbeat for {stale:.1f} s)"))
                    return
            time.sleep(_WATCH_PERIOD_S)

    # ---- stop ----------------------------------------------------------------------------

    def _terminate(self, grace_s: float = 0.0) -> None:
        """Stop every rank (after `grace_s` for them to exit on their own) and close the pipes; one
        thread at a time, so each pipe is closed once."""
        with self._stop_lock:
            grace_end = time.monotonic() + grace_s  # one grace period for all ranks, not one each
            for proc in self._procs:
                if proc.is_alive() and grace_s:
                    proc.join(max(0.0, grace_end - time.monotonic()))
            for proc in self._procs:
                if proc.is_alive():
                    proc.terminate()
            deadline = time.monotonic() + 2.0  # one grace period for all, then SIGKILL
            for proc in self._procs:
                proc.join(max(0.0, deadline - time.monotonic()))
                if proc.is_alive():
                    proc.kill()
                    proc.join(1.0)
            for conn in self._conns:
                conn.close()  # a no-op on a pipe already closed (by an earlier, finished call)

    def shutdown(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._failure is None:
            try:
                data = pickle.dumps(("stop", None))
                for conn in self._conns:
                    conn.send_bytes(data)
            except OSError:
                pass
        self._terminate(grace_s=3.0)
        watchdog = self._watchdog
        if watchdog is not None and watchdog is not threading.current_thread():
            watchdog.join()  # it sees `_closed` within one period
        logger.info("executor: %d worker processes stopped", len(self._procs))

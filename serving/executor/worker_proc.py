"""The body of one rank's process (spawned by `MultiprocExecutor`): join the group, load the
shard, then run the plans that arrive on the pipe until told to stop or the parent goes.

Messages in: ("step", StepPlan) | ("get", step_id) (rank 0 only) | ("reset", None) |
("stop", None). Out: ("ready", ExecutorInfo) or ("init_error", text) once; then, on rank 0,
("result", step_id, [SampledToken]) or ("error", step_id, text) per "get". A step that fails
on rank 0 is answered as an error (the engine fails that step's request and resets every
rank); a failure on another rank ends its process (the watchdog then fails the executor).
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import pickle
import signal
import threading
import time
import traceback

_PR_SET_PDEATHSIG = 1
_HEARTBEAT_S = 0.2


def die_with_parent(parent_pid: int) -> None:
    """Linux: SIGKILL this process when its parent exits, so no rank outlives the server."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:  # not glibc: the pipe's EOF still ends the loop
        pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def _beat(heartbeats, rank: int) -> None:  # noqa: ANN001 - a shared ctypes array
    while True:
        heartbeats[rank] = time.monotonic()
        time.sleep(_HEARTBEAT_S)


def worker_main(config, model_dir, rank, world_size, device, init_method, conn, heartbeats) -> None:  # noqa: ANN001
    """Entry point of rank `rank`'s process."""
    die_with_parent(os.getppid())
    logging.basicConfig(level=os.environ.get("LOG_LEVEL", "INFO").upper(),
                        format=f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s")
    threading.Thread(target=_beat, args=(heartbeats, rank), name="heartbeat", daemon=True).start()
    import torch

    from serving.executor import parallel
    from serving.executor.model_runner import ModelRunner

    try:
        dev = torch.device(device)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        parallel.init_tensor_parallel(rank, world_size, init_method, "nccl" if dev.type == "cuda" else "gloo",
                                      device=dev, custom_all_reduce=not config.disable_custom_all_reduce)
        runner = ModelRunner(config, model_dir, device=dev, rank=rank, world_size=world_size)
        conn.send(("ready", runner.info()))
    except BaseException:  # noqa: BLE001 - reported to the executor, which names the rank
        conn.send(("init_error", traceback.format_exc(limit=8)))
        os._exit(1)
    # What loading built (imports, model, graphs) lives as long as this process: keep it out of
    # the cyclic collector's full walks, which hold the GIL for tens of ms mid-serving (as the
    # server process does before /ping turns 200, serving/server/wsgi.py).
    gc.collect()
    gc.freeze()
    try:
        _serve(runner, conn, rank)
    except (EOFError, OSError):
        pass  # the parent closed the pipe: shut down
    except BaseException:  # noqa: BLE001 - this rank cannot go on; the watchdog sees the exit
        logging.getLogger(__name__).exception("rank %d failed", rank)
        os._exit(1)
    parallel.destroy_tensor_parallel()
    # Leave at once: the interpreter's own teardown (torch's modules) takes seconds and gives
    # back nothing the exit does not, while the executor's shutdown waits for this process.
    logging.shutdown()
    os._exit(0)


def _serve(runner, conn, rank: int) -> None:  # noqa: ANN001
    pending: dict[int, object] = {}  # step id -> StepOutput (or the exception it raised), rank 0
    last_step = -1
    while True:
        kind, payload = pickle.loads(conn.recv_bytes())
        if kind == "step":
            try:
                out = runner.execute(payload)
            except Exception as exc:  # noqa: BLE001
                if rank != 0:
                    raise
                out = exc
            if rank == 0:
                pending[payload.step_id] = out
                last_step = payload.step_id
        elif kind == "masks":  # the guided masks of the last step, which waits for them to sample
            try:
                runner.sample_deferred(payload)
            except Exception as exc:  # noqa: BLE001 - its "get" answers the error
                pending[last_step] = exc
        elif kind == "get":
            out = pending.pop(payload)
            for old in [k for k in pending if k < payload]:  # steps that sampled nothing
                del pending[old]
            try:
                if isinstance(out, BaseException):
                    raise out
                reply = ("result", payload, out.sampled)
            except Exception as exc:  # noqa: BLE001 - the engine fails the request
                reply = ("error", payload, f"{type(exc).__name__}: {exc}")
            conn.send_bytes(pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL))
        elif kind == "reset":
            pending.clear()
            runner.reset()
        elif kind == "stop":
            return
        else:
            raise ValueError(f"unknown message {kind!r}")

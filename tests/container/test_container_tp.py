"""The container with TENSOR_PARALLEL_DEGREE=2 on CPU (gloo, 2 rank processes, default model, fp32).

Greedy text through HTTP, plain and streamed, equals the offline engine's at TP=1. Killing one
rank's process turns /ping non-200 within 5 s, every rank process of that worker is gone
(none left orphaned in the process table), and gunicorn's fresh worker serves again. Last, SIGTERM
stops that same server (one TP start-up for the module): no rank process, no shared memory left.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import requests
from lmi_server import check_jsonlines, running_server, stream_lines
from processes import alive

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                out.append(int(entry))
    return out


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _rank_processes(worker: int) -> list[int]:
    """The worker's spawned rank processes (multiprocessing's resource tracker is not a rank)."""
    return [p for p in _children(worker) if "spawn_main" in _cmdline(p) and "resource_tracker" not in _cmdline(p)]


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    shm_before = _shm()  # before the start: a segment the server makes and leaves behind shows up
    with running_server(tmp_path_factory, {"TENSOR_PARALLEL_DEGREE": "2", "OPTION_NOT_A_KEY": "1"}, "serve_tp") as srv:
        srv.shm_before = shm_before
        yield srv


@pytest.fixture(scope="module")
def expected() -> str:
    from serving.llm import LLM
    from serving.sampling_params import SamplingParams

    llm = LLM(None, device="cpu", dtype="float32", max_model_len=512, kv_cache_memory_gb=0.05)
    return llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)[0].outputs[0].text


def test_tp2_plain_and_streamed_equal_tp1(server, expected):
    log = server.log()
    assert "tensor parallelism: degree 2" in log
    # The configuration is resolved once per start (container/serve), not again by gunicorn's
    # config file and worker: its warnings appear once.
    assert log.count("unknown setting option.not_a_key") == 1, log
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 16, "do_sample": False}}
    r = requests.post(server.url + "/invocations", json=body, timeout=120)
    assert r.status_code == 200 and r.json()["generated_text"] == expected
    r, lines = stream_lines(server.url + "/invocations", {**body, "stream": True})
    assert r.status_code == 200 and check_jsonlines(lines)["generated_text"] == expected


def test_killed_rank_turns_ping_non_200_within_5s_and_leaves_no_orphans(server):
    (worker,) = _children(server.proc.pid)  # gunicorn's one worker
    ranks = _rank_processes(worker)
    assert len(ranks) == 2, [(_cmdline(p)) for p in _children(worker)]
    t0 = time.monotonic()
    os.kill(ranks[1], signal.SIGKILL)
    status = 200
    while time.monotonic() - t0 < 5.0:
        try:
            status = requests.get(server.url + "/ping", timeout=1).status_code
        except requests.ConnectionError:
            status = 0
        if status != 200:
            break
        time.sleep(0.05)
    assert status != 200, "/ping still 200 five seconds after a rank died"
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline and any(alive(p) for p in ranks + [worker]):
        time.sleep(0.1)
    left = [p for p in ranks + [worker] if alive(p)]
    assert not left, f"processes left behind: {[(p, _cmdline(p)) for p in left]}"
    server.wait(200, timeout=240)  # gunicorn's new worker loads the model again
    (new_worker,) = _children(server.proc.pid)
    assert new_worker != worker and len(_rank_processes(new_worker)) == 2
    r = requests.post(server.url + "/invocations", json={"inputs": "Hi", "parameters": {"max_new_tokens": 4}},
                      timeout=120)
    assert r.status_code == 200


def test_sigterm_leaves_no_rank_process_and_no_shared_memory(server):
    # Last test of the module: the module's server (its worker restarted by the test above when
    # run in order, its first one otherwise), ready, is stopped with SIGTERM.
    srv = server
    srv.wait(200)
    (worker,) = _children(srv.proc.pid)
    pids = _rank_processes(worker) + [worker]
    assert len(pids) == 3
    stopped_before = srv.log().count("executor: 2 worker processes stopped")
    srv.stop()
    assert srv.proc.returncode is not None
    deadline = time.monotonic() + 5.0
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if alive(p)]
    # the engine shut down, not killed with its parent
    assert srv.log().count("executor: 2 worker processes stopped") == stopped_before + 1
    shm_after = _shm()
    assert not (shm_after - srv.shm_before), shm_after - srv.shm_before

"""The engine in a process of its own (`option.engine_process=true`, the GPU default) behind the real
server (`container/serve`, SmolLM2 on the CPU): requests, streams, aborts and metrics cross its socket;
a killed engine core fails the open streams with an error record, gunicorn's arbiter starts a fresh
core and the new worker serves again; SIGTERM leaves no process behind. (The LoRA module's server also runs this way.)
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import requests
from lmi_server import LMIServer, check_jsonlines, engine_cores, stream_lines

pytestmark = pytest.mark.slow


def engine_pid(srv: LMIServer) -> int:
    """The engine core: the spawned child of gunicorn's arbiter (`serve` exec'd it), not a worker's."""
    cores = engine_cores(srv)
    assert len(cores) == 1, cores
    return cores[0]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("engine-process")
    srv = LMIServer({"OPTION_ENGINE_PROCESS": "true", "OPTION_MAX_ROLLING_BATCH_SIZE": "8"}, cwd, cwd / "serve.log")
    try:
        srv.wait(200)
        yield srv
    finally:
        srv.stop()


def interval_count(srv: LMIServer) -> float:
    return srv.metrics()['lmi_engine_token_interval_seconds_count{step="decode"}']


def test_answers_stream_and_engine_cadence_come_from_the_engine_process(server):
    pid = engine_pid(server)
    assert b"python" in Path(f"/proc/{pid}/cmdline").read_bytes()
    r = requests.post(server.url + "/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 12,
        "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "The capital of France is Paris."
    before = interval_count(server)
    r, lines = stream_lines(server.url + "/invocations", {"inputs": "Once upon a time", "stream": True,
                                                          "parameters": {"max_new_tokens": 16, "ignore_eos": True}})
    last = check_jsonlines(lines)
    assert r.status_code == 200 and len(lines) == 16 and last["generated_text"]
    # One engine interval per step after the first (the engine is idle before and after).
    assert interval_count(server) - before == 15
    bad = requests.post(server.url + "/invocations", timeout=30, json={
        "inputs": "Hi", "parameters": {"max_new_tokens": 4, "min_tokens": 1, "stop_token_ids": [10**9]}})
    assert bad.status_code == 400 and "stop_token_ids" in bad.json()["error"]  # the child's ValueError, as a 400


def test_a_client_that_goes_away_frees_its_kv_blocks(server):
    r = requests.post(server.url + "/invocations", stream=True, timeout=120, json={
        "inputs": "Count slowly:", "stream": True, "parameters": {"max_new_tokens": 400, "ignore_eos": True}})
    lines = r.iter_lines()
    for _ in range(3):
        next(lines)
    assert server.metrics()["lmi_kv_blocks_used"] > 0
    r.close()
    server.wait_idle(30.0)


def test_a_killed_engine_process_fails_open_streams_then_a_new_worker_serves(server):
    pid = engine_pid(server)
    r = requests.post(server.url + "/invocations", stream=True, timeout=120, json={
        "inputs": "Tell a long story:", "stream": True, "parameters": {"max_new_tokens": 480, "ignore_eos": True}})
    lines = r.iter_lines()
    first = json.loads(next(lines))
    assert "token" in first
    os.kill(pid, signal.SIGKILL)
    rest = [json.loads(ln) for ln in lines if ln]
    assert rest and "error" in rest[-1] and "engine" in rest[-1]["error"], rest[-3:]
    assert len(rest) < 479  # it ended early, with an error record, not silently
    deadline = time.monotonic() + 180
    seen = []
    while time.monotonic() < deadline:
        try:
            seen.append(requests.get(server.url + "/ping", timeout=2).status_code)
            if seen[-1] == 200 and engine_pid(server) != pid:
                break
        except (requests.ConnectionError, AssertionError, OSError):
            pass
        time.sleep(0.5)
    assert seen and seen[-1] == 200, seen[-20:]
    r = requests.post(server.url + "/invocations", json={"inputs": "Hello", "parameters": {"max_new_tokens": 3}},
                      timeout=60)
    assert r.status_code == 200 and "generated_text" in r.json()


def test_sigterm_leaves_no_engine_process(server):
    pid = engine_pid(server)
    server.stop()
    assert server.proc.returncode is not None
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split(")")[1][:3]

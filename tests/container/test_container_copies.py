"""Model copies and overload through the real server on the CPU (issue 24).

Two real engine copies (`SERVING_MAX_WORKERS=2`: each copy's engine in a process of its own, the
embedded model) start every time, serve, and share the load; a model that fails to load stops the
whole server with the reason on one line and exit status 3; a flood far above a small queue gets
LMI's 503 (with Retry-After) for the excess at once while `/ping` keeps answering fast and every
accepted request ends whole.
"""

from __future__ import annotations

import json
import statistics
import threading
import time

import pytest
import requests
from lmi_server import LMIServer

pytestmark = pytest.mark.slow
QUEUE = 6  # job_queue_size of the copies server
STARTS = 3  # the copies server is started this many times; the last one stays up for the module's tests
COPIES_ENV = {"SERVING_MAX_WORKERS": "2", "SERVING_JOB_QUEUE_SIZE": str(QUEUE), "OPTION_MAX_MODEL_LEN": "256"}


def _generate(url: str, prompt: str, max_new_tokens: int = 8, timeout: float = 120) -> requests.Response:
    return requests.post(url + "/invocations", json={"inputs": prompt, "parameters": {
        "max_new_tokens": max_new_tokens, "ignore_eos_token": True, "details": True}}, timeout=timeout)


@pytest.fixture(scope="module")
def copies(tmp_path_factory):
    """The copies server, started STARTS times (each start must come up and answer); the last stays."""
    srv = None
    try:
        for attempt in range(STARTS):
            cwd = tmp_path_factory.mktemp(f"copies{attempt}")
            srv = LMIServer(COPIES_ENV, cwd, cwd / "serve.log")
            srv.wait(200)
            r = _generate(srv.url, "The capital of France is")
            assert r.status_code == 200 and r.json()["details"]["generated_tokens"] == 8, (attempt, r.text)
            assert "cannot import name" not in srv.log()
            if attempt < STARTS - 1:
                srv.stop()
        yield srv
    finally:
        if srv is not None:
            srv.stop()


def test_two_copies_start_each_in_its_own_process_and_share_the_load(copies):
    results: list[requests.Response] = []
    threads = [threading.Thread(target=lambda i=i: results.append(_generate(copies.url, f"Question {i}: why is the sky"
                                                                                          " blue? Answer:")))
               for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.status_code for r in results] == [200] * 4
    m = copies.metrics()
    routed = [m.get(f'lmi_copy_routed_requests_total{{copy="{i}"}}', 0) for i in range(2)]
    assert all(n >= 2 for n in routed), routed  # least-loaded routing used both copies
    # Same greedy answer from either copy: the copies hold the same model.
    answers = {_generate(copies.url, "The capital of France is").json()["generated_text"] for _ in range(4)}
    assert len(answers) == 1


def test_a_flood_past_the_queue_gets_503_at_once_while_ping_stays_fast(copies):
    copies.wait_idle(timeout=60)
    flood = 60  # ten times the queue, all at once
    statuses: dict[int, int] = {}
    bodies: list[dict] = []
    retry_after: set[str] = set()
    lock = threading.Lock()
    done = threading.Event()
    pings: list[float] = []

    def client(i: int) -> None:
        try:
            r = _generate(copies.url, f"Flood request {i}: tell me a long story about", max_new_tokens=24)
        except requests.RequestException as exc:  # a lost request fails the test below
            r = None
            with lock:
                statuses[-1] = statuses.get(-1, 0) + 1
            print("lost:", exc)
        if r is not None:
            with lock:
                statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                if r.status_code == 200:
                    bodies.append(r.json())
                else:
                    assert r.status_code == 503 and "capacity" in r.json()["error"], r.text
                    retry_after.add(r.headers.get("Retry-After", ""))

    def pinger() -> None:
        with requests.Session() as s:
            while not done.is_set():
                t0 = time.monotonic()
                r = s.get(copies.url + "/ping", timeout=10)
                pings.append(time.monotonic() - t0)
                assert r.status_code == 200
                time.sleep(0.05)

    ping_thread = threading.Thread(target=pinger)
    ping_thread.start()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(flood)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    done.set()
    ping_thread.join(15)
    assert time.monotonic() - t0 < 180
    assert statuses.get(-1, 0) == 0, statuses
    assert statuses.get(200, 0) >= QUEUE and statuses.get(503, 0) >= flood - 4 * QUEUE, statuses
    assert sum(statuses.values()) == flood
    assert all(b["details"]["generated_tokens"] == 24 and b["details"]["finish_reason"] == "length" for b in bodies)
    assert retry_after and all(v.isdigit() and int(v) >= 1 for v in retry_after), retry_after
    assert len(pings) >= 10
    p99 = statistics.quantiles(pings, n=100)[98]
    assert p99 < 1.0, (p99, max(pings))
    m = copies.wait_idle(timeout=60)
    assert m['lmi_requests_total{route="/invocations",status="503"}'] == statuses[503]


def test_ping_answered_by_the_poller_keeps_the_connection_and_head_works(copies):
    with requests.Session() as s:
        for _ in range(3):
            r = s.get(copies.url + "/ping", timeout=5)
            assert r.status_code == 200 and r.json() == {"status": "Healthy"}
        head = s.head(copies.url + "/ping", timeout=5)
        assert head.status_code == 200 and head.content == b"" and int(head.headers["Content-Length"]) > 0


def test_a_copy_that_fails_to_load_stops_the_server_within_seconds(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                                   "hidden_size": 64, "num_hidden_layers": 0,
                                                   "num_attention_heads": 4, "intermediate_size": 128,
                                                   "vocab_size": 100}))
    srv = LMIServer({**COPIES_ENV, "HF_MODEL_ID": str(model)}, tmp_path, tmp_path / "serve.log")
    t0 = time.monotonic()
    try:
        reason = srv.wait_failed_start(timeout=90)
    finally:
        srv.stop()
    assert time.monotonic() - t0 < 90
    assert 200 not in srv.ping_history and reason


def test_two_copies_of_tensor_parallel_two_start_and_serve(tmp_path, tiny_models):
    """Each copy's engine process starts its own two rank processes (the engine process may have
    children); both copies answer, with the same greedy tokens."""
    srv = LMIServer({"SERVING_MAX_WORKERS": "2", "TENSOR_PARALLEL_DEGREE": "2", "HF_MODEL_ID": str(tiny_models("llama")),
                     "OPTION_MAX_MODEL_LEN": "128"}, tmp_path, tmp_path / "serve.log")
    try:
        srv.wait(200, timeout=180)
        results: list[requests.Response] = []
        threads = [threading.Thread(target=lambda: results.append(_generate(srv.url, "hello world", 6)))
                   for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [r.status_code for r in results] == [200] * 6, [r.text for r in results]
        assert len({r.json()["generated_text"] for r in results}) == 1
        m = srv.metrics()
        assert all(m.get(f'lmi_copy_routed_requests_total{{copy="{i}"}}', 0) >= 1 for i in range(2)), m
    finally:
        srv.stop()

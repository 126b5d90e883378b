"""Model copies, several HTTP frontends and overload through the real server on the CPU (issue 24).

Two real engine copies (`SERVING_MAX_WORKERS=2`: each copy's engine in a core process that gunicorn's
arbiter starts, the embedded model) behind two HTTP frontends (`SERVING_FRONTENDS=2`: gunicorn
workers, each a client of both cores) start every time, serve, and share the load; a model that fails
to load stops the whole server with the reason on one line and exit status 3; a flood far above a
small queue gets LMI's 503 (with Retry-After) at the configured bound, counted over both frontends,
while `/ping` keeps answering fast and every accepted request ends whole; a killed frontend is
replaced and reconnects while the other's streams run on; an adapter registered through one
frontend serves through the other. Which frontend a connection reached is read from /proc
(`lmi_server.frontend_of`).
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import statistics
import threading
import time
import pytest
import requests
from lmi_server import LMIServer, check_jsonlines, engine_cores, frontend_of, frontends
from processes import alive

pytestmark = pytest.mark.slow
QUEUE = 6  # job_queue_size of the copies server
STARTS = 3  # the copies server is started this many times; the last one stays up for the module's tests
SERVED = "smol"
COPIES_ENV = {"SERVING_MAX_WORKERS": "2", "SERVING_FRONTENDS": "2", "SERVING_JOB_QUEUE_SIZE": str(QUEUE),
              "OPTION_MAX_MODEL_LEN": "256", "OPTION_ENABLE_LORA": "true", "OPTION_SERVED_MODEL_NAME": SERVED}


def _generate(url: str, prompt: str, max_new_tokens: int = 8, timeout: float = 120) -> requests.Response:
    return requests.post(url + "/invocations", json={"inputs": prompt, "parameters": {
        "max_new_tokens": max_new_tokens, "ignore_eos_token": True, "details": True}}, timeout=timeout)


class Frontend:
    """A kept-alive HTTP connection known to have reached one particular frontend (worker pid)."""

    def __init__(self, srv: LMIServer, conn: http.client.HTTPConnection, pid: int) -> None:
        self.srv, self.conn, self.pid = srv, conn, pid

    def request(self, method: str, path: str, body: dict | None = None, headers: dict | None = None,
                stream: bool = False) -> http.client.HTTPResponse:
        self.conn.request(method, path, body=None if body is None else json.dumps(body),
                          headers={"Content-Type": "application/json", **(headers or {})})
        r = self.conn.getresponse()
        if not stream:
            r.body = r.read()
        return r

    def generate(self, prompt: str, max_new_tokens: int = 8, adapter: str | None = None) -> tuple[int, dict]:
        r = self.request("POST", "/invocations", {"inputs": prompt, "parameters": {
            "max_new_tokens": max_new_tokens, "ignore_eos_token": True, "details": True}},
            headers={"X-Amzn-SageMaker-Custom-Attributes": f"adapter={adapter}"} if adapter else None)
        return r.status, json.loads(r.body)


def one_per_frontend(srv: LMIServer, want: int = 2, tries: int = 40) -> dict[int, Frontend]:
    """A connection to each of `want` frontends (fresh connections until each worker took one)."""
    found: dict[int, Frontend] = {}
    for _ in range(tries):
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=120)
        conn.connect()
        pid = frontend_of(srv, conn.sock)
        if pid in found:
            conn.close()
        else:
            found[pid] = Frontend(srv, conn, pid)
        if len(found) == want:
            return found
    raise AssertionError(f"connections reached only {sorted(found)} of {frontends(srv)}")


@pytest.fixture(scope="module")
def lora(lora_adapters):
    return lora_adapters("default")


@pytest.fixture(scope="module")
def copies(tmp_path_factory, lora):
    """The copies server, started STARTS times (each start must come up with two cores and two
    frontends, and answer; each stop must leave no process and no socket); the last stays."""
    base, adapters = lora
    model = tmp_path_factory.mktemp("model")
    (model / "adapters").mkdir()
    for f in base.iterdir():
        (model / f.name).symlink_to(f)
    (model / "adapters" / "r16").symlink_to(adapters["r16"], target_is_directory=True)  # every frontend registers it
    srv = None
    try:
        for attempt in range(STARTS):
            cwd = tmp_path_factory.mktemp(f"copies{attempt}")
            env = {**COPIES_ENV, "HF_MODEL_ID": str(model), "TMPDIR": str(cwd),
                   "OPTION_RUNTIME_ADAPTER_SOURCES": str(adapters["r8"])}
            srv = LMIServer(env, cwd, cwd / "serve.log")
            srv.wait(200)
            r = _generate(srv.url, "The capital of France is")
            assert r.status_code == 200 and r.json()["details"]["generated_tokens"] == 8, (attempt, r.text)
            assert "cannot import name" not in srv.log()
            cores, workers = engine_cores(srv), frontends(srv)
            assert len(cores) == 2 and len(workers) == 2, (cores, workers)
            assert sorted(p.name for p in cwd.glob("open-lmi-cores-*/*.sock")) == ["core0.sock", "core1.sock"]
            if attempt < STARTS - 1:
                srv.stop()
                assert srv.proc.returncode == 0, srv.log()[-3000:]
                time.sleep(0.5)
                assert not [p for p in cores + workers if alive(p)]
                assert not list(cwd.glob("open-lmi-cores-*")), "the cores' sockets and files are removed"
        yield srv
    finally:
        if srv is not None:
            srv.stop()


def test_two_copies_two_frontends_share_the_load_and_the_metrics(copies):
    ends = one_per_frontend(copies)
    a, b = ends.values()
    before = copies.metrics()
    key = 'lmi_requests_total{route="/invocations",status="200"}'
    results: list[tuple[int, dict]] = []
    lock = threading.Lock()

    def run(end: Frontend, i: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", copies.port, timeout=120)
        conn.connect()
        out = Frontend(copies, conn, end.pid).generate(f"Question {i}: why is the sky blue? Answer:")
        with lock:
            results.append(out)
        conn.close()

    # Three requests at once through each frontend (its own connection each): the queue's bound in all.
    threads = [threading.Thread(target=run, args=(end, i)) for i, end in enumerate([a, b] * (QUEUE // 2))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [status for status, _ in results] == [200] * QUEUE
    for end in (a, b):  # each frontend served: a request on its own connection
        assert end.generate("Hello there")[0] == 200
    # A scrape of either frontend shows the whole server: both frontends' requests, both cores' load.
    for end in (a, b):
        r = end.request("GET", "/metrics")
        m = {line.rpartition(" ")[0]: float(line.rpartition(" ")[2]) for line in r.body.decode().splitlines()
             if line and not line.startswith("#")}
        assert m[key] - before.get(key, 0) >= QUEUE + 2, (m[key], before.get(key))
        routed = [m.get(f'lmi_copy_routed_requests_total{{copy="{i}"}}', 0) - before.get(
            f'lmi_copy_routed_requests_total{{copy="{i}"}}', 0) for i in range(2)]
        assert sum(routed) >= QUEUE + 2 and all(n >= 2 for n in routed), routed  # least-loaded over both cores
    # Same greedy answer from either copy and either frontend: the copies hold the same model.
    answers = {end.generate("The capital of France is")[1]["generated_text"] for end in (a, b, a, b)}
    assert len(answers) == 1


def test_an_adapter_registered_through_one_frontend_serves_through_the_other(copies, lora):
    _, adapters = lora
    a, b = one_per_frontend(copies).values()
    listed = lambda end: [x["name"] for x in json.loads(end.request("GET", f"/models/{SERVED}/adapters").body)["adapters"]]  # noqa: E731
    assert listed(a) == listed(b) == ["r16"]  # the start-up adapter, registered by both frontends at once
    r = a.request("POST", f"/models/{SERVED}/adapters?name=r8&src={adapters['r8']}")
    assert r.status == 200, r.body
    base = a.generate("The capital of France is", 8)[1]["generated_text"]
    via_b = b.generate("The capital of France is", 8, adapter="r8")
    via_a = a.generate("The capital of France is", 8, adapter="r8")
    assert via_b[0] == via_a[0] == 200, (via_a, via_b)
    assert via_b[1]["generated_text"] == via_a[1]["generated_text"] != base
    assert listed(b) == ["r16", "r8"]
    again = b.request("POST", f"/models/{SERVED}/adapters?name=r8&src={adapters['r8']}")
    assert again.status == 409, again.body  # the name is taken, whichever frontend registered it
    assert b.request("DELETE", f"/models/{SERVED}/adapters/r8").status == 200
    status, body = a.generate("The capital of France is", 8, adapter="r8")
    assert status == 404 and "r8" in body["error"], body
    assert listed(a) == ["r16"]


def test_a_killed_frontend_is_replaced_and_reconnects_while_the_other_serves_on(copies):
    cores = engine_cores(copies)
    ends = one_per_frontend(copies)
    a, b = ends.values()
    streams = {}
    for end in (a, b):
        r = end.request("POST", "/invocations", {"inputs": "Tell me a long story about a ship:", "stream": True,
                                                 "parameters": {"max_new_tokens": 96, "ignore_eos": True}},
                        stream=True)
        assert r.status == 200
        streams[end.pid] = (r, [r.readline()])  # a first token: both requests run in the cores
    os.kill(a.pid, signal.SIGKILL)
    r, lines = streams[b.pid]
    lines = [ln.decode() for ln in lines + r.read().splitlines() if ln.strip()]
    check_jsonlines(lines)
    assert len(lines) == 96  # the other frontend's stream ran to its end
    cut, _ = streams[a.pid]
    with pytest.raises((http.client.HTTPException, OSError)):  # the killed worker's response never ends
        cut.read()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (len(frontends(copies)) == 2 and a.pid not in frontends(copies)):
        time.sleep(0.2)
    new = [p for p in frontends(copies) if p != b.pid]
    assert len(new) == 1 and new[0] != a.pid, frontends(copies)
    copies.wait(200, timeout=60)
    ends = one_per_frontend(copies)
    assert set(ends) == {b.pid, new[0]}
    for end in ends.values():
        assert end.generate("The capital of France is")[0] == 200
    assert engine_cores(copies) == cores  # the cores served on throughout
    copies.wait_idle(timeout=60)  # the killed frontend's request was aborted in its core: no KV held


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

"""Soak test of the LMI container: N minutes of mixed traffic, then the invariants after idle.

Starts `container/serve serve` on the embedded default model (fp32, CPU, loopback) or uses a
given loopback `--url`, and runs, with at most `--concurrency` clients and `--max-requests`
requests: streams (jsonlines, SSE), plain and batch requests, chat on /invocations and /v1,
/v1/completions, client disconnects mid-stream, and hostile requests (malformed JSON, 1 MB of
nesting, lone surrogates, NaN / Infinity and wrong-typed parameters, unknown paths and methods,
batches larger than the job queue, invalid UTF-8). `/ping` is probed every 0.5 s and `/metrics`
scraped every second throughout.

At the end it reports requests sent / accepted / completed / ended with an error record /
rejected 4xx, the /ping and /metrics latencies, the server's RSS growth, and, once the server is
idle, `lmi_kv_blocks_used` and `lmi_requests_in_flight` from /metrics. It exits 1 if an
invariant fails: /ping ever slower than 2 s (or not 200), any 5xx or transport error, any
answer of the wrong kind (a valid request refused, a hostile one accepted), KV blocks or
requests still in flight after idle, /metrics over 256 KB, or RSS growth over
`--max-rss-growth-mb` when given.

  .venv/bin/python bench/soak.py --minutes 3
  .venv/bin/python bench/soak.py --url http://127.0.0.1:8080 --pid <gunicorn master pid> --minutes 10
"""

from __future__ import annotations

import argparse
import collections
import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

ROOT = Path(__file__).resolve().parents[1]
LOOPBACK = ("127.0.0.1", "localhost", "::1")
# The container tests' CPU settings: fp32, short context, small KV budget, one torch thread.
SERVER_ENV = {"OPTION_DTYPE": "fp32", "OPTION_MAX_MODEL_LEN": "512", "OPTION_KV_CACHE_MEMORY_GB": "0.25",
              "OPTION_DEVICE": "cpu", "OMP_NUM_THREADS": "1", "LOG_LEVEL": "INFO"}
PING_EVERY_S, PING_LIMIT_S = 0.5, 2.0
SCRAPE_EVERY_S, METRICS_LIMIT_BYTES = 1.0, 256 * 1024
_PROMPTS = ("The capital of France is", "Write a haiku about the sea.", "List three colors:",
            "Explain gravity to a child.", "Once upon a time", "def fibonacci(n):", "The meaning of life is",
            "Translate to French: good morning", "Q: What is 2 + 2?\nA:", "Tell me a joke about cats.")


# ---- HTTP -------------------------------------------------------------------------------------

class Client:
    """One-shot HTTP/1.1 requests to the server under test (a fresh connection each)."""

    def __init__(self, url: str) -> None:
        u = urlparse(url)
        if u.scheme != "http" or u.hostname not in LOOPBACK:
            raise SystemExit(f"--url must be http:// on a loopback address ({', '.join(LOOPBACK)}), got {url}")
        self.host, self.port = u.hostname, u.port or 80

    def open(self, method: str, path: str, body: bytes | None = None, content_type: str = "application/json",
             timeout: float = 300.0) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse, socket.socket]:
        """Send a request; returns the connection, its response (body unread) and its socket."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        headers = {"Content-Type": content_type} if body is not None else {}
        conn.request(method, path, body=body, headers=headers)
        sock = conn.sock  # getresponse() may hand it over to the response
        return conn, conn.getresponse(), sock

    def call(self, method: str, path: str, body: bytes | None = None, content_type: str = "application/json",
             timeout: float = 300.0) -> tuple[int, bytes, float]:
        """(status, body, seconds)."""
        t0 = time.monotonic()
        conn, resp, _ = self.open(method, path, body, content_type, timeout)
        try:
            return resp.status, resp.read(), time.monotonic() - t0
        finally:
            conn.close()


# ---- the traffic ------------------------------------------------------------------------------

@dataclass
class Outcome:
    """How one request ended, as the soak counts it."""

    kind: str
    status: int = 0  # 0: no HTTP status (transport error)
    completed: bool = False  # a whole, well-formed answer
    error_record: bool = False  # a 200 whose stream / body ended with finish_reason "error"
    disconnected: bool = False  # the client went away on purpose
    problem: str = ""  # an answer of the wrong kind (invariant)


def _gen_params(rng: random.Random) -> dict:
    params: dict = {"max_new_tokens": rng.randint(2, 24)}
    if rng.random() < 0.3:
        params.update(do_sample=True, temperature=rng.choice([0.5, 0.8, 1.2]), top_p=0.9, seed=rng.randint(0, 99))
    if rng.random() < 0.2:
        params["stop_sequences"] = [rng.choice([".", "\n", " the"])]
    if rng.random() < 0.2:
        params["details"] = True
    return params


def _json(body: object) -> bytes:
    return json.dumps(body).encode()


def _expect_200(kind: str, status: int, raw: bytes, check: Callable[[object], bool]) -> Outcome:
    if status != 200:
        return Outcome(kind, status, problem=f"{kind}: {status} {raw[:200]!r}")
    try:
        obj = json.loads(raw)
    except ValueError:
        return Outcome(kind, status, problem=f"{kind}: not JSON: {raw[:200]!r}")
    error = any(isinstance(o, dict) and (o.get("details") or {}).get("finish_reason") == "error"
                for o in (obj if isinstance(obj, list) else [obj]))
    ok = check(obj)
    return Outcome(kind, status, completed=ok and not error, error_record=error,
                   problem="" if ok or error else f"{kind}: unexpected body {raw[:200]!r}")


def plain(c: Client, rng: random.Random) -> Outcome:
    body = {"inputs": rng.choice(_PROMPTS), "parameters": _gen_params(rng)}
    status, raw, _ = c.call("POST", "/invocations", _json(body))
    return _expect_200("plain", status, raw, lambda o: isinstance(o.get("generated_text"), str))


def batch(c: Client, rng: random.Random) -> Outcome:
    n = rng.randint(2, 4)
    body = {"inputs": rng.sample(_PROMPTS, n), "parameters": {"max_new_tokens": rng.randint(2, 12)}}
    status, raw, _ = c.call("POST", "/invocations", _json(body))
    return _expect_200("batch", status, raw, lambda o: isinstance(o, list) and len(o) == n)


def chat(c: Client, rng: random.Random) -> Outcome:
    path = rng.choice(["/v1/chat/completions", "/invocations"])
    body = {"messages": [{"role": "user", "content": rng.choice(_PROMPTS)}], "max_tokens": rng.randint(2, 16)}
    status, raw, _ = c.call("POST", path, _json(body))
    return _expect_200("chat", status, raw, lambda o: o.get("object") == "chat.completion" and o["choices"])


def completion(c: Client, rng: random.Random) -> Outcome:
    body = {"model": "any", "prompt": rng.choice(_PROMPTS), "max_tokens": rng.randint(2, 16), "temperature": 0}
    status, raw, _ = c.call("POST", "/v1/completions", _json(body))
    return _expect_200("completion", status, raw, lambda o: o.get("object") == "text_completion")


def stream(c: Client, rng: random.Random, disconnect_after: int = 0) -> Outcome:
    """A jsonlines (/invocations) or SSE (/v1) stream read to its end, or dropped after some records."""
    kind = "disconnect" if disconnect_after else "stream"
    route = rng.choice(["jsonlines", "jsonlines", "chat_sse", "completion_sse"])
    # A stream to be dropped is long enough to be still running when the client leaves.
    long = {"max_new_tokens": 200, "ignore_eos_token": True, "stop_sequences": []} if disconnect_after else {}
    if route == "jsonlines":
        path, body = "/invocations", {"inputs": rng.choice(_PROMPTS), "stream": True,
                                      "parameters": {**_gen_params(rng), **long}}
    else:
        opts = {"stream": True, "max_tokens": 200 if long else rng.randint(2, 24), "ignore_eos": bool(long)}
        if route == "chat_sse":
            path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": rng.choice(_PROMPTS)}],
                                                  **opts}
        else:
            path, body = "/v1/completions", {"prompt": rng.choice(_PROMPTS), **opts}
    conn, resp, sock = c.open("POST", path, _json(body))
    try:
        if resp.status != 200:
            return Outcome(kind, resp.status, problem=f"{kind}: {resp.status} {resp.read()[:200]!r}")
        records = []
        while True:
            line = resp.readline()
            if not line:
                break
            line = line.strip()
            if line:
                records.append(line)
            if disconnect_after and len(records) >= disconnect_after:
                sock.shutdown(socket.SHUT_RDWR)  # the client goes away mid-stream
                return Outcome(kind, 200, disconnected=True)
    finally:
        conn.close()
    return _check_stream(kind, route, records)


def _check_stream(kind: str, route: str, records: list[bytes]) -> Outcome:
    if route == "jsonlines":
        objs = [json.loads(r) for r in records]
        last = objs[-1] if objs else {}
        if (last.get("details") or {}).get("finish_reason") == "error" or "error" in last:
            return Outcome(kind, 200, error_record=True)
        ok = "generated_text" in last and last["generated_text"] == "".join(o["token"]["text"] for o in objs)
        return Outcome(kind, 200, completed=ok, problem="" if ok else f"{kind}: bad jsonlines end {records[-2:]!r}")
    if records and records[-1] == b"data: [DONE]":
        events = [json.loads(r[len(b"data: "):]) for r in records[:-1]]
        reasons = [ch.get("finish_reason") for e in events for ch in e.get("choices", [])]
        error = "error" in reasons or any("error" in e for e in events)
        return Outcome(kind, 200, completed=not error, error_record=error)
    return Outcome(kind, 200, problem=f"{kind}: SSE stream without [DONE]: {records[-2:]!r}")


def disconnect(c: Client, rng: random.Random) -> Outcome:
    return stream(c, rng, disconnect_after=rng.randint(1, 4))


# Hostile requests: (name, method, path, body, content type); each must be answered 4xx.
def _hostile_cases(queue_size: int) -> list[tuple[str, str, str, bytes | None, str]]:
    deep = b'{"inputs": "x", "parameters": ' + b"[" * 500_000 + b"]" * 500_000 + b"}"
    j = "application/json"
    return [
        ("malformed JSON", "POST", "/invocations", b'{"inputs": "unterminated', j),
        ("not an object", "POST", "/v1/completions", b'[1, 2, 3]', j),
        ("1 MB of nesting", "POST", "/invocations", deep, j),
        ("nesting past the recursion limit", "POST", "/v1/chat/completions", b'{"messages": ' + b"[" * 5000 + b"}", j),
        ("lone surrogate", "POST", "/invocations", b'{"inputs": "abc \\ud800 def"}', j),
        ("lone surrogate in chat", "POST", "/v1/chat/completions",
         b'{"messages": [{"role": "user", "content": "\\udfff"}]}', j),
        ("NaN temperature", "POST", "/invocations",
         b'{"inputs": "x", "parameters": {"do_sample": true, "temperature": NaN}}', j),
        ("Infinity repetition_penalty", "POST", "/v1/completions",
         b'{"prompt": "x", "repetition_penalty": Infinity}', j),
        ("1e999 top_p", "POST", "/v1/chat/completions",
         b'{"messages": [{"role": "user", "content": "x"}], "top_p": 1e999}', j),
        ("wrong types", "POST", "/invocations", _json({"inputs": "x", "parameters": {"max_new_tokens": "ten"}}), j),
        ("negative max_tokens", "POST", "/v1/completions", _json({"prompt": "x", "max_tokens": -3}), j),
        ("out-of-vocabulary stop id", "POST", "/invocations",
         _json({"inputs": "x", "parameters": {"min_tokens": 1, "stop_token_ids": [10 ** 9]}}), j),
        ("prompt over the max model length", "POST", "/invocations", _json({"inputs": "word " * 2000}), j),
        ("batch over the job queue", "POST", "/invocations", _json({"inputs": ["x"] * (queue_size + 1)}), j),
        ("invalid UTF-8", "POST", "/invocations", b'{"inputs": "\xff\xfe"}', j),
        ("empty body", "POST", "/v1/chat/completions", b"", j),
        ("unknown path", "POST", f"/no/such/route/{random.getrandbits(48):x}", b"{}", j),
        ("unknown method", "BREW", "/invocations", None, j),
        ("GET on a POST route", "GET", "/v1/completions", None, j),
    ]


@dataclass
class Stats:
    """Everything counted during the soak (guarded by `lock`)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    sent: int = 0
    by_kind: collections.Counter = field(default_factory=collections.Counter)
    statuses: collections.Counter = field(default_factory=collections.Counter)
    accepted: int = 0
    completed: int = 0
    error_records: int = 0
    disconnects: int = 0
    rejected_4xx: int = 0
    server_errors: int = 0
    transport_errors: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    pings: list[tuple[float, int]] = field(default_factory=list)  # (seconds, status; 0 = no answer)
    scrapes: list[tuple[float, int]] = field(default_factory=list)  # (seconds, bytes)
    rss: list[tuple[float, int]] = field(default_factory=list)  # (monotonic time, bytes)

    def add(self, out: Outcome) -> None:
        with self.lock:
            self.by_kind[out.kind] += 1
            self.statuses[out.status] += 1
            self.accepted += out.status == 200
            self.completed += out.completed
            self.error_records += out.error_record
            self.disconnects += out.disconnected
            self.rejected_4xx += 400 <= out.status < 500
            self.server_errors += out.status >= 500
            if out.problem:
                self.problems.append(out.problem)


def hostile(c: Client, rng: random.Random, queue_size: int) -> Outcome:
    name, method, path, body, ctype = rng.choice(_hostile_cases(queue_size))
    status, raw, _ = c.call(method, path, body, ctype)
    ok = 400 <= status < 500
    return Outcome("hostile", status, problem="" if ok else f"hostile {name}: {status} {raw[:200]!r}")


# ---- the server -------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(log_path: Path, extra_env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPTION_", "SERVING_", "HF_MODEL"))}
    env.update(SERVER_ENV, **extra_env, SAGEMAKER_BIND_TO_PORT=str(port))
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    log = open(log_path, "wb")  # noqa: SIM115 - the server writes to it until it exits
    proc = subprocess.Popen([str(ROOT / "container" / "serve"), "serve"], env=env, cwd=log_path.parent,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}"


def wait_ready(c: Client, proc: subprocess.Popen | None, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode} before it was ready")
        try:
            if c.call("GET", "/ping", timeout=5)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"/ping did not answer 200 within {timeout:g} s")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(40)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def tree_rss(pid: int) -> int:
    """Resident bytes of `pid` and all its descendants (gunicorn master + worker + rank processes)."""
    children: dict[int, list[int]] = collections.defaultdict(list)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children[ppid].append(int(entry))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo.extend(children.get(p, ()))
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def parse_metrics(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


# ---- the run ----------------------------------------------------------------------------------

def run(args: argparse.Namespace, c: Client, pid: int | None) -> tuple[Stats, dict[str, float], dict]:
    stats = Stats()
    start = time.monotonic()
    end = start + args.minutes * 60
    stop = threading.Event()

    def hostile_request(cl: Client, rng: random.Random) -> Outcome:
        return hostile(cl, rng, args.job_queue_size)

    kinds: list[tuple[Callable[[Client, random.Random], Outcome], int]] = [
        (stream, 22), (plain, 14), (batch, 5), (chat, 12), (completion, 7), (disconnect, 10), (hostile_request, 30)]

    def client(i: int) -> None:
        rng = random.Random(args.seed * 1000 + i)
        funcs, weights = zip(*kinds)
        while not stop.is_set() and time.monotonic() < end:
            with stats.lock:
                if stats.sent >= args.max_requests:
                    return
                stats.sent += 1
            fn = rng.choices(funcs, weights)[0]
            try:
                stats.add(fn(c, rng))
            except (OSError, http.client.HTTPException, ValueError) as exc:
                with stats.lock:
                    stats.transport_errors.append(f"{fn.__name__}: {type(exc).__name__}: {exc}")

    def pinger() -> None:
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                status, _, secs = c.call("GET", "/ping", timeout=10)
            except OSError:
                status, secs = 0, time.monotonic() - t0
            with stats.lock:
                stats.pings.append((secs, status))
            stop.wait(max(0.0, PING_EVERY_S - (time.monotonic() - t0)))

    def scraper() -> None:
        n = 0
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                status, raw, secs = c.call("GET", "/metrics", timeout=10)
                with stats.lock:
                    stats.scrapes.append((secs, len(raw) if status == 200 else -1))
            except OSError as exc:
                with stats.lock:
                    stats.transport_errors.append(f"/metrics: {exc}")
            if pid is not None and n % 5 == 0:
                with stats.lock:
                    stats.rss.append((time.monotonic(), tree_rss(pid)))
            n += 1
            stop.wait(max(0.0, SCRAPE_EVERY_S - (time.monotonic() - t0)))

    rss_ready = tree_rss(pid) if pid is not None else None
    side = [threading.Thread(target=pinger, daemon=True), threading.Thread(target=scraper, daemon=True)]
    clients = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.concurrency)]
    for t in side + clients:
        t.start()
    next_progress = start + 30
    try:
        while any(t.is_alive() for t in clients):
            time.sleep(0.5)
            if args.progress and time.monotonic() >= next_progress:
                next_progress += 30
                with stats.lock:
                    print(f"  {time.monotonic() - start:5.0f} s: {stats.sent} sent, {stats.completed} completed, "
                          f"{stats.rejected_4xx} rejected, max ping {max((p for p, _ in stats.pings), default=0):.3f} s",
                          file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        print("interrupted: stopping the clients", file=sys.stderr)
        stop.set()
    for t in clients:
        t.join(360)
    traffic_s = time.monotonic() - start
    # Idle: every request answered or dropped; /ping and /metrics keep going until the server is quiet.
    idle_deadline = time.monotonic() + args.idle_timeout
    metrics: dict[str, float] = {}
    while time.monotonic() < idle_deadline:
        metrics = parse_metrics(c.call("GET", "/metrics", timeout=10)[1].decode())
        if metrics.get("lmi_requests_in_flight") == 0 and metrics.get("lmi_kv_blocks_used") == 0:
            break
        time.sleep(0.5)
    idle_s = args.idle_timeout - max(0.0, idle_deadline - time.monotonic())
    stop.set()
    for t in side:
        t.join(15)
    rss_end = tree_rss(pid) if pid is not None else None
    info = {"traffic_s": traffic_s, "idle_s": idle_s, "rss_ready": rss_ready, "rss_end": rss_end}
    return stats, metrics, info


def report(args: argparse.Namespace, target: str, stats: Stats, metrics: dict[str, float], info: dict) -> list[str]:
    """Print the summary; returns the failed invariants."""
    mb = 1024 * 1024
    failed: list[str] = []
    pings = [p for p, _ in stats.pings]
    bad_pings = sum(1 for _, s in stats.pings if s != 200)
    sizes = [b for _, b in stats.scrapes if b >= 0]
    print(f"open-lmi soak: {info['traffic_s'] / 60:.1f} min of traffic against {target}, "
          f"{args.concurrency} clients, at most {args.max_requests} requests")
    print(f"requests sent                 {stats.sent}")
    print(f"  accepted (200)              {stats.accepted}")
    print(f"  completed                   {stats.completed}")
    print(f"  ended with an error record  {stats.error_records}")
    print(f"  client disconnects (chosen) {stats.disconnects}")
    four = {s: n for s, n in sorted(stats.statuses.items()) if 400 <= s < 500}
    print(f"  rejected 4xx                {stats.rejected_4xx}  {four}")
    print(f"  5xx                         {stats.server_errors}")
    print(f"  transport errors            {len(stats.transport_errors)}")
    print(f"  wrong kind of answer        {len(stats.problems)}")
    print(f"  by kind                     {dict(sorted(stats.by_kind.items()))}")
    print(f"/ping: {len(pings)} probes every {PING_EVERY_S} s, max {max(pings, default=0):.3f} s, "
          f"p99 {_pct(pings, 99):.3f} s, not 200: {bad_pings}")
    print(f"/metrics: {len(stats.scrapes)} scrapes every {SCRAPE_EVERY_S:g} s, max {max((s for s, _ in stats.scrapes), default=0):.3f} s, "
          f"size {sizes[0] if sizes else 0} -> {sizes[-1] if sizes else 0} bytes (max {max(sizes, default=0)})")
    print(f"after idle ({info['idle_s']:.1f} s): lmi_requests_in_flight {metrics.get('lmi_requests_in_flight')}, "
          f"lmi_kv_blocks_used {metrics.get('lmi_kv_blocks_used')}, lmi_running_sequences "
          f"{metrics.get('lmi_running_sequences')}, lmi_queue_depth {metrics.get('lmi_queue_depth')}")
    if info["rss_ready"] is not None:
        rss = [b for _, b in stats.rss]
        warm = rss[min(len(rss) - 1, max(1, len(rss) // 10))] if rss else info["rss_ready"]
        growth = info["rss_end"] - warm
        print(f"server RSS (process tree): ready {info['rss_ready'] / mb:.0f} MB, after warm-up {warm / mb:.0f} MB, "
              f"max {max(rss, default=0) / mb:.0f} MB, end {info['rss_end'] / mb:.0f} MB; "
              f"growth since warm-up {growth / mb:+.0f} MB, since ready {(info['rss_end'] - info['rss_ready']) / mb:+.0f} MB")
        t0 = stats.rss[0][0] if stats.rss else 0.0
        step = max(1, len(stats.rss) // 8)
        trend = ", ".join(f"{t - t0:.0f} s {b / mb:.0f}" for t, b in stats.rss[::step] + stats.rss[-1:])
        print(f"  RSS trend (MB): {trend}")
        if args.max_rss_growth_mb is not None and growth > args.max_rss_growth_mb * mb:
            failed.append(f"RSS grew {growth / mb:.0f} MB after warm-up (limit {args.max_rss_growth_mb} MB)")
    else:
        print("server RSS: unknown (pass --pid with the server's process id)")
    if max(pings, default=0) >= PING_LIMIT_S or bad_pings or not pings:
        failed.append(f"/ping: max {max(pings, default=0):.3f} s (limit {PING_LIMIT_S} s), {bad_pings} not 200")
    if metrics.get("lmi_requests_in_flight") != 0:
        failed.append(f"lmi_requests_in_flight is {metrics.get('lmi_requests_in_flight')} after idle")
    if metrics.get("lmi_kv_blocks_used") != 0:
        failed.append(f"lmi_kv_blocks_used is {metrics.get('lmi_kv_blocks_used')} after idle")
    if stats.server_errors:
        failed.append(f"{stats.server_errors} answers were 5xx")
    if stats.transport_errors:
        failed.append(f"{len(stats.transport_errors)} transport errors, e.g. {stats.transport_errors[:3]}")
    if stats.problems:
        failed.append(f"{len(stats.problems)} answers of the wrong kind, e.g. {stats.problems[:3]}")
    if max(sizes, default=0) > METRICS_LIMIT_BYTES:
        failed.append(f"/metrics grew to {max(sizes)} bytes (limit {METRICS_LIMIT_BYTES})")
    if stats.completed == 0:
        failed.append("no request completed")
    print("invariants: " + ("all hold" if not failed else "FAILED\n  - " + "\n  - ".join(failed)))
    return failed


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, int(len(s) * q / 100))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0, help="how long traffic runs (default 10)")
    ap.add_argument("--url", help="a running server on a loopback address (default: start container/serve)")
    ap.add_argument("--pid", type=int, help="with --url: the server's process id (its tree's RSS is measured)")
    ap.add_argument("--concurrency", type=int, default=8, help="client threads (default 8)")
    ap.add_argument("--max-requests", type=int, default=100_000, help="stop after this many requests")
    ap.add_argument("--job-queue-size", type=int, default=1000,
                    help="the server's job_queue_size (the 'batch over the job queue' case sends one more)")
    ap.add_argument("--max-rss-growth-mb", type=float, help="fail if RSS grows more after warm-up")
    ap.add_argument("--idle-timeout", type=float, default=60.0, help="seconds to wait for an idle server")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log", type=Path, help="the started server's log (default: a file in /tmp)")
    ap.add_argument("--progress", action="store_true", help="a progress line on stderr every 30 s")
    args = ap.parse_args()
    proc = None
    if args.url:
        c, pid, target = Client(args.url), args.pid, args.url
    else:
        log = args.log or Path(f"/tmp/open-lmi-soak-{os.getpid()}.log")
        proc, url = start_server(log.resolve(), {"SERVING_JOB_QUEUE_SIZE": str(args.job_queue_size)})
        c, pid, target = Client(url), proc.pid, f"{url} (container/serve serve, default model; log {log})"
    try:
        wait_ready(c, proc)
        stats, metrics, info = run(args, c, pid)
        failed = report(args, target, stats, metrics, info)
    finally:
        if proc is not None:
            stop_server(proc)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()

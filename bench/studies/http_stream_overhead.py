"""Server-side cost of one streamed token: how much Python (GIL) time the HTTP path spends per token.

The server is a real gunicorn gthread worker with the container's settings (container/gunicorn.conf.py)
running the real Flask app (serving/server/app.py), RequestRunner, formatters and EngineLoop; only the
LLMEngine is fake: each `step()` emits one token for every running request, after `--host-us` of
GIL-holding busy work (the engine's Python) and `--gpu-ms` of GIL-free sleep (waiting on the GPU).
A client process (raw sockets + selectors, so it costs the box little) opens N streams at once,
each for T tokens, reads them to the end and checks every record (count, order, final text).

Per (mode, format, N) it prints, as medians over `--repeats` runs:
  eng st/s   engine steps/s with nobody attached (the same fake engine in this process; the deltas
             pile up in the stream queues);
  srv st/s   engine steps/s inside the server while all N streams are attached and running;
  tok/s      tokens delivered to the clients per second (wall: first request sent -> last byte);
  us/tok     server CPU (user + sys, all threads) per delivered token, minus what the engine alone
             spent for the same steps: the HTTP side's cost of one token. `usr` is the user part,
             which is Python holding the GIL (the sys part is mostly socket writes, GIL released);
  eng +us/tok  how much longer each engine step took with the clients attached, per stream:
             (1/srv - 1/eng) / N; the engine thread's wait for the GIL that one token costs;
  rec/wr     records per HTTP chunk written (1.0 = one socket write per record; > 1 = coalesced).

Before the server runs, an in-process table gives the Python of one record alone (the runner's
generator: queue get, Result.add, formatting; and the engine thread's put), without sockets or threads.

Modes: `max` (host 0, gpu 0: the engine runs as fast as it can, so the HTTP threads fall behind
and whatever they cost per record shows up directly as lost engine steps) and `paced` (a GPU-like
step: the HTTP threads can keep up, mostly one record per stream per step, as on the GPU).

  OMP_NUM_THREADS=1 .venv/bin/python bench/studies/http_stream_overhead.py
  OMP_NUM_THREADS=1 .venv/bin/python bench/studies/http_stream_overhead.py --streams 128 --formats lmi --modes max
"""

from __future__ import annotations

import argparse
import json
import os
import random
import selectors
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # before bench/ (bench/serving.py would shadow the serving package)

from serving.outputs import StreamDelta  # noqa: E402

# Word-level vocabulary: plain words plus a few that need JSON escapes (quotes, non-ASCII, newline).
_WORDS = [" the", " of", " and", " to", " in", " is", " that", " for", " it", " as", " was", " with", " be",
          " by", " on", " not", " he", " this", " are", " or", " his", " from", " at", " which", " but",
          " have", " an", " they", " you", " were", " her", " she", " there", " been", " one", " all", " we",
          " caf\u00e9", " na\u00efve", ' "quoted"', "\n", " \u00fcber", " 20", "."]
VOCAB = ["<s>", "<unk>"] + _WORDS
MODES = {"max": (0.0, 0.0), "paced": (1000.0, 8.0)}  # (host_us, gpu_ms) per step


class WordTokenizer:
    all_special_ids = [0]
    chat_template = "fake"

    def __init__(self) -> None:
        self._ids = {w: i for i, w in enumerate(VOCAB)}

    def __len__(self) -> int:
        return len(VOCAB)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [self._ids.get(" " + w, 1) for w in text.split()]
        return ([0] if add_special_tokens else []) + (ids or [1])

    def decode(self, ids, skip_special_tokens: bool = True) -> str:  # noqa: ANN001
        return "".join(VOCAB[i] for i in ids if i or not skip_special_tokens)

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True, chat_template=None):  # noqa: ANN001, ANN201
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + ("assistant:" if add_generation_prompt else "")


def token_at(seed: int, i: int) -> int:
    return 2 + (seed * 7 + i * 13) % len(_WORDS)


class FakeEngine:
    """The LLMEngine surface EngineLoop and RequestRunner use; one token per running request per step."""

    def __init__(self, host_us: float = 0.0, gpu_ms: float = 0.0) -> None:
        self.host_us, self.gpu_ms = host_us, gpu_ms
        self.tokenizer = WordTokenizer()
        self.max_model_len = 1 << 20
        self.reqs: dict[str, list] = {}
        self.steps: list[tuple[float, int]] = []  # (perf_counter at step end, requests in the step)
        self.gate = 0  # no step until this many requests are in (all streams start together)

    def encode(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt)

    def validate(self, ids: list[int], params) -> None:  # noqa: ANN001
        pass

    def add_request(self, request_id: str, prompt, params, prompt_token_ids=None) -> None:  # noqa: ANN001
        ids = prompt_token_ids if prompt_token_ids is not None else self.encode(prompt)
        # [max tokens, generated, prompt ids, seed, with logprobs]
        self.reqs[request_id] = [params.max_tokens, 0, tuple(ids), len(self.reqs), params.logprobs is not None]

    def abort_request(self, request_id: str) -> list[StreamDelta]:
        r = self.reqs.pop(request_id, None)
        return [StreamDelta(request_id, 0, (), "", finish_reason="abort")] if r else []

    def has_unfinished_requests(self) -> bool:
        return len(self.reqs) >= self.gate if self.gate else bool(self.reqs)

    def stats(self) -> dict:
        return {"num_requests_running": len(self.reqs), "num_requests_waiting": 0}

    def step(self) -> list[StreamDelta]:
        self.gate = 0
        if self.host_us:
            end = time.perf_counter() + self.host_us * 1e-6
            while time.perf_counter() < end:
                pass
        if self.gpu_ms:
            time.sleep(self.gpu_ms * 1e-3)
        out = []
        for rid, r in list(self.reqs.items()):
            max_tokens, i, prompt_ids, seed, lp = r
            tid = token_at(seed, i)
            text = VOCAB[tid]
            last = i + 1 >= max_tokens
            out.append(StreamDelta(rid, 0, (tid,), text, logprobs=(-0.25 - i % 7 / 8,) if lp else (),
                                   token_texts=(text,), finish_reason="length" if last else None,
                                   num_prompt_tokens=len(prompt_ids), num_output_tokens=i + 1,
                                   prompt_token_ids=prompt_ids if i == 0 else None))
            r[1] = i + 1
            if last:
                del self.reqs[rid]
        self.steps.append((time.perf_counter(), len(out)))
        return out


def full_batch_rate(steps: list[tuple[float, int]], n: int) -> tuple[int, float]:
    """(steps, steps/s) over the steps that ran all n requests."""
    ts = [t for t, k in steps if k == n]
    if len(ts) < 2:
        return len(ts), float("nan")
    return len(ts), (len(ts) - 1) / (ts[-1] - ts[0])


# ---- engine alone (this process) -----------------------------------------------------------------

def engine_alone(n: int, tokens: int, host_us: float, gpu_ms: float) -> dict:
    from serving.engine_config import EngineConfig
    from serving.engine.engine_loop import EngineLoop
    from serving.sampling_params import SamplingParams

    engine = FakeEngine(host_us, gpu_ms)
    engine.gate = n
    loop = EngineLoop(EngineConfig(), engine_factory=lambda cfg: engine).start()
    loop.wait_ready(10)
    tok = engine.tokenizer
    try:
        c0, t0 = time.process_time(), time.perf_counter()
        streams = [loop.add_request(f"r{i}", tok.encode("hello world"), SamplingParams(max_tokens=tokens, logprobs=0))
                   for i in range(n)]
        while not all(s.finished for s in streams):
            time.sleep(0.002)
        cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    finally:
        loop.close()
    _, rate = full_batch_rate(engine.steps, n)
    return {"steps": len(engine.steps), "cpu_s": cpu, "wall_s": wall, "steps_per_s": rate,
            "cpu_per_step_us": cpu / max(1, len(engine.steps)) * 1e6}


# ---- the server (a child process) ----------------------------------------------------------------

def serve(port: int, threads: int) -> None:
    """gunicorn, one gthread worker, the container's settings; the app is built in the worker."""
    from gunicorn.app.base import BaseApplication

    class App(BaseApplication):
        def load_config(self) -> None:
            for k, v in {"bind": f"127.0.0.1:{port}", "workers": 1, "worker_class": "gthread", "threads": threads,
                         "worker_connections": threads + 64, "preload_app": False, "timeout": 120,
                         "keepalive": 75, "backlog": 2048, "loglevel": "warning", "accesslog": None,
                         "control_socket_disable": True}.items():
                if k in self.cfg.settings:
                    self.cfg.set(k, v)

        def load(self):  # noqa: ANN202 - runs in the worker, after fork
            return build_app()

    App().run()


def build_app():  # noqa: ANN201
    from flask import Response, request

    from serving.server.app import create_app
    from serving.server.settings.serving_config import load_config
    from serving.engine_config import EngineConfig
    from serving.engine.engine_loop import EngineLoop

    engine = FakeEngine()
    loop = EngineLoop(EngineConfig(), engine_factory=lambda cfg: engine).start()
    loop.wait_ready(10)
    config = load_config({"SERVING_GUNICORN_THREADS": "0"}, [], gpu_count=lambda: 0)
    app = create_app(loop, config)

    @app.post("/bench/reset")
    def reset() -> Response:
        body = request.get_json(force=True)
        engine.host_us, engine.gpu_ms = float(body["host_us"]), float(body["gpu_ms"])
        engine.steps, engine.gate = [], int(body["n"])
        return Response("{}", 200, mimetype="application/json")

    @app.get("/bench/stats")
    def stats() -> Response:
        n = int(request.args.get("n", "0"))
        t = os.times()
        full, rate = full_batch_rate(engine.steps, n)
        return Response(json.dumps({"user": t.user, "sys": t.system, "steps": len(engine.steps),
                                    "full_steps": full, "steps_per_s": rate}), 200, mimetype="application/json")

    return app


class Server:
    def __init__(self, threads: int) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve", str(self.port), "--threads", str(threads)],
                                     env=env, start_new_session=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if self.request("GET", "/ping")[0] == 200:
                    return
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError("the bench server did not come up")

    def request(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        import http.client

        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            c.request(method, path, body=json.dumps(body) if body is not None else None,
                      headers={"Content-Type": "application/json"})
            r = c.getresponse()
            return r.status, json.loads(r.read() or b"{}")
        finally:
            c.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


# ---- the client (a child process) ----------------------------------------------------------------

def request_bytes(fmt: str, port: int, tokens: int, i: int) -> bytes:
    if fmt == "lmi":
        path = "/invocations"
        body = {"inputs": f"hello world {i}", "parameters": {"max_new_tokens": tokens}, "stream": True}
    else:
        path = "/v1/chat/completions"
        body = {"model": "m", "messages": [{"role": "user", "content": f"hello world {i}"}], "max_tokens": tokens,
                "stream": True}
    raw = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(raw)}\r\nConnection: close\r\n\r\n").encode() + raw


def dechunk(raw: bytes) -> tuple[int, bytes, int]:
    """(status, body, number of chunks) of a chunked HTTP/1.1 response."""
    head, _, rest = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    if b"transfer-encoding: chunked" not in head.lower():
        return status, rest, 1
    body, chunks, pos = [], 0, 0
    while True:
        eol = rest.index(b"\r\n", pos)
        size = int(rest[pos:eol], 16)
        if size == 0:
            return status, b"".join(body), chunks
        body.append(rest[eol + 2: eol + 2 + size])
        chunks += 1
        pos = eol + 2 + size + 2


def check(fmt: str, body: bytes, tokens: int) -> int:
    """Validate a whole stream; returns its number of token records."""
    text = body.decode()
    if fmt == "lmi":
        lines = text.split("\n")
        assert lines[-1] == "", "the stream must end with a newline"
        objs = [json.loads(ln) for ln in lines[:-1]]  # one JSON object per line, no blank lines
        assert len(objs) == tokens, (len(objs), tokens)
        assert all("generated_text" not in o for o in objs[:-1])
        assert objs[-1]["generated_text"] == "".join(o["token"]["text"] for o in objs)
        return len(objs)
    events = text.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]", events[-3:]
    objs = [json.loads(e[len("data: "):]) for e in events[:-2]]
    assert objs[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    recs = objs[1:]
    assert len(recs) == tokens and recs[-1]["choices"][0]["finish_reason"] == "length"
    assert all(o["choices"][0]["finish_reason"] is None for o in recs[:-1])
    return len(recs)


def client(port: int, fmt: str, n: int, tokens: int) -> dict:
    sel = selectors.DefaultSelector()
    socks = []
    for i in range(n):
        s = socket.create_connection(("127.0.0.1", port))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        socks.append(s)
    bufs: dict[int, list[bytes]] = {}
    t0 = time.perf_counter()
    for i, s in enumerate(socks):
        s.sendall(request_bytes(fmt, port, tokens, i))
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ, i)
        bufs[i] = []
    open_ = n
    recvs = 0
    while open_:
        for key, _ in sel.select(timeout=60):
            data = key.fileobj.recv(1 << 18)
            recvs += 1
            if data:
                bufs[key.data].append(data)
            else:
                sel.unregister(key.fileobj)
                key.fileobj.close()
                open_ -= 1
    wall = time.perf_counter() - t0
    records = chunks = 0
    for i in range(n):
        status, body, nchunks = dechunk(b"".join(bufs[i]))
        assert status == 200, (status, body[:200])
        records += check(fmt, body, tokens)
        chunks += nchunks
    return {"wall_s": wall, "records": records, "chunks": chunks, "recvs": recvs}


def run_client(port: int, fmt: str, n: int, tokens: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--client", json.dumps([port, fmt, n, tokens])],
                         capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=600)
    if out.returncode:
        raise RuntimeError(f"client failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout)


# ---- in-process: the Python of one record, no sockets, no threads ---------------------------------

def python_per_record(fmt: str, backlog: bool, tokens: int = 2000) -> tuple[float, float]:
    """(HTTP side, engine side) us of Python per record, best of 7: the runner's generator with queue
    get, Result.add and formatting; and the engine loop's put of one delta. `backlog`: the whole
    stream is queued before it is read (coalesced); else every record is its own write."""
    from serving.server.settings.serving_config import load_config
    from serving.engine.request_stream import RequestStream
    from serving.server.api.lmi.request import parse_invocations
    from serving.server.api.openai_chat import parse_chat
    from serving.server.request_runner import RequestRunner

    class Loop:  # the EngineLoop surface RequestRunner uses; add_request queues the whole stream
        state, error, max_model_len, put_s = "ready", None, 1 << 20, 0.0

        def __init__(self) -> None:
            self.engine = FakeEngine()
            self.tokenizer = self.engine.tokenizer

        def add_request(self, rid: str, ids: list[int], params) -> RequestStream:  # noqa: ANN001
            stream = RequestStream(self, rid, params.n)  # type: ignore[arg-type]
            if not backlog:
                stream.get_nowait = lambda: None  # nothing is ever waiting behind a record
            self.engine.add_request(rid, None, params, prompt_token_ids=ids)
            deltas = [d for _ in range(params.max_tokens) for d in self.engine.step()]
            t0 = time.perf_counter()
            for d in deltas:
                stream._put(d)
            self.put_s = time.perf_counter() - t0
            return stream

        def abort(self, rid: str) -> None:
            pass

    loop = Loop()
    runner = RequestRunner(loop, load_config({}, [], gpu_count=lambda: 0))
    if fmt == "lmi":
        req = parse_invocations({"inputs": "hello world", "parameters": {"max_new_tokens": tokens}, "stream": True})
    else:
        req = parse_chat({"messages": [{"role": "user", "content": "hello"}], "max_tokens": tokens, "stream": True})
    http = put = float("inf")
    for _ in range(7):
        records = runner.run_stream(req, "bench")
        t0 = time.perf_counter()
        for _ in records:
            pass
        http = min(http, (time.perf_counter() - t0) / tokens * 1e6)
        put = min(put, loop.put_s / tokens * 1e6)
    return http, put


# ---- the table ----------------------------------------------------------------------------------

def measure(server: Server, mode: str, fmt: str, n: int, tokens: int, alone: dict) -> dict:
    host_us, gpu_ms = MODES[mode]
    server.request("POST", "/bench/reset", {"host_us": host_us, "gpu_ms": gpu_ms, "n": n})
    before = server.request("GET", f"/bench/stats?n={n}")[1]
    res = run_client(server.port, fmt, n, tokens)
    after = server.request("GET", f"/bench/stats?n={n}")[1]
    user, sys_ = after["user"] - before["user"], after["sys"] - before["sys"]
    engine_cpu = alone["cpu_per_step_us"] * after["steps"] * 1e-6
    toks = res["records"]
    return {"srv_steps_per_s": after["steps_per_s"], "tok_per_s": toks / res["wall_s"],
            "us_per_tok": (user + sys_ - engine_cpu) / toks * 1e6,
            "usr_us_per_tok": (user - engine_cpu) / toks * 1e6,
            "rec_per_write": toks / max(1, res["chunks"] - (n if fmt == "chat" else 0)), "wall_s": res["wall_s"]}


def delay(alone: dict, med: dict, n: int) -> float:
    return (1 / med["srv_steps_per_s"] - 1 / alone["steps_per_s"]) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", default="64,128")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--formats", default="lmi,chat")
    ap.add_argument("--modes", default="max,paced")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--client", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve, args.threads)
        return
    if args.client:
        print(json.dumps(client(*json.loads(args.client))))
        return
    print("Python per record, in-process (no sockets, no threads), best of 7:")
    print("| format | HTTP side, 1 record/write (us) | HTTP side, backlog coalesced (us) | engine put (us) |")
    print("|---|---|---|---|")
    for fmt in args.formats.split(","):
        one, put = python_per_record(fmt, backlog=False)
        many, _ = python_per_record(fmt, backlog=True)
        print(f"| {fmt} | {one:.2f} | {many:.2f} | {put:.2f} |", flush=True)
    streams = [int(x) for x in args.streams.split(",")]
    random.seed(0)
    server = Server(threads=max(streams) + 16)
    rows = []
    try:
        for mode in args.modes.split(","):
            for n in streams:
                alone = [engine_alone(n, args.tokens, *MODES[mode]) for _ in range(args.repeats)]
                a = min(alone, key=lambda d: d["cpu_per_step_us"])  # the least disturbed baseline
                a["steps_per_s"] = statistics.median(d["steps_per_s"] for d in alone)
                for fmt in args.formats.split(","):
                    runs = [measure(server, mode, fmt, n, args.tokens, a) for _ in range(args.repeats)]
                    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
                    rows.append((mode, fmt, n, a, med))
                    print(f"{mode:5s} {fmt:4s} N={n:3d}  eng {a['steps_per_s']:7.0f} st/s ({a['cpu_per_step_us']:6.0f} us/st)"
                          f"  srv {med['srv_steps_per_s']:7.1f} st/s  {med['tok_per_s']:7.0f} tok/s"
                          f"  {med['us_per_tok']:5.1f} us/tok (usr {med['usr_us_per_tok']:5.1f})"
                          f"  eng +{delay(a, med, n):5.1f} us/tok"
                          f"  rec/wr {med['rec_per_write']:5.2f}", file=sys.stderr, flush=True)
    finally:
        server.stop()
    print(f"\n{args.tokens} tokens per stream, medians of {args.repeats} runs; host_us/gpu_ms per step: "
          + ", ".join(f"{m}={MODES[m][0]:g}/{MODES[m][1]:g}" for m in args.modes.split(",")))
    print("| mode | format | N | engine alone st/s | server st/s | tok/s delivered | HTTP us/tok (cpu) | of which user |"
          " engine +us/tok | records/write |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for mode, fmt, n, a, m in rows:
        print(f"| {mode} | {fmt} | {n} | {a['steps_per_s']:.0f} | {m['srv_steps_per_s']:.1f} | {m['tok_per_s']:.0f} |"
              f" {m['us_per_tok']:.1f} | {m['usr_us_per_tok']:.1f} | {delay(a, m, n):.1f} | {m['rec_per_write']:.2f} |")


if __name__ == "__main__":
    main()

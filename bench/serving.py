"""HTTP load generator for any LMI-compatible endpoint: streaming latency and throughput.

Sends `POST /invocations {"inputs", "parameters": {"max_new_tokens", "ignore_eos"}, "stream": true}`
at Poisson arrivals (seed 0) and reads the jsonlines stream; every non-empty line carrying a
`token` is one output chunk. Metrics follow vLLM's benchmark_serving: TTFT = send -> first chunk;
ITL = every gap between chunks; TPOT per request = (E2E - TTFT) / (output tokens - 1); E2E =
send -> last byte; output throughput = sum of output tokens / benchmark duration.
Datasets: `questions` (bench/data/questions-59.json, cycled) or `synthetic` (ShareGPT-like
lognormal input/output lengths, text of common words).

  python bench/serving.py --url http://127.0.0.1:8080 --rate 16 --num-prompts 200 --dataset synthetic
  python bench/serving.py --sagemaker-endpoint my-endpoint --rate 2 --dataset questions
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import random
import re
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

ROOT = Path(__file__).resolve().parents[1]
_WORDS = ("the of and to in is that for it as was with be by on not he this are or his from at which but have an "
          "they you were her she there been one all we their has would when if so no more out up into do any "
          "time about can said them only its new some could these two may first then do way").split()


@dataclass
class Request:
    prompt: str
    max_new_tokens: int


class Refused(RuntimeError):
    """The server answered an HTTP error status instead of a stream."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Result:
    status: int = 0  # HTTP error status of a refused request (503: shed by a full queue)
    ok: bool = False
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str = ""
    sent: float = 0.0  # seconds after the run's start


def make_requests(dataset: str, num_prompts: int, seed: int, output_len: int, prefix_words: int = 0,
                  num_prefixes: int = 1) -> list[Request]:
    """The requests; with `prefix_words`, each prompt starts with one of `num_prefixes` fixed
    "system prompts" of that many words (chat deployments share such prefixes)."""
    rng = random.Random(seed)
    prefixes = [" ".join(random.Random(1000 + k).choice(_WORDS) for _ in range(prefix_words)) + "\n"
                for k in range(num_prefixes)] if prefix_words else [""]
    if dataset == "questions":
        questions = json.loads((ROOT / "bench" / "data" / "questions-59.json").read_text())
        return [Request(prefixes[i % len(prefixes)] + questions[i % len(questions)], output_len)
                for i in range(num_prompts)]
    reqs = []
    for _ in range(num_prompts):
        # ShareGPT-like: median ~150 input / ~150 output tokens, long right tail, clipped.
        n_in = int(min(1024, max(4, math.exp(rng.gauss(5.0, 0.8)))))
        n_out = int(min(1024, max(4, math.exp(rng.gauss(5.0, 0.8)))))
        prefix = rng.choice(prefixes)
        reqs.append(Request(prefix + " ".join(rng.choice(_WORDS) for _ in range(n_in)), n_out))
    return reqs


def _lines_http(url: str, body: bytes, timeout: float) -> Iterator[bytes]:
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=timeout)
    try:
        conn.request("POST", "/invocations", body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status >= 400:
            raise Refused(resp.status, f"HTTP {resp.status}: {resp.read()[:200]!r}")
        while True:
            line = resp.readline()
            if not line:
                return
            yield line
    finally:
        conn.close()


def _lines_sagemaker(endpoint: str, body: bytes) -> Iterator[bytes]:
    sys.path.insert(0, str(ROOT))
    from sdk.client import SageMakerTransport
    from sdk.iterators import iter_lines

    yield from iter_lines(SageMakerTransport(endpoint).invoke_stream(body))


def send(args: argparse.Namespace, req: Request) -> Result:
    body = json.dumps({"inputs": req.prompt, "stream": True,
                       "parameters": {"max_new_tokens": req.max_new_tokens, "ignore_eos": True,
                                      "do_sample": True, "temperature": 0.6}}).encode()
    res = Result()
    t0 = time.perf_counter()
    last = t0
    try:
        lines = _lines_sagemaker(args.sagemaker_endpoint, body) if args.sagemaker_endpoint else \
            _lines_http(args.url, body, args.timeout)
        for line in lines:
            line = line.strip()
            if not line:
                continue
            rec = json.loads(line)
            if rec.get("token") is None:
                if rec.get("details", {}).get("finish_reason") == "error" or "error" in rec:
                    raise RuntimeError(str(rec)[:200])
                continue
            now = time.perf_counter()
            if res.output_tokens == 0:
                res.ttft = now - t0
            else:
                res.itl.append(now - last)
            last = now
            res.output_tokens += 1
        res.e2e = time.perf_counter() - t0
        res.ok = res.output_tokens > 0
    except Exception as exc:  # one failed request must not stop the run
        res.error = f"{type(exc).__name__}: {exc}"
        res.status = getattr(exc, "status", 0)
    return res


def _stats(xs: list[float]) -> tuple[float, float, float]:
    if not xs:
        return (float("nan"),) * 3
    s = sorted(xs)
    return statistics.fmean(s), s[len(s) // 2], s[min(len(s) - 1, math.ceil(0.99 * len(s)) - 1)]


_INTERVAL_RE = re.compile(r'^lmi_engine_token_interval_seconds_bucket\{le="([^"]+)",step="([^"]+)"\} (\S+)$')


def engine_intervals(url: str) -> dict[str, list[tuple[float, float]]]:
    """The server's engine cadence histogram (`lmi_engine_token_interval_seconds`): per step kind,
    cumulative (upper bound s, count) pairs; empty when the server does not export it."""
    try:
        u = urlparse(url)
        conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=10)
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    except OSError:
        return {}
    out: dict[str, list[tuple[float, float]]] = {}
    for line in text.splitlines():
        m = _INTERVAL_RE.match(line)
        if m:
            out.setdefault(m.group(2), []).append((float(m.group(1)), float(m.group(3))))
    return out


def interval_summary(before: dict, after: dict) -> dict:
    """Per step kind over the run: count and the p50 / p99 as bucket upper bounds in ms."""
    out = {}
    for kind, rows in after.items():
        prev = dict(before.get(kind, []))
        cum = [(le, n - prev.get(le, 0.0)) for le, n in rows]
        total = cum[-1][1] if cum else 0.0
        entry: dict = {"count": int(total)}
        for name, q in (("p50_ms", 0.5), ("p99_ms", 0.99)):
            entry[name] = next((le * 1e3 for le, n in cum if total and n >= q * total), None)
        out[kind] = entry
    return out


def _send_all(args: argparse.Namespace, reqs: list[Request], rate: float, seed: int, start_at: float) -> list[Result]:
    """Send `reqs` at Poisson arrivals of `rate` from `start_at` (time.time()); their results."""
    rng = random.Random(seed)
    results: list[Result] = [Result() for _ in reqs]
    threads = []
    time.sleep(max(0.0, start_at - time.time()))
    start = time.perf_counter() - (time.time() - start_at)
    next_t = start
    for i, req in enumerate(reqs):
        if rate > 0:
            next_t += rng.expovariate(rate)
            time.sleep(max(0.0, next_t - time.perf_counter()))

        def work(i: int = i, req: Request = req) -> None:
            sent = time.perf_counter() - start
            results[i] = send(args, req)
            results[i].sent = sent

        t = threading.Thread(target=work, daemon=True)
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    return results


def _send_part(job: tuple) -> list[Result]:
    return _send_all(*job)


def _probe_ping(url: str, interval: float, stop: threading.Event, out: list) -> None:
    """GET /ping every `interval` s on one kept-alive connection: (latency s, status) each."""
    u = urlparse(url)
    conn = None
    while not stop.is_set():
        t0 = time.perf_counter()
        try:
            conn = conn or http.client.HTTPConnection(u.hostname, u.port or 80, timeout=30)
            conn.request("GET", "/ping")
            resp = conn.getresponse()
            resp.read()
            status = resp.status
        except OSError:
            conn, status = None, 0
        out.append((time.perf_counter() - t0, status))
        stop.wait(interval)


def run(args: argparse.Namespace) -> dict:
    reqs = make_requests(args.dataset, args.num_prompts, args.seed, args.output_len, args.prefix_words,
                         args.num_prefixes)
    before = engine_intervals(args.url) if not args.sagemaker_endpoint else {}
    pings: list[tuple[float, int]] = []
    stop = threading.Event()
    prober = threading.Thread(target=_probe_ping, args=(args.url, args.ping_interval, stop, pings), daemon=True)
    if args.ping_interval > 0 and not args.sagemaker_endpoint:
        prober.start()
    start_at = time.time() + 0.5
    start = time.perf_counter() + 0.5
    if args.procs > 1:  # one client process cannot read tens of thousands of lines a second
        import multiprocessing as mp

        k = args.procs
        jobs = [(args, reqs[i::k], args.rate / k, args.seed + i, start_at) for i in range(k)]
        with mp.get_context("spawn").Pool(k) as pool:
            parts = pool.map(_send_part, jobs)
        results: list[Result] = [Result()] * len(reqs)
        for i, part in enumerate(parts):
            results[i::k] = part
    else:
        results = _send_all(args, reqs, args.rate, args.seed, start_at)
    duration = time.perf_counter() - start
    stop.set()
    ok = [r for r in results if r.ok]
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itl = [x for r in ok for x in r.itl]
    out_tokens = sum(r.output_tokens for r in ok)
    summary = {
        "rate": args.rate, "dataset": args.dataset, "num_prompts": len(reqs), "completed": len(ok),
        "failed": len(reqs) - len(ok), "duration_s": duration, "output_tokens": out_tokens,
        "output_throughput_tok_s": out_tokens / duration, "request_throughput": len(ok) / duration,
        "errors": sorted({r.error for r in results if r.error})[:5],
        "refused_503": sum(r.status == 503 for r in results),
        "lost": sum(not r.ok and r.status != 503 for r in results),  # failed, not shed
    }
    if pings:
        lat = sorted(p[0] for p in pings)
        summary["ping"] = {"count": len(pings), "non_200": sum(p[1] != 200 for p in pings),
                           "p50_ms": lat[len(lat) // 2] * 1e3,
                           "p99_ms": lat[min(len(lat) - 1, math.ceil(0.99 * len(lat)) - 1)] * 1e3,
                           "max_ms": lat[-1] * 1e3}
    for name, xs in (("ttft_ms", [r.ttft for r in ok]), ("tpot_ms", tpot), ("itl_ms", itl), ("e2e_ms", [r.e2e for r in ok])):
        mean, p50, p99 = _stats(xs)
        summary[name] = {"mean": mean * 1e3, "p50": p50 * 1e3, "p99": p99 * 1e3}
    if before:  # the engine's own step-to-step cadence, to tell engine steps from delivery in the ITL tail
        summary["engine_intervals"] = interval_summary(before, engine_intervals(args.url))
    # Per request, to see which ones make the tails: (sent s, prompt words, TTFT ms, max ITL ms).
    summary["requests"] = [
        [round(r.sent, 3), len(q.prompt.split()), round(r.ttft * 1e3, 1), round(max(r.itl, default=0.0) * 1e3, 1)]
        for r, q in zip(results, reqs) if r.ok
    ]
    return summary


def print_table(s: dict) -> None:
    print(f"\nrate {s['rate']} req/s, {s['dataset']}: {s['completed']}/{s['num_prompts']} ok in {s['duration_s']:.1f} s, "
          f"{s['output_throughput_tok_s']:,.0f} output tok/s, {s['request_throughput']:.2f} req/s")
    print(f"{'metric':8} {'mean':>9} {'p50':>9} {'p99':>9}")
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        m = s[name]
        print(f"{name:8} {m['mean']:>9.1f} {m['p50']:>9.1f} {m['p99']:>9.1f}")
    print(f"shed (503): {s['refused_503']}, lost (failed otherwise): {s['lost']}")
    if "ping" in s:
        p = s["ping"]
        print(f"/ping during the run: {p['count']} probes, {p['non_200']} not 200, p50 {p['p50_ms']:.1f} ms, "
              f"p99 {p['p99_ms']:.1f} ms, max {p['max_ms']:.1f} ms")
    if s["errors"]:
        print("errors:", s["errors"])
    for kind, e in s.get("engine_intervals", {}).items():
        print(f"engine intervals, {kind} steps: {e['count']}, p50 <= {e['p50_ms']} ms, p99 <= {e['p99_ms']} ms")
    worst = sorted(s.get("requests", []), key=lambda r: -r[2])[:5]
    if worst:
        print("slowest TTFT [sent s, prompt words, TTFT ms, max ITL ms]:", worst)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--sagemaker-endpoint", default="")
    ap.add_argument("--rate", type=float, default=16.0, help="requests/s (Poisson); 0 = all at once")
    ap.add_argument("--num-prompts", type=int, default=200)
    ap.add_argument("--dataset", choices=("synthetic", "questions"), default="synthetic")
    ap.add_argument("--output-len", type=int, default=128, help="max_new_tokens for the questions dataset")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--out", default="")
    ap.add_argument("--procs", type=int, default=1, help="client processes (each sends rate/procs)")
    ap.add_argument("--ping-interval", type=float, default=0.0, help="probe /ping every this many s (0: off)")
    ap.add_argument("--prefix-words", type=int, default=0, help="a shared system prompt of this many words")
    ap.add_argument("--num-prefixes", type=int, default=1, help="how many distinct shared prefixes")
    args = ap.parse_args()
    summary = run(args)
    print_table(summary)
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()

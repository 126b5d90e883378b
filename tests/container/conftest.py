"""The CI image build (tests/container/test_image.py) runs in the background, overlapping the suite.

Building the real Dockerfile with buildah is minutes of mostly I/O (packages, vfs copies); nothing
else in the suite needs it. So when the session is going to run test_image.py (it was collected
and not deselected), `container/build-ci-image.sh` starts right after collection, at the lowest
CPU and I/O priority (the tests keep the cores), and test_image.py's items are moved to the end
of the run; its `image` fixture then only waits for that same build (`image_build` below) and
checks it exactly as it checked the build it used to start itself. Nothing else changes: same
script, same image, same checks. The build is stopped if the session ends without using it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "container" / "build-ci-image.sh"
IMAGE_TESTS = Path(__file__).resolve().parent / "test_image.py"


class BackgroundBuild:
    """`container/build-ci-image.sh`, started now (nice 19, idle I/O class), waited for by `result`."""

    def __init__(self) -> None:
        self._out = tempfile.TemporaryFile()
        self._err = tempfile.TemporaryFile()
        prefix = ["nice", "-n", "19"] + (["ionice", "-c", "3"] if shutil.which("ionice") else [])
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen([*prefix, str(BUILD)], stdout=self._out, stderr=self._err,
                                     start_new_session=True)

    def result(self, timeout: float) -> subprocess.CompletedProcess:
        """Wait for the build (at most `timeout` s more); the script's exit status and output."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise
        out = []
        for f in (self._out, self._err):
            f.seek(0)
            out.append(f.read().decode(errors="replace"))
        return subprocess.CompletedProcess(self.proc.args, self.proc.returncode, out[0], out[1])

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


_build: BackgroundBuild | None = None


def _is_image_test(item: pytest.Item) -> bool:
    return Path(str(item.path)).resolve() == IMAGE_TESTS


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """test_image.py last (in its own order), so its build has the whole run to finish in."""
    image = [item for item in items if _is_image_test(item)]
    if image:
        items[:] = [item for item in items if not _is_image_test(item)] + image


def pytest_collection_finish(session: pytest.Session) -> None:
    global _build
    if session.config.option.collectonly or os.environ.get("OPEN_LMI_TEST_IMAGE"):
        return
    if any(_is_image_test(item) for item in session.items) and BUILD.is_file():
        _build = BackgroundBuild()


def pytest_sessionfinish(session: pytest.Session) -> None:
    if _build is not None:
        _build.stop()


@pytest.fixture(scope="session")
def image_build() -> BackgroundBuild:
    """The session's build of the CI image (started after collection, else now)."""
    global _build
    if _build is None:
        _build = BackgroundBuild()
    return _build

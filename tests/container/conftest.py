"""The CI image build (tests/container/test_image.py) runs in the background, overlapping the suite.

Building the real Dockerfile with buildah takes minutes (package installs, the default model's
conversion, vfs copies of whole file trees), much of it waiting on network and disk; nothing else
in the suite needs it. So when the session is going to run test_image.py (it was collected
and not deselected), `container/build-ci-image.sh` starts right after collection, at the lowest
CPU and I/O priority (the tests keep the cores), and test_image.py's items are moved to the end
of the run; its `image` fixture then only waits for that same build (`image_build` below) and
checks it exactly as it checked the build it used to start itself; the module's working container
(`buildah from`: a full copy of the image with vfs) is made in the background too, right after the
build. Nothing else changes: same script, same image, same container, same checks. The build is
stopped, and an unused container removed, when the session ends.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "container" / "build-ci-image.sh"
IMAGE_TESTS = Path(__file__).resolve().parent / "test_image.py"


class BackgroundBuild:
    """`container/build-ci-image.sh`, started now (nice 19, idle I/O class), then `buildah from` its
    image; `result` waits for the build, `take_container` for the container."""

    CONTAINER_PREFIX = "open-lmi-test-"

    def __init__(self) -> None:
        self._out = tempfile.TemporaryFile()
        self._err = tempfile.TemporaryFile()
        self._low = ["nice", "-n", "19"] + (["ionice", "-c", "3"] if shutil.which("ionice") else [])
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen([*self._low, str(BUILD)], stdout=self._out, stderr=self._err,
                                     start_new_session=True)
        self.completed: subprocess.CompletedProcess | None = None
        self._built = threading.Event()
        self._container: tuple[str, str] | None = None  # (image, container) made and not yet taken
        self._thread = threading.Thread(target=self._run, name="image-build", daemon=True)
        self._thread.start()

    def _buildah(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*self._low, "buildah", "--storage-driver", "vfs", *args], capture_output=True,
                              text=True, timeout=600)

    def _run(self) -> None:
        try:
            self.proc.wait()
            out = []
            for f in (self._out, self._err):
                f.seek(0)
                out.append(f.read().decode(errors="replace"))
            self.completed = subprocess.CompletedProcess(self.proc.args, self.proc.returncode, out[0], out[1])
        finally:
            self._built.set()
        if self.completed.returncode != 0 or not self.completed.stdout.strip():
            return
        image = self.completed.stdout.strip().splitlines()[-1]
        name = f"{self.CONTAINER_PREFIX}{os.getpid()}"
        try:  # any failure here: the fixture makes the container itself, and says why if it cannot
            stale = self._buildah("containers", "--noheading", "--format", "{{.ContainerName}}").stdout.split()
            for old in [c for c in stale if c.startswith(self.CONTAINER_PREFIX)]:  # a killed run's (a full copy each)
                self._buildah("rm", old)
            if self._buildah("from", "--pull=never", "--name", name, image).returncode == 0:
                self._container = (image, name)
        except (OSError, subprocess.SubprocessError):
            pass

    def result(self, timeout: float) -> subprocess.CompletedProcess:
        """Wait for the build (at most `timeout` s more); the script's exit status and output."""
        if not self._built.wait(timeout):
            self.stop()
            raise subprocess.TimeoutExpired(self.proc.args, timeout)
        return self.completed

    def take_container(self, image: str) -> str | None:
        """The working container made from `image` in the background (the caller removes it), else None."""
        self._thread.join(900)
        made, self._container = self._container, None
        if made and made[0] != image:
            self._buildah("rm", made[1])
            return None
        return made[1] if made else None

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._thread.join(600)
        if self._container:  # made, never used
            self._buildah("rm", self._container[1])
            self._container = None


_build: BackgroundBuild | None = None


def _is_image_test(item: pytest.Item) -> bool:
    return Path(str(item.path)).resolve() == IMAGE_TESTS


SKIP_VAR = "OPEN_LMI_SKIP_IMAGE_TESTS"  # =1: deselect test_image.py (no system packages, no image build)


def _say(config: pytest.Config, line: str) -> None:
    """A line on the terminal now, whatever the capture mode (said before the build starts)."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(line, yellow=True, bold=True)


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """test_image.py last (in its own order), so its build has the whole run to finish in; deselected
    with OPEN_LMI_SKIP_IMAGE_TESTS=1; otherwise what its build will install is said before it starts."""
    image = [item for item in items if _is_image_test(item)]
    if not image:
        return
    if os.environ.get(SKIP_VAR, "") not in ("", "0"):
        items[:] = [item for item in items if not _is_image_test(item)]
        config.hook.pytest_deselected(items=image)
        _say(config, f"[image tests] {SKIP_VAR}={os.environ[SKIP_VAR]}: tests/container/test_image.py deselected "
                     "(no system packages installed, no image built)")
        return
    items[:] = [item for item in items if not _is_image_test(item)] + image
    if os.environ.get("OPEN_LMI_TEST_IMAGE"):
        return
    missing = [tool for tool in ("buildah", "podman", "debootstrap") if shutil.which(tool) is None]
    install = (f"installs {', '.join(missing)} with apt-get (as root), " if missing else "")
    _say(config, f"[image tests] tests/container/test_image.py builds the Dockerfile with buildah in the "
                 f"background: {install}debootstraps Debian bookworm into "
                 f"{os.environ.get('OPEN_LMI_CI_CACHE', '/var/cache/open-lmi-ci')} and builds a 3-6 GB image in "
                 f"buildah's storage (needs ~12 GB free); {SKIP_VAR}=1 skips it")


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
def image_build() -> BackgroundBuild | None:
    """The session's build of the CI image (started after collection, else now); None when
    $OPEN_LMI_TEST_IMAGE names an image built already."""
    global _build
    if _build is None and not os.environ.get("OPEN_LMI_TEST_IMAGE"):
        _build = BackgroundBuild()
    return _build

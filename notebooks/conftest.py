"""Notebook runs under pytest (``pytest --nbmake notebooks``): one container shared by 01 and 03.

Both only need a running server, so the first of them to run starts ``container/serve`` and exports
``OPEN_LMI_URL`` (the kernels inherit it); the session end stops it. Notebook 02 still starts its own
container from the deployed model's Environment. Nothing happens if ``OPEN_LMI_URL`` is already set.
"""

from __future__ import annotations

import os

_SHARED = {"01_local_quickstart.ipynb", "03_throughput.ipynb"}
_started: list = []


def pytest_runtest_setup(item) -> None:  # noqa: ANN001 - pytest hook
    if item.path.name not in _SHARED or os.environ.get("OPEN_LMI_URL"):
        return
    from sdk.local import ContainerProcess

    container = ContainerProcess({"OPTION_MAX_ROLLING_BATCH_SIZE": "8"}).start()
    _started.append(container)
    os.environ["OPEN_LMI_URL"] = container.wait_ready().url


def pytest_sessionfinish(session) -> None:  # noqa: ANN001 - pytest hook
    while _started:
        _started.pop().stop()
        os.environ.pop("OPEN_LMI_URL", None)

"""Fixtures for the SDK tests: a fake LMI upstream, the gateway in front of it, a boto3 runtime client."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("SAGEMAKER_SUPPRESS_V2_WARNING", "1")
from fake_lmi import FakeLMI, runtime_client  # noqa: E402

from sdk.gateway import Gateway  # noqa: E402


@pytest.fixture(scope="module")
def fake_lmi():
    with FakeLMI() as fake:
        yield fake


@pytest.fixture(scope="module")
def gateway(fake_lmi):
    with Gateway(fake_lmi.url) as gw:
        yield gw


@pytest.fixture(scope="module")
def smr(gateway):
    return runtime_client(gateway.url)

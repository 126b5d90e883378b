"""Shared test setup: offline hub, GPU marker skipping, small thread counts for the 2-core CI."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest

# Session fixtures, registered here once for all of tests/: a module that imported them itself would get
# its own copy, and each copy writes its own tiny checkpoints (hundreds of MB a copy on a CI disk).
from lora_fixtures import lora_adapters
from model_fixtures import smollm2_path, tiny_models


@pytest.fixture(scope="module")
def one_torch_thread():  # noqa: ANN201
    """One torch thread for a module's in-process fp32 model runs: on a 2-core box shared with other
    work, torch's 2 spinning threads were measured 10x+ slower (oversubscription), 1 is steady."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

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

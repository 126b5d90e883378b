"""GGUF files served as HF-format dirs: converted once through transformers into the cache.

A `.gguf` file (llama.cpp's format: weights, often quantized, plus tokenizer and chat template in
its metadata) is dequantized by transformers and saved as config.json + model.safetensors +
tokenizer files under `$OPEN_LMI_CACHE` (default `~/.cache/open-lmi`). The engine then serves that
dir like any checkpoint. The embedded default model is one such file (`serving/checkpoint/default_model.py`);
a user's `HF_MODEL_ID` may name another (`gguf_model_dir`), or a dir holding exactly one.

The conversion writes a temp dir and renames it into place under a file lock, so concurrent
processes either wait for it or find it done; later calls only check that the dir exists. A user
file's dir is keyed by its path, size and modification time, so a changed file converts again.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

# Files whose presence marks a finished conversion (the dir only appears by rename, but a
# half-deleted dir from a user's `rm` should still be rebuilt).
_REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
# GGUF files up to this size are saved in float32 (the default model: exact dequantized values);
# larger ones in bfloat16, half the disk and host memory of the conversion.
FP32_MAX_GGUF_BYTES = 1 << 30


class GGUFConversionError(RuntimeError):
    """A GGUF file cannot be converted (transformers cannot read it, or wrote an incomplete dir)."""


def cache_root() -> Path:
    """Root of our on-disk caches: `$OPEN_LMI_CACHE`, else `~/.cache/open-lmi`."""
    # NOTE: the one env read outside config: the cache location must be known before any
    # config exists (tests, the container's build step), and it is not an engine option.
    root = os.environ.get("OPEN_LMI_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "open-lmi"


def is_converted(d: Path) -> bool:
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


def converted_dir(gguf: Path, target: Path) -> Path:
    """`target`, holding `gguf` converted (now, under the lock, unless a finished conversion is there)."""
    if is_converted(target):
        return target
    with _file_lock(target.parent / f".{target.name}.lock"):
        if not is_converted(target):  # else another process finished while we waited
            convert_gguf(gguf, target)
    return target


def is_gguf_source(path: Path) -> bool:
    """A `.gguf` file, or a dir without config.json holding .gguf files: what `gguf_model_dir` serves."""
    if path.is_file():
        return path.suffix.lower() == ".gguf"
    return path.is_dir() and not (path / "config.json").is_file() and any(path.glob("*.gguf"))


def gguf_model_dir(path: Path) -> Path:
    """The HF dir of a user's GGUF file (a `.gguf` file, or a dir without config.json holding exactly one)."""
    path = path.expanduser().resolve()
    if path.is_dir():
        found = sorted(path.glob("*.gguf"))
        if len(found) != 1:
            raise GGUFConversionError(
                f"{path} has no config.json and {len(found)} .gguf files"
                + (f" ({', '.join(p.name for p in found)}): name one of them" if found else ""))
        path = found[0].resolve()  # a link: keyed by the file it names
    st = path.stat()
    key = hashlib.sha1(f"{path}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    return converted_dir(path, cache_root() / "gguf" / f"{path.stem}-{key}")


def convert_gguf(gguf: Path, target: Path) -> None:
    """Write the HF dir for `gguf` at `target` atomically: export into a temp dir, then rename.

    The caller holds the lock. A failed export leaves neither `target` nor the temp dir.
    """
    t0 = time.monotonic()
    logger.info("converting %s -> %s (once)", gguf, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; the cache is meant to be shared
    try:
        _export(gguf, tmp)
        if not is_converted(tmp):
            raise GGUFConversionError(f"conversion wrote {sorted(p.name for p in tmp.iterdir())}, expected {_REQUIRED}")
        if target.exists():  # an incomplete leftover: replace it
            shutil.rmtree(target)
        os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("%s converted in %.1f s", gguf.name, time.monotonic() - t0)


def _export(gguf: Path, out_dir: Path) -> None:
    """Dequantize `gguf` through transformers and save safetensors + tokenizer in `out_dir`.

    transformers un-permutes llama.cpp's Q/K layout on load, which is why we do not read
    the GGUF tensors ourselves.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = torch.float32 if gguf.stat().st_size <= FP32_MAX_GGUF_BYTES else torch.bfloat16
    kwargs = {"gguf_file": gguf.name, "local_files_only": True}
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), **kwargs)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), dtype=dtype, **kwargs)
    except (ValueError, KeyError, OSError) as e:
        raise GGUFConversionError(f"transformers cannot read {gguf}: {type(e).__name__}: {e}") from e
    # save_pretrained refuses GGUF-"quantized" models; the weights are already dequantized,
    # so drop the quantizer and its config entry (ecosystem-checks §1).
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.architectures = [type(model).__name__]
    model.config.dtype = dtype
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))

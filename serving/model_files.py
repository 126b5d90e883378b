"""Turn the `model=` option into a local HF-format directory.

`None` -> the embedded default model (converted once, see `serving/default_model.py`); an
existing directory -> itself; a `.gguf` file, or a directory without config.json holding one ->
its conversion (once, cached: `serving/gguf_convert.py`); anything else is taken as a Hugging Face hub id and fetched with
`huggingface_hub.snapshot_download` (weights as safetensors, configs, tokenizer files only).
When the hub cannot be reached, or offline mode is on and the id is not cached, the error
names the id and says what to do. (s3:// sources are the container's job, upstream of this.)
"""

from __future__ import annotations

import logging
from pathlib import Path

from serving.gguf_convert import GGUFConversionError, gguf_model_dir, is_gguf_source

logger = logging.getLogger(__name__)

# What a snapshot needs: no .bin / .pth / .gguf duplicates, no remote code.
_ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model", "*.tiktoken", "*.txt"]


class ModelNotFoundError(OSError):
    """The model source is neither a local model dir nor a reachable hub id."""


def resolve_model_dir(
    model: str | None, revision: str | None = None, token: str | None = None, cache_dir: str | None = None
) -> Path:
    """Local directory holding config.json + weights + tokenizer for `model`."""
    if model is None or str(model).strip() == "":
        from serving.default_model import default_model_path

        return default_model_path()
    model = str(model)
    path = Path(model).expanduser()
    if is_gguf_source(path):  # llama.cpp's single-file format
        try:
            return gguf_model_dir(path)
        except GGUFConversionError as e:
            raise ModelNotFoundError(str(e)) from e
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"model directory {path} has no config.json (not a Hugging Face model dir)")
        return path
    if model.startswith(("/", "./", "../", "~")) or path.exists():
        raise ModelNotFoundError(f"model path {model!r} does not exist or is not a directory")
    if model.startswith("s3://"):
        raise ModelNotFoundError(f"{model!r}: download s3:// models first (the container does this); "
                                 "pass the local directory here")
    return _snapshot(model, revision, token, cache_dir)


def _snapshot(repo_id: str, revision: str | None, token: str | None, cache_dir: str | None) -> Path:
    from huggingface_hub import snapshot_download

    where = f"{repo_id!r}" + (f" (revision {revision!r})" if revision else "")
    try:
        local = snapshot_download(
            repo_id=repo_id, revision=revision, token=token, cache_dir=cache_dir, allow_patterns=_ALLOW_PATTERNS
        )
    except Exception as e:  # noqa: BLE001 - hub errors come in many classes; all mean "cannot get it"
        raise ModelNotFoundError(
            f"cannot get model {where} from the Hugging Face hub: {type(e).__name__}: {e}. "
            "Check the id and revision, the network (HF_HUB_OFFLINE), and HF_TOKEN for gated models, "
            "or pass a local model directory."
        ) from e
    path = Path(local)
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(f"hub model {where} has no config.json: not a transformers model")
    logger.info("model %s resolved to %s", where, path)
    return path

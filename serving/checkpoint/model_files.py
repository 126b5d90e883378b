"""Turn the `model=` option into a local HF-format directory.

`None` -> the embedded default model (converted once, see `serving/checkpoint/default_model.py`);
an existing directory -> itself; a `.gguf` file, or a directory without config.json holding one ->
its conversion (once, cached: `serving/checkpoint/gguf_convert.py`); anything else is taken as a
Hugging Face hub id and fetched with `huggingface_hub.snapshot_download` (weights as safetensors,
configs, tokenizer files only).
When the hub cannot be reached, or offline mode is on and the id is not cached, the error
names the id and says what to do. (s3:// sources are the container's job, upstream of this.)

`local_model_dir` is the one judge of what a local model dir is, and `_ALLOW_PATTERNS` the one list
of files fetched from the hub: the edge's `model_source` resolves local paths and hub ids here.
"""

from __future__ import annotations

import logging
from pathlib import Path

from serving.checkpoint.gguf_convert import GGUFConversionError, gguf_model_dir, is_gguf_source

logger = logging.getLogger(__name__)

# What a hub snapshot needs: no .bin / .pth / .gguf duplicates, no remote code. The one allow-list:
# `serving/server/settings/model_source.py` fetches hub ids through `resolve_model_dir` too.
_ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model", "*.tiktoken", "*.txt"]


class ModelNotFoundError(OSError):
    """The model source is neither a local model dir nor a reachable hub id."""


def names_local_path(model: str) -> bool:
    """`model` names a local path, not a hub id: it exists, or it starts like a path (a hub id
    never starts with '/', '.' or '~')."""
    return model.startswith(("/", ".", "~")) or Path(model).expanduser().exists()


def looks_like_model_dir(path: Path) -> bool:
    """`path` holds a checkpoint `local_model_dir` serves: a dir with config.json, or GGUF."""
    return (path / "config.json").is_file() or is_gguf_source(path)


def local_model_dir(path: Path) -> Path:
    """The HF-format dir that local `path` serves: a dir with config.json is itself; a `.gguf`
    file, or a dir without config.json holding one, is its conversion (once, cached). Anything
    else raises ModelNotFoundError saying what is missing."""
    if is_gguf_source(path):  # llama.cpp's single-file format
        try:
            return gguf_model_dir(path)
        except GGUFConversionError as e:
            raise ModelNotFoundError(str(e)) from e
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"model directory {path} has no config.json (not a Hugging Face model dir)")
        return path
    raise ModelNotFoundError(f"model path {str(path)!r} does not exist or is not a directory (nor a .gguf file)")


def resolve_model_dir(
    model: str | None, revision: str | None = None, token: str | None = None, cache_dir: str | None = None
) -> Path:
    """Local directory holding config.json + weights + tokenizer for `model`."""
    if model is None or str(model).strip() == "":
        from serving.checkpoint.default_model import default_model_path

        return default_model_path()
    model = str(model)
    if names_local_path(model):
        return local_model_dir(Path(model).expanduser())
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

"""Where LoRA adapters come from: `<model dir>/adapters/<name>/`, a local path, or an `s3://` prefix.

`find_adapters(model_dir)` lists the adapters LMI loads at start (DJL's layout: one PEFT
directory per adapter under `adapters/`, shipped beside the model, locally or under the same
`s3://` prefix, which `serving/server/settings/model_source.py` has already mirrored with the model).
`fetch_adapter(src, ...)` turns a management-API `src` into a local directory (S3 through the
model's own resumable download). Both check only the layout and the name; whether the weights
fit the base model is the engine's check (`EngineClient.add_lora`).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from serving.server.settings.model_source import ModelSourceError, download_s3

logger = logging.getLogger("serving.server.settings.adapter_source")
ADAPTERS_DIR = "adapters"
PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
# Names travel in `X-Amzn-SageMaker-Custom-Attributes: adapter=<name>` (no ';' or '=' there), in
# URL paths and as /v1 model ids: letters, digits and . _ - only.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class AdapterSourceError(ValueError):
    """An adapter directory or source is unusable; the message names it and says why."""


def check_adapter_name(name: object) -> str:
    """`name` if it is a valid adapter name, else AdapterSourceError saying what is allowed."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise AdapterSourceError(f"invalid adapter name {name!r}: use 1 to 128 letters, digits, '.', '_' or '-', "
                                 "starting with a letter or digit")
    return name


def check_adapter_dir(path: Path, name: str) -> Path:
    """`path` if it holds a PEFT LoRA adapter (`adapter_config.json` + `adapter_model.safetensors`)."""
    if not path.is_dir():
        raise AdapterSourceError(f"adapter {name!r}: {path} is not a directory")
    missing = [f for f in (PEFT_CONFIG, PEFT_WEIGHTS) if not (path / f).is_file()]
    if missing:
        extra = " (only safetensors weights are read, not adapter_model.bin)" if (
            PEFT_WEIGHTS in missing and (path / "adapter_model.bin").is_file()) else ""
        raise AdapterSourceError(f"adapter {name!r}: {path} has no {' or '.join(missing)}: not a PEFT LoRA "
                                 f"adapter directory{extra}")
    return path


def find_adapters(model_dir: Path | None) -> dict[str, Path]:
    """{name: dir} of every adapter under `model_dir/adapters/`, sorted by name ({} when there is none).

    Hidden entries are skipped, a plain file with a warning. The directories are not checked
    here: registering one checks its name and files (`check_adapter_name`, `check_adapter_dir`).
    """
    root = Path(model_dir) / ADAPTERS_DIR if model_dir is not None else None
    if root is None or not root.is_dir():
        return {}
    found: dict[str, Path] = {}
    for entry in sorted(root.iterdir()):
        if entry.name.startswith("."):
            continue
        if not entry.is_dir():
            logger.warning("%s is not a directory: skipped (adapters are directories under %s)", entry, root)
            continue
        found[entry.name] = entry
    return found


def fetch_adapter(name: str, src: str, download_dir: str | Path, endpoint_url: str | None = None) -> Path:
    """A local adapter directory for `src`: a local path as given, or `s3://bucket/prefix` mirrored
    under `download_dir` (as models are: parallel, resumable). AdapterSourceError when unusable."""
    if not isinstance(src, str) or not src.strip():
        raise AdapterSourceError(f"adapter {name!r}: src must be a local directory or an s3://bucket/prefix")
    src = src.strip()
    if src.startswith("s3://"):
        try:
            path = download_s3(src, Path(download_dir), endpoint_url=endpoint_url)
        except ModelSourceError as exc:
            raise AdapterSourceError(f"adapter {name!r}: {exc}") from None
    elif "://" in src:
        raise AdapterSourceError(f"adapter {name!r}: src {src!r} is neither a local directory nor an s3:// prefix")
    else:
        path = Path(src).expanduser()
    return check_adapter_dir(path, name)

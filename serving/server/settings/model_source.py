"""Where the model comes from: a local dir, `/opt/ml/model`, an `s3://` prefix, or a hub id; a GGUF
file (or a dir holding one and no config.json) is served as its conversion
(`serving/checkpoint/gguf_convert.py`).

`resolve_model(config)` turns `ServingConfig.model_id` into a local directory (or None for the
embedded default model), downloading when needed: S3 with boto3 into `download_dir`, several
files at once, skipping files already complete (same size and ETag) so a restart resumes; hub
ids through `serving/checkpoint/model_files.py`, which also judges every local dir (one resolver,
one allow-list). It also refuses a model that needs remote code, since this server never executes it.
"""

from __future__ import annotations

import logging
import os
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from serving.checkpoint import model_files
from serving.server.settings.config import OPT_ML_MODEL, ServingConfig
from serving.server.settings.download_paths import S3_BUCKET, UnsafePathError, check_names, check_tree, destination

logger = logging.getLogger("serving.server.settings.model_source")
_META_DIR = ".open-lmi-s3"  # per-file ETag records, so a restart can skip finished files


class ModelSourceError(RuntimeError):
    """The model cannot be found or fetched; the message says where we looked and why."""


def _local_model_dir(path: Path) -> Path:
    """`model_files.local_model_dir`, its refusal as a ModelSourceError."""
    try:
        return model_files.local_model_dir(path)
    except model_files.ModelNotFoundError as e:
        raise ModelSourceError(str(e)) from e


def resolve_model(config: ServingConfig, opt_ml_model: str | Path = OPT_ML_MODEL) -> Path | None:
    """A local model dir for `config.model_id`; None means the embedded default model."""
    src = config.model_id
    if not src:
        if model_files.looks_like_model_dir(Path(opt_ml_model)):
            logger.info("no model id given: serving the SageMaker model artifacts in %s", opt_ml_model)
            path = Path(opt_ml_model)
        else:
            return None
    elif src.startswith("s3://"):
        path = download_s3(src, Path(config.download_dir), endpoint_url=config.s3_endpoint_url)
    elif model_files.names_local_path(src):
        path = Path(src).expanduser()
    else:
        path = download_hub(src, config.revision, config.hf_token, Path(config.download_dir) / "hub")
    path = _local_model_dir(path)
    check_no_remote_code(path, config.trust_remote_code)
    return path


def check_no_remote_code(path: Path, trust_remote_code: bool) -> None:
    """Refuse a checkpoint whose config.json points at repository code (auto_map) we can't run."""
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ModelSourceError(f"{path} has no config.json: not a Hugging Face model directory")
    from serving.checkpoint.model_config import (
        ModelConfigError,
        UnsupportedModelError,
        check_supported,
        read_json_object,
    )

    try:
        cfg = read_json_object(cfg_file)
    except ModelConfigError as exc:
        raise ModelSourceError(str(exc)) from None
    try:
        check_supported(cfg)
    except UnsupportedModelError as exc:
        hint = (" option.trust_remote_code=true cannot help: this server never executes model code."
                if cfg.get("auto_map") else "")
        raise ModelSourceError(f"{exc}.{hint}") from None
    if cfg.get("auto_map") and trust_remote_code:
        logger.warning("%s ships remote code (auto_map); it is NOT executed: the built-in %s implementation "
                       "is used", path, cfg.get("architectures"))


# ---- S3 ----------------------------------------------------------------------------------------

def _split_s3(uri: str) -> tuple[str, str]:
    rest = uri[len("s3://"):]
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise ModelSourceError(f"invalid S3 URI {uri!r}: expected s3://bucket/prefix")
    if not S3_BUCKET.fullmatch(bucket):
        raise ModelSourceError(f"invalid S3 URI {uri!r}: bucket name {bucket!r} is not a valid S3 bucket name")
    return bucket, prefix


def s3_destination(uri: str, cache_dir: Path) -> Path:
    """Where `s3://bucket/prefix` is mirrored: `cache_dir/s3/bucket/prefix`, checked to stay below
    `cache_dir` (a prefix with '..', '.' or empty segments is refused, naming it)."""
    bucket, prefix = _split_s3(uri)
    name = f"s3/{bucket}" + (f"/{prefix.rstrip('/')}" if prefix.rstrip("/") else "")
    try:
        return destination(cache_dir, name, f"S3 prefix of {uri!r}:")
    except UnsafePathError as exc:
        raise ModelSourceError(str(exc)) from None


def download_s3(uri: str, cache_dir: Path, *, endpoint_url: str | None = None, max_workers: int = 8,
                client: object | None = None) -> Path:
    """Mirror `s3://bucket/prefix` into `cache_dir/s3/bucket/prefix`; returns that directory.

    Every key is checked before anything is written (`serving/server/settings/download_paths.py`): a
    key that is absolute, holds '..', '.' or empty segments, names this mirror's bookkeeping directory, or
    resolves outside the mirror (a symlink in the tree) fails the whole download, naming the key.
    Files already present with the same size (and the same ETag, when we recorded one) are
    skipped; each file is written to a temp name and renamed, so an interrupted run resumes.
    """
    import boto3
    from botocore.exceptions import BotoCoreError, ClientError

    dest = s3_destination(uri, cache_dir)
    bucket, prefix = _split_s3(uri)
    if prefix and not prefix.endswith("/"):
        prefix += "/"
    s3 = client or boto3.session.Session().client("s3", endpoint_url=endpoint_url)
    try:
        objects = [o for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
                   for o in page.get("Contents", []) if not o["Key"].endswith("/")]
    except (BotoCoreError, ClientError) as exc:
        raise ModelSourceError(f"cannot list {uri}: {exc}") from None
    if not objects:
        raise ModelSourceError(f"no objects under {uri}")
    targets = _checked_targets(uri, dest, prefix, [o["Key"] for o in objects])
    tmp_dir = dest / _META_DIR / "tmp"

    def fetch(obj: dict) -> bool:
        rel, target = targets[obj["Key"]]
        meta = dest / _META_DIR / (rel + ".etag")
        etag = obj.get("ETag", "").strip('"')
        if target.is_file() and target.stat().st_size == obj["Size"] and (
                not meta.is_file() or meta.read_text() == etag):
            return False
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp_dir.mkdir(parents=True, exist_ok=True)
        tmp = tmp_dir / f"{uuid.uuid4().hex}.part"  # never a key's name: keys under _META_DIR are refused
        s3.download_file(bucket, obj["Key"], str(tmp))
        os.replace(tmp, target)
        meta.parent.mkdir(parents=True, exist_ok=True)
        meta.write_text(etag)
        return True

    try:
        with ThreadPoolExecutor(max_workers=max_workers) as pool:
            fetched = sum(pool.map(fetch, objects))
    except (BotoCoreError, ClientError, OSError) as exc:
        raise ModelSourceError(f"downloading {uri} failed (rerun resumes): {exc}") from None
    logger.info("%s -> %s: %d files fetched, %d already complete", uri, dest, fetched, len(objects) - fetched)
    return dest


def _checked_targets(uri: str, dest: Path, prefix: str, keys: list[str]) -> dict[str, tuple[str, Path]]:
    """{key: (name below the prefix, local path)}, every one checked to land inside `dest`; the
    first key that would not fails the download (ModelSourceError naming it), before any write."""
    out: dict[str, tuple[str, Path]] = {}
    try:
        for key in keys:
            rel = key[len(prefix):]
            what = f"S3 key {key!r} of {uri}: name"
            if rel.split("/", 1)[0] == _META_DIR:
                raise UnsafePathError(f"{what} {rel!r} is inside this mirror's bookkeeping directory {_META_DIR}: "
                                      "refused")
            out[key] = (rel, destination(dest, rel, what))
        check_names(keys, f"S3 key of {uri}:")  # keys share the prefix: a clash of names is one of keys
    except UnsafePathError as exc:
        raise ModelSourceError(str(exc)) from None
    return out


# ---- Hugging Face hub --------------------------------------------------------------------------

def download_hub(repo_id: str, revision: str | None, token: str | None, cache_dir: Path) -> Path:
    """Fetch a hub model (weights, config, tokenizer) and return its local snapshot directory."""
    try:
        path = Path(model_files.resolve_model_dir(repo_id, revision=revision, token=token, cache_dir=str(cache_dir)))
    except Exception as exc:  # noqa: BLE001 - offline, 401, 404, DNS: all become one clear message
        raise ModelSourceError(
            f"cannot fetch model {repo_id!r} (revision {revision or 'main'}) from the Hugging Face hub: "
            f"{type(exc).__name__}: {exc}. Check HF_MODEL_ID, HF_TOKEN and network access, or point "
            f"HF_MODEL_ID at a local directory or an s3:// prefix.") from None
    try:  # the hub client checks file names itself; this says so of the finished snapshot too
        check_tree(path, cache_dir, f"hub model {repo_id!r}: file")
    except UnsafePathError as exc:
        raise ModelSourceError(str(exc)) from None
    return path

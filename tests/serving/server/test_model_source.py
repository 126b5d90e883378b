"""Model sources: S3 against moto's real server (127.0.0.1), local dirs, remote-code refusal, hub errors."""

import json
import logging
import re

import boto3
import pytest

from serving.server.settings.config import load_config
from serving.server.settings.model_source import ModelSourceError, check_no_remote_code, download_s3, resolve_model

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}


@pytest.fixture(scope="module")
def s3_endpoint():
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture()
def s3(s3_endpoint, monkeypatch):
    for k, v in {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    client = boto3.client("s3", endpoint_url=s3_endpoint)
    client.create_bucket(Bucket="models")
    files = {"m/config.json": json.dumps(CONFIG).encode(), "m/model.safetensors": bytes(range(256)) * 40000,
             "m/tokenizer.json": b'{"x": 1}', "m/sub/extra.txt": b"hello"}
    for key, data in files.items():
        client.put_object(Bucket="models", Key=key, Body=data)
    return client, files


def test_s3_download_parallel_and_resumable(s3, s3_endpoint, tmp_path, caplog):
    client, files = s3
    env = {"HF_MODEL_ID": "s3://models/m/", "AWS_ENDPOINT_URL_S3": s3_endpoint, "SERVING_DOWNLOAD_DIR": str(tmp_path)}
    cfg = load_config(env, [])
    with caplog.at_level(logging.INFO, logger="serving.server.settings.model_source"):
        path = resolve_model(cfg)
    assert path == tmp_path / "s3" / "models" / "m"
    for key, data in files.items():
        assert (path / key[2:]).read_bytes() == data
    assert "4 files fetched, 0 already complete" in caplog.text
    caplog.clear()
    (path / "tokenizer.json").write_bytes(b"{")  # a broken/partial file is fetched again
    client.put_object(Bucket="models", Key="m/sub/extra.txt", Body=b"HELLO")  # same size, new ETag
    with caplog.at_level(logging.INFO, logger="serving.server.settings.model_source"):
        download_s3("s3://models/m", tmp_path, endpoint_url=s3_endpoint)
    assert "2 files fetched, 2 already complete" in caplog.text
    assert (path / "sub/extra.txt").read_bytes() == b"HELLO" and (path / "tokenizer.json").read_bytes() == b'{"x": 1}'


def test_s3_missing_prefix_is_a_clear_error(s3, s3_endpoint, tmp_path):
    with pytest.raises(ModelSourceError, match="no objects under s3://models/nothing"):
        download_s3("s3://models/nothing/", tmp_path, endpoint_url=s3_endpoint)
    with pytest.raises(ModelSourceError, match="cannot list s3://nobucket"):
        download_s3("s3://nobucket/x", tmp_path, endpoint_url=s3_endpoint)


def test_local_dir_and_opt_ml_model(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    assert resolve_model(load_config({"HF_MODEL_ID": str(tmp_path)}, [])) == tmp_path
    assert resolve_model(load_config({}, []), opt_ml_model=tmp_path) == tmp_path  # SageMaker artifacts
    assert resolve_model(load_config({}, []), opt_ml_model=tmp_path / "empty") is None  # default model
    with pytest.raises(ModelSourceError, match="not a directory"):
        resolve_model(load_config({"HF_MODEL_ID": str(tmp_path / "config.json")}, []))


def test_remote_code_models_are_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Phi3SmallForCausalLM"],
                                                      "auto_map": {"AutoModelForCausalLM": "modeling.X"}}))
    with pytest.raises(ModelSourceError, match="never executes model code"):
        check_no_remote_code(tmp_path, trust_remote_code=True)


def test_unreachable_hub_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = load_config({"HF_MODEL_ID": "org/definitely-not-cached", "SERVING_DOWNLOAD_DIR": str(tmp_path)}, [])
    with pytest.raises(ModelSourceError, match="cannot fetch model 'org/definitely-not-cached'.*HF_TOKEN"):
        resolve_model(cfg)


def test_a_gguf_in_opt_ml_model_or_named_by_path_is_served_converted(tmp_path, monkeypatch):
    """SageMaker artifacts holding only a .gguf (and HF_MODEL_ID naming the file) serve its conversion,
    made once (not the default model, as a dir without config.json would otherwise mean)."""
    from serving.checkpoint import gguf_convert

    monkeypatch.setenv("OPEN_LMI_CACHE", str(tmp_path / "cache"))
    calls = []

    def fake_export(gguf, out_dir):  # the conversion itself: tests/serving/checkpoint/test_gguf_models.py
        calls.append(gguf.name)
        (out_dir / "config.json").write_text(json.dumps(CONFIG))
        for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
            (out_dir / name).write_text("{}")

    monkeypatch.setattr(gguf_convert, "_export", fake_export)
    artifacts = tmp_path / "opt_ml_model"
    artifacts.mkdir()
    (artifacts / "model-Q4_K_M.gguf").write_bytes(b"GGUF")
    served = resolve_model(load_config({}, []), opt_ml_model=artifacts)
    assert served.parent == tmp_path / "cache" / "gguf" and served.name.startswith("model-Q4_K_M-")
    assert resolve_model(load_config({"HF_MODEL_ID": str(artifacts / "model-Q4_K_M.gguf")}, [])) == served
    assert calls == ["model-Q4_K_M.gguf"]  # converted once, found done the second time


def _files(root):
    """{relative path: bytes} of every file under `root` (symlinks listed, not followed)."""
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() and not p.is_symlink() else b"<link>")
            for p in sorted(root.rglob("*")) if p.is_file() or p.is_symlink()}


# Each key set: an ordinary-looking model prefix holding one hostile key (the victim sits at
# <tmp>/outside/victim; the mirror of s3://evil-<n>/m is <tmp>/dl/s3/evil-<n>/m).
HOSTILE_KEYS = [
    "m/../../../../outside/victim",  # '..' climbing out of the mirror
    "m/sub/../../../../../outside/victim",
    "m//outside/victim",  # an empty segment: '/outside/victim', absolute
    "m/./config2.json",  # '.' segment: normalises onto another key's file
    "m/.open-lmi-s3/config.json.etag",  # the mirror's own bookkeeping
    "m/config.json/inner",  # config.json is a file and a directory at once
]


@pytest.mark.parametrize("n, key", list(enumerate(HOSTILE_KEYS)))
def test_s3_keys_leaving_the_mirror_are_refused_naming_the_key(s3, s3_endpoint, tmp_path, n, key):
    client, _ = s3
    bucket = f"evil-{n}"
    client.create_bucket(Bucket=bucket)
    for k, data in {"m/config.json": json.dumps(CONFIG).encode(), "m/config2.json": b"{}", key: b"OVERWRITTEN"}.items():
        client.put_object(Bucket=bucket, Key=k, Body=data)
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "victim").write_bytes(b"original")
    before = _files(tmp_path)
    cfg = load_config({"HF_MODEL_ID": f"s3://{bucket}/m/", "AWS_ENDPOINT_URL_S3": s3_endpoint,
                       "SERVING_DOWNLOAD_DIR": str(tmp_path / "dl")}, [])
    with pytest.raises(ModelSourceError, match=re.escape(repr(key))) as err:
        resolve_model(cfg)
    assert "refused" in str(err.value)
    assert _files(tmp_path) == before  # checked before any write: nothing at all written, inside or out


@pytest.mark.parametrize("uri", ["s3://models/../../../outside", "s3://models/m/../../../../outside",
                                 "s3://models/./m", "s3://models//m", "s3://../m", "s3://models/m/%2e%2e/x/.."])
def test_s3_prefixes_leaving_the_download_dir_are_refused(s3, s3_endpoint, tmp_path, uri):
    (tmp_path / "outside").mkdir()
    with pytest.raises(ModelSourceError, match="refused|not a valid S3 bucket name"):
        download_s3(uri, tmp_path / "dl", endpoint_url=s3_endpoint)
    assert not (tmp_path / "dl").exists() and list((tmp_path / "outside").iterdir()) == []


def test_a_symlink_in_the_mirror_is_not_followed_out(s3, s3_endpoint, tmp_path):
    """A directory of the mirror that is a symlink (left by anyone) never carries a write outside."""
    (tmp_path / "outside").mkdir()
    mirror = tmp_path / "dl" / "s3" / "models" / "m"
    mirror.mkdir(parents=True)
    (mirror / "sub").symlink_to(tmp_path / "outside", target_is_directory=True)
    with pytest.raises(ModelSourceError, match=r"S3 key 'm/sub/extra.txt'.*outside .*symlink"):
        download_s3("s3://models/m", tmp_path / "dl", endpoint_url=s3_endpoint)
    assert list((tmp_path / "outside").iterdir()) == []


def test_unreadable_model_files_are_named_not_tracebacks(tmp_path):
    from serving.checkpoint.model_config import ModelConfigError, read_json_object

    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ModelSourceError, match=r"config.json holds a JSON list, not an object"):
        resolve_model(load_config({"HF_MODEL_ID": str(tmp_path)}, []))
    (tmp_path / "config.json").write_bytes(b'{"model_type": "\xff"}')
    with pytest.raises(ModelSourceError, match=r"config.json is not UTF-8 text"):
        resolve_model(load_config({"HF_MODEL_ID": str(tmp_path)}, []))
    (tmp_path / "generation_config.json").write_text("7")
    with pytest.raises(ModelConfigError, match="generation_config.json holds a JSON int"):
        read_json_object(tmp_path / "generation_config.json")


def test_a_hub_snapshot_reaching_outside_its_cache_is_refused(tmp_path, monkeypatch):
    """The hub client checks file names itself; the finished snapshot is checked again here."""
    from serving.checkpoint import model_files

    (tmp_path / "outside").mkdir()

    def snapshot(repo_id, revision=None, token=None, cache_dir=None):  # what a hostile snapshot would leave
        snap = tmp_path / "dl" / "hub" / "snap"
        snap.mkdir(parents=True)
        (snap / "config.json").write_text(json.dumps(CONFIG))
        (snap / "tokenizer.json").symlink_to(tmp_path / "outside" / "stolen")
        return snap

    monkeypatch.setattr(model_files, "resolve_model_dir", snapshot)
    cfg = load_config({"HF_MODEL_ID": "org/model", "SERVING_DOWNLOAD_DIR": str(tmp_path / "dl")}, [])
    with pytest.raises(ModelSourceError, match=r"hub model 'org/model': file tokenizer.json resolves to .*outside"):
        resolve_model(cfg)

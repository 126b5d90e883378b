"""A user's GGUF file as the model: converted once into the cache, then served like any checkpoint.

The embedded default model's own GGUF file stands in for a user's (its conversion is the oracle:
the same file must give the same weights), named as a file and as a dir holding it.
"""

from __future__ import annotations

import time

import pytest
import torch

from serving.checkpoint.default_model import gguf_path
from serving.checkpoint.model_files import ModelNotFoundError, resolve_model_dir


def test_a_gguf_file_or_its_dir_serves_its_conversion(tmp_path, monkeypatch, smollm2_path):
    from safetensors.torch import load_file

    from serving.llm import LLM
    from serving.sampling_params import SamplingParams

    monkeypatch.setenv("OPEN_LMI_CACHE", str(tmp_path / "cache"))
    user = tmp_path / "downloads"
    user.mkdir()
    (user / "my-model.gguf").symlink_to(gguf_path())
    converted = resolve_model_dir(str(user / "my-model.gguf"))
    assert converted.parent == tmp_path / "cache" / "gguf" and converted.name.startswith("SmolLM2-135M-Instruct.Q4_1-")
    t0 = time.monotonic()
    assert resolve_model_dir(str(user)) == converted  # the dir holding it: the same conversion, found done
    assert time.monotonic() - t0 < 1.0
    ours, default = load_file(str(converted / "model.safetensors")), load_file(str(smollm2_path / "model.safetensors"))
    assert ours.keys() == default.keys() and all(torch.equal(ours[k], default[k]) for k in ours)

    llm = LLM(str(user / "my-model.gguf"), device="cpu", kv_cache_memory_gb=0.05)
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text


def test_a_dir_of_several_gguf_files_or_an_unreadable_one_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("OPEN_LMI_CACHE", str(tmp_path / "cache"))
    two = tmp_path / "two"
    two.mkdir()
    for name in ("a-Q4_K_M.gguf", "a-Q8_0.gguf"):
        (two / name).write_bytes(b"GGUF")
    with pytest.raises(ModelNotFoundError, match=r"2 \.gguf files \(a-Q4_K_M\.gguf, a-Q8_0\.gguf\): name one"):
        resolve_model_dir(str(two))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelNotFoundError, match="transformers cannot read .*bad.gguf"):
        resolve_model_dir(str(bad))
    assert not any((tmp_path / "cache" / "gguf").glob("bad-*"))  # nothing half-written left behind

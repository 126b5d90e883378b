"""Sizing: the seed's Phi-3-mini arithmetic reproduced, and the GQA-correct figures beside it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from sdk.sizing import GB, PHI3_MINI_4K, ModelShape, kv_bytes_per_token, seed_estimate, seed_kv_bytes_per_token, size

SMOLLM2 = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
           "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152, "tie_word_embeddings": True}


def test_seed_004_numbers() -> None:
    seed = seed_estimate(params_billion=3.8, num_layers=32, hidden_size=4096, dtype_bytes=2, seq_len=4096, batch=4)
    assert seed.weights_gb == pytest.approx(7.6)
    assert seed.kv_bytes_per_token == 524_288
    assert seed.kv_gb_per_token_rounded == 0.00052
    assert round(seed.kv_cache_gb, 2) == 8.52
    assert round(seed.total_gb, 1) == 16.1


def test_phi3_gqa_correct_figure() -> None:
    shape = ModelShape.from_config(PHI3_MINI_4K)
    assert (shape.num_kv_heads, shape.head_dim) == (32, 96)
    assert kv_bytes_per_token(shape.num_layers, shape.num_kv_heads, shape.head_dim, 2) == 393_216
    assert seed_kv_bytes_per_token(32, 4096, 2) / 393_216 == pytest.approx(4 / 3)  # the article's 4096 overestimates
    assert shape.num_params() == pytest.approx(3.82e9, rel=0.01)  # "3.8B parameters"
    report = size(shape=shape, num_params=3_800_000_000, dtype="fp16", batch=4, seq_len=4096, seed_hidden_size=4096)
    assert report.weight_bytes / GB == pytest.approx(7.6)
    assert report.kv_bytes_per_token == 393_216 and report.seed_kv_bytes_per_token == 524_288
    assert report.kv_cache_bytes / GB == pytest.approx(6.44, abs=0.01)
    assert report.total_bytes / GB == pytest.approx(14.04, abs=0.01)
    assert report.instance_type == "ml.g5.xlarge" and report.tensor_parallel_degree == 1  # one A10G, like g5.4xlarge


def test_hidden_size_formula_overestimates_gqa_3x() -> None:
    report = size(shape=ModelShape.from_config(SMOLLM2), dtype="bf16", batch=1, seq_len=8192)
    assert report.kv_bytes_per_token == 2 * 30 * 3 * 64 * 2 == 23_040
    assert report.seed_kv_bytes_per_token == 2 * 2 * 30 * 576
    assert report.seed_overestimate == pytest.approx(3.0)
    assert report.num_params == pytest.approx(134_515_008, rel=0.001)  # the GGUF model's count


def test_big_model_needs_tensor_parallel() -> None:
    llama70 = {"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
               "num_key_value_heads": 8, "vocab_size": 128256}
    report = size(shape=ModelShape.from_config(llama70), dtype="bf16", batch=4, seq_len=4096)
    assert report.kv_bytes_per_token == 2 * 80 * 8 * 128 * 2
    assert report.tensor_parallel_degree in (4, 8) and report.instance_type is not None


def test_cli(tmp_path) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(PHI3_MINI_4K))
    cmd = [sys.executable, "-m", "sdk.sizing", "--config", str(cfg), "--params", "3.8e9", "--dtype", "fp16",
           "--batch", "4", "--seq-len", "4096", "--seed-hidden-size", "4096"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    assert "524,288" in out and "393,216" in out and "8.52 GB" in out and "7.6 GB" in out and "16.1 GB" in out
    assert "TENSOR_PARALLEL_DEGREE=1" in out and "ml.g5.xlarge" in out
    report = json.loads(subprocess.run(cmd + ["--json"], check=True, capture_output=True, text=True).stdout)
    assert report["kv_bytes_per_token"] == 393_216


LLAMA3_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "tie_word_embeddings": False}


def test_quantized_weight_bytes() -> None:
    """Llama-3-8B: 6.98 B linear weights; int4 g128 = 0.5 B + 4 B of scale/zero per 128 weights each,
    the 1.05 B embedding / head / norm weights stay 2 B."""
    shape = ModelShape.from_config(LLAMA3_8B)
    linear, rest = shape.linear_params(), shape.num_params() - shape.linear_params()
    assert linear == 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336)
    bf16 = size(shape=shape, dtype="bf16", batch=1, seq_len=1).weight_bytes
    int4 = size(shape=shape, dtype="bf16", batch=1, seq_len=1, quantization="gptq")
    assert int4.weight_bytes == pytest.approx(linear * (0.5 + 4 / 128) + rest * 2)
    assert int4.dtype == "gptq+bf16" and 0.35 < int4.weight_bytes / bf16 < 0.37  # 5.8 GB of 16.1 GB
    awq = size(shape=shape, dtype="bf16", batch=1, seq_len=1, quantization="awq").weight_bytes
    assert awq == int4.weight_bytes
    int8 = size(shape=shape, dtype="bf16", batch=1, seq_len=1, quantization="gptq", bits=8, group_size=None)
    out_cols = 32 * (4096 + 2 * 1024 + 4096 + 2 * 14336 + 4096)
    assert int8.weight_bytes == pytest.approx(linear + 4 * out_cols + rest * 2)
    fp8 = size(shape=shape, dtype="bf16", batch=1, seq_len=1, quantization="fp8").weight_bytes
    assert fp8 == pytest.approx(linear + 4 * out_cols + rest * 2) and 9.0e9 < fp8 < 9.2e9
    with pytest.raises(ValueError, match="awq weights are 4 bits"):
        size(shape=shape, quantization="awq", bits=8)
    with pytest.raises(ValueError, match="needs the model shape"):
        size(num_params=8_000_000_000, quantization="gptq")


def test_cli_quantized(tmp_path) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(LLAMA3_8B))
    cmd = [sys.executable, "-m", "sdk.sizing", "--config", str(cfg), "--dtype", "bf16", "--quantize", "gptq",
           "--batch", "1", "--seq-len", "4096", "--json"]
    report = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    assert report["dtype"] == "gptq+bf16" and 5.7e9 < report["weight_bytes"] < 5.9e9


@pytest.mark.parametrize("cfg, published", [
    # Mixtral-8x7B: 8 experts as wide as intermediate_size, every layer
    (dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336, num_local_experts=8,
          num_hidden_layers=32, vocab_size=32000), 46.7e9),
    # Qwen3-30B-A3B: 128 experts of moe_intermediate_size (its intermediate_size is a dense layer's)
    (dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128, intermediate_size=6144,
          moe_intermediate_size=768, num_experts=128, num_hidden_layers=48, vocab_size=151936), 30.5e9),
    # Qwen1.5-MoE-A2.7B: 60 experts and a shared expert
    (dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=16, intermediate_size=5632,
          moe_intermediate_size=1408, shared_expert_intermediate_size=5632, num_experts=60, num_hidden_layers=24,
          vocab_size=151936), 14.3e9),
    # StarCoder2-15B (the hub lists 16B): a plain MLP (c_fc, c_proj), 2 matrices not 3 (3 would give 22B)
    (dict(model_type="starcoder2", hidden_size=6144, num_attention_heads=48, num_key_value_heads=4,
          intermediate_size=24576, num_hidden_layers=40, vocab_size=49152, tie_word_embeddings=False), 16.0e9),
    # GPT-2 (124M) in its own config names, tied, n_inner null (4 x n_embd), biases left out of the count
    (dict(model_type="gpt2", n_embd=768, n_layer=12, n_head=12, n_inner=None, vocab_size=50257,
          tie_word_embeddings=True), 124.4e6 - 1024 * 768),
    # Nemotron-Mini-4B (Minitron): a plain squared-ReLU MLP (up, down), 2 matrices (3 would give 5.1B), untied
    (dict(model_type="nemotron", hidden_size=3072, num_attention_heads=24, num_key_value_heads=8, head_dim=128,
          intermediate_size=9216, num_hidden_layers=32, vocab_size=256000, tie_word_embeddings=False), 4.19e9),
], ids=["mixtral_8x7b", "qwen3_30b_a3b", "qwen1.5_moe_a2.7b", "starcoder2_15b", "gpt2", "nemotron_mini_4b"])
def test_parameter_counts_of_other_layouts(cfg, published) -> None:
    assert ModelShape.from_config(cfg).num_params() == pytest.approx(published, rel=0.01)

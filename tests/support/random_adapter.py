"""Random PEFT-layout LoRA adapters for a model config (no PEFT needed: the GPU machine has none).
Used by the LoRA kernel tests and `bench/lora.py`."""

from __future__ import annotations

import json
from pathlib import Path

import torch

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_random_adapter(c: dict, out_dir: Path, rank: int, seed: int, b_std: float = 0.01,
                         dtype: torch.dtype = torch.bfloat16) -> Path:
    """A random PEFT-layout adapter (adapter_config.json + adapter_model.safetensors) on all seven
    projections of the model whose config.json is `c` (no PEFT needed: the GPU machine has none)."""
    from safetensors.torch import save_file

    h, i = c["hidden_size"], c["intermediate_size"]
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    dims = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(c["num_hidden_layers"]):
        for name, (d_in, d_out) in dims.items():
            block = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{name}"
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, d_in, generator=g) / d_in**0.5).to(dtype)
            tensors[f"{prefix}.lora_B.weight"] = (b_std * torch.randn(d_out, rank, generator=g)).to(dtype)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    (out_dir / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS),
        "lora_dropout": 0.0, "bias": "none", "task_type": "CAUSAL_LM"}))
    return out_dir

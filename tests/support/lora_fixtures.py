"""Random PEFT LoRA adapters for the default model and a tiny Llama, and PEFT's greedy tokens.

Each adapter is made by PEFT itself (`get_peft_model` + `save_pretrained`: `adapter_config.json`
+ `adapter_model.safetensors`) on the transformers base model, with A and B both random (PEFT
starts B at zero, which would leave the outputs unchanged) so an adapter that is skipped,
mis-scaled or applied to the wrong rows changes the greedy tokens. `lora_alpha` differs from the
rank so the alpha / r scaling is exercised.

`lora_adapters` is registered once for all of tests/ by tests/conftest.py; `peft_greedy` is imported:

    from lora_fixtures import peft_greedy

    def test_x(lora_adapters):
        base, adapters = lora_adapters("llama")  # base model dir, {name: adapter dir}
        tokens = peft_greedy(str(base), str(adapters["r8"]), prompt_ids, 12)
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

import pytest
import torch

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# name -> (rank, lora_alpha, target modules, seed); "r16_attn" leaves the MLP alone.
ADAPTER_SPECS: dict[str, tuple[int, int, tuple[str, ...], int]] = {
    "r8": (8, 16, ALL_TARGETS, 1),
    "r16": (16, 8, ALL_TARGETS, 2),
    "r16_attn": (16, 32, ("q_proj", "k_proj", "v_proj", "o_proj"), 3),
}
# Std of lora_B per base: with kaiming-uniform A this moves the greedy tokens without drowning the base.
B_STD = {"default": 0.08, "llama": 0.02}


@lru_cache(maxsize=2)
def _base(model_dir: str):  # noqa: ANN202 - a transformers model, loaded once per dir
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def build_lora_adapter(base_dir: str | Path, out_dir: str | Path, rank: int, alpha: int,
                       target_modules: tuple[str, ...] = ALL_TARGETS, seed: int = 0, b_std: float = 0.02) -> Path:
    """Write a random PEFT LoRA adapter for the model at `base_dir` into `out_dir` and return it."""
    from peft import LoraConfig, get_peft_model

    base = _base(str(base_dir))
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(target_modules), lora_dropout=0.0,
                        bias="none", task_type="CAUSAL_LM")
    torch.manual_seed(seed)
    peft_model = get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(b_std * torch.randn(p.shape, generator=gen))
    out_dir = Path(out_dir)
    peft_model.save_pretrained(str(out_dir))
    peft_model.unload()  # the cached base model is plain again (no LoRA layers left in it)
    assert (out_dir / "adapter_model.safetensors").is_file() and (out_dir / "adapter_config.json").is_file()
    return out_dir


@lru_cache(maxsize=None)
def peft_greedy(base_dir: str, adapter_dir: str | None, prompt_ids: tuple[int, ...],
                max_new_tokens: int) -> tuple[int, ...]:
    """PEFT's greedy continuation (fp32, CPU, EOS off) of `prompt_ids` on `adapter_dir`
    (None: the base model alone)."""
    base = _base(base_dir)
    model = base
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(base, adapter_dir).eval()
    ids = torch.tensor([list(prompt_ids)])
    try:
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 min_new_tokens=0, do_sample=False, eos_token_id=None, pad_token_id=0)
    finally:
        if adapter_dir is not None:
            model.unload()
    return tuple(out[0, ids.shape[1]:].tolist())


class LoraAdapters:
    """Builds the base model (`"default"`: SmolLM2-135M; `"llama"`: a tiny random Llama) and its
    adapters (`ADAPTER_SPECS`) once under `root`."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._built: dict[str, tuple[Path, dict[str, Path]]] = {}

    def __call__(self, base: str) -> tuple[Path, dict[str, Path]]:
        if base not in self._built:
            if base == "default":
                from serving.checkpoint.default_model import default_model_path

                base_dir = Path(default_model_path())
            elif base == "llama":
                from model_fixtures import build_tiny_model

                base_dir = build_tiny_model("llama", self.root / "llama-base")
            else:
                raise ValueError(f"unknown base {base!r}: 'default' or 'llama'")
            adapters = {
                name: build_lora_adapter(base_dir, self.root / f"{base}-{name}", rank, alpha, targets, seed,
                                         B_STD[base])
                for name, (rank, alpha, targets, seed) in ADAPTER_SPECS.items()
            }
            self._built[base] = (base_dir, adapters)
        return self._built[base]


@pytest.fixture(scope="session")
def lora_adapters(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, dict[str, Path]]]:
    """Session-wide builder: `lora_adapters("default" | "llama") -> (base dir, {name: adapter dir})`."""
    return LoraAdapters(tmp_path_factory.mktemp("lora_adapters"))

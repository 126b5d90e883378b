"""The transformers reference for identity tests: greedy continuations, computed once per prompt.

One prompt per `generate` call (no padding), float32, EOS disabled so every prompt yields
exactly `max_new_tokens` tokens; results are memoized for the whole test session.
"""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=4)
def _load(model_dir: str):  # noqa: ANN202
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@lru_cache(maxsize=None)
def hf_greedy(model_dir: str, prompt_ids: tuple[int, ...], max_new_tokens: int) -> tuple[int, ...]:
    """transformers' greedy continuation of `prompt_ids` (new tokens only)."""
    import torch

    model = _load(model_dir)
    ids = torch.tensor([list(prompt_ids)])
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, min_new_tokens=0,
            do_sample=False, eos_token_id=None, pad_token_id=0,
        )
    return tuple(out[0, ids.shape[1] :].tolist())

"""The transformers reference for identity tests: greedy continuations, computed once per prompt.

One prompt per `generate` call (no padding), float32, EOS disabled so every prompt yields
exactly `max_new_tokens` tokens; results are memoized for the whole test session.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator, Mapping
from concurrent.futures import ProcessPoolExecutor
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


def _one_thread() -> None:
    import torch

    torch.set_num_threads(1)


class HFGreedyInBackground(Mapping):
    """`hf_greedy` of each prompt, computed in one spawned process (one torch thread, the prompts
    in the order given) while the caller goes on; reading a prompt's entry waits for it.

    The same call as `hf_greedy` in-process (same function, model, dtype, thread count): only where it
    runs changes, so a 2-core machine runs the oracle beside the engine under test.
    """

    def __init__(self, model_dir: str, prompt_ids: Mapping[str, tuple[int, ...]], max_new_tokens: int) -> None:
        self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=_one_thread)
        self._futures = {p: self._pool.submit(hf_greedy, model_dir, ids, max_new_tokens) for p, ids in prompt_ids.items()}

    def __getitem__(self, prompt: str) -> tuple[int, ...]:
        return self._futures[prompt].result()

    def __iter__(self) -> Iterator[str]:
        return iter(self._futures)

    def __len__(self) -> int:
        return len(self._futures)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

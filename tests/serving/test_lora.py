"""Multi-LoRA through the engine and the offline API, against PEFT on transformers (fp32, CPU).

Oracle: PEFT's greedy tokens (`tests/support/lora_fixtures.py`) for each adapter alone (ranks 8 and 16)
and for one batch mixing three adapters and the base model, on the default model and on a tiny
random Llama. With `max_loras=2` the three-adapter batch also exercises the slot limit (a
request waits for a slot) and slot reuse. Also: prefix-cache blocks are never shared between
adapters, adapter registration errors, unknown adapters, removal while a request runs on it.
"""

from __future__ import annotations

import json
import shutil
import threading

import pytest
from lora_fixtures import peft_greedy

from serving.llm import LLM
from serving.lora_request import LoRARequest, UnknownAdapterError
from serving.sampling_params import SamplingParams

PROMPTS = ["The capital of France is", "Write a haiku about the sea:", "List three prime numbers:",
           "Once upon a time"]
OPTIONS = dict(device="cpu", dtype="float32", block_size=4, max_model_len=256, kv_cache_memory_gb=0.05)


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _request(adapters: dict, name: str) -> LoRARequest:
    """The fixture adapter `name` as a LoRARequest (ids fixed per name, so re-registering matches)."""
    return LoRARequest(name, 1 + sorted(adapters).index(name), str(adapters[name]))


def _check_peft(llm: LLM, base, adapters, prompts, names, n, **kw) -> list:
    """Generate `prompts` each on its adapter (`names`, None = base) and compare with PEFT."""
    reqs = [None if name is None else _request(adapters, name) for name in names]
    outs = llm.generate(prompts, _greedy(n), lora_request=reqs, use_tqdm=False, **kw)
    for out, name in zip(outs, names):
        expected = peft_greedy(str(base), None if name is None else str(adapters[name]),
                               tuple(out.prompt_token_ids), n)
        assert tuple(out.outputs[0].token_ids) == expected, f"adapter {name}"
    return outs


@pytest.fixture(scope="module")
def llama(lora_adapters):
    base, adapters = lora_adapters("llama")
    # Async scheduling: slots are reloaded for step N+1 while step N is in flight.
    llm = LLM(str(base), enable_lora=True, max_loras=2, async_scheduling=True, **OPTIONS)
    plans = []
    execute = llm.llm_engine.executor.execute
    llm.llm_engine.executor.execute = lambda plan: (plans.append(plan), execute(plan))[1]
    yield llm, base, adapters, plans
    llm.llm_engine.shutdown()


def test_tiny_llama_matches_peft_alone_and_mixed_with_two_slots(llama):
    llm, base, adapters, plans = llama
    _check_peft(llm, base, adapters, PROMPTS[:1], ["r8"], 12)
    _check_peft(llm, base, adapters, PROMPTS[1:2], ["r16"], 12)
    plans.clear()
    _check_peft(llm, base, adapters, PROMPTS, ["r8", "r16", "r16_attn", None], 12)
    # Three adapters, two slots: never more than two in one step, and the third waited for a slot.
    per_step = [{s for s in p.lora_slots if s >= 0} for p in plans if p.lora_slots is not None]
    assert max(len(s) for s in per_step) == 2
    assert any(p.lora_loads for p in plans[1:])
    assert sorted(llm.llm_engine.list_loras()) == ["r16", "r16_attn", "r8"]


def test_prefix_cache_is_not_shared_between_adapters(llama):
    llm, base, adapters, _ = llama
    prompt = ["A long shared prefix about the weather in the mountains, the rivers and the sea, told twice."]
    out_base = llm.generate(prompt, _greedy(4), use_tqdm=False)[0]
    assert len(out_base.prompt_token_ids) >= 12  # several full blocks of 4
    # Had the adapter reused the base model's K/V for the prefix, its tokens would differ from PEFT's.
    first = _check_peft(llm, base, adapters, prompt, ["r8"], 4)[0]
    assert first.num_cached_tokens == 0
    again = _check_peft(llm, base, adapters, prompt, ["r8"], 4)[0]
    assert again.num_cached_tokens > 0  # its own blocks are cached


def test_chat_on_an_adapter_is_generate_on_the_rendered_prompt(llama):
    llm, base, adapters, _ = llama
    chat = llm.chat([{"role": "user", "content": "Name a colour."}], _greedy(6), use_tqdm=False,
                    lora_request=_request(adapters, "r16"))[0]
    expected = peft_greedy(str(base), str(adapters["r16"]), tuple(chat.prompt_token_ids), 6)
    assert tuple(chat.outputs[0].token_ids) == expected


def test_default_model_matches_peft_alone_and_mixed(lora_adapters):
    base, adapters = lora_adapters("default")
    llm = LLM(str(base), enable_lora=True, max_loras=4, **OPTIONS)
    try:
        _check_peft(llm, base, adapters, PROMPTS[:1], ["r8"], 6)  # alone (PEFT's tokens are memoized ...
        _check_peft(llm, base, adapters, PROMPTS[1:2], ["r16"], 6)
        _check_peft(llm, base, adapters, PROMPTS, ["r8", "r16", "r16_attn", None], 6)  # ... for the mix)
    finally:
        llm.llm_engine.shutdown()


def test_registration_errors_unknown_adapter_and_remove_while_running(llama, tmp_path):
    from safetensors.torch import load_file, save_file

    llm, base, adapters, _ = llama
    engine = llm.llm_engine
    with pytest.raises(ValueError, match="already registered"):
        engine.add_lora(LoRARequest("r8", 9, str(adapters["r16"])))
    saved, engine.lora.max_lora_rank = engine.lora.max_lora_rank, 8
    try:
        with pytest.raises(ValueError, match="exceeds max_lora_rank=8"):
            engine.add_lora(LoRARequest("big", 7, str(adapters["r16"])))
    finally:
        engine.lora.max_lora_rank = saved
    bad = tmp_path / "bad"
    shutil.copytree(adapters["r8"], bad)
    cfg = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    with pytest.raises(ValueError, match="use_dora"):
        engine.add_lora(LoRARequest("dora", 8, str(bad)))
    (bad / "adapter_config.json").write_text(json.dumps({**cfg, "r": 4}))
    with pytest.raises(ValueError, match="shape .* the base model needs"):
        engine.add_lora(LoRARequest("wrong_r", 8, str(bad)))
    (bad / "adapter_config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(bad / "adapter_model.safetensors"))
    tensors["base_model.model.lm_head.lora_A.weight"] = tensors[next(iter(tensors))].clone()
    save_file(tensors, str(bad / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="lm_head.* cannot be applied"):
        engine.add_lora(LoRARequest("head", 8, str(bad)))
    (bad / "adapter_model.safetensors").rename(bad / "adapter_model.bin")
    with pytest.raises(ValueError, match="only adapter_model.safetensors"):
        engine.add_lora(LoRARequest("bin", 8, str(bad)))
    assert "head" not in engine.list_loras()
    with pytest.raises(UnknownAdapterError, match="unknown adapter 'nope': no adapter of that name") as unknown:
        engine.add_request("x", "hello", _greedy(2), lora_name="nope")
    assert "r8" in unknown.value.known and "r8" not in str(unknown.value)  # for the caller, never in the message

    # Removed while a request runs on it: that request finishes on it, new ones are refused.
    engine.add_lora(LoRARequest("tmp", 42, str(adapters["r16"])))
    prompt_ids = llm.get_tokenizer().encode(PROMPTS[2])
    engine.add_request("run", None, _greedy(6), prompt_token_ids=prompt_ids, lora_name="tmp")
    tokens: list[int] = []
    for _ in range(2):
        tokens += [t for d in engine.step() for t in d.token_ids]
    assert engine.remove_lora("tmp") and not engine.remove_lora("tmp")
    with pytest.raises(UnknownAdapterError):
        engine.add_request("late", "hello", _greedy(2), lora_name="tmp")
    while engine.has_unfinished_requests():
        tokens += [t for d in engine.step() for t in d.token_ids]
    assert tuple(tokens) == peft_greedy(str(base), str(adapters["r16"]), tuple(prompt_ids), 6)
    llm.generate(PROMPTS[:1], _greedy(1), use_tqdm=False)  # the next step frees its slot, here and in the worker
    assert not [k for k in engine.lora._slots if k is not None and k[0] == "tmp"]  # noqa: SLF001
    assert not [k for k in engine.executor.runner.lora.slot_keys if k is not None and k[0] == "tmp"]


def test_engine_loop_registers_while_loading_then_serves_and_removes(llama):
    from serving.engine.engine_loop import EngineLoop

    llm, base, adapters, _ = llama
    engine = llm.llm_engine
    loaded = threading.Event()
    loop = EngineLoop(engine.config, engine_factory=lambda config: (loaded.wait(30), engine)[1]).start()
    try:
        loop.add_lora(LoRARequest("loop_r8", 31, str(adapters["r8"])))  # while loading: kept until loaded
        assert loop.list_loras() == ["loop_r8"]
        loaded.set()
        assert loop.wait_ready(30) and "loop_r8" in loop.list_loras()
        ids = llm.get_tokenizer().encode(PROMPTS[0])
        tokens = [t for d in loop.add_request("s1", ids, _greedy(5), lora_name="loop_r8") for t in d.token_ids]
        assert tuple(tokens) == peft_greedy(str(base), str(adapters["r8"]), tuple(ids), 5)
        with pytest.raises(UnknownAdapterError, match="'nope'") as unknown:
            loop.add_request("s2", ids, _greedy(2), lora_name="nope")
        assert "loop_r8" in unknown.value.known
        assert loop.remove_lora("loop_r8") and "loop_r8" not in loop.list_loras()
    finally:
        loop.close()  # (shuts the module's engine down: the last test that uses it)


def test_lora_off_refuses(lora_adapters):
    base, adapters = lora_adapters("llama")
    llm = LLM(str(base), **OPTIONS)
    try:
        with pytest.raises(ValueError, match="not enabled"):
            llm.generate(PROMPTS[:1], _greedy(2), lora_request=LoRARequest("r8", 1, str(adapters["r8"])),
                         use_tqdm=False)
        with pytest.raises(UnknownAdapterError, match="not enabled"):
            llm.llm_engine.add_request("x", "hello", _greedy(2), lora_name="r8")
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.slow
def test_tensor_parallel_two_ranks_matches_peft(lora_adapters):
    # Column-parallel qkv / gate_up hold this rank's rows of B; row-parallel o / down this
    # rank's columns of A, their shrink outputs summed over the ranks (gloo, 2 CPU processes).
    base, adapters = lora_adapters("llama")
    llm = LLM(str(base), enable_lora=True, max_loras=2, tensor_parallel_size=2, **OPTIONS)
    try:
        _check_peft(llm, base, adapters, PROMPTS, ["r8", "r16", "r16_attn", None], 12)
    finally:
        llm.llm_engine.shutdown()

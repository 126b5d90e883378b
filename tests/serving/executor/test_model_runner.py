"""ModelRunner: KV sizing and the one allocation, dtype/len options, greedy identity with HF
generate (batched and alone, chunked prefill), logprobs, prompt logprobs, seeds, dummy weights."""

from __future__ import annotations

import os

import pytest
import torch
from paged_driver import PagedDriver

from serving.engine_config import EngineConfig
from serving.executor.model_runner import ModelRunner
from serving.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=64)


def _runner(path, **options) -> ModelRunner:
    options.setdefault("block_size", 4)
    options.setdefault("kv_cache_memory_gb", 0.01)
    options.setdefault("device", "cpu")  # fp32 identity with HF on CPU, also on a GPU machine
    return ModelRunner(EngineConfig(model=str(path), **options))


def _prompts(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49000, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="module")
def llama_runner(tiny_models):  # noqa: F811
    return _runner(tiny_models("llama"))


@pytest.fixture(scope="module")
def hf_llama(tiny_models):  # noqa: F811
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_models("llama")), dtype=torch.float32).eval()


def test_kv_cache_is_one_allocation_sized_from_the_budget(llama_runner):
    r = llama_runner
    a = r.model_args
    block_bytes = 2 * a.num_hidden_layers * 4 * a.num_key_value_heads * a.head_dim * 4
    assert r.kv_block_bytes() == block_bytes
    assert r.cache_config.num_blocks == int(0.01 * 2**30) // block_bytes
    assert r.kv_cache.shape == (2, a.num_hidden_layers, r.cache_config.num_blocks, 4, a.num_key_value_heads, a.head_dim)
    for i, layer in enumerate(r.model.attention_layers):
        assert layer.k_cache.data_ptr() == r.kv_cache[0, i].data_ptr()
        assert layer.v_cache.data_ptr() == r.kv_cache[1, i].data_ptr()
    assert r.cache_config.max_model_len == a.max_position_embeddings == r.max_model_len
    assert r.eos_token_ids == (2,) and r.vocab_size == 49152 and r.dtype == torch.float32


def test_options_override_sizes_and_check_max_model_len(tiny_models):  # noqa: F811
    r = _runner(tiny_models("mistral"), num_gpu_blocks_override=7, max_model_len=100)
    assert r.cache_config.num_blocks == 7 and r.kv_cache.shape[2] == 7 and r.max_model_len == 100
    with pytest.raises(ValueError, match="max_position_embeddings"):
        _runner(tiny_models("mistral"), max_model_len=10**6)


def test_greedy_matches_hf_generate_batched_and_alone(llama_runner, hf_llama):
    prompts = _prompts([3, 17, 30], seed=1)
    new = 12
    together = PagedDriver(llama_runner, seed=1).generate(prompts, GREEDY, new, chunk=8)
    for p, s in zip(prompts, together):
        ref = hf_llama.generate(torch.tensor([p]), max_new_tokens=new, do_sample=False, eos_token_id=None,
                                pad_token_id=0)[0, len(p):].tolist()
        assert s.output_token_ids == ref
        alone = PagedDriver(llama_runner, seed=2).generate([p], GREEDY, new)[0]
        assert alone.output_token_ids == ref


def test_logprobs_and_prompt_logprobs_match_hf(llama_runner, hf_llama):
    prompt = _prompts([23], seed=3)[0]
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=3, prompt_logprobs=1)
    driver = PagedDriver(llama_runner)
    seq = driver.add(prompt, params)
    outs = []
    while seq.num_computed_tokens < len(prompt):  # chunked prefill: 10 + 10 + 3
        _, res = driver.step([(seq, min(10, len(prompt) - seq.num_computed_tokens))])
        outs += res.sampled
    for _ in range(3):
        outs += driver.step([(seq, 1)])[1].sampled
    assert len(outs) == 4
    with torch.no_grad():
        ref = torch.log_softmax(hf_llama(torch.tensor([seq.token_ids])).logits[0], -1)  # [L, V]
    plp = outs[0].prompt_logprobs
    assert plp[0] is None and len(plp) == len(prompt)
    want = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    torch.testing.assert_close(torch.tensor(plp[1:]), want, atol=1e-4, rtol=0)
    for k, out in enumerate(outs):
        row = ref[len(prompt) - 1 + k]
        assert out.token_id == int(row.argmax())
        assert out.logprob == pytest.approx(float(row.max()), abs=1e-4)
        assert list(out.top_logprobs) == row.topk(3).indices.tolist()
        assert all(o.prompt_logprobs is None for o in outs[1:])
    driver.release(seq)


def test_seeded_sampling_same_alone_and_in_batch(llama_runner):
    prompts = _prompts([9, 14, 5, 21], seed=4)
    seeded = SamplingParams(temperature=1.0, top_k=50, seed=1234, max_tokens=64)
    alone = PagedDriver(llama_runner).generate([prompts[0]], seeded, 12)[0].output_token_ids
    mixed = [seeded, SamplingParams(temperature=0.9, max_tokens=64), SamplingParams(temperature=0.7, seed=5),
             GREEDY]
    driver = PagedDriver(llama_runner, seed=9)
    batch = driver.generate(prompts, mixed, 12, chunk=6)
    assert batch[0].output_token_ids == alone
    other = PagedDriver(llama_runner).generate([prompts[0]], seeded.replace(seed=99), 12)[0].output_token_ids
    assert other != alone
    assert llama_runner._generators  # seeded state kept per sequence until freed
    for s in batch:
        driver.release(s)
    assert all(s.seq_id not in llama_runner._generators for s in batch)


def test_dummy_weights_are_deterministic_and_run(tiny_models):  # noqa: F811
    path = tiny_models("qwen2")
    a = _runner(path, load_format="dummy", seed=3)
    b = _runner(path, load_format="dummy", seed=3)
    c = _runner(path, load_format="dummy", seed=4)
    pa, pb, pc = (dict(r.model.named_parameters()) for r in (a, b, c))
    name = "model.layers.0.self_attn.qkv_proj.weight"
    assert torch.equal(pa[name], pb[name]) and not torch.equal(pa[name], pc[name])
    assert 0.015 < float(pa[name].std()) < 0.025
    assert torch.all(pa["model.norm.weight"] == 1)
    out = PagedDriver(a).generate(_prompts([6]), GREEDY, 3)[0]
    assert len(out.output_token_ids) == 3


def test_bfloat16_runs_and_stays_close(tiny_models):  # noqa: F811
    path = tiny_models("phi3")
    r32, r16 = _runner(path), _runner(path, dtype="bfloat16")
    assert r16.kv_cache.dtype == torch.bfloat16 and r16.cache_config.dtype == "bfloat16"
    prompt = _prompts([12], seed=6)
    d32, d16 = PagedDriver(r32), PagedDriver(r16)
    (a,) = d32.logits([(d32.add(prompt[0]), 12)]).values()
    (b,) = d16.logits([(d16.add(prompt[0]), 12)]).values()
    assert (a - b).abs().max() < 0.25 * a.abs().max()


def _copy_with(src, dst, config_changes=None):
    """A copy of the tiny model dir at `dst`, config.json updated with `config_changes`."""
    import json
    import shutil

    shutil.copytree(src, dst)
    if config_changes:
        cfg = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**cfg, **config_changes}))
    return dst


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nan_or_inf_weights_are_refused_at_load_naming_the_tensor(tiny_models, tmp_path, bad):  # noqa: F811
    from safetensors.torch import load_file, save_file

    path = _copy_with(tiny_models("llama"), tmp_path / "m")
    shard = sorted(path.glob("*.safetensors"))[-1]
    tensors = load_file(str(shard))
    name = sorted(n for n in tensors if n.endswith("k_proj.weight") or n.endswith("up_proj.weight"))[0]
    tensors[name][1, 2] = bad  # one value of a packed projection (q/k/v or gate/up in one parameter)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"NaN or Inf weights in checkpoint tensor ([\w.]+): refused") as err:
        _runner(path)
    assert err.match(rf"in checkpoint tensor {name.replace('.', '[.]')}: refused")  # that one alone, not q/v or gate


def test_rope_caches_are_sized_by_the_served_context_not_the_config(tiny_models, tmp_path):  # noqa: F811
    """max_position_embeddings: 10**12 must not size anything by it (it once tried to allocate 8 TB)."""
    path = _copy_with(tiny_models("llama"), tmp_path / "m", {"max_position_embeddings": 10**12})
    r = _runner(path)
    kv_token_bytes = r.kv_block_bytes() // r.block_size
    assert r.max_model_len < 10**12 and r.max_model_len * kv_token_bytes <= os.sysconf("SC_PAGE_SIZE") * os.sysconf(
        "SC_PHYS_PAGES")  # capped at the tokens whose KV the whole memory could hold
    assert r.model.model.cos_sin_cache.shape[0] == r.max_model_len
    r = _runner(path, max_model_len=96)
    assert r.max_model_len == 96 and r.model.model.cos_sin_cache.shape[0] == 96
    prompt = _prompts([20])[0]
    out = PagedDriver(r).generate([prompt], GREEDY, 4)
    assert out[0].num_output_tokens == 4  # and it serves


def test_parameters_whose_loader_reads_nothing_are_not_checked():
    """FP8's static input_scale is accepted and never read: its memory is whatever torch.empty gave (NaN
    at times), which must not refuse the checkpoint; a loaded parameter with a NaN still does."""
    from torch import nn

    from serving.executor.finite_weights import NonFiniteWeightsError, check_finite
    from serving.executor.weights import _loaded_regions

    model = nn.Module()
    model.unused = nn.Parameter(torch.full((2,), float("nan")), requires_grad=False)
    model.unused.values_not_loaded = True
    model.used = nn.Parameter(torch.ones(2), requires_grad=False)
    params = dict(model.named_parameters())
    loads = {"unused": [(None, "x.input_scale")], "used": [(None, "x.weight")]}
    check_finite(_loaded_regions(model, params, loads), "m")
    model.used.data[1] = float("nan")
    with pytest.raises(NonFiniteWeightsError, match=r"checkpoint tensor x\.weight: refused"):
        check_finite(_loaded_regions(model, params, loads), "m")


def test_finite_check_covers_every_float_dtype_fp8_included():
    from serving.executor.finite_weights import NonFiniteWeightsError, check_finite

    fine = {"w8": torch.randn(100).to(torch.float8_e4m3fn), "w16": torch.randn(9, dtype=torch.bfloat16),
            "idx": torch.arange(5), "empty": torch.empty(0)}
    check_finite(fine.items(), "m")  # integers skipped, fp8 reduced through fp16
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.float16, torch.bfloat16, torch.float32):
        bad = torch.randn(3 * 2**24 // 2)  # FP8: more than one chunk, the NaN in the last
        bad[-1] = float("nan")
        with pytest.raises(NonFiniteWeightsError, match=r"in checkpoint tensor bad: refused"):
            check_finite([*fine.items(), ("bad", bad.to(dtype))], "m")

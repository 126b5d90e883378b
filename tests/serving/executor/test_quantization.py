"""Quantized checkpoints (issue 12) on the CPU reference path: config, packing, layers, models, TP.

Checkpoints are packed in `tests/support/quant_fixtures.py` from the published formats; the AWQ packer
is proven against compressed-tensors' AutoAWQ converter and dequantiser, the GPTQ packer
against the format's formula and against the AWQ one (same integers, both layouts, same layer
output). Model oracle: transformers (and our unquantized path) on the same model with the
dequantised weights in fp32: greedy tokens must be identical.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from hf_oracle import hf_greedy
from model_fixtures import build_tiny_model
from quant_fixtures import (
    AWQ_ORDER,
    Format,
    awq_tensors,
    compressed_tensors_from_awq,
    gptq_tensors,
    pack_cols,
    quantize_rtn,
    write_quantized,
)
from tp_driver import greedy_logits, tp_worker_many

from serving.executor.models import build_model
from serving.executor.models.linear import OutputPart, PackedColumnParallelLinear, RowParallelLinear
from serving.executor.parallel import TPShard
from serving.executor.quant import linear_method, process_weights_after_loading
from serving.executor.weights import init_dummy_weights
from serving.checkpoint.model_args import ModelArgs
from serving.checkpoint.quantization import QuantConfig, QuantizationError, resolve_quantization

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py
MAX_NEW = 12
PROMPTS = ["The capital of France is", "def fibonacci(n):", "请用中文简单介绍一下长城的历史。"]


# ---- config ----------------------------------------------------------------------------------


def _resolve(qc: dict | None, option: str | None = None, tmp: Path = Path("/nonexistent")) -> QuantConfig | None:
    return resolve_quantization(tmp, {} if qc is None else {"quantization_config": qc}, option)


def test_config_parses_each_format():
    gptq = _resolve({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True, "sym": False})
    assert (gptq.method, gptq.bits, gptq.group_size, gptq.desc_act, gptq.sym, gptq.zero_offset) == (
        "gptq", 4, 128, True, False, 1)
    v2 = _resolve({"quant_method": "gptq", "bits": 8, "group_size": -1, "checkpoint_format": "gptq_v2"}, "gptq")
    assert (v2.bits, v2.group_size, v2.zero_offset, v2.pack_factor) == (8, None, 0, 4)
    awq = _resolve({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "GEMM",
                    "modules_to_not_convert": ["visual"]}, "awq_marlin")
    assert (awq.method, awq.sym, awq.skip_modules) == ("awq", False, ("visual",))
    assert awq.skips("model.visual.blocks.0") and not awq.skips("model.layers.0.mlp.down_proj")
    fp8 = _resolve({"quant_method": "fp8", "activation_scheme": "dynamic"}, "fp8")
    assert fp8.method == "fp8" and fp8.from_checkpoint
    ct = _resolve({"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
                   "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                       "num_bits": 8, "type": "float", "strategy": "channel"}}}})
    assert ct.method == "fp8" and ct.skip_modules == ("lm_head",)
    w4 = _resolve({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                           "group_size": 128, "actorder": "group"}}}}, "compressed-tensors")
    assert (w4.method, w4.bits, w4.group_size, w4.sym, w4.desc_act) == ("compressed-tensors", 4, 128, True, True)
    assert _resolve({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {
        "weights": {"num_bits": 8, "type": "float", "strategy": "tensor"}}}}, "compressed-tensors").method == "fp8"
    assert _resolve(None) is None and _resolve(None, "none") is None
    on_load = _resolve(None, "fp8")
    assert on_load.method == "fp8" and not on_load.from_checkpoint
    assert "group 128, desc_act (g_idx), asym, v1 zeros (+1)" in gptq.describe()


@pytest.mark.parametrize("qc, option, match", [
    ({"quant_method": "gptq", "bits": 4}, "awq",
     r"option.quantize=awq does not match the checkpoint: .* quant_method='gptq'"),
    ({"quant_method": "awq"}, "fp8", r"option.quantize=fp8 does not match .* quant_method='awq'"),
    (None, "gptq", r"option.quantize=gptq but the checkpoint .* is not quantized"),
    ({"quant_method": "gptq", "bits": 3}, None, r"bits=3 is not supported for GPTQ \(supported: 4, 8\)"),
    ({"quant_method": "gptq", "bits": "four"}, None, r"bits='four' is invalid"),
    ({"quant_method": "gptq", "group_size": 100}, None, r"group_size=100 is not supported"),
    ({"quant_method": "gptq", "checkpoint_format": "marlin"}, None, r"checkpoint_format='marlin' is not supported"),
    ({"quant_method": "gptq", "lm_head": True}, None, r"lm_head=true"),
    ({"quant_method": "awq", "bits": 8}, None, r"bits=8 is not supported for AWQ"),
    ({"quant_method": "awq", "version": "gemv"}, None, r"version='gemv' is not supported"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, None, r"weight_block_size=\[128, 128\]"),
    ({"quant_method": "bitsandbytes"}, None, r"quant_method='bitsandbytes' is not supported"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {}}}, None,
     r"compressed-tensors format='pack-quantized'"),
])
def test_config_errors_name_the_field(qc, option, match):
    with pytest.raises(QuantizationError, match=match):
        _resolve(qc, option)


def test_quantize_option_in_the_container_config():
    from serving.server.settings.serving_config import load_config
    from serving.server.settings.config_keys import ConfigError

    assert load_config({"OPTION_QUANTIZE": "AWQ"}, []).engine.quantization == "awq"
    assert load_config({"HF_MODEL_QUANTIZE": "gptq_marlin"}, []).engine.quantization == "gptq"
    assert load_config({}, []).engine.quantization is None
    with pytest.raises(ConfigError, match=r"OPTION_QUANTIZE='int3' is invalid: accepts none\|gptq\|awq\|fp8"):
        load_config({"OPTION_QUANTIZE": "int3"}, [])
    with pytest.raises(ConfigError, match=r"'squeezellm' is invalid.*SqueezeLLM checkpoints are not supported"):
        load_config({"OPTION_QUANTIZE": "squeezellm"}, [])


def test_startup_summary_names_the_format(tmp_path):
    from serving.checkpoint.quantization import startup_summary

    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {
        "quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}}))
    assert startup_summary(str(tmp_path), None) == "awq int4, group 128, asym (from config.json quantization_config)"
    assert startup_summary(str(tmp_path), "gptq").startswith("the model will not load: option.quantize=gptq does not")
    assert startup_summary(None, None) == "unquantized (the embedded default model)"
    assert "checked when it is fetched" in startup_summary("org/model", "awq")


def test_fp8_at_load_needs_a_hopper_class_gpu(tmp_path):
    from serving.executor.quant import check_device

    with pytest.raises(QuantizationError, match=r"needs an NVIDIA GPU with compute capability 8.9\+.*runs on cpu"):
        check_device(_resolve(None, "fp8"), torch.device("cpu"))
    check_device(_resolve({"quant_method": "fp8"}), torch.device("cpu"))  # an fp8 checkpoint runs anywhere


# ---- packers ---------------------------------------------------------------------------------


def test_awq_packer_matches_compressed_tensors():
    """Our AWQ GEMM tensors, converted by compressed-tensors' AutoAWQ converter and dequantised by
    compressed-tensors, give our dequantised weight."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    w = torch.randn(48, 64)  # HF [N, K]
    iq = quantize_rtn(w, 4, 32, sym=False, act_order=False)
    t = {f"m.{k}": v for k, v in awq_tensors(iq).items()}
    out = AutoAWQConverter(bits=4, group_size=32, zero_point=True).process(dict(t))
    shape = tuple(out["m.weight_shape"].tolist())
    q = unpack_from_int32(out["m.weight_packed"], 4, shape, packed_dim=1)
    zp = unpack_from_int32(out["m.weight_zero_point"], 4, (shape[0], shape[1] // 32), packed_dim=0)
    args = QuantizationArgs(num_bits=4, type="int", symmetric=False, group_size=32, strategy="group")
    ref = dequantize(q, out["m.weight_scale"].float(), zp, args=args, dtype=torch.float32)  # [N, K]
    torch.testing.assert_close(ref, iq.dequantize().t(), rtol=0, atol=0)


def test_gptq_packer_follows_the_format():
    """Word (i, n) of qweight holds rows 8i..8i+7 of column n, low bits first; qzeros packs N; v1 is zero - 1."""
    iq = quantize_rtn(torch.randn(16, 64), 4, 32, sym=False, act_order=True)
    t = gptq_tensors(iq, 4, v1=True)
    for k in (0, 7, 8, 63):
        for n in (0, 5, 15):
            assert (int(t["qweight"][k // 8, n]) >> (4 * (k % 8))) & 15 == iq.q[k, n]
    for g in range(2):
        for n in (0, 9, 15):
            assert ((int(t["qzeros"][g, n // 8]) >> (4 * (n % 8))) & 15) == (iq.zeros[g, n] - 1) % 16
    assert sorted(torch.bincount(iq.g_idx.long()).tolist()) == [32, 32]  # act-order: 2 groups of 32 rows
    assert pack_cols(torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]]), 4, AWQ_ORDER).item() & 0xFFFFFFFF == 0x86427531


# ---- layers ----------------------------------------------------------------------------------

LAYER_FORMATS = {
    "gptq4_g32_asym_v1": Format("gptq", 4, 32),
    "gptq4_g64_desc_act_sym_v2": Format("gptq", 4, 64, sym=True, desc_act=True, v1=False),
    "gptq4_per_channel": Format("gptq", 4, None),
    "gptq8_g32_desc_act": Format("gptq", 8, 32, desc_act=True),
    "awq_g32": Format("awq", 4, 32),
    "awq_per_channel": Format("awq", 4, None),
    "fp8_per_tensor": Format("fp8"),
    "fp8_per_channel": Format("fp8", per_channel=True),
    "compressed_tensors_w4a16_g32": Format("compressed-tensors", 4, 32),
}


def _quant_config(fmt: Format) -> QuantConfig:
    return resolve_quantization(Path("/nonexistent"), {"quantization_config": fmt.quantization_config()}, None)


def _format_tensors(fmt: Format, w: torch.Tensor, seed: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(checkpoint tensors, dequantised HF weight [N, K]) of `w` [N, K]."""
    from quant_fixtures import fp8_tensors

    if fmt.method == "fp8":
        return fp8_tensors(w, fmt.per_channel)
    iq = quantize_rtn(w, fmt.bits, fmt.group, fmt.sym, fmt.desc_act, seed)
    if fmt.method == "compressed-tensors":
        return compressed_tensors_from_awq(iq, fmt.group), iq.dequantize().t()
    tensors = gptq_tensors(iq, fmt.bits, fmt.v1) if fmt.method == "gptq" else awq_tensors(iq)
    return tensors, iq.dequantize().t()


@pytest.mark.parametrize("int4", ["general", "repacked", "kchunk"])
@pytest.mark.parametrize("name", list(LAYER_FORMATS))
def test_packed_and_row_layers_equal_the_dequantised_weights(name, int4, monkeypatch):
    """q|k|v from three checkpoint tensors (column-parallel, packed) and a row-parallel layer with bias;
    int4 on the general kernel, the repacked one and the k-chunk one."""
    from serving.executor.quant import gptq

    monkeypatch.setattr(gptq, "REPACKED_INT4", int4 == "repacked")
    monkeypatch.setattr(gptq, "KCHUNK_INT4", int4 == "kchunk")
    fmt, quant = LAYER_FORMATS[name], _quant_config(LAYER_FORMATS[name])
    torch.manual_seed(0)
    k_in = 128
    parts = {"q": OutputPart(64, 0, 64), "k": OutputPart(32, 0, 32), "v": OutputPart(32, 0, 32)}
    qkv = PackedColumnParallelLinear(k_in, parts, False, linear_method(quant, "q", "k", "v"), "qkv")
    dense = []
    for part in parts:
        tensors, w = _format_tensors(fmt, torch.randn(parts[part].full, k_in), 0)  # one act order: one input
        dense.append(w)
        for leaf, t in tensors.items():
            getattr(qkv, leaf).weight_loader(getattr(qkv, leaf), t, part)
    row = RowParallelLinear(k_in, 96, True, quant_method=linear_method(quant, "o"), name="o")
    tensors, w_row = _format_tensors(fmt, torch.randn(96, k_in), 7)
    for leaf, t in {**tensors, "bias": torch.randn(96)}.items():
        getattr(row, leaf).weight_loader(getattr(row, leaf), t)
    process_weights_after_loading(qkv)
    process_weights_after_loading(row)
    if fmt.desc_act:  # whole groups: rows sorted by group at load, the input gathered to match
        assert qkv.g_idx is None and qkv.act_perm is not None and row.act_perm is not None
    if fmt.method != "fp8":  # repacked int4 runs kernels.int4_linear, k-chunk int4 kernels.int4_kchunk_linear
        for layout in ("repacked", "kchunk"):
            want = fmt.bits == 4 and int4 == layout
            attr = "packed" if layout == "repacked" else "kchunk"
            assert (getattr(qkv, attr) is not None) == want and (getattr(row, attr) is not None) == want
    x = torch.randn(5, k_in)
    torch.testing.assert_close(qkv(x), x @ torch.cat(dense).t(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(row(x), x @ w_row.t() + row.bias, rtol=1e-5, atol=1e-5)


def _gptq_and_awq_layers(iq) -> list:
    """The same integers loaded from a GPTQ and an AWQ checkpoint into a row-parallel layer each."""
    layers = []
    for fmt, tensors in ((Format("gptq"), gptq_tensors(iq, 4)), (Format("awq"), awq_tensors(iq))):
        layer = RowParallelLinear(128, 64, quant_method=linear_method(_quant_config(fmt), "o"))
        for leaf, t in tensors.items():
            getattr(layer, leaf).weight_loader(getattr(layer, leaf), t)
        process_weights_after_loading(layer)
        layers.append(layer)
    return layers


def test_awq_and_gptq_layouts_of_the_same_integers_compute_the_same(monkeypatch):
    from serving.executor.quant import gptq

    monkeypatch.setattr(gptq, "KCHUNK_INT4", False)  # the repacked words first (k-chunk goes ahead of them)
    monkeypatch.setattr(gptq, "REPACKED_INT4", True)  # the same repacked words from either layout
    w = torch.randn(64, 128)
    iq = quantize_rtn(w, 4, 32, sym=False, act_order=False)
    outs = _gptq_and_awq_layers(iq)
    assert outs[0].packed.shape == (128, 64 // 8)  # int4 without g_idx: repacked for kernels.int4_linear
    assert torch.equal(outs[0].packed, outs[1].packed) and torch.equal(outs[0].zeros, outs[1].zeros)
    monkeypatch.setattr(gptq, "KCHUNK_INT4", True)  # and the same k-chunk words
    outs = _gptq_and_awq_layers(iq)
    assert outs[0].kchunk.shape == (128 // 32, 64, 4) and outs[0].packed is None
    assert torch.equal(outs[0].kchunk, outs[1].kchunk)


def test_checkpoint_shape_mismatch_names_the_tensor():
    quant = _quant_config(Format("gptq", 4, 32))
    layer = RowParallelLinear(128, 64, quant_method=linear_method(quant, "o"), name="o")
    with pytest.raises(ValueError, match=r"checkpoint tensor shape \(4, 4\) != expected \(4, 8\)"):
        layer.qzeros.weight_loader(layer.qzeros, torch.zeros(4, 4, dtype=torch.int32))


def test_row_split_off_a_group_boundary_is_refused():
    args = ModelArgs.from_dict(dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=64,
                                    hidden_size=256, intermediate_size=384, num_hidden_layers=1,
                                    num_attention_heads=2, num_key_value_heads=2))
    quant = _quant_config(Format("gptq", 4, 128))
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.down_proj: the tensor-parallel split of its 384 input "
                                         r"rows at \[0, 192\) does not fall on group_size 128"):
        build_model(args, torch.float32, torch.device("cpu"), 16, shard=TPShard(0, 2), quant=quant)
    # desc_act keeps every group on every rank, so any row split works
    build_model(args, torch.float32, torch.device("cpu"), 16, shard=TPShard(1, 2),
                quant=_quant_config(Format("gptq", 4, 128, desc_act=True)))


def test_dummy_quantized_weights_run_and_are_deterministic():
    args = ModelArgs.from_dict(dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=256,
                                    hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                    num_attention_heads=2, num_key_value_heads=1))
    for fmt in (Format("gptq", 4, 128), Format("gptq", 4, 64, desc_act=True), Format("awq", 4, 64), Format("fp8"),
                Format("compressed-tensors", 4, 64)):
        quant = _quant_config(fmt)
        models = []
        for _ in range(2):
            m = build_model(args, torch.float32, torch.device("cpu"), 16, quant=quant)
            init_dummy_weights(m, seed=1)
            models.append(dict(m.named_parameters()))
        assert models[0].keys() == models[1].keys()
        for name, p in models[0].items():
            assert torch.equal(p.float(), models[1][name].float()), name
        layer = m.model.layers[0].mlp.down_proj
        if fmt.desc_act:  # random act order, sorted at load
            assert layer.g_idx is None and layer.act_perm is not None
        x = torch.randn(3, 256)
        y = layer(x)
        assert torch.isfinite(y).all() and y.abs().max() > 0


# ---- whole models vs the dequantised oracle --------------------------------------------------

MODEL_FORMATS = {
    "gptq4_g32_desc_act_asym_v1": Format("gptq", 4, 32, desc_act=True),
    "gptq8_per_channel_sym_v2": Format("gptq", 8, None, sym=True, v1=False),
    "awq_g64": Format("awq", 4, 64),
    "fp8_per_tensor": Format("fp8"),
    "compressed_tensors_w4a16_g64": Format("compressed-tensors", 4, 64),
}


@pytest.fixture(scope="module")
def quant_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant_models")
    base = build_tiny_model("llama", root / "base")
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = write_quantized(base, root / name, MODEL_FORMATS[name])
        return built[name]

    yield get
    shutil.rmtree(root, ignore_errors=True)  # ~1 GB of checkpoints and fp32 oracles: give the disk back


@pytest.mark.parametrize("name", ["gptq4_g32_desc_act_asym_v1", "awq_g64", "fp8_per_tensor"])
def test_quantized_experts_greedy_equals_the_dequantised_oracle(name, tmp_path):
    """A Qwen3-MoE with every expert (and attention) quantized, the router not: the experts run
    through their linear methods (grouped / dense paths; the picked path is for float experts)."""
    from serving.llm import LLM
    from serving.sampling_params import SamplingParams

    path = write_quantized(build_tiny_model("qwen3_moe", tmp_path / "base"), tmp_path / name, MODEL_FORMATS[name])
    llm = LLM(str(path), block_size=4, max_num_batched_tokens=32, max_num_seqs=4, num_gpu_blocks_override=128,
              quantization=MODEL_FORMATS[name].method)
    assert all(layer.mlp.w13 is None for layer in llm.llm_engine.executor.runner.model.model.layers)
    tok = llm.get_tokenizer()
    expected = [hf_greedy(str(path / "oracle"), tuple(tok.encode(p)), MAX_NEW) for p in PROMPTS]
    out = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False)
    assert [tuple(o.outputs[0].token_ids) for o in out] == expected


@pytest.mark.parametrize("name", list(MODEL_FORMATS))
def test_greedy_tokens_equal_the_dequantised_oracle(name, quant_models):
    from serving.llm import LLM
    from serving.sampling_params import SamplingParams

    path = quant_models(name)
    llm = LLM(str(path), block_size=4, max_num_batched_tokens=32, max_num_seqs=4, num_gpu_blocks_override=128,
              quantization=MODEL_FORMATS[name].method)
    tok = llm.get_tokenizer()
    expected = [hf_greedy(str(path / "oracle"), tuple(tok.encode(p)), MAX_NEW) for p in PROMPTS]
    out = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False)
    assert [tuple(o.outputs[0].token_ids) for o in out] == expected


def test_missing_scales_names_the_tensor(quant_models, tmp_path):
    from safetensors.torch import load_file, save_file

    from serving.executor.weights import load_weights

    src = quant_models("awq_g64")
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            (bad / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(src / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.scales"]
    save_file(tensors, str(bad / "model.safetensors"))
    config = json.loads((bad / "config.json").read_text())
    model = build_model(ModelArgs.from_dict(config), torch.float32, torch.device("cpu"), 64,
                        quant=resolve_quantization(bad, config, None))
    with pytest.raises(ValueError, match=r"lacks weights for: \['model.layers.1.mlp.down_proj.scales'\]"):
        load_weights(model, bad)


# ---- tensor parallel -------------------------------------------------------------------------


@pytest.mark.slow
def test_tp2_logits_equal_tp1(quant_models, tmp_path):
    """GPTQ with desc_act (row-parallel ranks keep every group, their rows' g_idx), AWQ (packed N / 8
    columns split before the repack) and compressed-tensors W4A16 (HF orientation: packed K / 8 columns
    split by row-parallel layers), both ranks against the single-process logits and tokens."""
    names = ["gptq4_g32_desc_act_asym_v1", "awq_g64", "compressed_tensors_w4a16_g64"]
    paths = [str(quant_models(n)) for n in names]
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]
    mp.spawn(tp_worker_many, args=(2, str(tmp_path / "init"), paths, prompts, 3, str(tmp_path)), nprocs=2, join=True)
    for i, path in enumerate(paths):
        want_logits, want_tokens = greedy_logits(path, prompts, decode_steps=3)
        for rank in range(2):
            got = torch.load(tmp_path / f"rank{rank}_{i}.pt")
            assert got["tokens"] == want_tokens, names[i]
            for g, w in zip(got["logits"], want_logits):
                torch.testing.assert_close(g, w, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dim", [0, 1])
def test_packed_words_are_contiguous_and_round_trip(bits, dim):
    # Repacking at load (AWQ, GPTQ act-order) must give row-major words: the GPU kernels read
    # them by row and refuse anything else (found on the H200: a column-major view).
    from serving.executor.quant.packing import pack_int32, unpack_int32

    values = torch.randint(0, 2**bits, (64, 48), dtype=torch.int32)
    words = pack_int32(values, bits, dim)
    assert words.is_contiguous() and words.shape[dim] == values.shape[dim] * bits // 32
    assert torch.equal(unpack_int32(words, bits, dim), values)

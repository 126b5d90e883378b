"""Our Llama-family models through the paged KV cache vs transformers, fp32 logits.

Each model runs prompts of mixed lengths together with a small block size and scattered block
tables: chunked prefill (so later chunks read earlier chunks from the cache), then batched
decode steps, with one step mixing a decode and a prefill chunk. Every computed row's logits
must match HF's forward over the same tokens; greedy tokens must then agree exactly.
"""

from __future__ import annotations

import pytest
import torch
from model_fixtures import TINY_ARCHS, build_tiny_model
from paged_driver import PagedDriver

from serving.engine_config import EngineConfig
from serving.executor.model_runner import ModelRunner
from serving.checkpoint.model_args import ModelArgs

ATOL = 2e-4


def _hf(path, hf_class=None):
    if hf_class is None:
        from transformers import AutoModelForCausalLM as hf_class
    return hf_class.from_pretrained(str(path), dtype=torch.float32).eval()


def _check_paged_logits(path, block_size: int, lengths: list[int], chunk: int, decode_steps: int,
                        max_model_len: int | None = None, hf_class=None) -> None:
    runner = ModelRunner(EngineConfig(model=str(path), block_size=block_size, kv_cache_memory_gb=0.02, device="cpu",
                                      max_model_len=max_model_len))
    driver = PagedDriver(runner)
    gen = torch.Generator().manual_seed(sum(lengths))
    prompts = [torch.randint(3, 49000, (n,), generator=gen).tolist() for n in lengths]
    seqs = [driver.add(p) for p in prompts]
    rows: dict[int, list[torch.Tensor]] = {s.seq_id: [] for s in seqs}
    # Chunked prefill of all but the last prompt, all together.
    while any(s.num_computed_tokens < s.num_tokens for s in seqs[:-1]):
        work = [(s, min(chunk, s.num_tokens - s.num_computed_tokens)) for s in seqs[:-1]
                if s.num_computed_tokens < s.num_tokens]
        for sid, lg in driver.logits(work).items():
            rows[sid].append(lg)
    last = seqs[-1]
    for step in range(decode_steps):
        for s in seqs[:-1]:
            s.token_ids.append(int(rows[s.seq_id][-1][-1].argmax()))
        work = [(s, 1) for s in seqs[:-1]]
        if step == 0:  # a mixed step: decodes plus the whole last prompt as one prefill
            work.append((last, last.num_tokens))
        elif step > 0:
            last.token_ids.append(int(rows[last.seq_id][-1][-1].argmax()))
            work.append((last, 1))
        for sid, lg in driver.logits(work).items():
            rows[sid].append(lg)
    hf = _hf(path, hf_class)
    with torch.no_grad():
        for s in seqs:
            ours = torch.cat(rows[s.seq_id])  # [num_computed, vocab]
            ref = hf(torch.tensor([s.token_ids[: ours.shape[0]]])).logits[0]
            torch.testing.assert_close(ours, ref, atol=ATOL, rtol=1e-4)
            assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    assert max(len(s.block_table) for s in seqs) >= 5  # really spans many (scattered) blocks


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tiny_model_logits_match_transformers(tiny_models, arch):  # noqa: F811
    _check_paged_logits(tiny_models(arch), block_size=4, lengths=[5, 23, 37], chunk=9, decode_steps=6)


def test_phi3_longrope_served_within_its_original_context(tmp_path):
    """Phi-3.5-style LongRoPE (partial rotary dims too): served with max_model_len within the original
    64 positions, the short factors, as transformers uses for such sequences."""
    gen = torch.Generator().manual_seed(0)
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "short_factor": (1.0 + torch.rand(48, generator=gen)).tolist(),
            "long_factor": (1.0 + 20 * torch.rand(48, generator=gen)).tolist(), "original_max_position_embeddings": 64}
    path = build_tiny_model("phi3", tmp_path / "phi3-longrope", overrides=dict(
        rope_parameters=rope, partial_rotary_factor=0.75, original_max_position_embeddings=64))
    _check_paged_logits(path, block_size=4, lengths=[5, 23, 37], chunk=9, decode_steps=6, max_model_len=64)


@pytest.mark.parametrize("arch, overrides", [
    ("mistral", dict(sliding_window=8)),  # every layer within 8 positions
    ("qwen2", dict(use_sliding_window=True, sliding_window=6, max_window_layers=1,  # layer 1 of 2 only
                   layer_types=["full_attention", "sliding_attention"])),
])
def test_sliding_window_attention_matches_transformers(tmp_path, arch, overrides):
    """Sequences several windows long, chunked prefill and decodes: past the window a query attends to
    the window only, as transformers masks it."""
    path = build_tiny_model(arch, tmp_path / arch, overrides=overrides)
    args = ModelArgs.from_dir(path)
    assert args.sliding_window == overrides["sliding_window"]
    assert args.sliding_layers == (None if arch == "mistral" else (1,))
    _check_paged_logits(path, block_size=4, lengths=[5, 23, 37], chunk=9, decode_steps=6)


def test_gemma3_multimodal_checkpoint_served_as_text(tmp_path):
    """Gemma3ForConditionalGeneration (gemma-3-4b and larger): its text decoder, nested in the
    checkpoint under `language_model.`, against transformers' own text-only forward; the vision
    tower's tensors are skipped. Both spellings of the nesting map to the same parameters."""
    from serving.executor.models.gemma import Gemma3TextOfMultimodal

    path = build_tiny_model("gemma3_mm", tmp_path / "gemma3-mm")
    args = ModelArgs.from_dir(path)
    assert args.architecture == "Gemma3ForConditionalGeneration" and args.head_dim == 64 and args.qk_norm
    _check_paged_logits(path, block_size=4, lengths=[5, 23, 37], chunk=9, decode_steps=6)
    rename = Gemma3TextOfMultimodal.checkpoint_name
    assert rename("language_model.model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    assert rename("model.language_model.norm.weight") == "model.norm.weight"
    assert rename("language_model.lm_head.weight") == "lm_head.weight"
    assert rename("vision_tower.vision_model.embeddings.patch_embedding.weight") is None
    assert rename("model.multi_modal_projector.mm_input_projection_weight") is None


def test_mistral3_multimodal_checkpoint_served_as_text(tmp_path):
    """Mistral3ForConditionalGeneration (Mistral Small 3.1 / 3.2): its Mistral text decoder, untied
    LM head under `language_model.lm_head`, against transformers' text-only forward."""
    from transformers import Mistral3ForConditionalGeneration

    path = build_tiny_model("mistral3_mm", tmp_path / "mistral3-mm")
    args = ModelArgs.from_dir(path)
    assert args.architecture == "Mistral3ForConditionalGeneration" and args.head_dim == 80
    assert not args.tie_word_embeddings and not args.qk_norm
    _check_paged_logits(path, block_size=4, lengths=[5, 23, 37], chunk=9, decode_steps=6,
                        hf_class=Mistral3ForConditionalGeneration)


@pytest.mark.parametrize("arch", ["qwen2_5_vl_mm", "qwen3_vl_mm"])
def test_qwen_vl_checkpoints_served_as_text(tmp_path, arch):
    """Qwen2.5-VL (its config's text fields as 5.x nests them, tensors at `model.*`, the vision tower at
    `visual.*`) and Qwen3-VL (`model.language_model.*`, `model.visual.*`, q/k norms, tied) against
    transformers' text-only forward: their multimodal RoPE with text alone is plain RoPE."""
    import json

    import transformers
    from model_fixtures import MULTIMODAL_CLASSES

    path = build_tiny_model(arch, tmp_path / arch)
    args = ModelArgs.from_dir(path)
    assert args.qkv_bias == (arch == "qwen2_5_vl_mm") and args.qk_norm == (arch == "qwen3_vl_mm")
    assert args.rope.scaling_type == "default"
    hf_class = getattr(transformers, MULTIMODAL_CLASSES[arch])
    _check_paged_logits(path, block_size=4, lengths=[5, 23, 37], chunk=9, decode_steps=6, hf_class=hf_class)
    # The 4.x spelling of the same Qwen2.5-VL: text fields at the top, rope_scaling of type "mrope"
    if arch == "qwen2_5_vl_mm":
        config = json.loads((path / "config.json").read_text())
        text = config.pop("text_config")
        rope = text.pop("rope_parameters")
        flat = {**text, **config, "model_type": "qwen2_5_vl",
                "rope_theta": rope["rope_theta"], "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]}}
        assert ModelArgs.from_dict(flat) == args


@pytest.mark.parametrize("arch, overrides, field, value", [
    ("gpt_neox", dict(use_parallel_residual=False), "parallel_residual", False),  # GPT-NeoX's sequential block
    ("starcoder2", dict(use_bias=False), "qkv_bias", False),  # StarCoder2 without any bias
    ("gpt_bigcode", dict(multi_query=False), "num_key_value_heads", 2),  # q/k/v fused head by head
    ("stablelm", dict(use_parallel_residual=True), "parallel_residual", True),  # StableLM 2 12B's parallel block
    # Falcon 7B's layout: one KV head, one LayerNorm in parallel; then the sequential block with biases, MHA
    ("falcon", dict(new_decoder_architecture=False, multi_query=True, num_ln_in_parallel_attn=None, num_kv_heads=4),
     "num_key_value_heads", 1),
    ("falcon", dict(new_decoder_architecture=False, multi_query=False, parallel_attn=False, bias=True,
                    num_ln_in_parallel_attn=None, num_kv_heads=4), "parallel_residual", False),
])
def test_layernorm_decoder_switches_match_transformers(tmp_path, arch, overrides, field, value):
    path = build_tiny_model(arch, tmp_path / arch, overrides=overrides)
    assert getattr(ModelArgs.from_dir(path), field) == value
    _check_paged_logits(path, block_size=4, lengths=[5, 23], chunk=9, decode_steps=4)


def test_gpt2_checkpoint_names_of_both_layouts():
    """GPT2LMHeadModel's `transformer.*` names and the original checkpoints' bare ones (with their saved
    causal-mask buffers) map to the same parameters."""
    from serving.executor.models.gpt import gpt2_checkpoint_name as name

    for prefix in ("", "transformer."):
        assert name(f"{prefix}h.11.attn.c_attn.weight") == "model.layers.11.self_attn.qkv_proj.weight"
        assert name(f"{prefix}h.0.attn.c_proj.bias") == "model.layers.0.self_attn.o_proj.bias"
        assert name(f"{prefix}h.0.mlp.c_proj.weight") == "model.layers.0.mlp.fc_out.weight"
        assert name(f"{prefix}h.0.ln_2.bias") == "model.layers.0.post_attention_layernorm.bias"
        assert name(f"{prefix}wpe.weight") == "model.embed_positions.weight"
        assert name(f"{prefix}ln_f.weight") == "model.norm.weight"
        assert name(f"{prefix}h.3.attn.bias") is None and name(f"{prefix}h.3.attn.masked_bias") is None
    assert name("lm_head.weight") == "lm_head.weight"
    with pytest.raises(ValueError, match="add_cross_attention"):
        ModelArgs.from_dict({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 64, "n_layer": 1,
                             "n_head": 2, "vocab_size": 100, "add_cross_attention": True})
    args = ModelArgs.from_dict({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 768,
                                "n_layer": 12, "n_head": 12, "n_positions": 1024, "vocab_size": 50257})
    assert (args.hidden_size, args.intermediate_size, args.max_position_embeddings, args.head_dim, args.hidden_act,
            args.tie_word_embeddings, args.learned_positions, args.qkv_bias, args.mlp_bias) == (
        768, 3072, 1024, 64, "gelu_new", True, True, True, True)


def test_smollm2_logits_match_transformers(smollm2_path):  # noqa: F811
    _check_paged_logits(smollm2_path, block_size=8, lengths=[19, 45], chunk=16, decode_steps=4)


def test_weights_loaded_from_shards(tiny_models):  # noqa: F811
    from safetensors import safe_open

    from serving.executor.weights import checkpoint_files

    path = tiny_models("phi3")  # fused qkv_proj / gate_up_proj straight from the checkpoint
    files = checkpoint_files(path)
    assert len(files) >= 2
    runner = ModelRunner(EngineConfig(model=str(path), block_size=4, kv_cache_memory_gb=0.01, device="cpu"))
    params = dict(runner.model.named_parameters())
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                assert torch.equal(params[name], st.get_tensor(name)), name


def test_packed_qkv_from_separate_tensors(tiny_models):  # noqa: F811
    from safetensors import safe_open

    from serving.executor.weights import checkpoint_files

    path = tiny_models("qwen2")  # separate q/k/v with biases, tied embeddings
    runner = ModelRunner(EngineConfig(model=str(path), block_size=4, kv_cache_memory_gb=0.01, device="cpu"))
    tensors = {}
    for f in checkpoint_files(path):
        with safe_open(str(f), framework="pt") as st:
            tensors.update({k: st.get_tensor(k) for k in st.keys()})
    attn = runner.model.model.layers[1].self_attn
    for part in ("weight", "bias"):
        want = torch.cat([tensors[f"model.layers.1.self_attn.{p}_proj.{part}"] for p in "qkv"])
        assert torch.equal(getattr(attn.qkv_proj, part), want)
    assert runner.model.lm_head is None  # tied: logits use embed_tokens


@pytest.mark.parametrize("buffer_dtype", [torch.float32, torch.bfloat16])
def test_lm_head_logits_into_a_buffer_equal_the_upcast_logits(buffer_dtype):
    # The decode graphs have the LM head write its bf16 matmul straight into their static buffer:
    # float32 (several ranks: one pass from the matmul), or the weights' dtype on one rank, where
    # the buffer is the matmul's own output (no copy). Either holds exactly the upcast logits.
    from serving.executor.models.embedding import VocabParallelEmbedding

    head = VocabParallelEmbedding(50, 16)
    with torch.no_grad():
        head.weight.copy_(torch.randn(50, 16))
    head = head.to(torch.bfloat16)
    hidden = torch.randn(5, 16, dtype=torch.bfloat16)
    buf = torch.full((8, 50), float("nan"), dtype=buffer_dtype)
    got = head.compute_logits(hidden, out=buf[:5])
    want = head.compute_logits(hidden)
    assert want.dtype == torch.float32 and got.dtype == buffer_dtype and got.data_ptr() == buf.data_ptr()
    assert torch.equal(buf[:5].float(), want) and torch.isnan(buf[5:]).all()

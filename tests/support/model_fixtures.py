"""Tiny random HF-format model dirs for identity tests vs transformers: every architecture we serve
(`TINY_ARCHS`: the Llama family, Gemma 1-3, the mixture-of-experts Mixtral / Qwen2-MoE / Qwen3-MoE, the
LayerNorm decoders StarCoder2 / Phi / GPT-2 / GPT-BigCode / GPT-NeoX / Falcon / OPT, Cohere, OLMo 2 / 3)
and the multimodal checkpoints served as text (`MULTIMODAL_CLASSES`, `gemma3_mm`).

Each dir is written by transformers itself (`save_pretrained`, >= 2 safetensors shards plus
`model.safetensors.index.json`) and carries the default model's tokenizer, so the vocab
(49152) matches real text. Weights are random but deterministic; norm weights and biases are
perturbed away from HF's 1/0 init so a swapped or skipped tensor shows up in the logits.

`tiny_models` and `smollm2_path` are registered once for all of tests/ by tests/conftest.py:

    def test_x(tiny_models):
        path = tiny_models("llama")  # built once per session, cached
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

TINY_ARCHS: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3", "phi3", "smollm3", "granite", "gemma2",
                                "gemma3", "gemma", "mixtral", "qwen2_moe", "qwen3_moe", "starcoder2", "phi",
                                "gpt2", "gpt_neox", "gpt_bigcode", "falcon", "opt", "cohere", "olmo2", "olmo3",
                                "stablelm", "nemotron")
# NOTE: one head dim per arch so 64/80/96/128 are all exercised. Qwen3's heads are wider than
# hidden / heads (as in its real checkpoints: 0.6B has 16 heads of 128 on a hidden size of 1024).
HEAD_DIMS = {"llama": 64, "mistral": 80, "qwen2": 96, "qwen3": 64, "phi3": 128, "smollm3": 64, "granite": 64, "gemma2": 64,
             "gemma3": 64, "gemma": 64, "mixtral": 64, "starcoder2": 64, "phi": 80, "gpt2": 64, "gpt_neox": 64, "gpt_bigcode": 64, "falcon": 64, "opt": 64, "cohere": 64, "olmo2": 64, "olmo3": 64, "stablelm": 64, "nemotron": 64, "qwen2_moe": 64, "qwen3_moe": 64}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
VOCAB_SIZE = 49152  # SmolLM2's tokenizer
# The multimodal tiny archs transformers' AutoModelForCausalLM does not build: their class
MULTIMODAL_CLASSES = {"mistral3_mm": "Mistral3ForConditionalGeneration",
                      "qwen2_5_vl_mm": "Qwen2_5_VLForConditionalGeneration",
                      "qwen3_vl_mm": "Qwen3VLForConditionalGeneration"}


def tiny_config(arch: str):
    """A transformers config for a 2-layer model of `arch` with GQA and the SmolLM2 vocab."""
    from transformers import (
        CohereConfig,
        FalconConfig,
        Gemma2Config,
        Gemma3TextConfig,
        GemmaConfig,
        GPT2Config,
        GPTBigCodeConfig,
        GPTNeoXConfig,
        GraniteConfig,
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        NemotronConfig,
        Olmo2Config,
        Olmo3Config,
        OPTConfig,
        Phi3Config,
        PhiConfig,
        Qwen2Config,
        Qwen2MoeConfig,
        Qwen3Config,
        Qwen3MoeConfig,
        SmolLM3Config,
        StableLmConfig,
        Starcoder2Config,
    )

    common = dict(
        vocab_size=VOCAB_SIZE,
        num_hidden_layers=2,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        # Larger than HF's 0.02 so greedy argmax margins are wide (no near-ties between
        # implementations that differ in the last fp32 bits).
        initializer_range=0.08,
        rms_norm_eps=1e-5,
    )
    if arch == "llama":
        return LlamaConfig(
            hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=384,
            tie_word_embeddings=False,
            # Small original_max_position_embeddings so llama3 smoothing touches mid frequencies.
            rope_parameters={
                "rope_type": "llama3", "rope_theta": 50000.0, "factor": 4.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
            },
            **common,
        )
    if arch == "mistral":
        return MistralConfig(
            hidden_size=160, num_attention_heads=2, num_key_value_heads=1, intermediate_size=320,
            head_dim=80, sliding_window=None, tie_word_embeddings=False, **common,
        )
    if arch == "qwen2":
        return Qwen2Config(
            hidden_size=192, num_attention_heads=2, num_key_value_heads=1, intermediate_size=384,
            tie_word_embeddings=True, use_sliding_window=False, **common,
        )
    if arch == "qwen3":
        return Qwen3Config(
            hidden_size=128, num_attention_heads=4, num_key_value_heads=2, intermediate_size=320,
            tie_word_embeddings=True, use_sliding_window=False, **common,
        )
    if arch == "smollm3":  # layer 1 of 2 without RoPE (NoPE)
        return SmolLM3Config(
            hidden_size=128, num_attention_heads=2, num_key_value_heads=1, intermediate_size=256,
            tie_word_embeddings=True, no_rope_layers=[1, 0], use_sliding_window=False, **common,
        )
    if arch == "granite":  # every multiplier away from 1 (Granite 3's are 12 / 0.22 / 1/128 / 16)
        return GraniteConfig(
            hidden_size=128, num_attention_heads=2, num_key_value_heads=1, intermediate_size=256,
            tie_word_embeddings=True, embedding_multiplier=4.0, residual_multiplier=0.5,
            attention_multiplier=0.1, logits_scaling=2.0, **common,
        )
    if arch == "gemma2":  # a sliding layer (window 8) then a full one; scores capped at 3, logits at 30
        return Gemma2Config(
            hidden_size=128, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256,
            sliding_window=8, query_pre_attn_scalar=48, attn_logit_softcapping=3.0, final_logit_softcapping=30.0,
            **common,
        )
    if arch == "gemma3":  # a sliding layer (window 8, its own RoPE base) then a full one; a logit cap
        return Gemma3TextConfig(
            hidden_size=128, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256,
            sliding_window=8, layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=48,
            final_logit_softcapping=30.0,
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}},
            **common,
        )
    if arch == "gemma":  # Gemma 1: one KV head (as gemma-2b), head_dim apart from hidden / heads, legacy "gelu"
        return GemmaConfig(
            hidden_size=128, num_attention_heads=4, num_key_value_heads=1, intermediate_size=256, hidden_act="gelu",
            **common,
        )
    if arch == "starcoder2":  # LayerNorm, plain gelu MLP, biases everywhere, a sliding window of 16
        return Starcoder2Config(
            hidden_size=128, num_attention_heads=2, num_key_value_heads=1, intermediate_size=256, sliding_window=16,
            tie_word_embeddings=True, **{k: v for k, v in common.items() if k != "rms_norm_eps"}, norm_epsilon=1e-5,
        )
    if arch == "phi":  # Phi-2's layout: one LayerNorm feeding attention and MLP in parallel, 32 of 80 dims rotary, LM head bias
        return PhiConfig(
            hidden_size=160, num_attention_heads=2, num_key_value_heads=2, intermediate_size=256,
            partial_rotary_factor=0.4, tie_word_embeddings=False, resid_pdrop=0.0, embd_pdrop=0.0,
            **{k: v for k, v in common.items() if k != "rms_norm_eps"}, layer_norm_eps=1e-5,
        )
    if arch == "gpt2":  # learned positions, Conv1D weights, fused c_attn, biases, tied
        return GPT2Config(
            vocab_size=VOCAB_SIZE, n_embd=128, n_layer=2, n_head=2, n_positions=2048, bos_token_id=1, eos_token_id=2,
            pad_token_id=2, initializer_range=0.08, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )
    if arch == "gpt_bigcode":  # StarCoder 1's layout: GPT-2 with one KV head (multi_query) and Linear weights
        return GPTBigCodeConfig(
            vocab_size=VOCAB_SIZE, n_embd=128, n_layer=2, n_head=2, n_positions=2048, bos_token_id=1, eos_token_id=2,
            pad_token_id=2, initializer_range=0.08, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, multi_query=True,
        )
    if arch == "falcon":  # Falcon 40B's layout: grouped KV heads fused by group, ln_attn / ln_mlp in parallel
        return FalconConfig(
            hidden_size=256, num_attention_heads=4, num_kv_heads=2, new_decoder_architecture=True, bias=False,
            ffn_hidden_size=384, tie_word_embeddings=True, layer_norm_epsilon=1e-5,
            **{k: v for k, v in common.items() if k != "rms_norm_eps"},
        )
    if arch == "opt":  # learned positions at an offset of 2, ReLU MLP, per-layer final_layer_norm
        return OPTConfig(
            hidden_size=128, num_attention_heads=2, ffn_dim=256, word_embed_proj_dim=128, dropout=0.0,
            **{k: v for k, v in common.items() if k not in ("rms_norm_eps", "initializer_range")}, init_std=0.08,
        )
    if arch == "cohere":  # Command-R's layout: bias-free LayerNorm, parallel block, interleaved RoPE, logit scale
        return CohereConfig(
            hidden_size=128, num_attention_heads=2, num_key_value_heads=1, intermediate_size=256, logit_scale=0.5,
            use_qk_norm=False, tie_word_embeddings=True, layer_norm_eps=1e-5,
            **{k: v for k, v in common.items() if k != "rms_norm_eps"},
        )
    if arch == "olmo2":  # norms after the blocks, q / k normed over all heads
        return Olmo2Config(
            hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256,
            tie_word_embeddings=False, **common,
        )
    if arch == "olmo3":  # OLMo 2's layout with a sliding layer (window 8, plain RoPE) then a full one (YaRN)
        return Olmo3Config(
            hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256, sliding_window=8,
            layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False,
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 8.0,
                                                "original_max_position_embeddings": 256}},
            **common,
        )
    if arch == "stablelm":  # LayerNorm with Llama's gated MLP, q/k/v biases, a quarter of each head rotary
        return StableLmConfig(
            hidden_size=128, num_attention_heads=2, num_key_value_heads=1, intermediate_size=256, use_qkv_bias=True,
            partial_rotary_factor=0.25, use_parallel_residual=False, tie_word_embeddings=False, layer_norm_eps=1e-5,
            **{k: v for k, v in common.items() if k != "rms_norm_eps"},
        )
    if arch == "nemotron":  # LayerNorm1P, squared-ReLU MLP, half of each head rotary
        return NemotronConfig(
            hidden_size=128, num_attention_heads=2, num_key_value_heads=1, intermediate_size=256,
            partial_rotary_factor=0.5, tie_word_embeddings=False, norm_eps=1e-5,
            **{k: v for k, v in common.items() if k != "rms_norm_eps"},
        )
    if arch == "gpt_neox":  # Pythia's layout: parallel block with two LayerNorms, 25 % rotary, q/k/v fused per head
        return GPTNeoXConfig(
            hidden_size=128, num_attention_heads=2, intermediate_size=256, hidden_act="gelu", rotary_pct=0.25,
            tie_word_embeddings=False, **{k: v for k, v in common.items() if k != "rms_norm_eps"},
            layer_norm_eps=1e-5, hidden_dropout=0.0, attention_dropout=0.0,
        )
    if arch == "mixtral":  # 4 experts, 2 a token, every layer
        return MixtralConfig(
            hidden_size=128, num_attention_heads=2, num_key_value_heads=1, intermediate_size=96, num_local_experts=4,
            num_experts_per_tok=2, sliding_window=None, tie_word_embeddings=False, **common,
        )
    if arch == "qwen2_moe":  # layer 0: 4 experts (2 a token, not renormalised) + the gated shared expert; layer 1 dense
        return Qwen2MoeConfig(
            hidden_size=128, num_attention_heads=2, num_key_value_heads=1, intermediate_size=192, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=96, mlp_only_layers=[1],
            norm_topk_prob=False, use_sliding_window=False, tie_word_embeddings=False, **common,
        )
    if arch == "qwen3_moe":  # 8 experts, 3 a token, renormalised; q/k norms, heads wider than hidden / heads
        return Qwen3MoeConfig(
            hidden_size=128, num_attention_heads=4, num_key_value_heads=2, intermediate_size=192, num_experts=8,
            num_experts_per_tok=3, moe_intermediate_size=64, norm_topk_prob=True, use_sliding_window=False,
            tie_word_embeddings=True, **common,
        )
    if arch == "gemma3_mm":  # Gemma3ForConditionalGeneration: the tiny gemma3 text model beside a vision tower
        from transformers import Gemma3Config, SiglipVisionConfig

        text = tiny_config("gemma3")
        text.head_dim = HEAD_DIMS["gemma3"]
        vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                    image_size=28, patch_size=14)
        return Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
                            image_token_index=49000, boi_token_index=48998, eoi_token_index=48999,
                            initializer_range=0.08)
    if arch == "mistral3_mm":  # Mistral3ForConditionalGeneration: the tiny mistral beside a Pixtral vision tower
        from transformers import Mistral3Config, PixtralVisionConfig

        text = tiny_config("mistral")
        text.head_dim = HEAD_DIMS["mistral"]
        vision = PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                     image_size=28, patch_size=14, head_dim=16)
        return Mistral3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), image_token_index=49000,
                              spatial_merge_size=1, tie_word_embeddings=False)
    if arch in ("qwen2_5_vl_mm", "qwen3_vl_mm"):  # Qwen2.5-VL / Qwen3-VL: the tiny qwen2 / qwen3 beside a vision tower
        import transformers

        qwen3 = arch == "qwen3_vl_mm"
        text = tiny_config("qwen3" if qwen3 else "qwen2").to_dict()
        text["head_dim"] = HEAD_DIMS["qwen3" if qwen3 else "qwen2"]
        half = text["head_dim"] // 2  # multimodal RoPE: rotary pairs split over (time, height, width)
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0,
                                   "mrope_section": [half - 2 * (half // 3), half // 3, half // 3],
                                   **({"mrope_interleaved": True} if qwen3 else {})}
        cls = transformers.Qwen3VLConfig if qwen3 else transformers.Qwen2_5_VLConfig
        vision = dict(depth=1, hidden_size=32, num_heads=2, out_hidden_size=text["hidden_size"], intermediate_size=64)
        return cls(text_config=text, vision_config=vision, image_token_id=49000, video_token_id=49001,
                   vision_start_token_id=48998, vision_end_token_id=48999, tie_word_embeddings=qwen3)
    if arch == "phi3":
        return Phi3Config(
            hidden_size=256, num_attention_heads=2, num_key_value_heads=1, intermediate_size=384,
            tie_word_embeddings=False, sliding_window=None, original_max_position_embeddings=2048,
            resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0, **common,
        )
    raise ValueError(f"unknown tiny arch {arch!r}; known: {TINY_ARCHS}")


def _to_legacy_rope_keys(config_path: Path) -> None:
    """Rewrite a 5.x `rope_parameters` config.json as 4.x `rope_scaling` + `rope_theta`."""
    d = json.loads(config_path.read_text())
    rp = dict(d.pop("rope_parameters"))
    d["rope_theta"] = rp.pop("rope_theta")
    if rp.get("rope_type", "default") != "default":
        d["rope_scaling"] = rp
    config_path.write_text(json.dumps(d, indent=2))


def build_tiny_model(
    arch: str,
    out_dir: Path,
    *,
    seed: int = 0,
    tokenizer_dir: Path | None = None,
    max_shard_size: str = "8MB",
    legacy_rope_keys: bool | None = None,
    overrides: dict[str, object] | None = None,
) -> Path:
    """Write a random tiny `arch` model as an HF dir at `out_dir` and return it.

    Args:
        tokenizer_dir: where to copy tokenizer files from (default: the converted SmolLM2 dir).
        legacy_rope_keys: write `rope_scaling`/`rope_theta` (transformers 4.x style) instead of
            `rope_parameters`; default True for llama so both config styles are covered.
        overrides: config attributes to change (head counts, vocab_size, head_dim, ...).
    """
    from transformers import AutoModelForCausalLM, GenerationConfig

    config = tiny_config(arch)
    if arch in HEAD_DIMS and arch not in ("falcon", "opt"):  # theirs is hidden / heads (Falcon: read-only)
        config.head_dim = HEAD_DIMS[arch]
    for key, value in (overrides or {}).items():
        setattr(config, key, value)
    if arch not in ("qwen3", "qwen3_moe", "gemma", "gemma2", "gemma3", "gemma3_mm", "mistral3_mm", "qwen2_5_vl_mm", "qwen3_vl_mm", "opt"):
        assert config.hidden_size == config.num_attention_heads * config.head_dim
    torch.manual_seed(seed)
    if arch in MULTIMODAL_CLASSES:  # not AutoModelForCausalLMs in transformers
        import transformers

        model = getattr(transformers, MULTIMODAL_CLASSES[arch])(config).to(torch.float32).eval()
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name or ".ln_" in name and name.endswith(".weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir), max_shard_size=max_shard_size)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2, do_sample=False).save_pretrained(str(out_dir))
    if legacy_rope_keys is None:
        legacy_rope_keys = arch == "llama"
    if legacy_rope_keys:
        _to_legacy_rope_keys(out_dir / "config.json")
    if tokenizer_dir is None:
        from serving.checkpoint.default_model import default_model_path

        tokenizer_dir = default_model_path()
    for name in TOKENIZER_FILES:
        if (Path(tokenizer_dir) / name).is_file():
            shutil.copy(Path(tokenizer_dir) / name, out_dir / name)
    shards = sorted(out_dir.glob("*.safetensors"))
    assert len(shards) >= 2 and (out_dir / "model.safetensors.index.json").is_file(), shards
    return out_dir


class TinyModels:
    """Builds each tiny arch once under `root` and returns its dir on later calls."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._built: dict[str, Path] = {}

    def __call__(self, arch: str) -> Path:
        if arch not in self._built:
            self._built[arch] = build_tiny_model(arch, self.root / arch)
        return self._built[arch]


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Session-wide builder: `tiny_models("phi3") -> Path` of a cached tiny HF dir."""
    return TinyModels(tmp_path_factory.mktemp("tiny_models"))


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The converted default model dir (converted on first use, ~30 s once per machine)."""
    from serving.checkpoint.default_model import default_model_path

    return default_model_path()

"""`ModelArgs`: the architecture numbers our models need, read from an HF config.json dict.

We parse the raw dict ourselves (not `AutoConfig`) so both transformers 4.x spellings
(`rope_theta` + `rope_scaling`) and 5.x spellings (`rope_parameters`) work whatever
transformers is installed, and so unknown fields never matter. What differs by model type (its
defaults, which follow transformers' config classes for the fields older hub configs omit, its
config's own spellings, the fields it sets itself) is declared per family in
`serving/checkpoint/architectures/`; this module holds no per-architecture table.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from serving.checkpoint import architectures
from serving.checkpoint.architectures import SUPPORTED_ARCHITECTURES
from serving.checkpoint.architectures.model_type import ModelType

__all__ = ["SUPPORTED_ARCHITECTURES", "ModelArgs", "ModelConfigError", "RopeArgs", "UnsupportedModelError",
           "check_supported", "eos_token_ids", "read_json_object"]


class ModelConfigError(ValueError):
    """A model's JSON file (config.json, generation_config.json) is unreadable; the message names it."""


def read_json_object(path: str | Path) -> dict[str, Any]:
    """The JSON object in `path` (UTF-8). ModelConfigError naming the file when it is not UTF-8,
    not JSON, or JSON that is not an object (a list, a number): never a traceback from deeper in."""
    path = Path(path)
    try:
        value = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ModelConfigError(f"{path} is not UTF-8 text (byte {exc.start}): not a JSON file") from None
    except json.JSONDecodeError as exc:
        raise ModelConfigError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ModelConfigError(f"{path} holds a JSON {type(value).__name__}, not an object: not a model "
                               "configuration") from None
    return value


@dataclass(frozen=True)
class RopeArgs:
    """RoPE base and scaling. `scaling_type` is 'default' when there is no scaling."""

    theta: float
    scaling_type: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    partial_rotary_factor: float = 1.0
    # YaRN only: cos/sin scale (None: from factor and the mscales), the ramp's bounds in rotations
    attention_factor: float | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    # LongRoPE (Phi-3.5, Phi-4-mini): per-frequency divisors for short and long contexts
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None


@dataclass(frozen=True)
class ModelArgs:
    """Shapes and options of a Llama-family decoder (HF field meanings)."""

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool  # per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3)
    mlp_bias: bool
    rope: RopeArgs
    sliding_window: int | None  # the window of the layers in `sliding_layers` (all of them by default)
    torch_dtype: str | None
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    # the layers that attend within `sliding_window` (None: every layer, when there is a window)
    sliding_layers: tuple[int, ...] | None = None
    # SmolLM3: the layers whose attention applies no RoPE (NoPE)
    no_rope_layers: tuple[int, ...] = ()
    # Granite: embeddings and each block's output scaled, softmax scale set, logits divided
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None  # the softmax scale; None: head_dim ** -0.5
    logits_scaling: float = 1.0
    # Gemma: the MLP's activation, the sliding layers' own RoPE (3), the tanh caps of logits and scores (2)
    hidden_act: str = "silu"
    rope_local: RopeArgs | None = None
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    # Mixture of experts (Mixtral, Qwen2/3-MoE): the layers in `moe_layers` route each token to
    # `num_experts_per_tok` of `num_experts` SwiGLU experts of width `moe_intermediate_size` (the
    # others keep a dense MLP of `intermediate_size`); Qwen2-MoE adds a gated shared expert.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    moe_layers: tuple[int, ...] = ()
    norm_topk_prob: bool = True  # the chosen experts' probabilities renormalised to sum to 1
    shared_expert_intermediate_size: int = 0
    moe_combine_fp32: bool = False  # Mixtral weighs expert outputs in float32, Qwen in the model dtype
    # LayerNorm decoders (StarCoder2, Phi): LayerNorm with bias and a plain gelu MLP; Phi adds attention
    # and MLP (of one normed input) to the residual together and biases its LM head
    layer_norm: bool = False
    plain_mlp: bool = False  # fc_out(act(fc_in(x))), no gate (all LayerNorm decoders but StableLM)
    layer_norm_unit_offset: bool = False  # Nemotron's LayerNorm1P: scaled by 1 + weight
    parallel_residual: bool = False
    lm_head_bias: bool = False
    learned_positions: bool = False  # GPT-2: position embeddings added to the token embeddings, no RoPE
    position_offset: int = 0  # OPT: position p reads row p + 2 of its position embeddings
    logit_scale: float = 1.0  # Cohere: logits multiplied by it
    parallel_mlp_norm: bool = False  # GPT-NeoX's parallel block: the MLP reads a LayerNorm of its own

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer `layer`, or None where it attends to the whole context."""
        if self.sliding_window is None or (self.sliding_layers is not None and layer not in self.sliding_layers):
            return None
        return self.sliding_window

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelArgs:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{model_dir} has no config.json: not a Hugging Face model dir")
        return cls.from_dict(read_json_object(path))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelArgs:
        """Normalise a config.json dict; raises ValueError for what we cannot run."""
        archs = d.get("architectures") or []
        multimodal = architectures.MULTIMODAL.get(archs[0]) if archs else None
        if multimodal is not None and not isinstance(d.get("text_config"), dict):
            # the text model's fields at the top (Qwen2/2.5-VL as transformers 4.x saved them)
            d = {**d, "model_type": multimodal.text_model_type}
        elif multimodal is not None:
            # served as its text decoder only (image inputs are refused where requests are read)
            outer = d
            d = {**outer["text_config"], "architectures": archs, "model_type": multimodal.text_model_type}
            for key in ("eos_token_id", "bos_token_id", "dtype", "torch_dtype"):
                if d.get(key) is None and outer.get(key) is not None:
                    d[key] = outer[key]
            if "tie_word_embeddings" in outer:  # the composite model's own setting wins (transformers 5.x)
                d["tie_word_embeddings"] = outer["tie_word_embeddings"]
        model_type = str(d.get("model_type", ""))
        spec = architectures.declaration(model_type)
        d = spec.rewrite(d)
        if "text_config" in d and "hidden_size" not in d:
            raise ValueError("multimodal configs (text_config) are not supported")
        d = spec.with_defaults(d)
        arch = archs[0] if archs else spec.architecture
        _check_arch_matches_model_type(arch, model_type)
        hidden = int(d["hidden_size"])
        heads = int(d["num_attention_heads"])
        num_layers = int(d["num_hidden_layers"])
        kv_heads = int(d.get("num_key_value_heads") or heads)
        head_dim = d.get("head_dim") or hidden // heads
        act = d.get("hidden_activation") or d.get("hidden_act") or "silu"
        layer_norm, plain_mlp = spec.layer_norm, spec.plain_mlp
        if plain_mlp and act not in ("gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast", "relu", "relu2"):
            raise ValueError(f"hidden_act {act!r} is not supported for {model_type} (gelu, gelu_new, "
                             "gelu_pytorch_tanh, gelu_fast, relu, relu2)")
        if not plain_mlp and act not in ("silu", "swish", "gelu_pytorch_tanh"):
            raise ValueError(f"hidden_act {act!r} is not supported (silu: SwiGLU; gelu_pytorch_tanh: GeGLU)")
        if d.get("qk_layernorm") or d.get("use_qk_norm"):
            raise ValueError("qk_layernorm / use_qk_norm (LayerNorm on q and k: Phi's option, Command R+) is not supported")
        if d.get("use_bidirectional_attention"):
            raise ValueError("use_bidirectional_attention (an embedding model) is not supported: open-lmi generates")
        attention_bias = bool(d.get("attention_bias", spec.all_biased))
        qkv_bias = bool(d.get("qkv_bias", spec.qkv_bias)) or attention_bias  # `qkv_bias`: Qwen2-MoE's switch
        sliding = d.get("sliding_window")
        if ("use_sliding_window" in d or spec.sliding_opt_in) and not d.get("use_sliding_window"):
            sliding = None  # Qwen2/3 and SmolLM3 configs carry a window that is off unless use_sliding_window
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        per_layer_rope = isinstance((d.get("rope_parameters") or {}).get("sliding_attention"), dict)
        return cls(
            architecture=arch,
            model_type=model_type,
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=int(head_dim),
            rms_norm_eps=float(d.get("rms_norm_eps") or d.get("norm_epsilon") or d.get("layer_norm_eps")
                               or d.get("norm_eps") or spec.norm_eps),
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", spec.tied_embeddings)),
            qkv_bias=qkv_bias,
            o_bias=attention_bias,
            qk_norm=arch in architectures.QK_NORM_ARCHITECTURES,
            mlp_bias=bool(d.get("mlp_bias", False)) or (spec.all_biased and attention_bias),
            rope=_rope_args(d, spec, "full_attention"),
            sliding_window=int(sliding) if sliding else None,
            torch_dtype=d.get("dtype") or d.get("torch_dtype"),
            eos_token_ids=eos_ids,
            bos_token_id=d.get("bos_token_id"),
            sliding_layers=_sliding_layers(d, spec, num_layers) if sliding else None,
            embedding_multiplier=float(d.get("embedding_multiplier", 1.0)),
            residual_multiplier=float(d.get("residual_multiplier", 1.0)),
            logits_scaling=float(d.get("logits_scaling", 1.0)),
            hidden_act="silu" if act == "swish" else act,
            # Gemma 3, OLMo 3: the sliding layers' own RoPE (OLMo 3's configs key rope_parameters by layer type)
            rope_local=(_rope_args(d, spec, "sliding_attention")
                        if spec.local_rope_base_key or per_layer_rope else None),
            final_logit_softcapping=(None if d.get("final_logit_softcapping") is None
                                     else float(d["final_logit_softcapping"])),
            attn_logit_softcapping=(None if d.get("attn_logit_softcapping") is None
                                    else float(d["attn_logit_softcapping"])),
            layer_norm=layer_norm,
            plain_mlp=plain_mlp,
            parallel_residual=layer_norm and bool(d.get("use_parallel_residual")),
            parallel_mlp_norm=layer_norm and bool(d.get("parallel_mlp_norm")),
            **spec.own_args(d, num_layers),
        )


def _check_arch_matches_model_type(arch: str, model_type: str) -> None:
    """An architecture and a model_type of different families (a LayerNorm decoder named with a Llama
    config, say) would build a model the config does not describe: a clear error instead."""
    own, named = architectures.own_model_type(arch), architectures.MODEL_TYPES.get(model_type)
    if own is None or named is None or own is named or (own.llama_alike and named.llama_alike):
        return
    raise ValueError(f"config.json names architecture {arch} but model_type {model_type!r} "
                     f"(that architecture's is {own.name!r}): they must agree")


def _sliding_layers(d: dict[str, Any], spec: ModelType, num_layers: int) -> tuple[int, ...] | None:
    """The layers with a sliding window: as `layer_types` lists them, else as the model type declares
    (Qwen2/3's from `max_window_layers` on, Gemma's 4.x patterns); None (every layer) otherwise, as
    Mistral has it."""
    types = d.get("layer_types")
    if types:
        if len(types) != num_layers:
            raise ValueError(f"layer_types has {len(types)} entries for {num_layers} layers")
        return tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    return spec.sliding_layers(d, num_layers) if spec.sliding_layers is not None else None


def _rope_args(d: dict[str, Any], spec: ModelType, layer_type: str = "full_attention") -> RopeArgs:
    """RoPE settings from either `rope_parameters` (5.x) or `rope_theta`/`rope_scaling` (4.x).

    Gemma 3 has two: its 5.x configs key `rope_parameters` by layer type; its 4.x ones give the
    sliding layers' base as `rope_local_base_freq` (plain RoPE) beside the full layers' settings."""
    params = dict(d.get("rope_parameters") or {})
    if isinstance(params.get(layer_type), dict):  # per layer type (Gemma 3, 5.x)
        params = dict(params[layer_type])
    elif spec.local_rope_base_key and layer_type == "sliding_attention":
        return RopeArgs(theta=float(d[spec.local_rope_base_key]), scaling_type="default")
    scaling = d.get("rope_scaling") or {}
    merged = {**scaling, **params}  # 5.x dicts win where both exist
    theta = merged.get("rope_theta", d.get("rope_theta", 10000.0))
    rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
    partial = merged.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)) or 1.0
    orig = merged.get("original_max_position_embeddings", d.get("original_max_position_embeddings"))
    if rope_type == "su":  # LongRoPE's early name (Phi-3 configs of 2024)
        rope_type = "longrope"
    if rope_type == "mrope":  # Qwen-VL's 3-D RoPE (4.x name): with text only, its 3 positions are one
        rope_type = "default"
    if rope_type not in ("default", "llama3", "linear", "dynamic", "yarn", "longrope"):
        raise ValueError(
            f"rope scaling type {rope_type!r} is not supported "
            "(supported: default, llama3, linear, dynamic, yarn, longrope)"
        )
    factor = merged.get("factor")
    short = long = None
    if rope_type in ("yarn", "longrope"):
        if not orig:
            if rope_type == "yarn":
                raise ValueError("yarn rope scaling needs original_max_position_embeddings")
            orig = d.get("max_position_embeddings")  # LongRoPE: as transformers defaults it
        if factor is None:  # the ratio of the two context lengths (DeepSeek's YaRN, Phi-3's LongRoPE)
            factor = int(d.get("max_position_embeddings", orig)) / int(orig)
    if rope_type == "longrope":
        short, long = merged.get("short_factor"), merged.get("long_factor")
        half = int(int(d.get("head_dim") or int(d["hidden_size"]) // int(d["num_attention_heads"])) * partial) // 2
        for name, factors in (("short_factor", short), ("long_factor", long)):
            if not isinstance(factors, list) or len(factors) != half:
                raise ValueError(f"longrope rope scaling needs {name}: a list of {half} numbers (rotary dims / 2)")

    def opt(key: str) -> float | None:
        return None if merged.get(key) is None else float(merged[key])

    return RopeArgs(
        theta=float(theta),
        scaling_type=str(rope_type),
        factor=float(factor or 1.0),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(orig) if orig else None,
        partial_rotary_factor=float(partial),
        attention_factor=opt("attention_factor"),
        beta_fast=float(merged.get("beta_fast") or 32.0),
        beta_slow=float(merged.get("beta_slow") or 1.0),
        mscale=opt("mscale"),
        mscale_all_dim=opt("mscale_all_dim"),
        truncate=bool(merged.get("truncate", True)),
        short_factor=tuple(float(f) for f in short) if short else None,
        long_factor=tuple(float(f) for f in long) if long else None,
    )


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture is not one we implement."""


def check_supported(config: dict) -> None:
    """Raise UnsupportedModelError unless config.json describes an architecture we run."""
    archs = config.get("architectures") or []
    known = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
    if any(a in SUPPORTED_ARCHITECTURES for a in archs):
        return
    if config.get("auto_map"):
        raise UnsupportedModelError(
            f"model architecture {archs or config.get('model_type')!r} needs remote code (auto_map in config.json); "
            f"open-lmi does not run remote code. Supported architectures: {known}"
        )
    if not archs and config.get("model_type") in architectures.MODEL_TYPES:
        return
    raise UnsupportedModelError(
        f"model architecture {archs or config.get('model_type')!r} is not supported; supported: {known}"
    )


def eos_token_ids(model_dir: Path, args: ModelArgs) -> tuple[int, ...]:
    """The model's EOS ids, the one source the engine and workers use: config.json's, then
    generation_config.json's (union, config's first)."""
    ids = list(args.eos_token_ids)
    gen = Path(model_dir) / "generation_config.json"
    if gen.is_file():
        eos = read_json_object(gen).get("eos_token_id")
        for t in eos if isinstance(eos, list) else ([] if eos is None else [eos]):
            if int(t) not in ids:
                ids.append(int(t))
    return tuple(ids)

"""`ModelArgs`: the architecture numbers our models need, read from an HF config.json dict.

We parse the raw dict ourselves (not `AutoConfig`) so both transformers 4.x spellings
(`rope_theta` + `rope_scaling`) and 5.x spellings (`rope_parameters`) work whatever
transformers is installed, and so unknown fields never matter. Defaults follow transformers'
config classes for the fields that older hub configs omit.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# model_type -> (default rms_norm_eps, q/k/v projections carry a bias)
_ARCH_DEFAULTS: dict[str, tuple[float, bool]] = {
    "llama": (1e-6, False),
    "mistral": (1e-6, False),
    "qwen2": (1e-6, True),
    "qwen3": (1e-6, False),
    "phi3": (1e-5, False),
    "smollm3": (1e-6, False),
    "granite": (1e-6, False),
    "gemma": (1e-6, False),
    "gemma2": (1e-6, False),
    "gemma3_text": (1e-6, False),
    "starcoder2": (1e-5, False),  # their biases: `attention_bias` below
    "phi": (1e-5, False),
    "gpt2": (1e-5, False),
    "gpt_neox": (1e-5, False),
    "gpt_bigcode": (1e-5, False),
    "falcon": (1e-5, False),
    "opt": (1e-5, False),
    "cohere": (1e-5, False),
    "olmo2": (1e-5, False),
    "olmo3": (1e-5, False),
    "stablelm": (1e-5, False),
    "nemotron": (1e-5, False),
    "mixtral": (1e-5, False),
    "qwen2_moe": (1e-6, True),
    "qwen3_moe": (1e-6, False),
}
# model_type -> its architecture, for configs that name no `architectures`
_ARCH_OF_MODEL_TYPE: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "granite": "GraniteForCausalLM",
    "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "starcoder2": "Starcoder2ForCausalLM",
    "phi": "PhiForCausalLM",
    "gpt2": "GPT2LMHeadModel",
    "gpt_neox": "GPTNeoXForCausalLM",
    "gpt_bigcode": "GPTBigCodeForCausalLM",
    "falcon": "FalconForCausalLM",
    "opt": "OPTForCausalLM",
    "cohere": "CohereForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "olmo3": "Olmo3ForCausalLM",
    "stablelm": "StableLmForCausalLM",
    "nemotron": "NemotronForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
# Architectures whose attention RMS-normalises each head of q and k (over head_dim) before RoPE.
_QK_NORM_ARCHS = frozenset({"Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM",
                            "Gemma3ForConditionalGeneration", "Qwen3VLForConditionalGeneration"})
_QWEN_TYPES = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")  # a sliding window only with use_sliding_window
# LayerNorm decoders (serving/executor/models/layernorm_decoder.py); all but StableLM with a plain MLP
_PLAIN_MLP_TYPES = ("starcoder2", "phi", "gpt2", "gpt_neox", "gpt_bigcode", "falcon", "opt", "nemotron")
_LAYER_NORM_TYPES = (*_PLAIN_MLP_TYPES, "stablelm")
_BIASED_BY_DEFAULT = ("starcoder2", "phi", "gpt2", "gpt_neox", "gpt_bigcode")  # every linear layer has a bias
# transformers' default where a config omits tie_word_embeddings: tied for these (untied for the rest)
_TIED_BY_DEFAULT = frozenset({"gemma", "starcoder2", "gpt2", "gpt_bigcode", "falcon", "opt", "cohere"})  # LayerNorm, plain gelu MLP (serving/executor/models/layernorm_decoder.py)
# Gemma's configs leave out what transformers' config classes default (Gemma 3's multimodal text
# configs name little more than their sizes): those defaults, by model_type.
_GEMMA_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma3_text": {
        "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256, "sliding_window": 4096, "sliding_window_pattern": 6,
        "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True, "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10000.0, "bos_token_id": 2, "eos_token_id": 1,
    },
    "gemma2": {
        "vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256, "sliding_window": 4096,
        "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True, "rope_theta": 10000.0,
        "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0, "bos_token_id": 2, "eos_token_id": 1,
    },
}
# The keys whose explicit null still means transformers' default there (elsewhere null is a value)
_NULL_IS_DEFAULT = ("head_dim", "sliding_window_pattern", "rope_theta", "rope_local_base_freq", "hidden_activation")


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
        if archs and archs[0] in _TEXT_OF_MULTIMODAL and not isinstance(d.get("text_config"), dict):
            # the text model's fields at the top (Qwen2/2.5-VL as transformers 4.x saved them)
            d = {**d, "model_type": _TEXT_OF_MULTIMODAL[archs[0]]}
        elif archs and archs[0] in _TEXT_OF_MULTIMODAL:
            # served as its text decoder only (image inputs are refused where requests are read)
            outer = d
            d = {**outer["text_config"], "architectures": archs,
                 "model_type": _TEXT_OF_MULTIMODAL[archs[0]]}
            for key in ("eos_token_id", "bos_token_id", "dtype", "torch_dtype"):
                if d.get(key) is None and outer.get(key) is not None:
                    d[key] = outer[key]
            if "tie_word_embeddings" in outer:  # the composite model's own setting wins (transformers 5.x)
                d["tie_word_embeddings"] = outer["tie_word_embeddings"]
        if d.get("model_type") in _CONFIG_DIALECTS:
            d = _CONFIG_DIALECTS[d["model_type"]](d)
        if "text_config" in d and "hidden_size" not in d:
            raise ValueError("multimodal configs (text_config) are not supported")
        if d.get("model_type") in _GEMMA_DEFAULTS:
            d = {**_GEMMA_DEFAULTS[d["model_type"]],
                 **{k: v for k, v in d.items() if v is not None or k not in _NULL_IS_DEFAULT}}
        model_type = str(d.get("model_type", ""))
        arch = archs[0] if archs else _default_arch(model_type)
        _check_arch_matches_model_type(arch, model_type)
        eps_default, qkv_bias_default = _ARCH_DEFAULTS.get(model_type, (1e-6, False))
        hidden = int(d["hidden_size"])
        heads = int(d["num_attention_heads"])
        kv_heads = int(d.get("num_key_value_heads") or heads)
        head_dim = d.get("head_dim") or hidden // heads
        act = d.get("hidden_activation") or d.get("hidden_act") or "silu"
        if act == "gelu" and model_type == "gemma":  # Gemma 1's released configs: meant as the tanh approximation
            act = "gelu_pytorch_tanh"
        layer_norm, plain_mlp = model_type in _LAYER_NORM_TYPES, model_type in _PLAIN_MLP_TYPES
        if plain_mlp and act not in ("gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast", "relu", "relu2"):
            raise ValueError(f"hidden_act {act!r} is not supported for {model_type} (gelu, gelu_new, "
                             "gelu_pytorch_tanh, gelu_fast, relu, relu2)")
        if not plain_mlp and act not in ("silu", "swish", "gelu_pytorch_tanh"):
            raise ValueError(f"hidden_act {act!r} is not supported (silu: SwiGLU; gelu_pytorch_tanh: GeGLU)")
        if d.get("qk_layernorm") or d.get("use_qk_norm"):
            raise ValueError("qk_layernorm / use_qk_norm (LayerNorm on q and k: Phi's option, Command R+) is not supported")
        gemma3 = model_type == "gemma3_text"
        if d.get("use_bidirectional_attention"):
            raise ValueError("use_bidirectional_attention (an embedding model) is not supported: open-lmi generates")
        attention_bias = bool(d.get("attention_bias", model_type in _BIASED_BY_DEFAULT))
        if model_type == "starcoder2":  # one switch for every bias
            attention_bias = bool(d.get("use_bias", True))
        qkv_bias = bool(d.get("qkv_bias", qkv_bias_default)) or attention_bias  # `qkv_bias`: Qwen2-MoE's switch
        sliding = d.get("sliding_window")
        if ("use_sliding_window" in d or model_type in _QWEN_TYPES) and not d.get("use_sliding_window"):
            sliding = None  # Qwen2/3 and SmolLM3 configs carry a window that is off unless use_sliding_window
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            architecture=arch,
            model_type=model_type,
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=int(head_dim),
            rms_norm_eps=float(d.get("rms_norm_eps") or d.get("norm_epsilon") or d.get("layer_norm_eps")
                               or d.get("norm_eps") or eps_default),
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", model_type in _TIED_BY_DEFAULT)),
            qkv_bias=qkv_bias,
            o_bias=attention_bias,
            qk_norm=arch in _QK_NORM_ARCHS,
            mlp_bias=bool(d.get("mlp_bias", False)) or (model_type in _BIASED_BY_DEFAULT and attention_bias),
            rope=_rope_args(d, "full_attention"),
            sliding_window=int(sliding) if sliding else None,
            torch_dtype=d.get("dtype") or d.get("torch_dtype"),
            eos_token_ids=eos_ids,
            bos_token_id=d.get("bos_token_id"),
            sliding_layers=_sliding_layers(d, model_type, int(d["num_hidden_layers"])) if sliding else None,
            no_rope_layers=_no_rope_layers(d, model_type, int(d["num_hidden_layers"])),
            embedding_multiplier=float(d.get("embedding_multiplier", 1.0)),
            residual_multiplier=float(d.get("residual_multiplier", 1.0)),
            attention_multiplier=(float(d.get("attention_multiplier", 1.0)) if model_type == "granite" else
                                  float(d["query_pre_attn_scalar"]) ** -0.5 if model_type in _GEMMA_DEFAULTS
                                  else None),
            logits_scaling=float(d.get("logits_scaling", 1.0)),
            hidden_act="silu" if act == "swish" else act,
            # Gemma 3, OLMo 3: the sliding layers' own RoPE (OLMo 3's configs key rope_parameters by layer type)
            rope_local=(_rope_args(d, "sliding_attention")
                        if gemma3 or isinstance((d.get("rope_parameters") or {}).get("sliding_attention"), dict)
                        else None),
            final_logit_softcapping=(None if d.get("final_logit_softcapping") is None
                                     else float(d["final_logit_softcapping"])),
            attn_logit_softcapping=(None if d.get("attn_logit_softcapping") is None
                                    else float(d["attn_logit_softcapping"])),
            **_moe_args(d, model_type, int(d["num_hidden_layers"])),
            layer_norm=layer_norm,
            plain_mlp=plain_mlp,
            layer_norm_unit_offset=model_type == "nemotron",
            parallel_residual=layer_norm and bool(d.get("use_parallel_residual")),
            parallel_mlp_norm=layer_norm and bool(d.get("parallel_mlp_norm")),
            lm_head_bias=model_type == "phi",
            learned_positions=model_type in ("gpt2", "gpt_bigcode", "opt"),
            position_offset=2 if model_type == "opt" else 0,
            logit_scale=float(d.get("logit_scale") or 1.0) if model_type == "cohere" else 1.0,
        )


# model_types whose config a Llama-family class reads alike (a fine-tune may name another's architecture)
_LLAMA_ALIKE = frozenset({"llama", "mistral", "qwen2", "qwen3", "phi3", "smollm3", "granite"})


def _check_arch_matches_model_type(arch: str, model_type: str) -> None:
    """An architecture and a model_type of different families (a LayerNorm decoder named with a Llama
    config, say) would build a model the config does not describe: a clear error instead."""
    own = {a: t for t, a in _ARCH_OF_MODEL_TYPE.items()}.get(arch)
    if own is None or model_type not in _ARCH_OF_MODEL_TYPE or own == model_type:
        return
    if own in _LLAMA_ALIKE and model_type in _LLAMA_ALIKE:
        return
    raise ValueError(f"config.json names architecture {arch} but model_type {model_type!r} "
                     f"(that architecture's is {own!r}): they must agree")


def _sliding_layers(d: dict[str, Any], model_type: str, num_layers: int) -> tuple[int, ...] | None:
    """The layers with a sliding window: as `layer_types` lists them, or Qwen2/3's layers from
    `max_window_layers` on; None (every layer) otherwise, as Mistral has it."""
    types = d.get("layer_types")
    if types:
        if len(types) != num_layers:
            raise ValueError(f"layer_types has {len(types)} entries for {num_layers} layers")
        return tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    if model_type in _QWEN_TYPES and d.get("max_window_layers") is not None:
        return tuple(range(int(d["max_window_layers"]), num_layers))
    if model_type == "gemma3_text":  # 4.x configs: every `sliding_window_pattern`-th layer is global
        pattern = int(d.get("sliding_window_pattern", 6))
        return tuple(i for i in range(num_layers) if (i + 1) % pattern)
    if model_type == "gemma2":  # 4.x configs: the even layers slide
        return tuple(range(0, num_layers, 2))
    return None


def _gpt2_fields(d: dict[str, Any]) -> dict[str, Any]:
    """A GPT-2 config's own names (n_embd, n_layer, n_head, n_positions, n_inner, ...) as the other
    configs spell them; what GPT-2 can switch that we do not run is refused."""
    if not d.get("scale_attn_weights", True) or d.get("scale_attn_by_inverse_layer_idx"):
        raise ValueError("GPT-2 without scale_attn_weights, or with scale_attn_by_inverse_layer_idx, is not supported")
    if d.get("add_cross_attention"):
        raise ValueError("GPT-2 with add_cross_attention (an encoder-decoder) is not supported")
    hidden = int(d.get("n_embd") or d["hidden_size"])
    heads = d.get("n_head", d.get("num_attention_heads"))
    bigcode = d.get("model_type") == "gpt_bigcode"  # GPT-BigCode (StarCoder 1, SantaCoder): one KV head by default
    return {**d, "hidden_size": hidden, "num_hidden_layers": d.get("n_layer", d.get("num_hidden_layers")),
            "num_attention_heads": heads, "num_key_value_heads": 1 if bigcode and d.get("multi_query", True) else heads,
            "max_position_embeddings": d.get("n_positions", d.get("max_position_embeddings", 1024)),
            "intermediate_size": d.get("n_inner") or 4 * hidden, "layer_norm_eps": d.get("layer_norm_epsilon", 1e-5),
            "hidden_act": d.get("activation_function", "gelu_pytorch_tanh" if bigcode else "gelu_new")}


def _falcon_fields(d: dict[str, Any]) -> dict[str, Any]:
    """Falcon's config (n_embed / n_head / n_layer in old ones, num_kv_heads, ffn_hidden_size, bias,
    multi_query, new_decoder_architecture) as the other configs spell it; ALiBi refused."""
    if d.get("alibi"):
        raise ValueError("Falcon with alibi (ALiBi positions instead of RoPE) is not supported")
    hidden = int(d.get("hidden_size") or d["n_embed"])
    heads = int(d.get("num_attention_heads") or d["n_head"])
    new = bool(d.get("new_decoder_architecture"))
    if new and not d.get("parallel_attn", True):
        raise ValueError("Falcon's new_decoder_architecture without parallel_attn is not a layout transformers runs")
    kv = int(d.get("num_kv_heads") or heads) if new else (1 if d.get("multi_query", True) else heads)
    bias = bool(d.get("bias", False))
    return {**d, "hidden_size": hidden, "num_attention_heads": heads, "num_key_value_heads": kv,
            "num_hidden_layers": d.get("num_hidden_layers") or d.get("n_layer"),
            "intermediate_size": d.get("ffn_hidden_size") or 4 * hidden, "layer_norm_eps": d.get("layer_norm_epsilon", 1e-5),
            "hidden_act": d.get("activation") or "gelu", "attention_bias": bias, "mlp_bias": bias,
            "use_parallel_residual": d.get("parallel_attn", True),
            "parallel_mlp_norm": (d.get("num_ln_in_parallel_attn") or (2 if new else 1)) == 2}


def _opt_fields(d: dict[str, Any]) -> dict[str, Any]:
    """OPT's config (ffn_dim, activation_function, enable_bias) as the other configs spell it; the
    350M model's layout (post-norm, projected embeddings) refused."""
    hidden = int(d["hidden_size"])
    if not d.get("do_layer_norm_before", True) or d.get("_remove_final_layer_norm"):
        raise ValueError("OPT with do_layer_norm_before=false (opt-350m's post-norm layout) is not supported")
    if int(d.get("word_embed_proj_dim") or hidden) != hidden:
        raise ValueError(f"OPT with word_embed_proj_dim ({d['word_embed_proj_dim']}) != hidden_size ({hidden}) "
                         "is not supported")
    if not d.get("layer_norm_elementwise_affine", True):
        raise ValueError("OPT with layer_norm_elementwise_affine=false is not supported")
    bias = bool(d.get("enable_bias", True))
    return {**d, "intermediate_size": d["ffn_dim"], "hidden_act": d.get("activation_function", "relu"),
            "attention_bias": bias, "mlp_bias": bias}


def _neox_fields(d: dict[str, Any]) -> dict[str, Any]:
    """GPT-NeoX: its 4.x names of the RoPE settings; the parallel block (its default) reads two norms."""
    return {"rope_theta": d.get("rotary_emb_base", 10000.0), "partial_rotary_factor": d.get("rotary_pct", 0.25),
            "use_parallel_residual": True, **d, "parallel_mlp_norm": True}



# model_type -> its config's own spellings rewritten to the keys `ModelArgs.from_dict` reads (and, for
# the LayerNorm decoders, `use_parallel_residual` / `parallel_mlp_norm`: their block's layout)
_CONFIG_DIALECTS = {"gpt2": _gpt2_fields, "gpt_bigcode": _gpt2_fields, "falcon": _falcon_fields, "opt": _opt_fields,
                    "gpt_neox": _neox_fields, "phi": lambda d: {**d, "use_parallel_residual": True},
                    "stablelm": lambda d: {"qkv_bias": d.get("use_qkv_bias", False), **d}}

def _moe_args(d: dict[str, Any], model_type: str, num_layers: int) -> dict[str, Any]:
    """The mixture-of-experts fields of `ModelArgs` (none for a dense model).

    Mixtral: every layer, experts as wide as `intermediate_size`, top-k always renormalised.
    Qwen2/3-MoE: the layers (i + 1) % decoder_sparse_step == 0 not in `mlp_only_layers`, experts of
    `moe_intermediate_size`, `norm_topk_prob` as configured (transformers' default: false)."""
    # transformers 5 writes either spelling of the expert count (an attribute map), hub configs their own
    num_experts = int(d.get("num_experts") or d.get("num_local_experts") or (8 if model_type == "mixtral" else 0))
    if model_type not in ("mixtral", "qwen2_moe", "qwen3_moe") or not num_experts:
        return {}
    top_k = int(d.get("num_experts_per_tok") or (2 if model_type == "mixtral" else 0))
    if not 0 < top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok={top_k} must be in 1..{num_experts} (the number of experts)")
    if model_type == "mixtral":
        return dict(num_experts=num_experts, num_experts_per_tok=top_k, moe_intermediate_size=int(d["intermediate_size"]),
                    moe_layers=tuple(range(num_layers)), norm_topk_prob=True, moe_combine_fp32=True)
    step = int(d.get("decoder_sparse_step") or 1)
    dense = set(d.get("mlp_only_layers") or ())
    return dict(num_experts=num_experts, num_experts_per_tok=top_k,
                moe_intermediate_size=int(d["moe_intermediate_size"]),
                moe_layers=tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0),
                norm_topk_prob=bool(d.get("norm_topk_prob", False)),
                shared_expert_intermediate_size=int(d.get("shared_expert_intermediate_size") or 0)
                if model_type == "qwen2_moe" else 0)


def _no_rope_layers(d: dict[str, Any], model_type: str, num_layers: int) -> tuple[int, ...]:
    """SmolLM3's NoPE layers: `no_rope_layers[i]` is 1 where layer i applies RoPE, 0 where it does
    not; without the list, every `no_rope_layer_interval`-th layer (default 4) has none."""
    if model_type != "smollm3":
        return ()
    flags = d.get("no_rope_layers")
    if flags is None:
        interval = int(d.get("no_rope_layer_interval", 4))
        flags = [int((i + 1) % interval != 0) for i in range(num_layers)]
    if len(flags) != num_layers:
        raise ValueError(f"no_rope_layers has {len(flags)} entries for {num_layers} layers")
    return tuple(i for i, use_rope in enumerate(flags) if not use_rope)


def _default_arch(model_type: str) -> str:
    return _ARCH_OF_MODEL_TYPE.get(model_type, f"<model_type {model_type!r}>")


def _rope_args(d: dict[str, Any], layer_type: str = "full_attention") -> RopeArgs:
    """RoPE settings from either `rope_parameters` (5.x) or `rope_theta`/`rope_scaling` (4.x).

    Gemma 3 has two: its 5.x configs key `rope_parameters` by layer type; its 4.x ones give the
    sliding layers' base as `rope_local_base_freq` (plain RoPE) beside the full layers' settings."""
    params = dict(d.get("rope_parameters") or {})
    if isinstance(params.get(layer_type), dict):  # per layer type (Gemma 3, 5.x)
        params = dict(params[layer_type])
    elif d.get("model_type") == "gemma3_text" and layer_type == "sliding_attention":
        return RopeArgs(theta=float(d["rope_local_base_freq"]), scaling_type="default")
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


# The architectures the executor implements (serving/executor/models checks it agrees).
# Multimodal architectures served as their text decoder: architecture -> the text config's model_type
# (Qwen-VL's multimodal RoPE gives a text token the same position on its 3 axes: plain RoPE.)
_TEXT_OF_MULTIMODAL: dict[str, str] = {"Gemma3ForConditionalGeneration": "gemma3_text",
                                        "Qwen2VLForConditionalGeneration": "qwen2",
                                        "Qwen2_5_VLForConditionalGeneration": "qwen2",
                                        "Qwen3VLForConditionalGeneration": "qwen3",
                                        "Mistral3ForConditionalGeneration": "mistral"}
SUPPORTED_ARCHITECTURES = (*_ARCH_OF_MODEL_TYPE.values(), *_TEXT_OF_MULTIMODAL)


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
    if not archs and config.get("model_type") in _ARCH_OF_MODEL_TYPE:
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

"""The LayerNorm decoders' model types (serving/executor/models/layernorm_decoder.py): StarCoder2,
Phi-1/1.5/2, GPT-2, GPT-BigCode, GPT-NeoX, Falcon, OPT, StableLM, Nemotron, and their configs' own
spellings. All but StableLM have a plain MLP (`sdk/model_types.py` lists them)."""

from __future__ import annotations

from serving.checkpoint.architectures.model_type import ArchitectureFamily, Config, ModelType


def _gpt2_fields(d: Config) -> Config:
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


def _falcon_fields(d: Config) -> Config:
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


def _opt_fields(d: Config) -> Config:
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


def _neox_fields(d: Config) -> Config:
    """GPT-NeoX: its 4.x names of the RoPE settings; the parallel block (its default) reads two norms."""
    return {"rope_theta": d.get("rotary_emb_base", 10000.0), "partial_rotary_factor": d.get("rotary_pct", 0.25),
            "use_parallel_residual": True, **d, "parallel_mlp_norm": True}


# Each model type's fields: LayerNorm (with bias), `layer_norm_eps` of 1e-5; `dialect`s also give the
# block's layout (`use_parallel_residual`, `parallel_mlp_norm`) where the config does not.
_LN = dict(norm_eps=1e-5, layer_norm=True)
STARCODER2 = ModelType("starcoder2", "Starcoder2ForCausalLM", tied_embeddings=True, all_biased=True, **_LN,
                       dialect=lambda d: {**d, "attention_bias": bool(d.get("use_bias", True))})  # one switch for every bias
# Phi adds attention and MLP (of one normed input) to the residual together and biases its LM head
PHI = ModelType("phi", "PhiForCausalLM", all_biased=True, **_LN, fixed_args={"lm_head_bias": True},
                dialect=lambda d: {**d, "use_parallel_residual": True})
# GPT-2: position embeddings added to the token embeddings, no RoPE
GPT2 = ModelType("gpt2", "GPT2LMHeadModel", tied_embeddings=True, all_biased=True, **_LN, dialect=_gpt2_fields,
                 fixed_args={"learned_positions": True})
GPT_NEOX = ModelType("gpt_neox", "GPTNeoXForCausalLM", all_biased=True, **_LN, dialect=_neox_fields)
GPT_BIGCODE = ModelType("gpt_bigcode", "GPTBigCodeForCausalLM", tied_embeddings=True, all_biased=True, **_LN,
                        dialect=_gpt2_fields, fixed_args={"learned_positions": True})
FALCON = ModelType("falcon", "FalconForCausalLM", tied_embeddings=True, **_LN, dialect=_falcon_fields)
# OPT: position p reads row p + 2 of its position embeddings
OPT = ModelType("opt", "OPTForCausalLM", tied_embeddings=True, **_LN, dialect=_opt_fields,
                fixed_args={"learned_positions": True, "position_offset": 2})
STABLELM = ModelType("stablelm", "StableLmForCausalLM", **_LN,
                     dialect=lambda d: {"qkv_bias": d.get("use_qkv_bias", False), **d})
# Nemotron's LayerNorm1P: scaled by 1 + weight
NEMOTRON = ModelType("nemotron", "NemotronForCausalLM", **_LN, fixed_args={"layer_norm_unit_offset": True})

FAMILY = ArchitectureFamily("layernorm_decoder", (STARCODER2, PHI, GPT2, GPT_NEOX, GPT_BIGCODE, FALCON, OPT,
                                                  STABLELM, NEMOTRON))

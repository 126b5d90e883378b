"""The architecture registry: every family's declarations (one module each, named after the executor
module that runs it) assembled into the lookups `ModelArgs.from_dict` and `check_supported` read.

Torch-free, importing nothing of serving outside the checkpoint package (and `sdk/model_types.py`,
the one table the sizing calculator reads too), so the edge, the engine and the executor all can.
"""

from __future__ import annotations

from serving.checkpoint.architectures import cohere, gemma, layernorm_decoder, llama, moe, multimodal_text, olmo
from serving.checkpoint.architectures.model_type import ArchitectureFamily, ModelType, MultimodalText

FAMILIES: tuple[ArchitectureFamily, ...] = tuple(m.FAMILY for m in (llama, gemma, layernorm_decoder, cohere, olmo,
                                                                    moe, multimodal_text))

MODEL_TYPES: dict[str, ModelType] = {t.name: t for f in FAMILIES for t in f.model_types}
MULTIMODAL: dict[str, MultimodalText] = {m.architecture: m for f in FAMILIES for m in f.multimodal}
# architecture -> its model type, for the model types that name one (the multimodal ones read a text config)
_OWN_MODEL_TYPE = {t.architecture: t for t in MODEL_TYPES.values()}

assert len(MODEL_TYPES) == sum(len(f.model_types) for f in FAMILIES), "a model_type declared twice"
assert len(_OWN_MODEL_TYPE) == len(MODEL_TYPES), "an architecture declared by two model types"
assert not set(MULTIMODAL) & set(_OWN_MODEL_TYPE), "an architecture declared both as text and multimodal"
assert all(m.text_model_type in MODEL_TYPES for m in MULTIMODAL.values()), "a multimodal text of no model type"
# the executor builds a plain MLP only in its LayerNorm decoders
assert all(t.layer_norm for t in MODEL_TYPES.values() if t.plain_mlp), "a plain MLP outside the LayerNorm decoders"

# The architectures the executor implements (serving/executor/models checks it agrees).
SUPPORTED_ARCHITECTURES: tuple[str, ...] = (*_OWN_MODEL_TYPE, *MULTIMODAL)

# Architectures whose attention RMS-normalises each head of q and k (over head_dim) before RoPE.
QK_NORM_ARCHITECTURES = frozenset(
    [a for a, t in _OWN_MODEL_TYPE.items() if t.qk_norm]
    + [a for a, m in MULTIMODAL.items() if MODEL_TYPES[m.text_model_type].qk_norm])


def declaration(name: str) -> ModelType:
    """The declaration of model_type `name`; an undeclared one gets the plain defaults (a Llama-like
    decoder), its architecture a placeholder naming it."""
    return MODEL_TYPES.get(name) or ModelType("", f"<model_type {name!r}>")


def own_model_type(architecture: str) -> ModelType | None:
    """The model type that names `architecture` as its own (None for multimodal or unknown ones)."""
    return _OWN_MODEL_TYPE.get(architecture)

"""`ModelType`: what one Hugging Face `model_type`'s config.json means to us, declared once.

Each family module beside this one (named after the executor module that runs it, under
`serving/executor/models/`) declares its model types: the architecture a config without
`architectures` names, what transformers' config class assumes where a config leaves a key out,
the config's own spellings (its dialect) and the few `ModelArgs` fields the model type sets itself.
`ModelArgs.from_dict` reads these declarations; it holds no table of its own. The declarations are
torch-free and live with the checkpoint (the ground floor) because `ModelArgs` is read by every
layer; the executor's model classes point at them (`serves`) to say which they run.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from sdk import model_types as shared

Config = dict[str, Any]  # a config.json object, as `ModelArgs.from_dict` reads it

# The keys whose explicit null still means the declared default there (elsewhere null is a value)
_NULL_IS_DEFAULT = ("head_dim", "sliding_window_pattern", "rope_theta", "rope_local_base_freq", "hidden_activation")


@dataclass(frozen=True)
class ModelType:
    """One `model_type` (HF spelling) and its defaults; a frozen value the registry collects."""

    name: str
    architecture: str  # its *ForCausalLM, for configs that name no `architectures`
    norm_eps: float = 1e-6  # the norms' epsilon where the config gives none
    qkv_bias: bool = False  # q/k/v projections carry a bias unless the config says otherwise
    tied_embeddings: bool = False  # transformers' default where a config omits tie_word_embeddings
    all_biased: bool = False  # every linear layer has a bias unless `attention_bias` says otherwise
    qk_norm: bool = False  # attention RMS-normalises each head of q and k (over head_dim) before RoPE
    layer_norm: bool = False  # a LayerNorm decoder (serving/executor/models/layernorm_decoder.py)
    llama_alike: bool = False  # a Llama-family class reads its config alike (a fine-tune may name another's)
    sliding_opt_in: bool = False  # the config's sliding window is off unless `use_sliding_window` (Qwen)
    # what transformers' config class defaults where the config omits a key (Gemma 2/3 name little more
    # than their sizes); an explicit null of a `_NULL_IS_DEFAULT` key still takes the default
    defaults: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    # the config's own spellings rewritten to the keys `ModelArgs.from_dict` reads (refusing what we do not run)
    dialect: Callable[[Config], Config] | None = None
    # the sliding layers where the config has no `layer_types` (None: every layer, when there is a window)
    sliding_layers: Callable[[Config, int], tuple[int, ...] | None] | None = None
    # the config key of the sliding layers' own plain-RoPE base (Gemma 3's 4.x configs)
    local_rope_base_key: str | None = None
    # `ModelArgs` fields this model type sets whatever its config says
    fixed_args: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    # `ModelArgs` fields this model type reads from its config: read_args(config, num_hidden_layers)
    read_args: Callable[[Config, int], dict[str, Any]] | None = None

    @property
    def plain_mlp(self) -> bool:
        """fc_out(act(fc_in(x))), no gate: from the one table sizing reads too (`sdk/model_types.py`)."""
        return shared.mlp_matrices(self.name) == 2

    def rewrite(self, d: Config) -> Config:
        """`d` in the spellings `from_dict` reads: the dialect applied."""
        return self.dialect(d) if self.dialect is not None else d

    def with_defaults(self, d: Config) -> Config:
        """`d` over the declared defaults (a null counts as absent for the `_NULL_IS_DEFAULT` keys)."""
        if not self.defaults:
            return d
        return {**self.defaults, **{k: v for k, v in d.items() if v is not None or k not in _NULL_IS_DEFAULT}}

    def own_args(self, d: Config, num_layers: int) -> dict[str, Any]:
        """The `ModelArgs` fields this model type sets itself (fixed, then read from `d`)."""
        return {**self.fixed_args, **(self.read_args(d, num_layers) if self.read_args is not None else {})}


@dataclass(frozen=True)
class MultimodalText:
    """A multimodal architecture served as its text decoder (image inputs are refused where requests
    are read): the model type its text config is read as."""

    architecture: str
    text_model_type: str


@dataclass(frozen=True)
class ArchitectureFamily:
    """What one executor model module runs: its model types and the multimodal checkpoints read as them."""

    module: str  # the executor module that runs it (serving/executor/models/<module>.py)
    model_types: tuple[ModelType, ...]
    multimodal: tuple[MultimodalText, ...] = ()

"""Architecture registry: HF `architectures[0]` -> our model class, and `build_model`.

Every supported architecture is a Llama-family decoder (some with mixture-of-experts MLPs, some
with LayerNorm and a plain MLP); the differences are options in `ModelArgs`. What each model type
means in config.json is declared torch-free in `serving/checkpoint/architectures/` (the checkpoint
package may not import the executor); each model class here points at the declarations it runs
(`serves`), and the registry is assembled from those. An unknown architecture, or a config that
points at remote code (`auto_map`), raises `UnsupportedModelError` naming what was found and what
is supported.

Tensor parallel: `build_model` builds this process's slice of the model. The shard is the
explicit `shard` argument, else the process state set by `parallel.init_tensor_parallel`
(single process, `TPShard(0, 1)`, when that never ran).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from serving.executor.models.cohere import CohereForCausalLM
from serving.executor.models.gemma import (
    Gemma1ForCausalLM,
    Gemma3TextOfMultimodal,
    GemmaForCausalLM,
)
from serving.executor.models.layernorm_decoder import (
    FalconForCausalLM,
    GPT2ForCausalLM,
    GPTBigCodeForCausalLM,
    GPTNeoXForCausalLM,
    LayerNormForCausalLM,
    NemotronForCausalLM,
    OPTForCausalLM,
)
from serving.executor.models.llama import LlamaForCausalLM, MixtralForCausalLM
from serving.executor.models.multimodal_text import LlamaTextOfMultimodal
from serving.executor.models.olmo import OlmoForCausalLM
from serving.executor.parallel import TPShard
from serving.checkpoint.model_config import (
    SUPPORTED_ARCHITECTURES,
    ModelArgs,
    UnsupportedModelError,
)
from serving.checkpoint.quantization import QuantConfig

# Every class that runs a model; each says which declarations it serves (`serves`).
_MODEL_CLASSES: tuple[type[nn.Module], ...] = (
    LlamaForCausalLM, MixtralForCausalLM, Gemma1ForCausalLM, GemmaForCausalLM, Gemma3TextOfMultimodal,
    LlamaTextOfMultimodal, CohereForCausalLM, OlmoForCausalLM, LayerNormForCausalLM, GPT2ForCausalLM,
    GPTNeoXForCausalLM, GPTBigCodeForCausalLM, FalconForCausalLM, OPTForCausalLM, NemotronForCausalLM,
)


def _registry(classes: tuple[type[nn.Module], ...]) -> dict[str, type[nn.Module]]:
    """HF architecture -> the class whose own `serves` names it (an inherited `serves` counts for
    nothing, so a subclass never serves its base's architectures twice)."""
    registry: dict[str, type[nn.Module]] = {}
    for cls in classes:
        assert "serves" in vars(cls), f"{cls.__name__} must say which model types it serves"
        for served in vars(cls)["serves"]:
            assert served.architecture not in registry, f"{served.architecture} served by two classes"
            registry[served.architecture] = cls
    return registry


MODEL_REGISTRY: dict[str, type[nn.Module]] = _registry(_MODEL_CLASSES)
assert set(MODEL_REGISTRY) == set(SUPPORTED_ARCHITECTURES), \
    "every architecture serving/checkpoint/architectures/ declares is run by exactly one class here"


def get_model_class(args: ModelArgs) -> type[nn.Module]:
    try:
        return MODEL_REGISTRY[args.architecture]
    except KeyError:
        raise UnsupportedModelError(
            f"model architecture {args.architecture!r} is not supported; supported: {', '.join(sorted(MODEL_REGISTRY))}"
        ) from None


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(prev)


def build_model(
    args: ModelArgs, dtype: torch.dtype, device: torch.device, max_position: int | None = None,
    shard: TPShard | None = None, quant: QuantConfig | None = None, context_len: int | None = None,
) -> nn.Module:
    """Instantiate the model (this rank's slice) with uninitialised parameters of `dtype` directly on `device`.

    `quant`: the checkpoint's quantization (its linear layers then hold quantized tensors).
    `context_len`: the longest sequence the engine serves (it picks LongRoPE's factors).
    Raises ValueError when the model does not split over the tensor-parallel degree (or its
    quantized groups do not).
    """
    cls = get_model_class(args)
    with _default_dtype(dtype), torch.device(device):
        model = cls(args, max_position=max_position, shard=shard, quant=quant, context_len=context_len)
    return model.eval()

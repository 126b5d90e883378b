"""The architecture declarations (serving/checkpoint/architectures/) against their two readers: the
executor's model registry, which must run each one with the class that says it serves it, and the
sizing calculator, which must count the same MLP matrices the server builds (one table)."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch import nn

from sdk import model_types as shared
from sdk.sizing import ModelShape
from serving.checkpoint import architectures
from serving.checkpoint.model_config import ModelArgs
from serving.executor import models
from serving.executor.models.layernorm_decoder import LayerNormForCausalLM, NemotronForCausalLM

# enough of a config for every declared model type (OPT reads ffn_dim; a gelu that every MLP accepts)
SIZES = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 100,
         "intermediate_size": 128, "ffn_dim": 128, "hidden_act": "gelu_pytorch_tanh"}


@pytest.mark.parametrize("name", sorted(architectures.MODEL_TYPES))
def test_sizing_counts_the_mlp_the_server_builds(name: str) -> None:
    config = {**SIZES, "model_type": name}
    args = ModelArgs.from_dict(config)
    assert ModelShape.from_config(config).mlp_matrices == (2 if args.plain_mlp else 3)


def test_one_plain_mlp_table() -> None:
    """The server's plain-MLP model types are exactly the shared table's, less those only sized."""
    served_plain = {n for n, t in architectures.MODEL_TYPES.items() if t.plain_mlp}
    assert served_plain == shared.PLAIN_MLP_MODEL_TYPES & set(architectures.MODEL_TYPES)
    assert shared.PLAIN_MLP_MODEL_TYPES - served_plain == {"bloom", "mpt"}
    assert "nemotron" in served_plain and "stablelm" not in served_plain  # StableLM: LayerNorm, gated MLP


@pytest.mark.parametrize("name", sorted(architectures.MODEL_TYPES))
def test_each_model_type_runs_on_the_class_that_serves_it(name: str) -> None:
    spec = architectures.MODEL_TYPES[name]
    args = ModelArgs.from_dict({**SIZES, "model_type": name})  # no `architectures`: the declared one
    assert args.architecture == spec.architecture
    assert spec in vars(models.get_model_class(args))["serves"]


@pytest.mark.parametrize("arch", sorted(architectures.MULTIMODAL))
def test_multimodal_checkpoints_read_their_text_config(arch: str) -> None:
    declared = architectures.MULTIMODAL[arch]
    text = architectures.MODEL_TYPES[declared.text_model_type]
    args = ModelArgs.from_dict({"architectures": [arch], "text_config": {**SIZES}})
    assert args.model_type == text.name and args.architecture == arch
    assert args.qk_norm == text.qk_norm  # Qwen3-VL and Gemma 3 normalise q and k like their text models
    assert declared in vars(models.get_model_class(args))["serves"]


def test_registry_refuses_a_class_that_serves_nothing_of_its_own_or_twice() -> None:
    class Inherits(NemotronForCausalLM):  # no `serves` of its own: would serve Nemotron twice
        pass

    with pytest.raises(AssertionError, match="must say which model types"):
        models._registry((NemotronForCausalLM, Inherits))

    class Twice(nn.Module):
        serves = NemotronForCausalLM.serves

    with pytest.raises(AssertionError, match="served by two classes"):
        models._registry((NemotronForCausalLM, Twice))
    assert models._registry((LayerNormForCausalLM,)) == {
        "Starcoder2ForCausalLM": LayerNormForCausalLM, "PhiForCausalLM": LayerNormForCausalLM,
        "StableLmForCausalLM": LayerNormForCausalLM}


def test_an_undeclared_model_type_gets_the_plain_defaults() -> None:
    spec = architectures.declaration("bloom")  # sized by sdk, not served: no plain MLP in the server
    assert spec.architecture == "<model_type 'bloom'>" and not spec.plain_mlp and not spec.layer_norm


def test_each_family_names_the_executor_module_that_runs_it() -> None:
    root = Path(models.__file__).parent
    for family in architectures.FAMILIES:
        assert (root / f"{family.module}.py").is_file(), family.module
        assert (Path(architectures.__file__).parent / f"{family.module}.py").is_file(), family.module

"""Facts about Hugging Face `model_type`s that both the GPU sizing calculator and the server read.

One table, torch-free and importing nothing of ours, so `sdk/sizing.py` (which must not import the
server) and the server's architecture declarations (`serving/checkpoint/architectures/`, which read
it) cannot drift apart: a model type's MLP is written down here once.
"""

from __future__ import annotations

# model_types whose MLP is fc_in -> activation -> fc_out: two matrices, no gate. The server runs all
# of them but `bloom` and `mpt`, which only the sizing calculator knows (LMI serves them elsewhere).
PLAIN_MLP_MODEL_TYPES = frozenset({
    "starcoder2", "phi", "gpt2", "gpt_neox", "gpt_bigcode", "falcon", "opt", "nemotron", "bloom", "mpt",
})


def mlp_matrices(model_type: str) -> int:
    """The weight matrices of one MLP of `model_type`: 2 for a plain MLP, else 3 (gate, up, down)."""
    return 2 if model_type in PLAIN_MLP_MODEL_TYPES else 3

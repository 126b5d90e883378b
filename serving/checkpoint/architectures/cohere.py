"""The Cohere model type (serving/executor/models/cohere.py): Command R, whose logits are multiplied
by `logit_scale`."""

from __future__ import annotations

from serving.checkpoint.architectures.model_type import ArchitectureFamily, ModelType

COHERE = ModelType("cohere", "CohereForCausalLM", norm_eps=1e-5, tied_embeddings=True,
                   read_args=lambda d, n: {"logit_scale": float(d.get("logit_scale") or 1.0)})

FAMILY = ArchitectureFamily("cohere", (COHERE,))

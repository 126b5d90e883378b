"""Client side of open-lmi: talk to an LMI-compatible container directly or through SageMaker.

Importable without torch (and without the server package): ``pip install 'open-lmi[sdk]'``.
Modules: ``iterators`` (LineIterator), ``client`` (StreamingClient), ``parsing``/``results`` (typed
wire formats), ``gateway`` (local sagemaker-runtime), ``deploy`` (sagemaker 2.x helpers),
``sizing`` (GPU memory calculator), ``model_types`` (the model-type facts sizing
and the server share), ``local`` (container process + moto + gateway for laptops/CI).
"""

from sdk.client import StreamingClient, TokenStream
from sdk.iterators import InternalStreamFailure, LineIterator, ModelStreamError, StreamError
from sdk.results import GenerationResult, ModelError, StreamChunk, Token

__all__ = [
    "GenerationResult", "InternalStreamFailure", "LineIterator", "ModelError", "ModelStreamError",
    "StreamChunk", "StreamError", "StreamingClient", "Token", "TokenStream",
]

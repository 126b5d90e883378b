"""Public kernel ops. One place picks the implementation: Triton on CUDA tensors, else torch.

Callers use `kernels.write_kv_cache(...)` etc.; each op dispatches on the device of its first
tensor argument, so the CPU path is always the pure-torch reference in `kernels/reference.py`.
"""

from kernels.reference import (
    paged_decode_attention,
    prefill_attention,
    rms_norm,
    rotary_embedding,
    silu_and_mul,
    write_kv_cache,
)

__all__ = [
    "paged_decode_attention",
    "prefill_attention",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "write_kv_cache",
]

"""RoPE cos/sin cache builder (the kernels apply it; this decides the frequencies).

`build_cos_sin_cache` returns `[max_position, rot_dim]` float32 with cos in the first half
and sin in the second, the layout `kernels.rotary_embedding` reads. Frequencies follow
transformers' `modeling_rope_utils` bit for bit for default, llama3 and linear scaling, so
fp32 logits match HF exactly in the rotary step.
"""

from __future__ import annotations

import logging
import math

import torch

from serving.model_config import RopeArgs

logger = logging.getLogger(__name__)


def inverse_frequencies(rope: RopeArgs, rot_dim: int, max_position: int) -> torch.Tensor:
    """[rot_dim // 2] float32 inverse frequencies after scaling."""
    base = rope.theta
    if rope.scaling_type == "dynamic":
        # HF recomputes the base from the longest sequence in the batch; at lengths within
        # the original window that is plain RoPE. We fix it for the longest length we serve,
        # so it equals HF exactly when max_position <= original (vLLM's approximation beyond).
        orig = rope.original_max_position_embeddings or max_position
        if max_position > orig:
            base = base * ((rope.factor * max_position / orig) - (rope.factor - 1)) ** (rot_dim / (rot_dim - 2))
    exponents = torch.arange(0, rot_dim, 2, dtype=torch.int64).to(torch.float) / rot_dim
    inv_freq = 1.0 / (base**exponents)  # [rot_dim // 2]
    if rope.scaling_type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.scaling_type == "llama3":
        inv_freq = _llama3_scale(inv_freq, rope)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, rope: RopeArgs) -> torch.Tensor:
    # Same expression order as transformers' _compute_llama3_parameters.
    factor = rope.factor
    low, high = rope.low_freq_factor, rope.high_freq_factor
    old_context_len = rope.original_max_position_embeddings
    assert old_context_len is not None, "llama3 rope scaling needs original_max_position_embeddings"
    low_freq_wavelen = old_context_len / low
    high_freq_wavelen = old_context_len / high
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def build_cos_sin_cache(
    rope: RopeArgs, head_dim: int, max_position: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """[max_position, rot_dim] float32: cos(pos * f) | sin(pos * f), rot_dim = head_dim * partial."""
    rot_dim = int(head_dim * rope.partial_rotary_factor)
    inv_freq = inverse_frequencies(rope, rot_dim, max_position)
    positions = torch.arange(max_position, dtype=torch.int64).float()
    freqs = positions[:, None] * inv_freq[None, :]  # [P, rot_dim // 2], as HF: pos.float() * inv_freq
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).contiguous().to(device)

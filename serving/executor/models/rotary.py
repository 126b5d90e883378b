"""RoPE cos/sin cache builder (the kernels apply it; this decides the frequencies).

`build_cos_sin_cache` returns `[max_position, rot_dim]` float32 with cos in the first half
and sin in the second, the layout `kernels.rotary_embedding` reads. Frequencies follow
transformers' `modeling_rope_utils` bit for bit for default, llama3, linear, YaRN and LongRoPE
scaling, so fp32 logits match HF exactly in the rotary step. YaRN and LongRoPE also scale cos and
sin (their attention factor), which the cache carries.

LongRoPE has two sets of frequencies; transformers picks one per forward from the longest position
in the batch, so a sequence's keys could be rotated by both. Here the choice is made once for the
served context (`context_len`, the engine's max_model_len): the long factors when it exceeds the
original pretraining context, else the short ones, which equal transformers for every sequence
within that context.
"""

from __future__ import annotations

import logging
import math

import torch

from serving.checkpoint.model_config import RopeArgs

logger = logging.getLogger(__name__)


def inverse_frequencies(rope: RopeArgs, rot_dim: int, max_position: int, context_len: int | None = None
                        ) -> torch.Tensor:
    """[rot_dim // 2] float32 inverse frequencies after scaling (`context_len`: see the module text)."""
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
    elif rope.scaling_type == "yarn":
        inv_freq = _yarn_blend(base, rot_dim, rope)
    elif rope.scaling_type == "longrope":
        orig = rope.original_max_position_embeddings
        assert orig is not None and rope.short_factor is not None and rope.long_factor is not None
        factors = rope.long_factor if (context_len or max_position) > orig else rope.short_factor
        inv_freq = 1.0 / (torch.tensor(factors, dtype=torch.float32) * base**exponents)
    return inv_freq


def _yarn_blend(base: float, rot_dim: int, rope: RopeArgs) -> torch.Tensor:
    """YaRN: each frequency interpolated (divided by `factor`), extrapolated (kept), or a linear
    blend of both, by how many rotations it makes over the original context (`beta_fast` and
    more: kept; `beta_slow` and fewer: interpolated). Computed as transformers computes it."""
    orig = rope.original_max_position_embeddings
    assert orig is not None, "yarn rope scaling needs original_max_position_embeddings"

    def dim_of(rotations: float) -> float:  # the dimension index that makes `rotations` over `orig`
        return (rot_dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = dim_of(rope.beta_fast), dim_of(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rot_dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(rot_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, rot_dim, 2).to(dtype=torch.float) / rot_dim)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (rope.factor * pos_freqs)
    keep = 1 - ramp
    return interpolated * (1 - keep) + extrapolated * keep


def cos_sin_scale(rope: RopeArgs) -> float:
    """What cos and sin are multiplied by: 1, or YaRN's attention factor (from `factor` and the
    mscales when the config gives none)."""
    if rope.scaling_type not in ("yarn", "longrope"):
        return 1.0
    if rope.attention_factor is not None:
        return rope.attention_factor
    if rope.scaling_type == "longrope":
        orig = rope.original_max_position_embeddings
        assert orig is not None
        return 1.0 if rope.factor <= 1.0 else math.sqrt(1 + math.log(rope.factor) / math.log(orig))

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if rope.mscale and rope.mscale_all_dim:
        return float(mscale(rope.factor, rope.mscale) / mscale(rope.factor, rope.mscale_all_dim))
    return mscale(rope.factor)


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
    rope: RopeArgs, head_dim: int, max_position: int, device: torch.device | str = "cpu",
    context_len: int | None = None,
) -> torch.Tensor:
    """[P, rot_dim] float32: cos(pos * f) | sin(pos * f), rot_dim = head_dim * partial.

    `context_len`: the longest sequence served (default `max_position`); picks LongRoPE's factors
    and is P, the rows built (positions past it are never read): the config's `max_position`
    only shapes the frequencies, so a config claiming 10**12 positions allocates nothing for them."""
    rot_dim = int(head_dim * rope.partial_rotary_factor)
    inv_freq = inverse_frequencies(rope, rot_dim, max_position, context_len)
    positions = torch.arange(context_len or max_position, dtype=torch.int64).float()
    freqs = positions[:, None] * inv_freq[None, :]  # [P, rot_dim // 2], as HF: pos.float() * inv_freq
    cos, sin = freqs.cos(), freqs.sin()
    scale = cos_sin_scale(rope)
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return torch.cat([cos, sin], dim=-1).contiguous().to(device)

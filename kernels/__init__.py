"""Public kernel ops. One place picks the implementation: Triton on CUDA tensors, else torch.

Callers use `kernels.write_kv_cache(...)` etc.; each op dispatches on the device of its first
tensor argument: CUDA tensors go to the Triton launchers (imported lazily, on first use), CPU
tensors to the pure-torch reference in `kernels/reference.py`. `OPEN_LMI_KERNELS=reference`
(read once, at import) forces the reference everywhere, e.g. to bisect a numerical issue.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from kernels import quant_reference, reference
from kernels.decode_rope import DecodeRope

if TYPE_CHECKING:
    from kernels.l2_prefetch import L2Hint

_FORCE_REFERENCE = os.environ.get("OPEN_LMI_KERNELS", "").strip().lower() == "reference"


@functools.cache
def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


@functools.cache
def _mod(name: str) -> ModuleType:
    return importlib.import_module(f"kernels.{name}")


def use_triton(t: torch.Tensor) -> bool:
    """True when `t` lives on a CUDA device, Triton imports, and no override forces torch."""
    return t.is_cuda and not _FORCE_REFERENCE and _triton_available()


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
) -> None:
    """Store each token's K/V row at its slot; rows with slot -1 are skipped."""
    impl = _mod("cache_ops").write_kv_cache if use_triton(key) else reference.write_kv_cache
    impl(key, value, k_cache, v_cache, slot_mapping)


def paged_decode_attention(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, >= 1
    scale: float,
    out: torch.Tensor | None = None,  # [num_seqs, H, D]: written and returned instead of a new tensor
    window: int = 0,  # > 0: a sliding window, each query sees its last `window` positions
    softcap: float = 0.0,  # > 0: scores capped as c * tanh(s / c) before the softmax
    rope: DecodeRope | None = None,  # RoPE on query and rope.key, rope.key / value into the cache, here
) -> torch.Tensor:
    """One query token per sequence attending to its whole cached context -> [num_seqs, H, D]."""
    if use_triton(query):
        impl = _mod("paged_decode_attention").paged_decode_attention
    else:
        impl = reference.paged_decode_attention
    return impl(query, k_cache, v_cache, block_tables, seq_lens, scale, out=out, window=window, softcap=softcap,
                rope=rope)


def prefill_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32: total K/V length incl. this chunk
    max_query_len: int,
    scale: float,
    out: torch.Tensor | None = None,  # [num_tokens, H, D]: written and returned instead of a new tensor
    window: int = 0,  # > 0: a sliding window, each query sees the last `window` positions up to its own
    softcap: float = 0.0,  # > 0: scores capped as c * tanh(s / c) before the softmax
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its cached prefix + itself."""
    impl = _mod("prefill_attention").prefill_attention if use_triton(query) else reference.prefill_attention
    return impl(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, max_query_len, scale, out=out,
                window=window, softcap=softcap)


def mixed_attention(
    query: torch.Tensor,  # [T, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    query_start_loc: torch.Tensor,  # [S + 1] int32, non-decreasing from 0, last <= T
    seq_lens: torch.Tensor,  # [S] int32: K/V length after this step (0: an unused slot)
    scale: float,
    out: torch.Tensor | None = None,  # [T, H, D]: written and returned instead of a new tensor
    window: int = 0,  # > 0: a sliding window, each query sees the last `window` positions up to its own
    softcap: float = 0.0,  # > 0: scores capped as c * tanh(s / c) before the softmax
) -> torch.Tensor:
    """Decode rows and prompt chunks in one launch whose grid depends only on T and S (graph-safe)."""
    impl = _mod("mixed_attention").mixed_attention if use_triton(query) else reference.mixed_attention
    return impl(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, out=out, window=window,
                softcap=softcap)


def rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [num_tokens, hidden]
    unit_offset: bool = False,  # Gemma: scale by 1 + weight in float32, cast once
    fp8_rows: bool = False,  # an FP8 linear reads the result: write its FP8 rows too where they serve
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm; with `residual`, first x = x + residual and return (normed, x). `unit_offset`: the
    weight is stored as w - 1 (Gemma), the row scaled by 1 + w in float32 and cast once. `fp8_rows`:
    the normed rows' per-token FP8 copy rides along for the FP8 linear after it (`kernels/fp8_rows.py`;
    Triton on Hopper, more than 16 rows; elsewhere nothing is written and the result is the same)."""
    if use_triton(x):
        wanted = fp8_rows and _mod("fp8_rows").wanted(x)
        return _mod("rms_norm").rms_norm(x, weight, eps, residual, unit_offset, fp8_rows=wanted)
    return reference.rms_norm(x, weight, eps, residual, unit_offset, fp8_rows=fp8_rows)


def rotary_embedding(
    positions: torch.Tensor,  # [num_tokens] int64
    query: torch.Tensor,  # [num_tokens, num_heads * head_dim] (or [T, H, D]), rotated in place
    key: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim] (or [T, KVH, D]), in place
    cos_sin_cache: torch.Tensor,  # [max_position, rot_dim]: cos in the first half, sin second
    head_dim: int,
) -> None:
    """Neox-style (rotate-half) RoPE on the first rot_dim dims of each head, in place."""
    impl = _mod("rotary").rotary_embedding if use_triton(query) else reference.rotary_embedding
    impl(positions, query, key, cos_sin_cache, head_dim)


def rotary_and_write_kv(
    positions: torch.Tensor,  # [num_tokens] int64
    query: torch.Tensor,  # [num_tokens, num_heads * head_dim] (or [T, H, D]), rotated in place
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], rotated in place, then stored
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], stored
    cos_sin_cache: torch.Tensor,  # [max_position, rot_dim]
    head_dim: int,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = not stored
) -> None:
    """`rotary_embedding` then `write_kv_cache` of the rotated key and the value, in one launch."""
    impl = _mod("rotary").rotary_and_write_kv if use_triton(query) else reference.rotary_and_write_kv
    impl(positions, query, key, value, cos_sin_cache, head_dim, k_cache, v_cache, slot_mapping)


def silu_and_mul(x: torch.Tensor, fp8_rows: bool = False) -> torch.Tensor:
    """SwiGLU activation: x = [gate | up] along the last dim -> silu(gate) * up. `fp8_rows`: as
    `rms_norm`'s (the SwiGLU before an FP8 down projection)."""
    if use_triton(x):
        wanted = fp8_rows and _mod("fp8_rows").wanted(x)
        return _mod("activation").silu_and_mul(x, fp8_rows=wanted)
    return reference.silu_and_mul(x, fp8_rows=fp8_rows)


# Multi-LoRA: rows grouped by adapter slot once per step (on the host: `lora_segments_host`, numpy;
# `lora_segments` is the same in torch), then a shrink and an expand per adapted projection
# (kernels/lora.py).
lora_segments = reference.lora_segments
lora_segments_host = reference.lora_segments_host
lora_num_blocks = reference.lora_num_blocks


def lora_shrink(
    x: torch.Tensor,  # [T, K]
    a_stacked: torch.Tensor,  # [num_slots, R, K]
    sorted_rows: torch.Tensor,  # [>= T] int32 (lora_segments)
    seg_starts: torch.Tensor,  # [num_slots] int32
    seg_counts: torch.Tensor,  # [num_slots] int32
    block_slot: torch.Tensor,  # [NB] int32: the row blocks to run (lora_segments)
    block_m0: torch.Tensor,  # [NB] int32
) -> torch.Tensor:
    """Per row of slot s: x[t] · a_stacked[s]ᵀ -> float32 partial sums [P, T, R] (sum over dim 0)."""
    impl = _mod("lora").lora_shrink if use_triton(x) else reference.lora_shrink
    return impl(x, a_stacked, sorted_rows, seg_starts, seg_counts, block_slot, block_m0)


def lora_expand(
    y: torch.Tensor,  # [T, N], in place
    partials: torch.Tensor,  # [P, T, slices * r] float32
    b_stacked: torch.Tensor,  # [num_slots, N, r]
    slice_sizes: tuple[int, ...],  # output columns per packed slice, summing to N
    sorted_rows: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_counts: torch.Tensor,
    block_slot: torch.Tensor,
    block_m0: torch.Tensor,
) -> None:
    """Per row of slot s and slice p: y[t, cols(p)] += (Σ partials)[t, p-th r columns] · B[s, cols(p)]ᵀ."""
    impl = _mod("lora").lora_expand if use_triton(y) else reference.lora_expand
    impl(y, partials, b_stacked, slice_sizes, sorted_rows, seg_starts, seg_counts, block_slot, block_m0)


def stage_decode_inputs(
    ids: torch.Tensor,  # [n] int64 (PLACEHOLDER where `fix_rows` says)
    positions: torch.Tensor,  # [n] int64
    slots: torch.Tensor,  # [n] int64
    seq_lens: torch.Tensor,  # [n] int64
    rows: torch.Tensor,  # [n] int64: each sequence's row of `block_table`
    fix_rows: torch.Tensor,  # [f] int64: rows whose id is a placeholder
    fix_src: torch.Tensor,  # [f] int64: the entry of `prev_ids` holding each one's id
    prev_ids: torch.Tensor | None,  # the previous step's sampled ids (needed when f > 0)
    block_table: torch.Tensor,  # [rows, max_blocks] int32, the device mirror
    width: int,  # block-table columns in use
    out_ids: torch.Tensor,  # the graph's static buffers ([bucket] and more) ...
    out_positions: torch.Tensor,
    out_slots: torch.Tensor,
    out_seq_lens: torch.Tensor,  # int32
    out_tables: torch.Tensor,  # [>= bucket, >= width] int32
    bucket: int,  # the replayed graph's batch size: rows [n, bucket) become padding
) -> None:
    """Write one decode step's inputs into a CUDA graph's static buffers (one launch on CUDA)."""
    impl = _mod("stage_inputs").stage_decode_inputs if use_triton(ids) else reference.stage_decode_inputs
    impl(ids, positions, slots, seq_lens, rows, fix_rows, fix_src, prev_ids, block_table, width,
         out_ids, out_positions, out_slots, out_seq_lens, out_tables, bucket)


def gumbel_sample(
    logits: torch.Tensor,  # [num_rows, vocab] float
    inv_temperature: torch.Tensor,  # [num_rows] float32; 0 = greedy row
    seeds: torch.Tensor,  # [num_rows] int64: this draw's key per row
) -> torch.Tensor:
    """Sample one token per row of softmax(logits * inv_temperature); greedy rows take the argmax."""
    impl = _mod("sampling").gumbel_sample if use_triton(logits) else reference.gumbel_sample
    return impl(logits, inv_temperature, seeds)


def quant_linear(
    x: torch.Tensor,  # [M, K] bf16 / fp16 (fp32 on CPU)
    qweight: torch.Tensor,  # [K * bits // 32, N] int32, GPTQ packing (row k at bits bits * (k % (32 // bits)))
    scales: torch.Tensor,  # [num_groups, N], x's dtype
    zeros: torch.Tensor,  # [num_groups, N], x's dtype (float zero points)
    g_idx: torch.Tensor | None,  # [K] int32 act-order groups, or None: k // group_size
    bits: int,  # 4 or 8
    group_size: int,  # K means per-channel
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:
    """y = x @ ((q - zeros[g]) * scales[g]) + bias -> [M, N] in x's dtype (W is [K, N])."""
    impl = _mod("int4_matmul").quant_linear if use_triton(x) else quant_reference.quant_linear
    return impl(x, qweight, scales, zeros, g_idx, bits, group_size, bias)


def repack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """Load time: GPTQ-order int4 [K // 8, N] -> `int4_linear`'s [K, N // 8] (packed along N)."""
    return quant_reference.repack_int4(qweight)


def int4_linear(
    x: torch.Tensor,  # [M, K] bf16 / fp16 (fp32 on CPU)
    packed: torch.Tensor,  # [K, N // 8] int32 from repack_int4: nibble j of word [k, c] = column 8c + j
    scales: torch.Tensor,  # [num_groups, N], x's dtype
    zeros: torch.Tensor,  # [num_groups, N], x's dtype (float zero points)
    group_size: int,  # rows k of group k // group_size; >= K means per channel
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:
    """y = x @ ((q - zeros[g]) * scales[g]) + bias -> [M, N] in x's dtype; no dense copy of W on the GPU."""
    impl = _mod("int4_repacked").int4_linear if use_triton(x) else quant_reference.int4_linear
    return impl(x, packed, scales, zeros, group_size, bias)


def repack_int4_kchunk(qweight: torch.Tensor) -> torch.Tensor:
    """Load time: GPTQ-order int4 [K // 8, N] -> `int4_kchunk_linear`'s [K // 32, N, 4] (32 rows of a column in 16 bytes)."""
    return quant_reference.repack_int4_kchunk(qweight)


def int4_kchunk_linear(
    x: torch.Tensor,  # [M, K] bf16 / fp16 (fp32 on CPU)
    packed: torch.Tensor,  # [K // 32, N, 4] int32 from repack_int4_kchunk: nibble j of word w of [c, n] = row 32c + 4j + w
    scales: torch.Tensor,  # [num_groups, N], x's dtype
    zeros: torch.Tensor,  # [num_groups, N], x's dtype (float zero points)
    group_size: int,  # rows k of group k // group_size; >= K means per channel
    bias: torch.Tensor | None = None,  # [N]
    gated: bool = False,  # N = [gate | up] (a SwiGLU MLP's): return silu(gate) * up [M, N / 2]
) -> torch.Tensor:
    """y = x @ ((q - zeros[g]) * scales[g]) + bias -> [M, N] in x's dtype; the decode-size (M <= 16) int4 kernels."""
    impl = _mod("int4_kchunk").int4_kchunk_linear if use_triton(x) else quant_reference.int4_kchunk_linear
    return impl(x, packed, scales, zeros, group_size, bias, gated=gated)


def fp8_linear(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K] float8_e4m3fn (torch Linear orientation)
    weight_scale: torch.Tensor,  # fp32 scalar (per-tensor) or [N] (per-channel)
    bias: torch.Tensor | None = None,  # [N]
    gated: bool = False,  # N = [gate | up] (a SwiGLU MLP's): return silu(gate) * up [M, N / 2]
    fp8_rows: bool = False,  # gated, before an FP8 linear: the SwiGLU writes its FP8 rows (kernels/fp8_rows.py)
) -> torch.Tensor:
    """y = x @ (weight * weight_scale).T + bias -> [M, N] in x's dtype (FP8 matmul on Hopper)."""
    if use_triton(x):
        return _mod("fp8_matmul").fp8_linear(x, weight, weight_scale, bias, gated=gated, fp8_rows=fp8_rows)
    return quant_reference.fp8_linear(x, weight, weight_scale, bias, gated=gated, fp8_rows=fp8_rows)


def skinny_linear(
    x: torch.Tensor,  # [M, K], M <= 16 on CUDA
    weight: torch.Tensor,  # [N, K] bf16 / fp16 / float8_e4m3fn
    scale: torch.Tensor | None = None,  # None (float weight) or fp32 scalar / [N] (FP8)
    bias: torch.Tensor | None = None,  # [N]
    gated: bool = False,  # N = [gate | up] (a SwiGLU MLP's): return silu(gate) * up [M, N / 2]
    push: object = None,  # kernels.all_reduce_norm.PeerBuffers: push the rows to the fused all-reduce (`skinny_can_push`)
) -> torch.Tensor:
    """Decode-sized y = x @ (weight * scale).T + bias in one bandwidth-bound launch (ask `use_skinny` first);
    `gated` writes the SwiGLU activation from the GEMV's epilogue where the picked kernel has one;
    `push` sends a row-parallel partial's rows to the fused all-reduce's buffers (the result unwritten)."""
    if push is not None:
        return _mod("skinny_linear").skinny_linear(x, weight, scale, bias, gated=gated, push=push)
    impl = _mod("skinny_linear").skinny_linear if use_triton(x) else quant_reference.skinny_linear
    return impl(x, weight, scale, bias, gated=gated)


def skinny_can_push(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `skinny_linear(x, weight, push=...)` can push (CUDA, Triton, a GEMV tiling for this shape)."""
    return use_triton(x) and x.is_cuda and _mod("skinny_linear").can_push(x, weight)


def use_skinny(M: int, N: int, K: int, dtype: torch.dtype, device: torch.device) -> bool:
    """True when `skinny_linear` beats cuBLAS for this shape and weight dtype on `device` (CUDA only)."""
    if device.type != "cuda" or _FORCE_REFERENCE or not _triton_available():
        return False
    return _mod("skinny_linear").use_skinny(M, N, K, dtype, device)


def l2_hint(t: torch.Tensor, max_bytes: int) -> L2Hint | None:
    """What the fused all-reduce + norm (`kernels/all_reduce_norm.py`) takes as `prefetch`: the first
    min(max_bytes, bytes) of contiguous weight `t`, warmed in L2 by programs it adds at decode
    sizes while the ranks exchange. None off CUDA (no cache to warm) and below one line."""
    if not use_triton(t):
        return None
    return _mod("l2_prefetch").l2_hint(t, max_bytes)


def l2_prefetch(t: torch.Tensor, max_bytes: int, mode: int | None = None) -> None:
    """Ask the GPU's L2 to fetch the first min(max_bytes, bytes of contiguous `t`); returns at once
    and changes nothing (a no-op off CUDA). `mode`: `kernels.l2_prefetch.MODE_*` (default: per line)."""
    impl = _mod("l2_prefetch").l2_prefetch if use_triton(t) else reference.l2_prefetch
    impl(t, max_bytes, mode)


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel FP8 at load time: [N, K] -> (float8_e4m3fn [N, K], fp32 scale [N])."""
    return quant_reference.quantize_fp8(weight)


_OPS = frozenset(
    ("fp8_linear", "gumbel_sample", "int4_kchunk_linear", "int4_linear", "repack_int4", "repack_int4_kchunk",
     "l2_hint", "l2_prefetch", "mixed_attention", "paged_decode_attention", "prefill_attention", "quant_linear",
     "quantize_fp8",
     "rms_norm", "rotary_and_write_kv", "rotary_embedding", "silu_and_mul", "skinny_can_push", "skinny_linear", "use_skinny",
     "write_kv_cache")
)


class _KernelsPackage(ModuleType):
    """Keeps each public op bound to its dispatcher.

    Importing the launcher module `kernels.rms_norm` makes Python set the package attribute
    `rms_norm` to that module, which would shadow the op of the same name; such assignments are
    dropped here. (So use `from kernels.rms_norm import rms_norm`, not `import kernels.rms_norm as m`.)
    """

    def __setattr__(self, name: str, value: object) -> None:
        if name in _OPS and isinstance(value, ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _KernelsPackage

__all__ = [
    "fp8_linear",
    "gumbel_sample",
    "int4_kchunk_linear",
    "int4_linear",
    "lora_expand",
    "lora_num_blocks",
    "lora_segments",
    "lora_segments_host",
    "lora_shrink",
    "mixed_attention",
    "paged_decode_attention",
    "prefill_attention",
    "quant_linear",
    "quantize_fp8",
    "repack_int4",
    "repack_int4_kchunk",
    "rms_norm",
    "rotary_and_write_kv",
    "rotary_embedding",
    "silu_and_mul",
    "skinny_can_push",
    "skinny_linear",
    "use_skinny",
    "use_triton",
    "write_kv_cache",
]

"""Skinny linear for decode: y[M, N] = x[M, K] @ (W[N, K] * scale[N]).T + bias, M <= 16, one launch.

In: `x [M, K]` (bf16/fp16; fp32 in the CPU interpreter), `weight [N, K]` (bf16/fp16, `scale` None;
or float8_e4m3fn with an fp32 `scale` per tensor (one element) or per channel `[N]`), `bias [N]`
or None. Out: `[M, N]` in x's dtype. `quant_reference.skinny_linear` is the same op in torch.

At M <= 16 the cost is reading W once from HBM, so every variant is built for bandwidth:
- each program owns `BLOCK_N` contiguous weight rows and walks K in `BLOCK_K` tiles whose loads are
  16 bytes wide along K (rows past N and the tail of K are clamped to valid addresses, so the hot
  loads carry no mask when K % BLOCK_K == 0; clamped rows are dropped at the store);
- the next tile's loads are issued before the current tile is used (a register double buffer, or
  with `num_stages` > 1 Triton's pipeliner keeping several tiles in flight through shared memory);
- all M rows of x are used against each weight tile, so W is read once whatever M is;
- K is split across programs when N / BLOCK_N alone cannot fill the GPU; the splits meet through
  `kernels.int4_common.finish_tile`'s fp32 workspace and self-resetting counters (deterministic
  order, no host sync, CUDA-graph capturable).
Three ways to multiply (`SkinnyConfig.mode`):
- `MODE_FMA` (CUDA cores): fp32 FMAs into a `[BLOCK_M, BLOCK_N, BLOCK_K]` register tile reduced
  over K once at the end (few instructions per weight; for M of 1-2).
- `MODE_FMA_REDUCE`: the same FMAs, reduced over each K tile into `[BLOCK_M, BLOCK_N]` (fewer
  registers at M of 2-8).
- `MODE_DOT` (tensor cores): the weight tile (converted to x's dtype: e4m3 is exact in bf16/fp16)
  feeds `tl.dot` with x padded to 16 rows; Triton's pipeliner keeps `num_stages` tiles in flight.
The per-channel scale multiplies the fp32 sums once, before the bias.
FP8 weights at M <= 4 go to `kernels/fp8_gemv.py` instead (the picker returns its `GemvConfig`): word
loads, inline-asm e4m3 conversion, fp32 FMAs at M = 1-2, fp16 tensor cores at 3-4; measured faster on
every 8B shape. bf16 weights at M = 1-2 go there too (two a word, fp32 FMAs); cuBLAS keeps bf16 above.
`pick_skinny_config` chooses the tiling from shapes alone (one compiled variant per M bucket) and
`use_skinny` says per shape whether this kernel or cuBLAS runs; both read the tables below, which
`bench/skinny_sweep.py` measures (on an H100); a card whose engine measured faster with other entries
(`card_of`: the H200) replaces those buckets (`_CARD_GEMV_TABLE`, `_CARD_TABLE`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels import fp8_gemv
from kernels.activation import silu_and_mul
from kernels.all_reduce_norm import PeerBuffers
from kernels.fp8_gemv import GemvConfig
from kernels.int4_common import finish_tile
from kernels.int4_matmul import _num_sms, split_k_workspace
from kernels.pdl import launch_options, release_dependents, wait_upstream

MAX_M = 16
MODE_FMA, MODE_FMA_REDUCE, MODE_DOT = 0, 1, 2
MODE_NAMES = {MODE_FMA: "fma", MODE_FMA_REDUCE: "fma_red", MODE_DOT: "dot"}
WEIGHT_DTYPES = (torch.bfloat16, torch.float16, torch.float8_e4m3fn)


class SkinnyConfig(NamedTuple):
    """One tiling of the skinny kernel: how to multiply, the tile, the K split and the launch."""

    mode: int  # MODE_FMA / MODE_FMA_REDUCE / MODE_DOT
    block_n: int  # weight rows per program
    block_k: int  # K columns per tile
    split_k: int  # programs along K (1: none)
    num_warps: int
    num_stages: int  # MODE_DOT: the pipeliner's stages; FMA modes: 1 = register double buffer, > 1 = tl.range
    sub: int = 1  # FMA modes with num_stages > 1: slices of block_k summed into one accumulator

    def short(self) -> str:
        sub = f"/u{self.sub}" if self.sub > 1 else ""
        return (f"{MODE_NAMES[self.mode]}/n{self.block_n}/k{self.block_k}/s{self.split_k}/w{self.num_warps}"
                f"/st{self.num_stages}{sub}")


@triton.jit
def _load_w(w_rows, k0, offs_k, K, EVEN_K: tl.constexpr):
    # One [BLOCK_N, BLOCK_K] weight tile at columns k0 + offs_k (rows already clamped below N).
    cols = k0 + offs_k
    if EVEN_K:
        return tl.load(w_rows + cols[None, :], eviction_policy="evict_first")
    return tl.load(w_rows + cols[None, :], mask=(cols < K)[None, :], other=0.0, eviction_policy="evict_first")


@triton.jit
def _load_x(x_rows, k0, offs_k, K, EVEN_K: tl.constexpr):
    # The [BLOCK_M, BLOCK_K] activation tile (rows already clamped below M), in fp32.
    cols = k0 + offs_k
    if EVEN_K:
        return tl.load(x_rows + cols[None, :]).to(tl.float32)
    return tl.load(x_rows + cols[None, :], mask=(cols < K)[None, :], other=0.0).to(tl.float32)


@triton.jit
def _fma(acc, w, x, MODE: tl.constexpr, BLOCK_M: tl.constexpr):
    # acc += x . w^T on CUDA cores for one tile: w [BN, BK] (any float dtype), x [BM, BK] fp32.
    # (one return: the compiler checks every return's type, constexpr-dead branches included)
    wf = w.to(tl.float32)
    if MODE == 0 and BLOCK_M == 1:
        acc = acc + wf * x  # [BN, BK], x broadcast from [1, BK]
    elif MODE == 0:
        acc = acc + x[:, None, :] * wf[None, :, :]  # [BM, BN, BK]
    else:
        acc = acc + tl.sum(x[:, None, :] * wf[None, :, :], axis=2)  # [BM, BN]
    return acc


@triton.jit(do_not_specialize=["M", "tiles_per_split", "split_k"])
def _skinny_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K] bf16 / fp16 / float8e4nv
    scale_ptr,  # [N] fp32 (stride 0: one per tensor); unread without HAS_SCALE
    bias_ptr, out_ptr, partial_ptr, counter_ptr,  # as kernels/int4_common.finish_tile's
    M, N, K, tiles_per_split, split_k, stride_xm, stride_wn, stride_scale, stride_om,
    HAS_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    USE_SPLIT: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no K masks
    MODE: tl.constexpr,
    STAGES: tl.constexpr,  # FMA modes: 1 = register double buffer, > 1 = tl.range pipelining
    SUB: tl.constexpr,  # FMA modes with STAGES > 1: column slices per tile sharing one accumulator
    BLOCK_M: tl.constexpr,  # power of two >= M (>= 16 for MODE_DOT)
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,  # launched with programmatic dependent launch (kernels/pdl.py)
):
    release_dependents(PDL)
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    offs_k = tl.arange(0, BLOCK_K)
    # Clamped rows: every load is in bounds without a row mask; the store masks them off.
    w_rows = w_ptr + tl.minimum(offs_n, N - 1).to(tl.int64)[:, None] * stride_wn  # [BN, 1]
    x_rows = x_ptr + tl.minimum(offs_m, M - 1).to(tl.int64)[:, None] * stride_xm  # [BM, 1]
    num_k_tiles = tl.cdiv(K, BLOCK_K)
    t_start = split * tiles_per_split
    t_end = tl.minimum(t_start + tiles_per_split, num_k_tiles)
    if MODE == 2:
        wait_upstream(PDL)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for t in range(t_start, t_end):
            k0 = t * BLOCK_K
            cols = k0 + offs_k
            if EVEN_K:
                x = tl.load(x_rows + cols[None, :])
            else:
                x = tl.load(x_rows + cols[None, :], mask=(cols < K)[None, :], other=0.0)
            w = _load_w(w_rows, k0, offs_k, K, EVEN_K)  # [BN, BK]
            acc = tl.dot(x, tl.trans(w.to(DTYPE)), acc, input_precision=DOT_PRECISION)
        y = acc
    else:
        if MODE == 0 and BLOCK_M == 1:
            acc = tl.zeros([BLOCK_N, BLOCK_K // SUB], dtype=tl.float32)  # one row: a plain 2-D tile
        elif MODE == 0:
            acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K // SUB], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if STAGES > 1:
            # Triton's pipeliner keeps STAGES - 1 weight tiles in flight through shared memory.
            # Each tile is SUB column slices summed into one accumulator of BLOCK_K // SUB columns:
            # more bytes in flight per accumulator register.
            offs_s = tl.arange(0, BLOCK_K // SUB)
            wait_upstream(PDL)
            for t in tl.range(t_start, t_end, num_stages=STAGES):
                for u in tl.static_range(SUB):
                    k0 = t * BLOCK_K + u * (BLOCK_K // SUB)
                    w = _load_w(w_rows, k0, offs_s, K, EVEN_K)
                    x = _load_x(x_rows, k0, offs_s, K, EVEN_K)
                    acc = _fma(acc, w, x, MODE, BLOCK_M)
        else:
            # Register double buffer: tile t + 1 is requested before tile t is multiplied. The last
            # prefetch re-reads this split's last tile (in bounds, a cache hit) instead of masking.
            w_next = _load_w(w_rows, tl.minimum(t_start, num_k_tiles - 1) * BLOCK_K, offs_k, K, EVEN_K)
            wait_upstream(PDL)  # the first weight tile was requested before the previous kernel ended
            for t in range(t_start, t_end):
                w = w_next
                w_next = _load_w(w_rows, tl.minimum(t + 1, t_end - 1) * BLOCK_K, offs_k, K, EVEN_K)
                x = _load_x(x_rows, t * BLOCK_K, offs_k, K, EVEN_K)
                acc = _fma(acc, w, x, MODE, BLOCK_M)
        if MODE == 0 and BLOCK_M == 1:
            y = tl.sum(acc, axis=1)[None, :]
        elif MODE == 0:
            y = tl.sum(acc, axis=2)
        else:
            y = acc
    if HAS_SCALE:
        scale = tl.load(scale_ptr + tl.minimum(offs_n, N - 1) * stride_scale)
        y = y * scale[None, :]
    if BLOCK_M == 1:
        # finish_tile takes tiles of >= 2 rows: row 1 repeats row 0 and is masked off
        rows = tl.arange(0, 2)
        finish_tile(tl.broadcast_to(y, [2, BLOCK_N]), rows, offs_n, rows < M, mask_n, split, split_k, pid_n,
                    M, N, bias_ptr, out_ptr, partial_ptr, counter_ptr, stride_om, HAS_BIAS, USE_SPLIT)
    else:
        finish_tile(y, offs_m, offs_n, mask_m, mask_n, split, split_k, pid_n, M, N, bias_ptr, out_ptr,
                    partial_ptr, counter_ptr, stride_om, HAS_BIAS, USE_SPLIT)


# ---- shape-only choices -------------------------------------------------------------------------

# Per M bucket (1, 2, 4, 8, 16) and weight bytes per element: (mode, block_n, block_k, warps,
# stages, programs per SM wanted: K is split until the grid reaches that many[, sub]).
# From `bench/skinny_sweep.py` on an H100 (G1, triton 3.6; the tiling with the best geometric mean of
# best-time / time over the 24 per-rank shapes of Llama-3-8B/70B at TP 1/2/4): tensor-core tiles for
# every bucket but FP8 at M = 1, which keeps the old `fp8_skinny` GEMV's tiling (run 30: 111 us per
# 8B layer against G1's best tensor-core tiles' 122). FP8 at M = 1-4 now takes `_GEMV_TABLE` below.
_TABLE: dict[tuple[int, int], tuple[int, ...]] = {
    (1, 2): (MODE_DOT, 64, 128, 4, 4, 4),
    (2, 2): (MODE_DOT, 64, 128, 4, 4, 4),
    (4, 2): (MODE_DOT, 64, 128, 4, 4, 4),
    (8, 2): (MODE_DOT, 32, 256, 4, 3, 0),
    (16, 2): (MODE_DOT, 32, 256, 4, 3, 0),
    (1, 1): (MODE_FMA, 16, 256, 4, 1, 4),
    (2, 1): (MODE_DOT, 64, 256, 4, 4, 4),
    (4, 1): (MODE_DOT, 64, 256, 4, 4, 4),
    (8, 1): (MODE_DOT, 32, 512, 4, 3, 4),
    (16, 1): (MODE_DOT, 32, 512, 4, 3, 2),
}

# use_skinny: where cuBLAS (F.linear for bf16/fp16; quantise + _scaled_mm for FP8) stays, as
# (weight bytes per element, smallest M, largest M, smallest N, largest N * K); anything else at
# M <= 16 runs the skinny kernel. H100 sweep G1 (sums over the 24 shapes):
# - bf16 / fp16: the best tiling only ties cuBLAS (8B TP4 layer 52.1 -> 51.7 us): cuBLAS from 3 rows
#   (fp16 at every M); bf16 at 1-2 rows takes `_BF16_GEMV_TABLE` (`bench/gemv_bf16.py`, below);
# - FP8, M = 5-16: the picked tiles beat the _scaled_mm path by ~20 % overall (G1, M = 8/16) but lose
#   4-13 % on gate_up at 8B TP1/TP2 and 70B TP4 (N 14336-28672, N * K < 2**27), which keep it.
# FP8 at M = 1-4 always runs `kernels/fp8_gemv.py` (bench/RESULTS.md runs 41-42: faster than _scaled_mm on
# every 8B shape, gate_up included: TP1 M = 2 52.8 -> 49.8 us, M = 4 54.6 -> 49.8 in run 42).
_CUBLAS_WINS: tuple[tuple[int, int, int, int, int], ...] = (
    (2, 3, MAX_M, 0, 1 << 62),
    (1, 5, MAX_M, 14336, 1 << 27),
)


# FP8 weights per M bucket where `kernels/fp8_gemv.py` beats the table above: (mode, block_n, block_k,
# unroll, warps, stages, programs per SM wanted). From `bench/skinny_sweep.py --fp8-gemv` on an H100
# (triton 3.6, 2026-11-27, copy ~2,970 GB/s; run 41 swept every family, run 42 the winners' neighbours; the tiling
# with the least sum over one 8B layer's four linears at TP 1 + TP 2, CUDA graphs from HBM). One 8B layer,
# us, TP1 / TP2, against the path used before (the skinny kernel's old tiles; `_scaled_mm` for gate_up at
# M >= 2) and bf16 cuBLAS:
# - M = 1: un-reduced fp32 FMAs, 16 rows x 512 bytes, 4-stage smem pipeline, no split at 8B (run 42: 87.9 /
#   49.9; before 113.2 / 68.4 in run 41; bf16 184.1 / 91.8; gate_up 43.6 us = 2,690 GB/s, down 23.8);
# - M = 2: the same FMAs, 32 x 256 tiles, 3 stages (run 42: 99.4 / 57.2; before 119.7 / 72.6 in run 41);
# - M = 3-4: fp16 tensor cores, 128 x 128 tiles, 3 stages (run 41: 102.5 / 61.2, run 42: 105.8 / 62.1; before
#   118.3 / 73.5 in run 41).
_GEMV_TABLE: dict[int, tuple[int, ...]] = {
    1: (fp8_gemv.MODE_ACC, 16, 512, 1, 4, 4, 1),
    2: (fp8_gemv.MODE_ACC, 32, 256, 1, 4, 3, 1),
    4: (fp8_gemv.MODE_DOT16, 128, 128, 1, 4, 3, 1),
}

# bf16 weights at M = 1-2 through the same GEMV (two bf16 a word; block_k in weights), same columns as
# `_GEMV_TABLE`. From `bench/gemv_bf16.py` on an H100 (triton 3.6, 2026-11-27, copy 2,906 GB/s; RESULTS
# run 49): one layer's four linears at M = 1, a CUDA graph of whole layers, us, cuBLAS -> this GEMV with
# PDL (`kernels/pdl.py`): 8B TP1 166.2 -> 152.4, TP2 91.7 -> 77.6, TP4 51.8 -> 42.8, 70B TP4 158.3 -> 149.1;
# M = 2: 8B TP2 91.5 -> 84.4, 70B TP4 158.4 -> 152.4. At M = 4 it ties or loses (70B TP4 158.6 -> 168.0):
# cuBLAS from 3 rows.
_BF16_GEMV_TABLE: dict[int, tuple[int, ...]] = {
    1: (fp8_gemv.MODE_ACC, 8, 512, 1, 4, 1, 1),
    2: (fp8_gemv.MODE_ACC, 16, 256, 1, 4, 3, 1),
}

# Per card: buckets of the tables above that a card replaces, where the engine's decode graph measured
# faster on that card (the tables above came from H100 sweeps). Keyed by a word of the device's name
# (`card_of`); a card not listed takes the tables above. H200 (bench/RESULTS.md run 72, `python3
# bench/decode_profile.py --tp 1 --quantize fp8 [--batch N]`, the 8B decode graph alone, us a step):
# - FP8 at M = 1: the same tiles with K split to reach 2 programs per SM (at 8B TP=1 o and down split in
#   two): 2,714 -> 2,592. 3 and 4 per SM 2,655 / 2,825; 3 stages without the split 2,739; 1-stage
#   register-prefetch tilings (which overlap the previous kernel under PDL) 2,873-3,165.
# - FP8 at 5-8 rows: 2 programs per SM instead of 4: batch 8 3,996 -> 3,947.
# - FP8 at M = 2 stays: split to 2 per SM 3,386, 16 x 512 tiles 3,247, against 3,086.
_CARD_GEMV_TABLE: dict[str, dict[int, tuple[int, ...]]] = {
    "H200": {1: (fp8_gemv.MODE_ACC, 16, 512, 1, 4, 4, 2)},
}
_CARD_TABLE: dict[str, dict[tuple[int, int], tuple[int, ...]]] = {
    "H200": {(8, 1): (MODE_DOT, 32, 512, 4, 3, 2)},
}
CARDS = tuple(dict.fromkeys([*_CARD_GEMV_TABLE, *_CARD_TABLE]))


def card_of_name(name: str) -> str:
    """The `CARDS` key a device name carries as a word ("NVIDIA H200", "NVIDIA H200 NVL" -> "H200"; "NVIDIA
    GH200 480GB", "NVIDIA H100 80GB HBM3" -> ''): only the cards measured take their buckets."""
    words = set(name.split())
    return next((card for card in CARDS if card in words), "")


@functools.cache
def _card_of_index(device_index: int) -> str:
    return card_of_name(torch.cuda.get_device_name(device_index))


def card_of(device: torch.device) -> str:
    """The `CARDS` key whose per-card tiles `device` takes ('' for none: the tables measured on an H100,
    and every CPU device)."""
    if device.type != "cuda":
        return ""
    return _card_of_index(device.index if device.index is not None else torch.cuda.current_device())


def m_bucket(M: int) -> int:
    """The power of two >= M (1..16) that names M's compiled variant."""
    assert 1 <= M <= MAX_M, M
    return 1 << (M - 1).bit_length()


def split_for(tiles: int, num_k_tiles: int, target_programs: int) -> int:
    """Split K so tiles * split reaches target_programs (at most 32 splits), no split left empty."""
    if tiles >= target_programs:
        return 1
    split = max(1, min(num_k_tiles, triton.cdiv(target_programs, tiles), 32))
    return triton.cdiv(num_k_tiles, triton.cdiv(num_k_tiles, split))


def config_for(M: int, N: int, K: int, mode: int, block_n: int, block_k: int, warps: int, stages: int,
               per_sm: float, num_sms: int, sub: int = 1) -> SkinnyConfig:
    """A tiling with its split-K set to reach per_sm programs per SM (0: no split)."""
    split = split_for(triton.cdiv(N, block_n), triton.cdiv(K, block_k), int(per_sm * num_sms))
    return SkinnyConfig(mode, block_n, block_k, split, warps, stages, sub)


def pick_skinny_config(M: int, N: int, K: int, weight_dtype: torch.dtype, num_sms: int,
                       card: str = "") -> SkinnyConfig | GemvConfig:
    """The tiling for one call, from shapes alone: the table's entry for M's bucket, split-K from N, K
    (a `GemvConfig`, run by `kernels/fp8_gemv.py`, where `_GEMV_TABLE` has FP8's bucket); `card` (from
    `card_of`) takes that card's entries where `_CARD_GEMV_TABLE` / `_CARD_TABLE` have them."""
    if card and card not in CARDS:
        raise ValueError(f"pick_skinny_config: card {card!r} is not one of {CARDS} ('' for the default tables)")
    bucket = m_bucket(M)
    if weight_dtype == torch.float8_e4m3fn:
        gemv = _CARD_GEMV_TABLE.get(card, {}).get(bucket, _GEMV_TABLE.get(bucket))
    else:
        gemv = _BF16_GEMV_TABLE.get(bucket) if weight_dtype == torch.bfloat16 else None
    if gemv is not None:
        mode, bn, bk, unroll, warps, stages, per_sm = gemv
        return fp8_gemv.gemv_config(N, K, mode, bn, bk, unroll, warps, stages, per_sm, num_sms)
    return _tiled_config(M, N, K, weight_dtype.itemsize, num_sms, card)


def _tiled_config(M: int, N: int, K: int, itemsize: int, num_sms: int, card: str) -> SkinnyConfig:
    # The tiled kernel's entry for M's bucket and the weight's width (the card's where it has one).
    key = (m_bucket(M), min(itemsize, 2))
    mode, bn, bk, warps, stages, per_sm, *sub = _CARD_TABLE.get(card, {}).get(key, _TABLE[key])
    return config_for(M, N, K, mode, bn, bk, warps, stages, per_sm, num_sms, *sub)


@functools.cache
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def use_skinny(M: int, N: int, K: int, dtype: torch.dtype, device: torch.device) -> bool:
    """True when `skinny_linear` should run instead of cuBLAS for this shape (weight dtype `dtype`).

    Needs a CUDA device (sm_80+; FP8 sm_89+), 1 <= M <= 16, K a multiple of 16 (16-byte aligned
    rows), and no `_CUBLAS_WINS` entry covering the shape. CPU callers keep F.linear / the reference.
    """
    if device.type != "cuda" or dtype not in WEIGHT_DTYPES or not 1 <= M <= MAX_M or K % 16:
        return False
    if dtype == torch.float16:  # the bf16 GEMV reads bf16 words only; fp16 ties cuBLAS at best (sweep G1)
        return False
    cap = _capability(device.index if device.index is not None else torch.cuda.current_device())
    if cap < ((8, 9) if dtype == torch.float8_e4m3fn else (8, 0)):
        return False
    return not cublas_wins(M, N, K, dtype.itemsize)


def cublas_wins(M: int, N: int, K: int, itemsize: int) -> bool:
    """True where `_CUBLAS_WINS` keeps cuBLAS for this shape and weight width (device-free)."""
    return any(size == itemsize and lo <= M <= hi and N >= n_min and N * K < nk_max
               for size, lo, hi, n_min, nk_max in _CUBLAS_WINS)


# ---- launcher -------------------------------------------------------------------------------------

def _call_config(x: torch.Tensor, weight: torch.Tensor) -> SkinnyConfig | GemvConfig:
    """The tiling a call without an explicit one runs: `pick_skinny_config`'s, the tiled kernel's
    where the GEMV's pick cannot read the weight's rows as words."""
    (M, K), N = x.shape, weight.shape[0]
    num_sms = _num_sms(x.device.index or 0) if x.is_cuda else 132
    card = card_of(x.device)
    config = pick_skinny_config(M, N, K, weight.dtype, num_sms, card)
    if isinstance(config, GemvConfig) and not fp8_gemv.word_aligned(weight):
        config = _tiled_config(M, N, K, weight.element_size(), num_sms, card)
    return config


def can_push(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `skinny_linear(x, weight, push=...)` can push its rows to the fused all-reduce: the
    call runs `kernels/fp8_gemv.py` (whose epilogue pushes), not the tiled kernel."""
    return (use_skinny(x.shape[0], weight.shape[0], x.shape[1], weight.dtype, x.device)
            and isinstance(_call_config(x, weight), GemvConfig))


def skinny_linear_impl(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None = None,
    config: SkinnyConfig | GemvConfig | None = None, gated: bool = False, push: PeerBuffers | None = None,
) -> torch.Tensor:
    """`skinny_linear` with an explicit tiling (tests and the sweep pass their own); a `GemvConfig`
    runs `kernels/fp8_gemv.py` (FP8 and bf16 weights). `gated`: the weight is a packed [gate | up]
    and the result silu(gate) * up, from the GEMV's epilogue (else through `kernels/activation.py`).
    `push`: the rows go to the fused all-reduce's buffers, not to the output (`fp8_gemv`'s `push`;
    a `GemvConfig` only: `can_push`)."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"skinny_linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not chain")
    M, K = x.shape
    N = weight.shape[0]
    if M > MAX_M:
        raise ValueError(f"skinny_linear: M = {M} rows, at most {MAX_M}")
    if weight.dtype not in WEIGHT_DTYPES:
        raise ValueError(f"skinny_linear: weight dtype {weight.dtype} is not one of {WEIGHT_DTYPES}")
    fp8 = weight.dtype == torch.float8_e4m3fn
    if fp8 and (scale is None or scale.dtype != torch.float32 or scale.numel() not in (1, N)):
        raise ValueError("skinny_linear: an FP8 weight needs an fp32 scale of 1 or N elements")
    if x.stride(1) != 1:
        x = x.contiguous()
    assert weight.stride(1) == 1, "weight rows must be contiguous"
    assert bias is None or bias.shape == (N,)
    out = torch.empty((M, N), device=x.device, dtype=x.dtype)
    if M == 0 or N == 0:
        return out
    if config is None:
        config = _call_config(x, weight)
    if isinstance(config, GemvConfig):
        return fp8_gemv.fp8_gemv(x, weight, scale, bias, config, gated=gated, push=push)
    if push is not None:
        raise ValueError(f"skinny_linear: the tiled kernel ({config.short()}) cannot push its rows; see can_push")
    if gated:
        return silu_and_mul(skinny_linear_impl(x, weight, scale, bias, config))
    assert config.sub == 1 or (config.mode != MODE_DOT and config.num_stages > 1 and config.block_k % config.sub == 0)
    block_m = max(16, m_bucket(M)) if config.mode == MODE_DOT else m_bucket(M)
    tiles = triton.cdiv(N, config.block_n)
    split = config.split_k
    partial, counters = split_k_workspace(out, split, tiles)
    scale_arg = scale.reshape(-1) if scale is not None else out
    bias_arg = bias if bias is not None else out
    tiles_per_split = triton.cdiv(triton.cdiv(K, config.block_k), split)
    pdl = launch_options(x)
    _skinny_kernel[(tiles, split)](
        x, weight, scale_arg, bias_arg, out, partial, counters,
        M, N, K, tiles_per_split, split, x.stride(0), weight.stride(0),
        1 if scale is not None and scale.numel() > 1 else 0, out.stride(0),
        HAS_SCALE=scale is not None, HAS_BIAS=bias is not None, USE_SPLIT=split > 1,
        EVEN_K=K % config.block_k == 0, MODE=config.mode, STAGES=config.num_stages, SUB=config.sub, BLOCK_M=block_m, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=config.num_warps, num_stages=config.num_stages, **pdl,
    )
    return out


def skinny_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
    gated: bool = False, push: PeerBuffers | None = None,
) -> torch.Tensor:
    """y = x @ (weight * scale).T + bias for M <= 16 rows, one launch (tiling from `pick_skinny_config`);
    `gated`: silu(gate) * up of a packed [gate | up] weight; `push`: see `skinny_linear_impl`."""
    return skinny_linear_impl(x, weight, scale, bias, gated=gated, push=push)

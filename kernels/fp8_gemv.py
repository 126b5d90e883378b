"""FP8 GEMV for decode: y[M, N] = x[M, K] @ (W[N, K] * scale[N]).T + bias at M <= 4 (FMA) or <= 16 (dot16).

The same kernel reads bf16 weights (two a word, no scale, FMA modes): `bench/gemv_bf16.py` measured it
ahead of cuBLAS at every per-rank 8B/70B shape at M = 1 (`kernels/skinny_linear.py`'s `_BF16_GEMV_TABLE`).

In: `x [M, K]` (bf16/fp16; fp32 in the CPU interpreter), `weight [N, K]` float8_e4m3fn in the standard
row-major layout (the same tensor `_scaled_mm` reads at large M: no repack), an fp32 `scale` of one
element (per tensor) or `[N]` (per channel), `bias [N]` or None. Out: `[M, N]` in x's dtype, or with
`gated` (W a SwiGLU MLP's packed [gate | up], N = 2 I) silu(gate) * up `[M, I]` from the epilogue (each
program's rows half gate, half up: `kernels.int4_common.gemv_rows`). `quant_reference.skinny_linear`
is the same op in torch (and the CPU path).

Why a second kernel beside `kernels/skinny_linear.py`: that kernel's FMA modes keep one `[M, N, K]`
register tile and double-buffer exactly one weight tile; at M = 1 it reads the 8B layer at ~60 % of
copy bandwidth. This one is built only for the byte stream of an FP8 weight:
- a program owns `BLOCK_N` rows; each iteration reads `UNROLL` sub-tiles of `[BLOCK_N, BLOCK_K]`
  bytes whose loads are 16 bytes a thread along K (BLOCK_K = 32: two threads cover a 32-byte
  sector and a warp spans 16 rows; BLOCK_K = 512: a warp spans one row);
- with `STAGES == 1` the next iteration's UNROLL sub-tiles are requested before this iteration's
  are multiplied (UNROLL x 16 bytes a thread in flight per row slab, in registers); with
  `STAGES > 1` Triton's pipeliner keeps STAGES - 1 iterations in flight through shared memory;
- `MODE_ACC` (fp32 FMAs into one `[BLOCK_N, BLOCK_K]` accumulator per x row, reduced over K once
  at the end) or `MODE_ROWSUM` (each sub-tile summed along K into `[BLOCK_N]` per row: fewer
  registers, a shuffle per sub-tile when threads share a row) for M <= 4; each x row is its own
  accumulator, so W is read once whatever M is;
- `MODE_DOT16`: weights converted to fp16 (e4m3 is exact in fp16, one cvt per two weights) and x
  to fp16 (clamped to +-65504), tensor cores through `tl.dot` with x padded to 16 rows (M <= 16);
- K split across programs when N / BLOCK_N cannot fill the GPU, finished deterministically by
  `kernels.int4_common.finish_tile` (fp32 workspace, self-resetting counters; graph-capturable).
The per-channel scale multiplies the fp32 sums once, before the bias. With `push` (a row-parallel
partial under tensor parallelism) the epilogue stores the rows into the fused all-reduce's buffers
instead of the output (`kernels/all_reduce_norm.py`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.all_reduce_norm import PeerBuffers
from kernels.int4_common import finish_gemv_tile, gemv_rows, stack_rows
from kernels.int4_matmul import _num_sms, gated_workspace, split_k_workspace
from kernels.pdl import launch_options, release_dependents, wait_upstream

MODE_ACC, MODE_ROWSUM, MODE_DOT16 = 0, 1, 2
MODE_NAMES = {MODE_ACC: "acc", MODE_ROWSUM: "rowsum", MODE_DOT16: "dot16"}
MAX_M_FMA = 4
MAX_M_DOT = 16
F16_MAX = tl.constexpr(65504.0)  # fp16 max: x is clamped to it for MODE_DOT16


class GemvConfig(NamedTuple):
    """One tiling of the FP8 GEMV: how to multiply, the tile, loads per iteration, the K split, the launch."""

    mode: int  # MODE_ACC / MODE_ROWSUM / MODE_DOT16
    block_n: int  # weight rows per program
    block_k: int  # K columns (bytes) per sub-tile
    unroll: int  # sub-tiles per iteration (all loaded before any is used)
    split_k: int  # programs along K (1: none)
    num_warps: int
    stages: int  # 1: register prefetch of the next iteration; > 1: tl.range pipelining through shared memory
    cvt: int = 1  # 1: the inline-asm e4m3 conversions (CUDA only; the interpreter casts); 0: Triton's cast

    def short(self) -> str:
        return (f"{MODE_NAMES[self.mode]}/n{self.block_n}/k{self.block_k}x{self.unroll}/s{self.split_k}"
                f"/w{self.num_warps}/st{self.stages}" + ("" if self.cvt else "/tc"))

    def max_m(self) -> int:
        return MAX_M_DOT if self.mode == MODE_DOT16 else MAX_M_FMA


@triton.jit
def _w_tile(w_rows, k0, offs_kw, K, EVEN_K: tl.constexpr, EPW: tl.constexpr):
    # One [BLOCK_N, BLOCK_K / EPW] tile of int32 words (EPW weights each: four e4m3 bytes or two bf16)
    # starting at column k0 (rows already clamped below N): streamed once, 16 bytes a thread along K.
    cols = k0 // EPW + offs_kw
    if EVEN_K:
        return tl.load(w_rows + cols[None, :], eviction_policy="evict_first")
    return tl.load(w_rows + cols[None, :], mask=(cols < K // EPW)[None, :], other=0, eviction_policy="evict_first")


@triton.jit
def bf16_words_to_f32(words):
    # [R, C] int32 words of two bf16 -> [R, 2 C] fp32 in natural column order (the low half is column
    # 2 c): a bf16 is the top half of its fp32, so one shift or one mask a weight.
    lo = (words << 16).to(tl.float32, bitcast=True)
    hi = (words & -65536).to(tl.float32, bitcast=True)
    return tl.reshape(tl.join(lo, hi), [words.shape[0], words.shape[1] * 2])


@triton.jit
def e4m3_words_to_f32(words, ASM: tl.constexpr):
    # [R, C] int32 words of four e4m3 bytes -> [R, 4 C] fp32 in natural column order (byte j of word c
    # is column 4 c + j). ASM: two cvt.rn.f16x2.e4m3x2 on the word's halves and four f16 -> f32 (no
    # per-byte extraction, which Triton's own fp8 cast does at ~1.5 extra instructions a weight);
    # otherwise (the CPU interpreter) shifts and Triton's cast.
    if ASM:
        f0, f1, f2, f3 = tl.inline_asm_elementwise(
            """{
            .reg .b16 lo, hi, a0, a1, b0, b1;
            .reg .b32 a, b;
            mov.b32 {lo, hi}, $4;
            cvt.rn.f16x2.e4m3x2 a, lo;
            cvt.rn.f16x2.e4m3x2 b, hi;
            mov.b32 {a0, a1}, a;
            mov.b32 {b0, b1}, b;
            cvt.f32.f16 $0, a0;
            cvt.f32.f16 $1, a1;
            cvt.f32.f16 $2, b0;
            cvt.f32.f16 $3, b1;
            }""",
            "=r,=r,=r,=r,r", [words], dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True,
            pack=1)
    else:
        f0 = (words & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        f1 = ((words >> 8) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        f2 = ((words >> 16) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        f3 = ((words >> 24) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return _join4(f0, f1, f2, f3)


@triton.jit
def _join4(f0, f1, f2, f3):
    # four [R, C] tiles -> [R, 4 C] with column 4 c + j = f_j[:, c]: t[r, c, i, k] = f_{2 i + k}
    t = tl.join(tl.join(f0, f2), tl.join(f1, f3))
    return tl.reshape(t, [f0.shape[0], f0.shape[1] * 4])


@triton.jit
def e4m3_words_to_f16(words, ASM: tl.constexpr):
    # [R, C] int32 words of four e4m3 bytes -> [R, 4 C] fp16 (exact), natural column order; ASM: two
    # cvt.rn.f16x2.e4m3x2 per word (no per-byte extraction); otherwise shifts and Triton's cast.
    if ASM:
        f0, f1, f2, f3 = tl.inline_asm_elementwise(
            """{
            .reg .b16 lo, hi;
            .reg .b32 a, b;
            mov.b32 {lo, hi}, $4;
            cvt.rn.f16x2.e4m3x2 a, lo;
            cvt.rn.f16x2.e4m3x2 b, hi;
            mov.b32 {$0, $1}, a;
            mov.b32 {$2, $3}, b;
            }""",
            "=h,=h,=h,=h,r", [words], dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True,
            pack=1)
    else:
        f0 = (words & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        f1 = ((words >> 8) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        f2 = ((words >> 16) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        f3 = ((words >> 24) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
    return _join4(f0, f1, f2, f3)


@triton.jit
def f32_to_f16_sat(x, ASM: tl.constexpr):
    # fp32 -> fp16 clamped to +-65504 (no inf from a large activation): ASM one cvt.rn.satfinite.f16x2.f32
    # per pair; otherwise (the CPU interpreter) clamp and cast.
    if ASM:
        return tl.inline_asm_elementwise("cvt.rn.satfinite.f16x2.f32 $0, $2, $1;", "=r,r,r", [x], dtype=tl.float16,
                                         is_pure=True, pack=2)
    return tl.clamp(x, -F16_MAX, F16_MAX).to(tl.float16)


@triton.jit
def _x_row(x_row_ptr, k0, offs_k, K, EVEN_K: tl.constexpr):
    # x[row, k0 + offs_k] as a [1, BLOCK_K] fp32 row (x_row_ptr: the row's start, row clamped below M).
    ptrs = x_row_ptr + k0 + offs_k
    if EVEN_K:
        xr = tl.load(ptrs)
    else:
        xr = tl.load(ptrs, mask=(k0 + offs_k) < K, other=0.0)
    return xr.to(tl.float32)[None, :]


@triton.jit
def _fma_rows(acc0, acc1, acc2, acc3, w, x_ptr, M, stride_xm, k0, offs_k, K, EVEN_K: tl.constexpr,
              MODE: tl.constexpr, BLOCK_M: tl.constexpr, ASM_CVT: tl.constexpr, EPW: tl.constexpr):
    # Each x row m < BLOCK_M: acc_m += w * x_m (MODE_ACC, [BN, BK]) or sum_K(w * x_m) (MODE_ROWSUM, [BN]).
    if EPW == 2:
        wf = bf16_words_to_f32(w)
    else:
        wf = e4m3_words_to_f32(w, ASM_CVT)
    x0 = _x_row(x_ptr, k0, offs_k, K, EVEN_K)
    if MODE == 0:
        acc0 += wf * x0
    else:
        acc0 += tl.sum(wf * x0, axis=1)
    if BLOCK_M > 1:
        x1 = _x_row(x_ptr + tl.minimum(1, M - 1) * stride_xm, k0, offs_k, K, EVEN_K)
        if MODE == 0:
            acc1 += wf * x1
        else:
            acc1 += tl.sum(wf * x1, axis=1)
    if BLOCK_M > 2:
        x2 = _x_row(x_ptr + tl.minimum(2, M - 1) * stride_xm, k0, offs_k, K, EVEN_K)
        x3 = _x_row(x_ptr + tl.minimum(3, M - 1) * stride_xm, k0, offs_k, K, EVEN_K)
        if MODE == 0:
            acc2 += wf * x2
            acc3 += wf * x3
        else:
            acc2 += tl.sum(wf * x2, axis=1)
            acc3 += tl.sum(wf * x3, axis=1)
    return acc0, acc1, acc2, acc3


@triton.jit(do_not_specialize=["M", "iters_per_split", "split_k"])
def _fp8_gemv_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K / 4] int32: the float8e4nv weight's bytes, four a word
    scale_ptr,  # [N] fp32 (stride 0: one per tensor)
    bias_ptr, out_ptr, partial_ptr, counter_ptr,  # as kernels/int4_common.finish_tile's
    push_ptr, push_state,  # with PUSH_W: the fused all-reduce's buffers (int64 [W]) and state (int32 [3])
    M, N, K, iters_per_split, split_k, stride_xm, stride_wn, stride_scale, stride_om, push_rank, slot_elems,
    HAS_BIAS: tl.constexpr,
    USE_SPLIT: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % (BLOCK_K * UNROLL) == 0: no K masks
    MODE: tl.constexpr,
    STAGES: tl.constexpr,
    UNROLL: tl.constexpr,  # 1, 2 or 4 sub-tiles per iteration
    BLOCK_M: tl.constexpr,  # FMA modes: 1, 2 or 4 (power of two >= M); MODE_DOT16: 16
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ASM_CVT: tl.constexpr,  # convert with `e4m3_to_f32` / `e4m3_to_f16` (GPU only) instead of Triton's cast
    EPW: tl.constexpr,  # weights a word: 4 (e4m3, scaled) or 2 (bf16, no scale; FMA modes only)
    GATED: tl.constexpr,  # W is [gate | up] (N = 2 I rows): write silu(gate) * up [M, I] (`finish_gated_tile`)
    PUSH_W: tl.constexpr,  # > 0: push the rows to the W ranks' all-reduce buffers instead of out (`push_partial`)
    PDL: tl.constexpr,  # launched with programmatic dependent launch (kernels/pdl.py)
):
    release_dependents(PDL)
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    offs_n, mask_n = gemv_rows(pid_n, N, BLOCK_N, GATED)
    offs_k = tl.arange(0, BLOCK_K)
    offs_kw = tl.arange(0, BLOCK_K // EPW)
    # Clamped rows: every load is in bounds without a row mask; the store masks them off.
    w_rows = w_ptr + tl.minimum(offs_n, N - 1).to(tl.int64)[:, None] * stride_wn  # [BN, 1]
    STEP: tl.constexpr = BLOCK_K * UNROLL
    num_iters = tl.cdiv(K, STEP)
    i_start = split * iters_per_split
    i_end = tl.minimum(i_start + iters_per_split, num_iters)
    if MODE == 2:
        offs_m = tl.arange(0, BLOCK_M)
        x_rows = x_ptr + tl.minimum(offs_m, M - 1).to(tl.int64)[:, None] * stride_xm  # [16, 1]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        wait_upstream(PDL)
        for i in tl.range(i_start, i_end, num_stages=STAGES):
            for u in tl.static_range(UNROLL):
                k0 = i * STEP + u * BLOCK_K
                cols = k0 + offs_k
                if EVEN_K:
                    xt = tl.load(x_rows + cols[None, :])
                else:
                    xt = tl.load(x_rows + cols[None, :], mask=(cols < K)[None, :], other=0.0)
                x16 = f32_to_f16_sat(xt.to(tl.float32), ASM_CVT)
                w16 = e4m3_words_to_f16(_w_tile(w_rows, k0, offs_kw, K, EVEN_K, EPW), ASM_CVT)
                acc = tl.dot(x16, tl.trans(w16), acc)
        y = acc
    else:
        if MODE == 0:
            acc0 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        else:
            acc0 = tl.zeros([BLOCK_N], dtype=tl.float32)
        acc1 = tl.zeros_like(acc0)
        acc2 = tl.zeros_like(acc0)
        acc3 = tl.zeros_like(acc0)
        if STAGES > 1:
            wait_upstream(PDL)
            for i in tl.range(i_start, i_end, num_stages=STAGES):
                for u in tl.static_range(UNROLL):
                    k0 = i * STEP + u * BLOCK_K
                    w = _w_tile(w_rows, k0, offs_kw, K, EVEN_K, EPW)
                    acc0, acc1, acc2, acc3 = _fma_rows(acc0, acc1, acc2, acc3, w, x_ptr, M, stride_xm, k0, offs_k,
                                                       K, EVEN_K, MODE, BLOCK_M, ASM_CVT, EPW)
        else:
            # Register prefetch: iteration i + 1's sub-tiles are requested before iteration i's are
            # used. The last prefetch re-reads this split's last iteration (in bounds, a cache hit).
            k_first = tl.minimum(i_start, num_iters - 1) * STEP
            n0 = _w_tile(w_rows, k_first, offs_kw, K, EVEN_K, EPW)
            n1 = n0
            n2 = n0
            n3 = n0
            if UNROLL > 1:
                n1 = _w_tile(w_rows, k_first + BLOCK_K, offs_kw, K, EVEN_K, EPW)
            if UNROLL > 2:
                n2 = _w_tile(w_rows, k_first + 2 * BLOCK_K, offs_kw, K, EVEN_K, EPW)
                n3 = _w_tile(w_rows, k_first + 3 * BLOCK_K, offs_kw, K, EVEN_K, EPW)
            wait_upstream(PDL)  # the first iteration's weights were requested before the previous kernel ended
            for i in range(i_start, i_end):
                w0 = n0
                w1 = n1
                w2 = n2
                w3 = n3
                k_next = tl.minimum(i + 1, i_end - 1) * STEP
                n0 = _w_tile(w_rows, k_next, offs_kw, K, EVEN_K, EPW)
                if UNROLL > 1:
                    n1 = _w_tile(w_rows, k_next + BLOCK_K, offs_kw, K, EVEN_K, EPW)
                if UNROLL > 2:
                    n2 = _w_tile(w_rows, k_next + 2 * BLOCK_K, offs_kw, K, EVEN_K, EPW)
                    n3 = _w_tile(w_rows, k_next + 3 * BLOCK_K, offs_kw, K, EVEN_K, EPW)
                k0 = i * STEP
                acc0, acc1, acc2, acc3 = _fma_rows(acc0, acc1, acc2, acc3, w0, x_ptr, M, stride_xm, k0, offs_k,
                                                   K, EVEN_K, MODE, BLOCK_M, ASM_CVT, EPW)
                if UNROLL > 1:
                    acc0, acc1, acc2, acc3 = _fma_rows(acc0, acc1, acc2, acc3, w1, x_ptr, M, stride_xm,
                                                       k0 + BLOCK_K, offs_k, K, EVEN_K, MODE, BLOCK_M, ASM_CVT, EPW)
                if UNROLL > 2:
                    acc0, acc1, acc2, acc3 = _fma_rows(acc0, acc1, acc2, acc3, w2, x_ptr, M, stride_xm,
                                                       k0 + 2 * BLOCK_K, offs_k, K, EVEN_K, MODE, BLOCK_M, ASM_CVT, EPW)
                    acc0, acc1, acc2, acc3 = _fma_rows(acc0, acc1, acc2, acc3, w3, x_ptr, M, stride_xm,
                                                       k0 + 3 * BLOCK_K, offs_k, K, EVEN_K, MODE, BLOCK_M, ASM_CVT, EPW)
        if MODE == 0:
            r0 = tl.sum(acc0, axis=1)
            r1 = tl.sum(acc1, axis=1)
            r2 = tl.sum(acc2, axis=1)
            r3 = tl.sum(acc3, axis=1)
        else:
            r0 = acc0
            r1 = acc1
            r2 = acc2
            r3 = acc3
        y, offs_m = stack_rows(r0, r1, r2, r3, BLOCK_M)
    if EPW == 4:
        scale = tl.load(scale_ptr + tl.minimum(offs_n, N - 1) * stride_scale)
        y = y * scale[None, :]
    finish_gemv_tile(y, offs_m, offs_n, offs_m < M, mask_n, split, split_k, pid_n, M, N, bias_ptr, out_ptr,
                     partial_ptr, counter_ptr, stride_om, push_ptr, push_state, push_rank, slot_elems, HAS_BIAS,
                     USE_SPLIT, GATED, BLOCK_N, PUSH_W)


def block_m_for(M: int, mode: int) -> int:
    """The compiled row count for M rows: 16 for MODE_DOT16, else the power of two >= M (1, 2, 4)."""
    if mode == MODE_DOT16:
        assert 1 <= M <= MAX_M_DOT, M
        return 16
    assert 1 <= M <= MAX_M_FMA, M
    return 1 << (M - 1).bit_length()


def gemv_config(N: int, K: int, mode: int, block_n: int, block_k: int, unroll: int, warps: int, stages: int,
                per_sm: float, num_sms: int, cvt: int = 1) -> GemvConfig:
    """A tiling with split-K chosen so the grid reaches per_sm programs per SM (0: no split, at most 32)."""
    tiles = triton.cdiv(N, block_n)
    iters = triton.cdiv(K, block_k * unroll)
    target = int(per_sm * num_sms)
    split = 1
    if tiles < target:
        split = max(1, min(iters, triton.cdiv(target, tiles), 32))
        split = triton.cdiv(iters, triton.cdiv(iters, split))  # no split left empty
    return GemvConfig(mode, block_n, block_k, unroll, split, warps, stages, cvt)


def word_aligned(weight: torch.Tensor) -> bool:
    """True when the weight's rows (FP8 or bf16) can be read as int32 words (what `fp8_gemv` needs)."""
    epw = 4 // weight.element_size()
    return (weight.dim() == 2 and weight.stride(1) == 1 and weight.shape[1] % epw == 0 and weight.stride(0) % epw == 0
            and weight.storage_offset() % epw == 0)


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
             config: GemvConfig, gated: bool = False, push: PeerBuffers | None = None) -> torch.Tensor:
    """y = x @ (weight * scale).T + bias with an explicit tiling (the picker in `kernels/skinny_linear.py`
    or the sweep chooses it). A bf16 weight (two a word, `scale` None) runs the FMA modes only.
    `gated`: the weight is a packed [gate | up] of 2 I rows and the result silu(gate) * up `[M, I]`
    (each program's rows are half gate, half up; the tiling is the one N = 2 I would take).
    `push`: y is a row-parallel partial sum that the next launch, `kernels.all_reduce_norm`'s with
    `pushed=True`, sums over the ranks: each tile's rows go straight into every rank's receive
    buffer from the epilogue (`push_partial`), and the returned tensor is left unwritten."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"fp8_gemv: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not chain")
    M, K = x.shape
    N = weight.shape[0]
    if weight.dtype not in (torch.float8_e4m3fn, torch.bfloat16):
        raise ValueError(f"fp8_gemv: weight dtype {weight.dtype}, expected torch.float8_e4m3fn or torch.bfloat16")
    fp8 = weight.dtype == torch.float8_e4m3fn
    if fp8 and (scale is None or scale.dtype != torch.float32 or scale.numel() not in (1, N)):
        raise ValueError("fp8_gemv: an fp32 scale of 1 or N elements is required")
    if not fp8 and (scale is not None or config.mode == MODE_DOT16 or x.dtype not in (torch.bfloat16, torch.float32)):
        raise ValueError("fp8_gemv: a bf16 weight takes bf16 x (fp32 in the interpreter), no scale and an FMA mode")
    if not 1 <= M <= config.max_m():
        raise ValueError(f"fp8_gemv: M = {M} rows, {MODE_NAMES[config.mode]} takes 1 to {config.max_m()}")
    if not word_aligned(weight):
        raise ValueError(f"fp8_gemv: weight rows (K = {K}, strides {weight.stride()}, offset "
                         f"{weight.storage_offset()}) cannot be read as int32 words")
    if config.unroll not in (1, 2, 4):
        raise ValueError(f"fp8_gemv: unroll {config.unroll} is not 1, 2 or 4")
    if x.stride(1) != 1:
        x = x.contiguous()
    assert bias is None or bias.shape == (N,)
    if gated and (N % 2 or config.block_n % 2):
        raise ValueError(f"fp8_gemv: a gated weight needs an even row count and tile, got N = {N}, {config.short()}")
    out = torch.empty((M, N // 2 if gated else N), device=x.device, dtype=x.dtype)
    if push is not None and (gated or not push.fits(out)):
        raise ValueError(f"fp8_gemv: cannot push {'a gated' if gated else 'this'} output {tuple(out.shape)} "
                         f"{out.dtype} into the all-reduce's slots ({push.slot_bytes} bytes of {push.dtype})")
    if N == 0:
        return out
    split = config.split_k
    if gated:
        tiles, partial, counters = gated_workspace(out, split, config.block_n)
    else:
        tiles = triton.cdiv(N, config.block_n)
        partial, counters = split_k_workspace(out, split, tiles)
    step = config.block_k * config.unroll
    iters_per_split = triton.cdiv(triton.cdiv(K, step), split)
    # MODE_DOT16 launches without PDL: with it the engine's FP8 8B decode step at 3-4 requests took 4.76 ms
    # instead of 3.57 (bench/RESULTS.md run 68; the FMA modes at 1-2 rows gain from it: 3.39 -> 3.20 ms at 2).
    pdl = launch_options(x, enabled=config.mode != MODE_DOT16)
    epw = 4 if fp8 else 2
    _fp8_gemv_kernel[(tiles, split)](
        x, weight.view(torch.int32), scale.reshape(-1) if fp8 else out, bias if bias is not None else out, out,
        partial, counters, push.peer_ptrs if push else out, push.state if push else counters,
        M, N, K, iters_per_split, split, x.stride(0), weight.stride(0) // epw,
        1 if fp8 and scale.numel() > 1 else 0, out.stride(0), push.rank if push else 0,
        push.slot_bytes // out.element_size() if push else 0,
        HAS_BIAS=bias is not None, USE_SPLIT=split > 1, EVEN_K=K % step == 0, MODE=config.mode,
        STAGES=config.stages, UNROLL=config.unroll, BLOCK_M=block_m_for(M, config.mode), BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, ASM_CVT=bool(config.cvt) and x.is_cuda, EPW=epw, GATED=gated,
        PUSH_W=push.world_size if push else 0,
        num_warps=config.num_warps,
        num_stages=config.stages, **pdl,
    )
    return out


def num_sms_of(x: torch.Tensor) -> int:
    """SMs of x's device (132, an H100's, on CPU: the interpreter's grids match the GPU's)."""
    return _num_sms(x.device.index or 0) if x.is_cuda else 132

"""Int4 linear for many rows (prefill, large decode batches) on Hopper's `wgmma`, the weights dequantised in registers.

Same operands as `kernels/int4_kchunk.py` (`packed` int32 `[K // 32, N, 4]`: nibble j of word w of
`packed[c, n]` is row 32c + 4j + w; `scales`/`zeros [G, N]`, integer zero points 0..127), torch
reference `quant_reference.int4_kchunk_linear`; CUDA sm_90 only, bf16 or fp16 x, K and the group a
multiple of 128 (or one group).

Why: above ~24 rows the other int4 paths either re-read x per column tile from global memory
(`int4_kchunk_mma`), run Triton's dequantise-then-`tl.dot` tiles at a third of the tensor cores'
rate (`int4_kchunk_gemm`, 1.4-2x bf16's time at 64-256 rows), or write a bf16 copy of the whole weight
per call for cuBLAS (bench/RESULTS.md runs 41, 62). Written in Gluon, this kernel computes
out^T = W^T x^T with the weights as wgmma's register operand A, the way Marlin / Machete feed
tensor cores from int4: each program loads its words straight into A's register layout (as
`int4_kchunk_mma` does), turns them into (q - z) * s two at a time (`prmt`, `lop3` into the magic
number's mantissa, a packed FMA subtracting magic + z exactly, a packed multiply by the scale), and
multiplies them with x's rows from shared memory, which `cp.async` fills STAGES - 2 K tiles ahead. Sub-dot
j of a 128-row tile (nibble j of every word) pairs with x's columns 32 r + 4 j + w: programs of few rows
gather them (8-byte pieces) into one [BLOCK_M, 16] buffer per sub-dot; programs of SUB_DOT_BLOCK_M rows
and more read a copy of x permuted once a call so that each sub-dot's columns are contiguous (16-byte
pieces, whole 32-byte rows).
The weight reads are the HBM stream (one tile ahead in registers); x tiles come from L2. Rounding:
each weight is (q - z) * s rounded once to x's dtype, as the dequantised weight is.
"""

from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from kernels.int4_kchunk_mma import (  # noqa: F401 - fits: the same shape rule
    BLOCK_K, _columns, _ptx, fits, group_row, group_tiles, pair_ptx, store_tile)
from kernels.int4_matmul import split_k_workspace

# Programs of this many rows and more read x permuted into the sub-dot order (`sub_dot_order`): the gather costs
# a launch and a pass over x, the 8-byte copies it saves grow with the rows a program copies (bench/RESULTS.md
# run 66, H200, us, own order -> sub-dot order: 2,048 rows in 256-row programs gate_up 1,795 -> 1,155, qkv
# 398.6 -> 273.7 (best tilings); 64-row programs at 128 rows qkv 49.0 -> 41.0, gate_up 135.8 -> 110.3, but at
# 33-48 rows, where most of a 64-row program's rows re-read row M - 1, 66-68 -> 96-144; 16- and 32-row programs
# lose 2-10 us). The picker's programs have at most 64 rows, so today only explicit tilings (the sweep's) take it.
SUB_DOT_BLOCK_M = 128


# `int4_kchunk_mma.pair_ptx` with the scale: per pair of words and byte, two pairs of (q - z) * s.
_BF16_0 = gl.constexpr(pair_ptx(0, False, scaled=True))
_BF16_1 = gl.constexpr(pair_ptx(1, False, scaled=True))
_BF16_2 = gl.constexpr(pair_ptx(2, False, scaled=True))
_BF16_3 = gl.constexpr(pair_ptx(3, False, scaled=True))
_FP16_0 = gl.constexpr(pair_ptx(0, True, scaled=True))
_FP16_1 = gl.constexpr(pair_ptx(1, True, scaled=True))
_FP16_2 = gl.constexpr(pair_ptx(2, True, scaled=True))
_FP16_3 = gl.constexpr(pair_ptx(3, True, scaled=True))


@gluon.jit
def _weights(words, neg_zero, scale, PTX: gl.constexpr):
    # Byte B's two sub-dots' A operands: (nibble 2B, nibble 2B + 1) as (q - z) * s.
    return gl.inline_asm_elementwise(PTX, "=r,=r,r,r,r,r", [words, neg_zero, scale],
                                     dtype=(neg_zero.dtype, neg_zero.dtype), is_pure=True, pack=2)


@gluon.jit
def _copy_x(x0, x1, x2, x3, x4, x5, x6, x7, x_tile, t, stage, STEP: gl.constexpr):
    # x's columns of K tile t for sub-dot j into xj[stage] ([BLOCK_M, 16] by cp.async; sub-dot j starts STEP j
    # columns on: 4 in x's own order, 16 in the sub-dot order). One allocation per sub-dot: copies into
    # different allocations need no barrier between them.
    x_t = x_tile + t * 128
    async_copy.async_copy_global_to_shared(x0.index(stage), x_t)
    async_copy.async_copy_global_to_shared(x1.index(stage), x_t + STEP)
    async_copy.async_copy_global_to_shared(x2.index(stage), x_t + 2 * STEP)
    async_copy.async_copy_global_to_shared(x3.index(stage), x_t + 3 * STEP)
    async_copy.async_copy_global_to_shared(x4.index(stage), x_t + 4 * STEP)
    async_copy.async_copy_global_to_shared(x5.index(stage), x_t + 5 * STEP)
    async_copy.async_copy_global_to_shared(x6.index(stage), x_t + 6 * STEP)
    async_copy.async_copy_global_to_shared(x7.index(stage), x_t + 7 * STEP)


@gluon.jit
def _byte(acc, words, neg_zero, scale, x_lo, x_hi, a1, a2, a3, a4, PTX: gl.constexpr):
    # Dequantise a byte's two sub-dots while the two previous bytes' MMAs run (their A operands a1, a2 and
    # a3, a4), queue them behind those, then wait until only this byte's and the previous byte's are in flight:
    # the A registers of the byte before are free again. Returns (acc, this byte's A, the previous byte's A).
    lo, hi = _weights(words, neg_zero, scale, PTX)
    acc = warpgroup_mma(lo, x_lo.permute((1, 0)), acc, is_async=True)
    acc = warpgroup_mma(hi, x_hi.permute((1, 0)), acc, is_async=True)
    acc, a1, a2, a3, a4 = warpgroup_mma_wait(4, deps=[acc, a1, a2, a3, a4])
    return acc, lo, hi, a1, a2


@gluon.jit
def _tile(acc, words, neg_zero, scale, xs, a1, a2, a3, a4, P0: gl.constexpr, P1: gl.constexpr, P2: gl.constexpr,
          P3: gl.constexpr):
    # One K tile: bytes 0-3 of the words (sub-dots 2B and 2B + 1 against x buffers xs[2B], xs[2B + 1]).
    acc, a1, a2, a3, a4 = _byte(acc, words, neg_zero, scale, xs[0], xs[1], a1, a2, a3, a4, P0)
    acc, a1, a2, a3, a4 = _byte(acc, words, neg_zero, scale, xs[2], xs[3], a1, a2, a3, a4, P1)
    acc, a1, a2, a3, a4 = _byte(acc, words, neg_zero, scale, xs[4], xs[5], a1, a2, a3, a4, P2)
    return _byte(acc, words, neg_zero, scale, xs[6], xs[7], a1, a2, a3, a4, P3)


@gluon.jit(do_not_specialize=["M", "tiles_per_split", "split_k"])
def _kchunk_wgmma_kernel(
    # as `int4_kchunk_mma._kchunk_mma_kernel`'s
    x_ptr, w_ptr, scales_ptr, zeros_ptr, bias_ptr, out_ptr, partial_ptr, counter_ptr,
    M, N, K, tiles_per_split, split_k, stride_xm, stride_wc, stride_sg, stride_om,
    HAS_BIAS: gl.constexpr,
    USE_SPLIT: gl.constexpr,
    GROUP_TILES: gl.constexpr,  # K tiles a scale group (`int4_kchunk_mma.group_tiles`; 0: one group)
    BLOCK_N: gl.constexpr,  # weight columns per program: a multiple of 16 * WARPS (WARPS a multiple of 4)
    BLOCK_M: gl.constexpr,  # rows of x per program (the MMA's N): a power of two, 16 to 256
    WARPS: gl.constexpr,
    STAGES: gl.constexpr,  # K tiles of x in shared memory (>= 3): STAGES - 2 copies ahead of the MMAs
    SUB_DOT_ORDER: gl.constexpr,  # x's columns come permuted (`sub_dot_order`): sub-dot j's 16 are contiguous
):
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                   instr_shape=[16, BLOCK_M, 16])
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    # The copies' layout: 16-byte pieces (32 contiguous bytes a row) in the sub-dot order, else 8-byte ones.
    X_L: gl.constexpr = (gl.BlockedLayout([1, 8], [16, 2], [WARPS, 1], [1, 0]) if SUB_DOT_ORDER
                         else gl.BlockedLayout([1, 4], [8, 4], [WARPS, 1], [1, 0]))
    STEP: gl.constexpr = 16 if SUB_DOT_ORDER else 4
    X_S: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=32, element_bitwidth=16, rank=2)
    DTYPE: gl.constexpr = x_ptr.dtype.element_ty
    MAGIC: gl.constexpr = 1024.0 if DTYPE == gl.float16 else 128.0
    pid = gl.program_id(0)
    split = gl.program_id(1)
    num_m = gl.cdiv(M, BLOCK_M)
    pid_m = pid % num_m  # neighbouring programs share a column tile: its words come from L2 after the first
    pid_n = pid // num_m
    # A side: [BLOCK_N, 16] words, column q = 4 r + w of the tile's chunk r (rows 32 r + 4 j + w), loaded straight
    # into the A operand's layout one tile ahead; columns past N re-read column N - 1.
    n_sa = gl.minimum(pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, A_L)), N - 1)
    q_a = gl.arange(0, 16, layout=gl.SliceLayout(0, A_L))
    w_tile = w_ptr + (n_sa * 4)[:, None] + ((q_a // 4) * stride_wc + q_a % 4)[None, :]
    # x side: sub-dot j's buffer [m, q] = x[m, 128 t + 32 (q // 4) + q % 4 + 4 j] (in the sub-dot order: column
    # 128 t + 16 j + q); rows past M re-read row M - 1.
    m_x = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, X_L))
    q_x = gl.arange(0, 16, layout=gl.SliceLayout(0, X_L))
    col_x = q_x if SUB_DOT_ORDER else (q_x // 4) * 32 + q_x % 4
    x_tile = x_ptr + (gl.minimum(m_x, M - 1) * stride_xm)[:, None] + col_x[None, :]
    x0 = gl.allocate_shared_memory(DTYPE, [STAGES, BLOCK_M, 16], X_S)
    x1 = gl.allocate_shared_memory(DTYPE, [STAGES, BLOCK_M, 16], X_S)
    x2 = gl.allocate_shared_memory(DTYPE, [STAGES, BLOCK_M, 16], X_S)
    x3 = gl.allocate_shared_memory(DTYPE, [STAGES, BLOCK_M, 16], X_S)
    x4 = gl.allocate_shared_memory(DTYPE, [STAGES, BLOCK_M, 16], X_S)
    x5 = gl.allocate_shared_memory(DTYPE, [STAGES, BLOCK_M, 16], X_S)
    x6 = gl.allocate_shared_memory(DTYPE, [STAGES, BLOCK_M, 16], X_S)
    x7 = gl.allocate_shared_memory(DTYPE, [STAGES, BLOCK_M, 16], X_S)
    num_k_tiles = K // 128
    t_start = split * tiles_per_split
    t_end = gl.minimum(t_start + tiles_per_split, num_k_tiles)
    for ahead in gl.static_range(STAGES - 2):
        if t_start + ahead < t_end:
            _copy_x(x0, x1, x2, x3, x4, x5, x6, x7, x_tile, t_start + ahead, ahead, STEP)
        async_copy.commit_group()
    words_next = gl.load(w_tile + gl.minimum(t_start, num_k_tiles - 1) * 4 * stride_wc)
    g_row = group_row(gl.minimum(t_start, num_k_tiles - 1), stride_sg, GROUP_TILES)  # an empty split reads tile 0
    z_next = gl.load(zeros_ptr + g_row + n_sa)
    s_next = gl.load(scales_ptr + g_row + n_sa)
    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=MMA)
    a1 = gl.zeros([BLOCK_N, 16], DTYPE, layout=A_L)
    a2 = a1
    a3 = a1
    a4 = a1
    for t in range(t_start, t_end):
        i = t - t_start
        words = words_next  # the next tile's words, scales and zero points are in flight meanwhile
        words_next = gl.load(w_tile + gl.minimum(t + 1, t_end - 1) * 4 * stride_wc)
        z = z_next
        s = s_next
        g_row = group_row(gl.minimum(t + 1, t_end - 1), stride_sg, GROUP_TILES)
        z_next = gl.load(zeros_ptr + g_row + n_sa)
        s_next = gl.load(scales_ptr + g_row + n_sa)
        async_copy.wait_group(STAGES - 3)  # this thread's copies of tile t have landed
        fence_async_shared()  # ... and are visible to the tensor cores' reads
        # Every thread's copies of tile t are in, and every warp group has queued tile t - 1's MMAs and waited
        # for all but its last two bytes': tile t - 2's buffers are free.
        _ptx("bar.sync 0; // $0")
        if t + STAGES - 2 < t_end:  # into tile t - 2's buffers
            _copy_x(x0, x1, x2, x3, x4, x5, x6, x7, x_tile, t + STAGES - 2, (i + STAGES - 2) % STAGES, STEP)
        async_copy.commit_group()
        st = i % STAGES
        neg_zero = gl.broadcast((-(z.to(gl.float32) + MAGIC)).to(DTYPE)[:, None], words)[0]
        scale = gl.broadcast(s[:, None], words)[0]
        xs = (x0.index(st), x1.index(st), x2.index(st), x3.index(st), x4.index(st), x5.index(st), x6.index(st),
              x7.index(st))
        if DTYPE == gl.float16:
            acc, a1, a2, a3, a4 = _tile(acc, words, neg_zero, scale, xs, a1, a2, a3, a4, _FP16_0, _FP16_1, _FP16_2,
                                        _FP16_3)
        else:
            acc, a1, a2, a3, a4 = _tile(acc, words, neg_zero, scale, xs, a1, a2, a3, a4, _BF16_0, _BF16_1, _BF16_2,
                                        _BF16_3)
    acc, a1, a2, a3, a4 = warpgroup_mma_wait(0, deps=[acc, a1, a2, a3, a4])
    async_copy.wait_group(0)
    n_sm, valid = _columns(pid_n, N, gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, MMA)), BLOCK_N, False)
    m_m = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, MMA))
    store_tile(acc, n_sm, valid, m_m, pid, split, split_k, M, N, bias_ptr, out_ptr, partial_ptr, counter_ptr,
               stride_om, HAS_BIAS, USE_SPLIT, False)


@functools.cache
def _sub_dot_columns(K: int, device: torch.device) -> torch.Tensor:
    k = torch.arange(K, device=device)
    q = k % 16
    return (k // 128) * 128 + (q // 4) * 32 + q % 4 + 4 * (k % 128 // 16)


def reads_sub_dot_order(block_m: int) -> bool:
    """Whether programs of block_m rows read x permuted (`sub_dot_order`): the kernel's SUB_DOT_ORDER."""
    return block_m >= SUB_DOT_BLOCK_M


def sub_dot_order(x: torch.Tensor) -> torch.Tensor:
    """x's columns permuted so that each K tile's sub-dot j (columns 32 r + 4 j + w) is 16 contiguous columns
    128 t + 16 j + q: one gather a call, after which the kernel copies x in 16-byte pieces, whole 32-byte rows."""
    return x.index_select(1, _sub_dot_columns(x.shape[1], x.device))


def launch(x, packed, scales, zeros, group_size, bias, out, block_n, block_m, split, num_warps, stages) -> None:
    """One launch over out [M, N]: programs of block_n columns x block_m rows (column tiles outer), K split in
    `split` (the workspace as the other int4 kernels take it, `split_k_workspace`). Programs of SUB_DOT_BLOCK_M
    rows and more read x permuted (`sub_dot_order`)."""
    M, K = x.shape
    permuted = reads_sub_dot_order(block_m)
    if permuted:
        x = sub_dot_order(x)
    N = packed.shape[1]
    assert num_warps % 4 == 0 and block_n % (16 * num_warps) == 0 and stages >= 3, (block_n, num_warps, stages)
    assert block_m in (16, 32, 64, 128, 256), block_m
    tiles = triton.cdiv(N, block_n) * triton.cdiv(M, block_m)
    partial, counters = split_k_workspace(out, split, tiles)
    _kchunk_wgmma_kernel[(tiles, split)](
        x, packed, scales, zeros, bias if bias is not None else scales, out, partial, counters,
        M, N, K, triton.cdiv(K // BLOCK_K, split), split, x.stride(0), packed.stride(0), scales.stride(0),
        out.stride(0), HAS_BIAS=bias is not None, USE_SPLIT=split > 1, GROUP_TILES=group_tiles(K, group_size),
        BLOCK_N=block_n, BLOCK_M=block_m,
        WARPS=num_warps, STAGES=stages, SUB_DOT_ORDER=permuted, num_warps=num_warps,
    )
